"""The profile's count of micro-batches: `engine.step()` calls, and `train_batch`'s micro-batches within them.

[Note: counting micro-batches]
engine.step() counts one micro-batch per call, and train_batch calls it once per batch, after all of the batch's
`parallel.microbatches` micro-batches (pipeline or not). train_batch's backwards (one per micro-batch, or one per
micro-batch and virtual stage through a pipeline) end with the engine's "backward_end" event and never begin with
"backward_begin", which only engine.backward emits: a step() after backwards that all ended that way stepped on a
batch of that many micro-batches, and any other step() on one (an accumulation loop's micro-step). Counting the
backwards instead would count a pipeline's virtual stages, and a loop's second backward through one graph
(retain_graph), as micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class MicroBatches:
    """Counts from the engine's backward_begin, backward_end and micro_step events: `steps`, the engine.step() calls,
    and `count`, the micro-batches they stepped on."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.count = 0
        self.steps = 0  # engine.step() calls
        self.begun = 0  # backward_begin events since the last step() (engine.backward's)
        self.ended = 0  # backward_end events since the last step() (engine.backward's and train_batch's)

    def subscribe(self, events: Any) -> list[Callable[[], None]]:
        """Subscribe to the engine's events; returns the functions that unsubscribe."""
        names = {"backward_begin": self.backward_begin, "backward_end": self.backward_end, "micro_step": self.step}
        return [events.subscribe(name, fn) for name, fn in names.items()]

    def backward_begin(self) -> None:
        self.begun += 1

    def backward_end(self) -> None:
        self.ended += 1

    def step(self) -> None:
        batch = self.ended and not self.begun  # train_batch's: [Note: counting micro-batches]
        self.count += self.engine.config.parallel.microbatches if batch else 1
        self.steps += 1
        self.begun = self.ended = 0
