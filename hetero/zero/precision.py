"""Compute dtypes and the loss scaler for fp16.

[Note: the fp16 loss scale]
fp16 gradients underflow unless the loss is scaled up before backward; a step whose gradients overflow is skipped
(no update, the schedule not stepped) and tells the scaler. hetero's default is torch.amp.GradScaler's rule: start at
2**16, halve at every overflow, double after 2000 overflow-free steps, never below 1. The `loss_scale` section of the
config (LossScaleConfig) adds what DeepSpeed's DynamicLossScaler does, with its exact arithmetic (update_scale in
deepspeed/runtime/fp16/loss_scaler.py), so that a translated DeepSpeed config scales and skips as DeepSpeed does:
- hysteresis h: an overflow halves the scale only when the count of overflows left is down to 1 (or h is 1);
  otherwise it only decrements the count. The count refills to h when the scale grows, or, with
  consecutive_hysteresis, at every overflow-free step. Every overflowing step is skipped all the same.
- the growth window counts from the last overflow and keeps counting past a growth (DeepSpeed keeps the iteration of
  the last overflow; here `good_steps`, the overflow-free steps since it, carries the same information). hetero and
  GradScaler double at the growth_interval-th overflow-free step; DeepSpeed's loss_scale_window W doubles at the
  step after W of them (its `stable_interval` leaves the current step out), then every W: `deepspeed_window`.
- a static scale (DeepSpeed's loss_scale > 0): never changes, and an overflowing step is still skipped, as
  DeepSpeed's ZeRO optimizers check for overflow whatever their scaler.
Two things of DeepSpeed's are not taken: at the minimum scale its run stops with an exception at the overflow that
would halve it (raise_error_at_min_scale), where hetero keeps the minimum and goes on skipping such steps, as
torch's GradScaler goes on (see [Note: overflows the scale cannot cure]); and its ZeRO stage 0 fp16 optimizer
(FP16_Optimizer) ignores hysteresis, where hetero applies it at every stage.

[Note: overflows the scale cannot cure]
A step that overflows at a scale that cannot fall (the minimum, or a static scale) says that the loss or the
gradients are inf or nan whatever the scale: a nan loss from the first step on, a bad batch, a diverged run. The
step is skipped all the same, as GradScaler skips every overflowing step (it has no minimum and halves on towards
0), but a run that skipped every step said so only in an info line per step: 40 steps of a nan loss ended at scale
1 with no update and no warning. The update warns (`LossScaler.log_skipped`) at the first such overflow and
whenever their run in a row doubles, naming the scale and what to check.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hetero.config import LossScaleConfig

log = logging.getLogger("hetero.zero")

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# What a checkpoint restores: the running state. The settings are the config's, so a resumed run may change them.
_STATE = ("scale", "good_steps", "hysteresis_left", "skipped_steps")


@dataclass
class LossScaler:
    """The fp16 loss scale: [Note: the fp16 loss scale]. The defaults are hetero's dynamic scale (LossScaleConfig's)."""

    scale: float = 2.0**16  # the factor the loss is multiplied by before backward
    growth_interval: int = 2000  # overflow-free steps before the scale grows
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    hysteresis: int = 1  # overflows it takes to halve the scale
    consecutive_hysteresis: bool = False  # the count refills at every overflow-free step, not only at a growth
    deepspeed_window: bool = False  # grow at the step after growth_interval clean ones, as DeepSpeed does
    static: bool = False  # the scale never changes (overflowing steps are still skipped)
    good_steps: int = 0  # overflow-free steps since the last overflow (or the start)
    skipped_steps: int = 0  # steps skipped for overflow, in total
    hysteresis_left: int = field(init=False)  # overflows until the next halving: DeepSpeed's cur_hysteresis

    def __post_init__(self) -> None:
        self.hysteresis_left = self.hysteresis
        # Overflows in a row at a scale that cannot fall (the minimum, or static): not a field, so neither saved nor
        # compared; the update warns on it ([Note: overflows the scale cannot cure])
        self.floor_overflows = 0

    @classmethod
    def configured(cls, config: LossScaleConfig) -> LossScaler:
        """The scaler a validated `loss_scale` config section describes."""
        if config.static is not None:
            return cls(scale=config.static, static=True)
        return cls(
            scale=config.initial_scale,
            growth_interval=config.growth_interval,
            min_scale=config.min_scale,
            hysteresis=config.hysteresis,
            consecutive_hysteresis=config.consecutive_hysteresis,
            deepspeed_window=config.deepspeed_window,
        )

    def update(self, overflow: bool) -> None:
        """After a step: whether its gradients overflowed (then the step is skipped)."""
        if overflow:
            self.skipped_steps += 1
            self.good_steps = 0
            self.floor_overflows = self.floor_overflows + 1 if self.static or self.scale <= self.min_scale else 0
            if self.static:
                return
            if self.hysteresis == 1 or self.hysteresis_left <= 1:
                self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            else:
                self.hysteresis_left -= 1
            return
        self.good_steps += 1
        self.floor_overflows = 0
        if self.static:
            return
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        # DeepSpeed's stable_interval leaves the current step out: it grows one overflow-free step later.
        stable = self.good_steps - 1 if self.deepspeed_window else self.good_steps
        if stable > 0 and stable % self.growth_interval == 0:
            if not self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def log_skipped(self) -> None:
        """After a step skipped for overflow (the scale settled): an info line, and a warning where a smaller scale
        cannot cure it, at the first such overflow and whenever their run in a row has doubled since (1, 2, 4, ...
        steps): [Note: overflows the scale cannot cure]."""
        log.info("fp16 gradients overflowed: step skipped, loss scale now %g", self.scale)
        n = self.floor_overflows
        if n == 0 or n & (n - 1):
            return
        where = (
            f"the static loss scale {self.scale:g} (loss_scale.static)"
            if self.static
            else f"the minimum loss scale {self.min_scale:g} (loss_scale.min_scale)"
        )
        log.warning(
            "hetero: fp16 gradients overflowed (inf or nan) at %s, %d step(s) in a row, every one skipped: a smaller "
            "scale cannot cure this, so the loss or the gradients are inf or nan whatever the scale. Check the loss "
            "and the batches of these steps (a nan or inf loss, a log of 0, a division by zero), lower the learning "
            "rate, or train in bf16, whose range does not overflow",
            where,
            n,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The running state of a checkpoint; a field it lacks (an older checkpoint's) keeps its value here: the
        hysteresis count starts full, as it always was before hysteresis. Older checkpoints counted good_steps from
        the last growth too, which the growth test reads modulo growth_interval alike. A static scale is the
        config's."""
        for name in _STATE:
            if name in state and not (name == "scale" and self.static):
                setattr(self, name, state[name])
        self.hysteresis_left = min(self.hysteresis_left, self.hysteresis)  # a resumed run may lower the hysteresis
