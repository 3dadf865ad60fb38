"""Activation memory: the bytes autograd saves for backward, counted through saved-tensor hooks.

[Note: counting saved activations]
What a training step holds beyond the model states is what forward saves for backward. A saved-tensor pack hook sees
every tensor autograd keeps; counting each distinct storage once (views of one tensor share it) and leaving out
storages that back parameters (they are model states, counted elsewhere) gives the activation bytes. On the meta
device the same hooks run without allocating anything, so the estimate is this count over a forward on meta tensors,
and the measurement the same count over a real forward: the two differ only where a kernel saves different tensors
on meta than on a real device. One does: scaled_dot_product_attention on meta takes the math path, which saves the
[seq x seq] attention matrices, while CUDA and CPU run fused (flash) kernels that save only q, k, v, the output and
a per-row log-sum-exp; so on meta it is replaced by a stand-in that saves exactly those. With activation
checkpointing only the blocks' inputs stay saved, plus one block's activations while it is recomputed in backward.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


def storage_key(t: torch.Tensor) -> int:
    """An identity for a tensor's storage, valid while the storage is alive: the address of its StorageImpl. Not
    the data pointer: on meta every data pointer is 0, and a stage-3 chunk's storage keeps its identity while its
    memory is dropped and grown back (a new data pointer each time)."""
    return t.untyped_storage()._cdata


@dataclass
class SavedBytes:
    """Distinct bytes saved for backward while active, in total and per owner (a label the caller sets)."""

    exclude: set[int] = field(default_factory=set)  # storage keys not to count (parameters)
    total: int = 0
    by_owner: dict[str, int] = field(default_factory=dict)
    owner: str = ""  # who is saving now (set by module hooks)
    _seen: dict[int, torch.Tensor] = field(default_factory=dict)  # key -> a tensor keeping the storage alive

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self._seen and key not in self.exclude:
            # Holding the tensor keeps its storage alive, so its key cannot be reused by another while we count.
            self._seen[key] = t
            n = t.untyped_storage().nbytes()
            self.total += n
            self.by_owner[self.owner] = self.by_owner.get(self.owner, 0) + n
        return t.detach()  # what autograd keeps must not hold the tensor's grad_fn (a cycle for saved outputs)

    @contextlib.contextmanager
    def active(self) -> Iterator[SavedBytes]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack):
            yield self
        self._seen.clear()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def parameter_keys(model: nn.Module) -> set[int]:
    return {storage_key(p) for p in model.parameters()}


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The members of the model's largest ModuleList of same-class modules: the blocks that activation checkpointing
    wraps (transformer layers)."""
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(c) for c in m}) == 1:
            best = list(m)
    return best


@dataclass(frozen=True)
class ActivationEstimate:
    bytes: int  # held at the end of forward (what backward starts from)
    saved: int  # saved for backward with no checkpointing
    checkpointed: bool
    note: str = ""


def meter_modules(
    model: nn.Module, inputs: dict[str, Any], modules: dict[str, nn.Module], *, dtype: torch.dtype
) -> tuple[SavedBytes, dict[str, int]]:
    """One forward of `model` on `inputs` on the meta device: what it saves for backward, attributed to the labelled
    `modules` that were running (`by_owner`; "" for outside all of them), and the bytes of each module's first
    tensor input. Parameters and buffers are replaced by meta tensors of the compute dtype for the call
    (torch.func.functional_call), so this works on a real model as well as on one built on meta."""
    params = {n: meta_like(p, dtype) for n, p in model.named_parameters()}
    buffers = {n: meta_like(b, dtype) for n, b in model.named_buffers()}
    meter = SavedBytes(exclude={storage_key(t) for t in params.values()})
    firsts: dict[str, int] = {}
    handles = []
    for name, module in modules.items():

        def pre(mod: nn.Module, args: tuple, kwargs: dict, label: str = name) -> None:
            meter.owner = label
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if first is not None:
                firsts[label] = first.untyped_storage().nbytes()

        def post(mod: nn.Module, args: tuple, out: Any) -> None:
            meter.owner = ""

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    try:
        with torch.device("meta"), FusedAttention(), _autocast_off_on_meta(), meter.active():
            torch.func.functional_call(model, {**params, **buffers}, args=(), kwargs=inputs, tie_weights=True)
    finally:
        for h in handles:
            h.remove()
    return meter, firsts


@contextlib.contextmanager
def _autocast_off_on_meta() -> Iterator[None]:
    """`torch.autocast(device_type="meta", enabled=False)` as a no-op, which it is: torch takes no autocast on the meta
    device at all ("unsupported scalarType"), and transformers 4's rotary embeddings (Llama and its kin) switch it off
    around their float32 arithmetic, so their meta forward failed and the estimate counted no activations. An
    enabled autocast on meta still fails, and the estimate says so."""
    original = torch.autocast

    def autocast(device_type: str, *args: Any, **kwargs: Any) -> Any:
        if device_type == "meta" and kwargs.get("enabled", True) is False:
            return contextlib.nullcontext()
        return original(device_type, *args, **kwargs)

    torch.autocast = autocast  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.autocast = original  # type: ignore[misc]


