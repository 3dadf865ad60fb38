"""The optimizer update on flat shards, with the user's optimizer's algorithm and hyperparameters.

hetero does not call the user's optimizer: its states live in chunks (maybe on NVMe) and its parameters are flat
fp32 shards. It reads the algorithm and every hyperparameter from the user's optimizer (per param group, at every
step, so LR schedulers work) and runs PyTorch's own functional kernels, fused where the device supports them. Adam,
AdamW and SGD take that fused path; any other elementwise torch optimizer (Adagrad, RMSprop, NAdam, ...) runs its
own `step()` on views of the flat shards (hetero/zero/generic_optim.py).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import SGD, Adam, AdamW
from torch.optim.adam import adam as adam_fn
from torch.optim.adamw import adamw as adamw_fn
from torch.optim.sgd import sgd as sgd_fn

from hetero.errors import ConfigError
from hetero.zero.generic_optim import GenericUpdate

FUSED = (Adam, AdamW, SGD)  # updated by torch's fused kernels on whole runs of a shard
# Newer torch folds AdamW into Adam's functional form with this keyword; older versions have adamw() instead.
_ADAM_DECOUPLES = "decoupled_weight_decay" in inspect.signature(adam_fn).parameters


@dataclass(frozen=True)
class Algorithm:
    name: str  # "adam", "sgd", "none" (inference), or the torch class's name on the generic path
    state_names: tuple[str, ...]  # flat fp32 states kept beside each master shard
    decoupled: bool  # AdamW-style weight decay, where a param group does not say (older torch's AdamW)
    generic: GenericUpdate | None = None  # set for optimizers stepped through their own step() (generic path)

    def decouples(self, group: dict[str, Any]) -> bool:
        """Whether this param group's weight decay is AdamW's. torch reads `decoupled_weight_decay` per group, so one
        group's setting is not every group's (an Adam with one decoupled group stepped all of them decoupled)."""
        return bool(group.get("decoupled_weight_decay", self.decoupled))


NO_OPTIMIZER = Algorithm("none", (), decoupled=False)


def algorithm_of(optimizer: torch.optim.Optimizer | None) -> Algorithm:
    if optimizer is None:
        return NO_OPTIMIZER
    for g, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            raise ConfigError(f"optimizer param group {g}: differentiable=True is not supported")
    # amsgrad keeps a running maximum: elementwise, but not in the fused kernels' state layout.
    amsgrad = any(g.get("amsgrad") for g in optimizer.param_groups)
    if type(optimizer) not in FUSED or amsgrad:
        generic = GenericUpdate.probe(optimizer)  # raises, saying why, for a non-elementwise optimizer
        algo = Algorithm(type(optimizer).__name__.lower(), generic.state_names, decoupled=False, generic=generic)
    elif isinstance(optimizer, SGD):
        algo = Algorithm("sgd", ("momentum_buffer",), decoupled=False)
    else:
        decoupled = isinstance(optimizer, AdamW) or any(g.get("decoupled_weight_decay") for g in optimizer.param_groups)
        algo = Algorithm("adam", ("exp_avg", "exp_avg_sq"), decoupled=decoupled)
    check_states(optimizer, algo)
    return algo


def state_steps(state: dict[str, Any]) -> int:
    """The steps a parameter's state says it took. SGD (and a class that counts none) keeps no "step": a state tensor
    there stands for one, which is what hetero's count tells the update (the state exists; a first step makes it)."""
    step = state.get("step")
    if step is not None:
        return int(float(step))
    return 1 if any(isinstance(v, torch.Tensor) for v in state.values()) else 0


