"""Module and parameter hooks that drive the chunks through forward and backward.

Stage 3 gathers a chunk just before a module that owns one of its parameters runs, and drops it once every
parameter of the chunk has been used in that pass. Backward needs the parameters again: a module's outputs pass
through `_PreBackward`, an identity whose backward runs before the module's own, and gathers them there (the same
device as PyTorch FSDP and DeepSpeed use, since modules have no reliable pre-backward hook). Every stage takes
gradients from a post-accumulate-grad hook: the moment a parameter's gradient of this micro-batch is complete it is
added into the chunk's gradient buffer and `param.grad` is cleared, so no per-parameter gradient outlives its use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hetero.memory import TensorState

Entry = tuple[Any, Any, Any]  # (ZeroChunk, ParamInfo, TensorSlot)


class _PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hook: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hook()
        return (None, *grads)


def wrap_outputs(output: Any, hook: Callable[[], None]) -> Any:
    """Pass every floating tensor of output that requires grad through one _PreBackward."""
    found: list[torch.Tensor] = []
    _collect(output, found)
    if not found:
        return output
    wrapped = iter(_PreBackward.apply(hook, *found))
    return _replace(output, lambda t: next(wrapped))


def _wants(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()


def _collect(x: Any, out: list[torch.Tensor]) -> None:
    if _wants(x):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _collect(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _collect(v, out)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            _collect(getattr(x, f.name), out)


def _replace(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Same traversal order as _collect, rebuilding containers."""
    if _wants(x):
        return fn(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(_replace(v, fn) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_replace(v, fn) for v in x)
    if isinstance(x, dict):
        # Hugging Face ModelOutput is a dict and a dataclass; setting items keeps both views in step.
        for k in list(x.keys()):
            x[k] = _replace(x[k], fn)
        return x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        changes = {f.name: _replace(getattr(x, f.name), fn) for f in dataclasses.fields(x) if f.init}
        return dataclasses.replace(x, **changes)
    return x


class Hooks:
    """Installs and removes the hooks for one engine."""

    def __init__(self, module: nn.Module, entries: dict[int, Entry], *, stage: int, on_grad: Callable) -> None:
        self.handles: list[RemovableHandle] = []
        for _, info, _ in entries.values():
            if info.trainable:
                self.handles.append(info.param.register_post_accumulate_grad_hook(on_grad))
        if stage == 3:
            for m in module.modules():
                own = [entries[id(p)] for p in m.parameters(recurse=False) if id(p) in entries]
                if own:
                    self.handles.append(m.register_forward_pre_hook(self._pre_forward(own)))
                    self.handles.append(m.register_forward_hook(self._post_forward(own)))

    @staticmethod
    def _pre_forward(own: list[Entry]) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            _enter(own)

        return hook

    @staticmethod
    def _post_forward(own: list[Entry]) -> Callable:
        chunks = list({id(zc): zc for zc, _, _ in own}.values())

        def pre_backward() -> None:
            _enter(own)

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            for zc, info, slot in own:
                zc.exit(info, slot, TensorState.HOLD_AFTER_FWD)
            for zc in chunks:
                zc.maybe_release(TensorState.HOLD_AFTER_FWD)
            if torch.is_grad_enabled():
                return wrap_outputs(output, pre_backward)
            return output

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _enter(own: list[Entry]) -> None:
    # Chunk by chunk: gather, then mark its parameters COMPUTE at once, so fetching the next chunk cannot evict it.
    done: set[int] = set()
    for zc, _, _ in own:
        if id(zc) in done:
            continue
        done.add(id(zc))
        zc.fetch()
        for zc2, info, slot in own:
            if zc2 is zc:
                zc.enter(info, slot)
