"""What a training loop does around the engine that trains otherwise than it means, noticed from the calls it makes
([Note: a loop stepping what the engine steps]).

[Note: a loop stepping what the engine steps]
Two habits of loops ported from plain PyTorch and DDP change the training without an error of their own:
- An LR scheduler handed to `initialize(lr_scheduler=...)` and still stepped by the loop (`sched.step()` after
  `engine.step()`) advanced twice per update: measured, StepLR(gamma=0.5) gave 0.25x the learning rate per update.
  The engine steps it once per real update and remembers where it left it (`last_epoch`); at the next update a
  schedule that moved meanwhile stops the loop naming the fix, before that update uses the wrong rate.
- A DDP-style accumulation loop (`engine.step()` only every N micro-batches) with `grad_accumulation_steps` N: the
  engine counts micro-batches by its `step()` calls, so it updated every N*N micro-batches (measured: no update in
  the first 8 at N = 4). Whether the loop means several forward/backward pairs per `step()` cannot be told apart
  from the loop's own design (two tasks' batches summed into one micro-batch are legitimate), so this one warns,
  once, when a `step()` is N pairs late, naming both ways to write the loop.
Neither patches the user's objects: the scheduler's state dict stays as torch writes it.

[Note: a step without its backward]
`engine.step()` counts one micro-batch, and at the accumulation boundary updates and steps the LR scheduler. Called
with no `engine.backward(loss)` since the last `step()` (or since `initialize` or `load_checkpoint`) it used to do all
of that on no gradient: `step(); step()` after initialize left the weights as they were but counted 2 global steps,
halved a StepLR twice and said `was_step_applied()`; a loop written forward, step, backward trained each batch one
update late with its schedule running ahead, and a second `step()` after one backward counted an update of nothing.
Every `step()` must follow at least one backward of its micro-batch (several are fine: two tasks summed, as plain
PyTorch sums two `backward()` calls), so one without is refused (StepOrderError) before it counts or touches anything;
the message says which order it saw (a forward whose backward has not run; a forward, or a backward, that raised,
whose batch the loop skips, `step()` included; nothing since the last step). A backward is that of
`engine.backward` or of `train_batch` (pipeline schedules included), ended without raising. An update skipped for fp16
overflow followed its backward, so it is legal. The decision reads this rank's own calls only, no collective: ranks
running one loop decide alike, and a rank that skipped its backward raises before its update's first collective.
Its peers wait in their backward's collectives for it: when its script ends on the error, they stop within about a
second with RankFailedError naming it and the error ([Note: a rank's failure told to the others] in
hetero/comm/watch.py). A loop that catches the error on that rank alone and goes on is out of step with the others:
its next backward joins the collectives they wait in, a batch apart (measured with 2 ranks at stages 1 and 3: no
error until a collective it never joins timed out, RankTimeoutError after comm_timeout), so a loop that catches
StepOrderError must stop every rank, not only the one that raised.
"""

from __future__ import annotations

import warnings
from typing import Any

from hetero.errors import HeteroError, StepOrderError


def _every(n: int) -> str:
    """'every step()', 'every 2nd step()', ..."""
    if n == 1:
        return "every step()"
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"every {n}{suffix} step()"


def _epoch(scheduler: Any) -> Any:
    return getattr(scheduler, "last_epoch", None)


