"""The loop's own `torch.nn.utils.clip_grad_norm_` on a held model ([Note: the loop's clip_grad_norm_]).

[Note: the loop's clip_grad_norm_]
Loops written for plain PyTorch, DDP and FSDP2 clip between the backward and the optimizer step:
`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`. Under hetero every gradient goes into its chunk and
`param.grad` stays empty, so torch's function found no gradient, returned 0 and clipped nothing: the loop trained
unclipped without a word (measured: max_norm 0.05 on the tests' parity model, AdamW, left the weights 0.0032 off the
clipped run's after three updates, at stages 0 and 3). While an engine holds a model, `torch.nn.utils.clip_grad_norm_`
given exactly the parameters that engine updates (`model.parameters()`, `engine.parameters()`; frozen ones may be in the
list) is `engine.clip_grad_norm_(max_norm)`: it returns the norm of the whole gradient (the data-parallel mean,
unscaled) and the next update clips by it, as `grad_clip_norm` does, with the same arithmetic (so the same bits). It is
a collective: every rank calls it, as every DDP rank clips. Any other call (no held parameter among them) is torch's
own. A list mixing held and other parameters, a part of a model, a norm other than 2, or a call outside the span between
the backward that ends an accumulation and its `step()` is refused with the reason. A loop that imported the function by
name before the first `hetero.initialize` (`from torch.nn.utils import clip_grad_norm_`) holds torch's own, which still
finds no gradient: call it through `torch.nn.utils`, or set `grad_clip_norm`. The update clips by the norm the call
computed (`Updater.clip_stats`), not summing the gradient again; a backward after the call makes it sum afresh.
torch's other clips of parameters find no gradient either: `clip_grads_with_norm_` (the second half of torchtitan's
clip, after `get_total_norm` of the `.grad`s, which is 0) clipped nothing without a word, and `clip_grad_value_`
failed inside torch ("Expected !nested_tensorlist[0].empty()"). Given a held parameter, both are refused, naming the
clip hetero does instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

_ENGINES: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(param) -> (param, the engine holding it), weakly
_TORCH: dict[str, Callable[..., Any]] = {}  # torch's own functions, once replaced


def _holder(p: torch.Tensor) -> Any:
    entry = _ENGINES.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, routed to the engine that holds the parameters given (see the Note)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    holders = [_holder(p) for p in params]
    engines = {id(e): e for e in holders if e is not None}
    if not engines:
        return _TORCH["clip_grad_norm_"](params, max_norm, norm_type, error_if_nonfinite, foreach)
    if len(engines) > 1 or None in holders:
        raise RuntimeError(
            "torch.nn.utils.clip_grad_norm_ was given parameters of a model hetero holds together with others "
            "(another engine's, or a model of the loop's own): hetero clips the gradient of its whole model at its "
            "update. Clip each engine's parameters in their own call, or set grad_clip_norm in the config"
        )
    (engine,) = engines.values()
    return engine.clip_grad_norm_(max_norm, norm_type, parameters=params, error_if_nonfinite=error_if_nonfinite)


def _refuse_held(name: str, parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters as a list, or the refusal of torch's `name` where one of them is held by an engine."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if any(_holder(p) is not None for p in params):
        raise RuntimeError(
            f"torch.nn.utils.{name} was given parameters of a model hetero holds: their gradients are in hetero's "
            "chunks, not in .grad, so it would clip nothing. hetero clips the whole gradient by its 2-norm at the "
            "update: call torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) after the backward that ends "
            "an accumulation and before step() (it returns the norm), or set grad_clip_norm in the config"
        )
    return params


def clip_grad_value_(
    parameters: torch.Tensor | Iterable[torch.Tensor], clip_value: float, foreach: bool | None = None
) -> None:
    """torch.nn.utils.clip_grad_value_, refused for a held model's parameters (see the Note)."""
    _TORCH["clip_grad_value_"](_refuse_held("clip_grad_value_", parameters), clip_value, foreach)


def clip_grads_with_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    """torch.nn.utils.clip_grads_with_norm_, refused for a held model's parameters (see the Note)."""
    params = _refuse_held("clip_grads_with_norm_", parameters)
    _TORCH["clip_grads_with_norm_"](params, max_norm, total_norm, foreach)


def route(params: Iterable[torch.Tensor], engine: Any) -> Callable[[], None]:
    """While `engine` is open, torch.nn.utils.clip_grad_norm_ of its parameters is the engine's; returns the undo."""
    if not _TORCH:
        import torch.nn.utils.clip_grad as module

        _TORCH["clip_grad_norm_"] = module.clip_grad_norm_
        _TORCH["clip_grad_value_"] = module.clip_grad_value_
        module.clip_grad_norm_ = clip_grad_norm_
        module.clip_grad_value_ = clip_grad_value_
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
        torch.nn.utils.clip_grad_value_ = clip_grad_value_
        if hasattr(torch.nn.utils, "clip_grads_with_norm_"):  # torch 2.6 and later
            _TORCH["clip_grads_with_norm_"] = torch.nn.utils.clip_grads_with_norm_
            torch.nn.utils.clip_grads_with_norm_ = clip_grads_with_norm_
    me = weakref.ref(engine)
    held = list(params)
    for p in held:
        _ENGINES[id(p)] = (weakref.ref(p), me)

    def undo() -> None:
        for p in held:
            entry = _ENGINES.get(id(p))
            if entry is not None and entry[0]() is p:
                del _ENGINES[id(p)]

    return undo
