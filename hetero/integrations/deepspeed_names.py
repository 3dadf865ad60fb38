"""The names a training loop written for DeepSpeed's engine calls, answered by hetero's engine.

A loop ported from DeepSpeed logs `engine.get_lr()` and `engine.get_global_grad_norm()`, checks
`engine.was_step_applied()` after an fp16 step, and asks `engine.gradient_accumulation_steps()` or
`engine.zero_optimization_stage()`; with these it runs unchanged (its `initialize` call and config aside:
`hetero.Config.from_deepspeed`). Each is hetero's own figure under DeepSpeed's name and meaning.
"""

from __future__ import annotations

from typing import Any


class DeepSpeedNames:
    """Mixed into `hetero.Engine`."""

    optimizer: Any
    config: Any
    stage: int
    last_grad_norm: float | None
    last_update_skipped: bool

    def get_lr(self) -> list[float]:
        """Each param group's learning rate, as the next update uses it."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The last update's gradient norm over every rank, before clipping (None before the first)."""
        return self.last_grad_norm

    def was_step_applied(self) -> bool:
        """False when the last update was skipped (fp16 overflow)."""
        return not self.last_update_skipped

    def gradient_accumulation_steps(self) -> int:
        return int(self.config.grad_accumulation_steps)

    def zero_optimization_stage(self) -> int:
        return self.stage
