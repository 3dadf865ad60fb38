"""The optimizer update on flat shards, with the user's optimizer's algorithm and hyperparameters.

hetero does not call the user's optimizer: its states live in chunks (maybe on NVMe) and its parameters are flat
fp32 shards. It reads the algorithm and every hyperparameter from the user's optimizer (per param group, at every
step, so LR schedulers work) and runs PyTorch's own functional kernels, fused where the device supports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import SGD, Adam, AdamW
from torch.optim.adam import adam as adam_fn
from torch.optim.sgd import sgd as sgd_fn

from hetero.errors import ConfigError

SUPPORTED = (Adam, AdamW, SGD)


@dataclass(frozen=True)
class Algorithm:
    name: str  # "adam" or "sgd"
    state_names: tuple[str, ...]  # flat fp32 states kept beside each master shard
    decoupled: bool  # AdamW-style weight decay


def algorithm_of(optimizer: torch.optim.Optimizer) -> Algorithm:
    if not isinstance(optimizer, SUPPORTED):
        names = ", ".join(f"torch.optim.{c.__name__}" for c in SUPPORTED)
        raise ConfigError(f"optimizer {type(optimizer).__name__} is not supported; use one of {names}")
    for g, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad"):
            raise ConfigError(f"optimizer param group {g}: amsgrad=True is not supported; set amsgrad=False")
        if group.get("differentiable"):
            raise ConfigError(f"optimizer param group {g}: differentiable=True is not supported")
    if isinstance(optimizer, SGD):
        return Algorithm("sgd", ("momentum_buffer",), decoupled=False)
    decoupled = isinstance(optimizer, AdamW) or any(g.get("decoupled_weight_decay") for g in optimizer.param_groups)
    return Algorithm("adam", ("exp_avg", "exp_avg_sq"), decoupled=decoupled)


def _fused_ok(t: torch.Tensor) -> bool:
    # PyTorch's fused kernels cover CUDA and the CPU for floating point parameters.
    return t.device.type in ("cuda", "cpu")


def update(
    algo: Algorithm,
    group: dict[str, Any],
    master: torch.Tensor,
    grad: torch.Tensor,
    states: dict[str, torch.Tensor],
    step: torch.Tensor,
) -> None:
    """One optimizer step on a flat fp32 run of parameters, in place. `step` is a 0-d float tensor holding the steps
    these parameters took before (torch's Adam kernels advance it themselves)."""
    if algo.name == "adam":
        beta1, beta2 = group["betas"]
        adam_fn(
            [master],
            [grad],
            [states["exp_avg"]],
            [states["exp_avg_sq"]],
            [],
            [step],
            fused=_fused_ok(master),
            decoupled_weight_decay=algo.decoupled,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group.get("maximize", False),
        )
        return
    momentum = group["momentum"]
    # torch's SGD starts the momentum buffer as a copy of the first gradient (no dampening); `step` says whether
    # these parameters' buffer exists yet.
    buf = states["momentum_buffer"] if momentum != 0 and step.item() > 0 else None
    bufs: list[torch.Tensor | None] = [buf]
    sgd_fn(
        [master],
        [grad],
        bufs,
        weight_decay=group["weight_decay"],
        momentum=momentum,
        lr=group["lr"],
        dampening=group["dampening"],
        nesterov=group["nesterov"],
        maximize=group.get("maximize", False),
    )
    if momentum != 0 and buf is None:
        states["momentum_buffer"].copy_(bufs[0])
