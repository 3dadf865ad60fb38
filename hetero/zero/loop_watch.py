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
"""

from __future__ import annotations

import warnings
from typing import Any

from hetero.errors import HeteroError


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
            f"{self.gas}: the engine counts micro-batches by its step() calls and updates at every {self.gas}th, so "
            f"a loop that calls step() once per {self.gas} micro-batches (DDP's accumulation) updates every "
            f"{self.gas * self.gas}. Call engine.step() after every engine.backward(), or set "
            "grad_accumulation_steps 1 and divide the loss yourself (engine.no_sync() keeps DDP's loop as it is). "
            "Several pairs per micro-batch by design (two tasks summed) may ignore this",
            stacklevel=3,
        )

    def step(self) -> None:
        self._pairs = 0