def meta_activation_bytes(
    model: nn.Module,
    inputs: dict[str, Any],
    *,
    dtype: torch.dtype,
    checkpointing: bool = False,
) -> ActivationEstimate:
    """Bytes a forward of `model` on `inputs` saves for backward, counted on the meta device: nothing is allocated
    (`meter_modules`)."""
    blocks = repeated_blocks(model) if checkpointing else []
    meter, firsts = meter_modules(model, inputs, {f"block{i}": b for i, b in enumerate(blocks)}, dtype=dtype)
    if not blocks:
        return ActivationEstimate(bytes=meter.total, saved=meter.total, checkpointed=False)
    in_blocks = {k: v for k, v in meter.by_owner.items() if k}
    outside = meter.by_owner.get("", 0)
    held = outside + sum(firsts.values()) + max(in_blocks.values(), default=0)
    return ActivationEstimate(bytes=held, saved=meter.total, checkpointed=True, note=f"{len(blocks)} blocks")


@dataclass(frozen=True)
class UnitActivation:
    saved: int  # bytes one micro-batch's forward through the unit saves for backward
    input: int  # bytes of its input (what a checkpointed unit keeps instead)


def unit_activations(
    units: list[tuple[str, nn.Module]], first_input: torch.Tensor, *, dtype: torch.dtype, labels: Any = None
) -> list[UnitActivation]:
    """Per pipeline unit, what one micro-batch saves for backward, counted on meta: each unit's input is the
    previous unit's output; the last is called with `labels=` when given (a model computing its own loss)."""
    out = []
    x: Any = first_input.to("meta")
    if x.is_floating_point():
        x = x.to(dtype)
    for i, (_, unit) in enumerate(units):
        params = {n: meta_like(p, dtype) for n, p in unit.named_parameters()}
        buffers = {n: meta_like(b, dtype) for n, b in unit.named_buffers()}
        meter = SavedBytes(exclude={storage_key(t) for t in params.values()})
        kwargs = {"labels": labels.to("meta")} if labels is not None and i == len(units) - 1 else {}
        inp = x.detach().requires_grad_(x.is_floating_point())
        with torch.device("meta"), FusedAttention(), _autocast_off_on_meta(), meter.active():
            y = torch.func.functional_call(unit, {**params, **buffers}, args=(inp,), kwargs=kwargs)
        out.append(UnitActivation(saved=meter.total, input=inp.untyped_storage().nbytes()))
        x = y if isinstance(y, torch.Tensor) else getattr(y, "logits", y)
    return out


def meta_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out_dtype = dtype if t.is_floating_point() else t.dtype
    return torch.empty(t.shape, dtype=out_dtype, device="meta").requires_grad_(t.requires_grad)


class _FlashStandIn(torch.autograd.Function):
    """Meta-only stand-in for a fused attention kernel: the output's shape, and what flash attention saves."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, *extra)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise RuntimeError("the meta attention stand-in is for counting saved bytes only")


class FusedAttention(TorchFunctionMode):
    """Routes scaled_dot_product_attention to `_FlashStandIn` (see [Note: counting saved activations])."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            extra = (mask,) if isinstance(mask, torch.Tensor) else ()
            return _FlashStandIn.apply(q, k, v, *extra)
        return func(*args, **kwargs)


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages created while active and still alive, and their peak: what a step really holds in
    activations (recomputation and received tensors included), on any device, the CPU too.

    [Note: counting live storages]
    Saved-tensor hooks see what autograd keeps, not what checkpointing recomputes in backward nor the temporaries of
    a kernel; this counts every storage an operator creates (each once, however many views it has) from its creation
    until it is freed (a finalizer on the storage). An output sharing an input's storage (a view, an in-place
    result) is not new, so storages that existed before (parameters and their transposes, gradient buffers that
    backward only adds into) are not counted: the peak is the activation memory of what ran inside."""

    def __init__(self, device_type: str | None = None) -> None:
        super().__init__()
        self.device_type = device_type  # count storages of this device type only (None: all but meta)
        self.current = 0
        self.peak = 0
        self.paused = False  # storages created while paused are not counted (e.g. an optimizer update's)
        self._alive: dict[int, Any] = {}  # storage key -> its finalizer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        inputs = {storage_key(t) for t in _tensors((args, tuple(kwargs.values())))}
        for t in _tensors(out):
            if t.device.type == "meta" or (self.device_type is not None and t.device.type != self.device_type):
                continue
            storage = t.untyped_storage()
            key = storage_key(t)
            if key in self._alive or key in inputs:  # counted already, or a view / in-place result of an input
                continue
            n = storage.nbytes()
            self.current += n
            self.peak = max(self.peak, self.current)
            self._alive[key] = weakref.finalize(storage, self._freed, key, n)
        return out

    def _freed(self, key: int, n: int) -> None:
        self.current -= n
        self._alive.pop(key, None)

    def reset_peak(self) -> None:
        self.peak = self.current


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