def check_states(optimizer: torch.optim.Optimizer, algo: Algorithm) -> None:
    """A state loaded into the optimizer before `initialize` is taken over ([Note: a plain optimizer's states taken
    over] in optimizer.py): each parameter that took a step must have every state the update keeps, of its size.
    Checked before anything is built, on every rank alike (each holds the whole state)."""
    scalars = algo.generic.scalar_names if algo.generic is not None else ()
    for g, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            st = optimizer.state.get(p)
            if not st or state_steps(st) == 0:
                continue
            where = f"param group {g}, parameter {j} (shape {tuple(p.shape)})"
            for name in algo.state_names:
                value = st.get(name)
                if value is None and algo.name == "sgd":
                    continue  # torch keeps a None buffer where momentum was 0
                if not isinstance(value, torch.Tensor) or value.numel() != p.numel():
                    have = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "none"
                    raise ConfigError(
                        f"the optimizer's state {name!r} for {where} is not one of its size ({have}): the state dict "
                        "loaded into the optimizer before hetero.initialize belongs to another model, another order "
                        "of parameters or another optimizer class; load the one saved with this model and optimizer"
                    )
            missing = [n for n in scalars if not isinstance(st.get(n), torch.Tensor)]
            if missing:
                raise ConfigError(
                    f"the optimizer's state for {where} has no {missing[0]!r}, which {type(optimizer).__name__} keeps "
                    "for every parameter that took a step: load a state dict saved by the same optimizer class"
                )


def check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer | None) -> Any:
    """The LR scheduler `initialize` was given, checked: it must drive this optimizer's param groups."""
    if scheduler is None:
        return None
    if optimizer is None:
        raise ConfigError("lr_scheduler: an inference engine (optimizer=None) has no learning rate to schedule")
    if not callable(getattr(scheduler, "step", None)) or not callable(getattr(scheduler, "state_dict", None)):
        raise ConfigError(f"lr_scheduler: expected a torch LR scheduler, got {type(scheduler).__name__}")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError(
            "lr_scheduler: ReduceLROnPlateau steps on a metric the engine does not see; keep stepping it yourself "
            "(scheduler.step(val_loss)) and leave lr_scheduler unset"
        )
    target = getattr(scheduler, "optimizer", None)
    ids = [[id(p) for p in g["params"]] for g in optimizer.param_groups]
    if target is not None and [[id(p) for p in g["params"]] for g in target.param_groups] != ids:
        raise ConfigError(
            "lr_scheduler: it was built on another optimizer; build it on the optimizer you pass to "
            "hetero.initialize (its param groups are the ones the engine updates)"
        )
    return scheduler


def step_scheduler(scheduler: Any) -> None:
    """Step an LR scheduler after a real update. The update is an optimizer step that torch's scheduler did not see
    (it watches the user's `optimizer.step()`, which the engine never calls), so torch's warning that the schedule
    was stepped before the optimizer would be wrong here: it is silenced for this call only, as is its warning that
    `optimizer.step` was replaced after the scheduler was built (the engine replaced it with a refusal: [Note: the
    optimizer handed over])."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        warnings.filterwarnings("ignore", message=r"Seems like `optimizer\.step\(\)` has been overridden")
        scheduler.step()


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
    taken: int,
    *,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One optimizer step on a flat fp32 run of parameters, in place. `step` is a 0-d float tensor holding the steps
    these parameters took before (torch's Adam kernels advance it themselves), `taken` the same count as a number
    (read back from a device tensor it would make the host wait). found_inf: a device scalar, 1.0 where the fused
    Adam kernel is to leave everything as it was (fp16 overflow, [Note: the overflow check on the device])."""
    if algo.name == "adam":
        beta1, beta2 = group["betas"]
        fn, extra = adam_fn, {}
        if found_inf is not None:
            extra["found_inf"] = found_inf
        decoupled = algo.decouples(group)
        if _ADAM_DECOUPLES:
            extra["decoupled_weight_decay"] = decoupled
        elif decoupled:
            fn = adamw_fn
        fn(
            [master],
            [grad],
            [states["exp_avg"]],
            [states["exp_avg_sq"]],
            [],
            [step],
            fused=_fused_ok(master),
            **extra,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group.get("maximize", False),
        )
        return
    assert found_inf is None, "only the fused Adam kernels skip a step themselves"
    momentum = group["momentum"]
    # torch's SGD starts the momentum buffer as a copy of the first gradient (no dampening); `step` says whether
    # these parameters' buffer exists yet.
    buf = states["momentum_buffer"] if momentum != 0 and taken > 0 else None
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
