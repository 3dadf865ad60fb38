"""`engine.optimizer`: a `torch.optim.Optimizer` over the user's param groups, whose `step` is the chunked update.

LR schedulers read and write its `param_groups` (the user's own dicts, hyperparameters included), so they drive the
update. Its states live in chunks across tiers and ranks, not in `self.state`: `state_dict()` refuses rather than
return an empty state a caller would take for the real one; checkpoints save them (`engine.save_checkpoint`).

[Note: a plain optimizer's states taken over]
A loop resuming from a plain PyTorch checkpoint loads the optimizer's state before `hetero.initialize`
(`optimizer.load_state_dict(ckpt["optimizer"])`, on every rank, as DDP loops do), and the refusal of a later
`load_state_dict` tells users to do so. hetero used to start every state afresh all the same: Adam's moments at zero
and its step count at 0, so its bias correction restarted (measured: the second step after the resume 0.012 off
plain PyTorch's loss, SGD's momentum lost 0.05 off by the third). So the states are taken over when the optimizer
is built: each parameter's per-element states copied into this rank's range of its chunks (a tile's rows where a
parameter is split over chunks), its step count into the chunk's per-parameter counts (SGD keeps none: a momentum
buffer stands for one step: what the update asks of it), and the 0-d states of the generic path (NAdam's
`mu_product`) beside them. A parameter whose state says it took no step yet gets hetero's fresh state, as a first
step makes it. The user's `optimizer.state` is then emptied: it is a full copy on every rank, which ZeRO exists not
to hold. A state that does not fit its parameter (another shape, a missing moment) is a ConfigError, before
anything is built (`check_states` in optim.py).

[Note: the update is engine.step()'s]
`engine.optimizer.step()` called by a loop (a DeepSpeed or plain-PyTorch habit: `engine.backward(loss)` then
`engine.optimizer.step()`) ran the update and nothing around it: measured, the LR scheduler given to `initialize`
never stepped (StepLR(gamma=0.5) left the rate at its first value), `grad_accumulation_steps` was ignored (an update
on every call), and the step-order check and the loop's parameter writes were skipped. So only the engine's own
`step()` runs it (inside `stepping()`, which keeps the call going through `optimizer.step`, where a scheduler built on
this object counts it); a direct call is refused, naming `engine.step()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from hetero.errors import HeteroError
from hetero.memory import Tier
from hetero.zero.optim import state_steps
from hetero.zero.update import Updater


class ZeroOptimizer(torch.optim.Optimizer):
    """The user's param groups and hyperparameters; `step` runs the chunked update."""

    def __init__(self, updater: Updater, user: torch.optim.Optimizer) -> None:
        self._built = False  # torch's constructor adds the groups through add_param_group; later calls are refused
        super().__init__(user.param_groups, user.defaults)
        self._built = True
        self._updater = updater  # runs the update; shares these param groups
        self._engine_stepping = False  # [Note: the update is engine.step()'s]
        updater.param_groups = self.param_groups
        take_states(updater, user)  # [Note: a plain optimizer's states taken over]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("hetero's optimizer takes no closure: call engine.backward(loss) and engine.step()")
        if not self._engine_stepping:
            raise HeteroError(
                "engine.optimizer.step() was called directly: it would run the update without what engine.step() "
                "does around it (the grad_accumulation_steps count, the LR scheduler given to hetero.initialize, "
                "the check that a backward came first, the writes a loop made to the parameters). Call "
                "engine.step() after every engine.backward(loss) instead: it updates at the accumulation boundary"
            )
        self._updater.step()

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """The engine's own update: `step()` runs inside ([Note: the update is engine.step()'s])."""
        self._engine_stepping = True
        try:
            yield
        finally:
            self._engine_stepping = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._updater.zero_grads(set_to_none)  # False: the gradients stay, as zeros ([Note: zero gradients kept])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._built:
            super().add_param_group(param_group)
            return
        # The group would join the list the update reads, but no chunk holds its parameters: they never trained.
        raise HeteroError(
            "engine.optimizer.add_param_group(): hetero lays its chunks out once, at hetero.initialize, so parameters "
            "added now would never train. Build the optimizer with every param group up front (a group may start "
            "with lr 0 and be raised later, or its parameters may start with requires_grad False)"
        )

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


def take_states(updater: Updater, user: torch.optim.Optimizer) -> None:
    """The user's optimizer states into the chunks, then emptied ([Note: a plain optimizer's states taken over])."""
    # By id: at stage 3 a released parameter refuses to be hashed as a tensor key would be.
    given = {id(p): s for p, s in user.state.items() if s}
    if not given:
        return
    algo = updater.algorithm
    scalar_names = algo.generic.scalar_names if algo.generic is not None else ()
    for zc in updater.chunks:
        found = [(i, info, given.get(id(info.param))) for i, info in enumerate(zc.spec.params)]
        found = [(i, info, st, state_steps(st)) for i, info, st in found if st is not None]
        found = [f for f in found if f[3] > 0]
        if not found:
            continue
        lo, hi = zc.kept_range()
        views = dict(zip(algo.state_names, zc.state_views()))
        for i, info, st, steps in found:
            zc.param_steps[i] = steps
            a, b = max(info.offset, lo), min(info.offset + info.numel, hi)
            if a >= b:
                continue  # its elements are other ranks': only its step count is this rank's
            for name, view in views.items():
                value = st.get(name)
                if value is not None:  # None: SGD's buffer where momentum was 0 (`check_states` in optim.py)
                    part = value.detach().reshape(-1)[info.element(a) : info.element(b)]
                    view[a - lo : b - lo].copy_(part.to(view.device, torch.float32))
            if scalar_names:
                algo.generic.scalars[(zc.spec.index, i)] = {n: st[n].detach().cpu().clone() for n in scalar_names}
        if zc.placement.optim is Tier.NVME:
            updater.manager.move(zc.optim, Tier.NVME)  # as the chunk's first values went: [Note: the update pipeline]
    user.state.clear()