class LoopWatch:
    """The counts behind [Note: a loop stepping what the engine steps], for one engine."""

    def __init__(self, *, grad_accumulation_steps: int, scheduler: Any) -> None:
        self.gas = grad_accumulation_steps
        self.scheduler = scheduler
        self._epoch = _epoch(scheduler)  # where the engine left the schedule
        self._pairs = 0  # forward/backward pairs since the last step()
        self._forwarded = False  # a training forward since the last backward
        self._warned = False
        # [Note: a step without its backward]: a backward ended since `_since` (the last step, initialize, a load)
        self._backward_done = False
        self._since = "hetero.initialize"
        self._dropped = False  # the last backward raised and the accumulation's gradients were dropped
        self._forward_raised = False  # the last training forward raised (the loop skips its batch)

    # ---- the scheduler --------------------------------------------------------------------------------------
    def before_update(self) -> None:
        """An update is about to read the learning rate: the schedule must be where the engine left it."""
        now = _epoch(self.scheduler)
        if self.scheduler is None or now is None or now == self._epoch:
            return
        raise HeteroError(
            f"the LR scheduler given to hetero.initialize(lr_scheduler=...) moved from step {self._epoch} to {now} "
            "between two updates without the engine: the loop steps it too, so it advances twice per update. The "
            "engine steps it once per real update (after engine.step() at the accumulation boundary, not after an "
            "update skipped for fp16 overflow): remove the loop's scheduler.step(), or leave lr_scheduler unset "
            "and step it yourself when engine.was_step_applied() after a boundary"
        )

    def stepped_scheduler(self) -> None:
        """The engine stepped the schedule (or restored it from a checkpoint)."""
        self._epoch = _epoch(self.scheduler)

    # ---- micro-batches ----------------------------------------------------------------------------------------
    def forward(self, *, training: bool) -> None:
        if training:
            self._forwarded = True
            self._forward_raised = self._dropped = False  # what the message names is the latest

    def forward_raised(self, *, training: bool) -> None:
        """A forward raised ([Note: a forward that fails] in hetero/engine.py): its batch has no backward to come."""
        if training:
            self._forward_raised = True

    def backward(self, *, counted: bool) -> None:
        """counted: the boundary comes from the count of step() calls (no `no_sync`, no override)."""
        if self._forwarded:
            self._pairs += 1
            self._forwarded = False
        if not counted or self.gas <= 1 or self._pairs < self.gas or self._warned:
            return
        self._warned = True
        warnings.warn(
            f"{self._pairs} forward/backward pairs ran without engine.step() while grad_accumulation_steps is "
            f"{self.gas}: the engine counts micro-batches by its step() calls and updates at {_every(self.gas)}, so "
            f"a loop that calls step() once per {self.gas} micro-batches (DDP's accumulation) updates every "
            f"{self.gas * self.gas}. Call engine.step() after every engine.backward(), or set "
            "grad_accumulation_steps 1 and divide the loss yourself (engine.no_sync() keeps DDP's loop as it is). "
            "Several pairs per micro-batch by design (two tasks summed) may ignore this",
            stacklevel=3,
        )

    def step(self) -> None:
        self._pairs = 0
        self._backward_done, self._dropped, self._since = False, False, "the last engine.step()"
        self._forward_raised = False

    # ---- the order of backward and step ([Note: a step without its backward]) -------------------------------------
    def backward_ended(self) -> None:
        """A training backward (engine.backward's, train_batch's) ended without raising."""
        self._backward_done, self._dropped, self._forward_raised = True, False, False

    def backward_dropped(self) -> None:
        """A backward raised: its gradients, and the accumulation's before it, were dropped."""
        self._backward_done, self._dropped = False, True

    def loaded(self) -> None:
        """A checkpoint was loaded: the gradients are the checkpoint's, and the next step() needs its own backward."""
        self._backward_done, self._dropped, self._since = False, False, "load_checkpoint"
        self._forward_raised = False
        self._forwarded = False  # a forward before the load belongs to no step after it

    def before_step(self) -> None:
        """engine.step() is about to count a micro-batch: refused, before anything is counted, without a backward."""
        if self._backward_done:
            return
        if self._dropped:
            why = (
                "the last engine.backward raised, and its gradients (with those of the accumulation before it) were "
                "dropped, so there is nothing to step on. Skip step() for that batch and go on with the next "
                "batch's forward, engine.backward(loss) and engine.step()"
            )
        elif self._forward_raised:
            why = (
                "the last forward raised, so its batch has no gradient (the accumulation's earlier ones stay, and "
                "the update comes after grad_accumulation_steps step() calls for batches the loop keeps). Skip "
                "step() for that batch as well as its backward, and go on with the next batch's forward, "
                "engine.backward(loss) and engine.step()"
            )
        elif self._forwarded:
            why = (
                "a forward ran and its engine.backward(loss) has not yet: a loop ordered forward, step, backward "
                "updates each batch one update late, with its LR schedule a step ahead. Call engine.backward(loss) "
                "before engine.step(): forward, engine.backward(loss), engine.step() for every micro-batch"
            )
        else:
            why = (
                "no micro-batch's gradient is there for it, yet it would count one, and where it ends an "
                "accumulation count an update of no new gradient and step the LR scheduler. Call "
                "engine.backward(loss) before engine.step(), once per micro-batch: forward, engine.backward(loss), "
                f"engine.step() (with grad_accumulation_steps {self.gas} the update happens at {_every(self.gas)}), "
                "or use engine.train_batch(inputs, labels)"
            )
        raise StepOrderError(
            f"engine.step() with no engine.backward(loss) since {self._since}: {why}. Nothing was counted or "
            "updated (global_steps, the LR scheduler and the weights are as they were)"
        )
