"""`engine.optimizer`: a `torch.optim.Optimizer` over the user's param groups, whose `step` is the chunked update.

LR schedulers read and write its `param_groups` (the user's own dicts, hyperparameters included), so they drive the
update. Its states live in chunks across tiers and ranks, not in `self.state`: `state_dict()` refuses rather than
return an empty state a caller would take for the real one; checkpoints save them (`engine.save_checkpoint`).
"""

from __future__ import annotations

from typing import Any

import torch

from hetero.errors import HeteroError
from hetero.zero.update import Updater


class ZeroOptimizer(torch.optim.Optimizer):
    """The user's param groups and hyperparameters; `step` runs the chunked update."""

    def __init__(self, updater: Updater, user: torch.optim.Optimizer) -> None:
        super().__init__(user.param_groups, user.defaults)
        self._updater = updater  # runs the update; shares these param groups
        updater.param_groups = self.param_groups

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("hetero's optimizer takes no closure: call engine.backward(loss) and engine.step()")
        self._updater.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._updater.zero_grads(set_to_none)  # False: the gradients stay, as zeros ([Note: zero gradients kept])

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Each param group's settings (lr, betas, ...), without its parameters: what a checkpoint keeps."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def load_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{len(groups)} param groups given; this optimizer has {len(self.param_groups)}")
        for group, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                old = group.get(k)
                if isinstance(old, torch.Tensor) and isinstance(v, torch.Tensor):
                    old.copy_(v)  # keep the tensor object a compiled step may hold
                else:
                    group[k] = v

    def state_dict(self) -> dict[str, Any]:
        raise HeteroError(
            "engine.optimizer.state_dict(): hetero keeps the optimizer's states (and fp32 master weights) in chunks "
            "spread over tiers and ranks, not in the optimizer object. Save them with engine.save_checkpoint(path) "
            "and restore them with engine.load_checkpoint(path); engine.optimizer.hyperparameters() gives the "
            "param groups' settings"
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise HeteroError(
            "engine.optimizer.load_state_dict(): hetero's optimizer states live in chunks; restore them with "
            "engine.load_checkpoint(path), or load a plain optimizer's state before hetero.initialize"
        )
