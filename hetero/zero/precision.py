"""Compute dtypes and the dynamic loss scaler for fp16."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LossScaler:
    """Dynamic loss scaling: fp16 gradients underflow unless the loss is scaled up before backward.

    The scale halves whenever a step's gradients overflow (that step is skipped) and doubles after `growth_interval`
    steps without overflow, as in torch.amp.GradScaler and DeepSpeed.
    """

    scale: float = 2.0**16  # the factor the loss is multiplied by before backward
    growth_interval: int = 2000  # overflow-free steps before the scale grows
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    good_steps: int = 0  # overflow-free steps since the last change
    skipped_steps: int = 0  # steps skipped for overflow, in total

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])
