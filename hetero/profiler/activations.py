"""Activation memory: the bytes autograd saves for backward, counted through saved-tensor hooks.

[Note: counting saved activations]
What a training step holds beyond the model states is what forward saves for backward. A saved-tensor pack hook sees
every tensor autograd keeps; counting each distinct storage once (views of one tensor share it) and leaving out
storages that back parameters (they are model states, counted elsewhere) gives the activation bytes. On the meta
device the same hooks run without allocating anything, so the estimate is this count over a forward on meta tensors,
and the measurement the same count over a real forward: the two differ only where a kernel saves different tensors
on meta than on a real device. One does: scaled_dot_product_attention on meta takes the math path, which saves the
[seq x seq] attention matrices, while CUDA and CPU run fused (flash) kernels that save only q, k, v, the output and
a per-row log-sum-exp; so on meta it is replaced by a stand-in that saves exactly those, its output laid out as
theirs (`_fused_output`). Counted so, a Llama or GPT block in fp32 or bf16 saves on meta exactly the storages a CPU
run saves (tests/test_estimator.py compares them byte for byte), with one exception the meta device cannot know:
LayerNorm's per-row mean and rstd are float32 on meta and CUDA but in the input's dtype on the CPU (2 x rows x 2
bytes fewer per bf16 LayerNorm there). What the count leaves out, and a device adds: the CUDA caching allocator
rounds each storage up to 512 bytes (at most 511 x `ActivationEstimate.storages`), memory-efficient attention (fp32
on CUDA) pads its log-sum-exp to 32 rows, and a kernel's scratch (cuBLAS workspace) is not an activation.

[Note: what checkpointing keeps]
Under activation checkpointing (torch's non-reentrant checkpoint) a block saves nothing of its own in forward: it
keeps its tensor arguments (its hidden-state input, and what every block is given, such as rotary tables, once).
Forward therefore ends holding what is saved outside the blocks ("before": the embeddings; "after": the final norm,
the head and the loss) and the blocks' arguments. Backward runs the "after" nodes first, freeing what they saved,
then recomputes the last block: its own saved storages are held at once, with "before" and the arguments of every
block up to it; a block's arguments go when its backward is done. The peak of saved bytes is the larger of the
forward's end and the largest of these recomputations; storages are counted once however many hold them (keys).
Outside saves between two blocks are counted as "before" (held to the end of backward, an upper bound). These are
the saved bytes; with `activation_offload` the arguments move to the host, which a step's peak models
(`step_peak.py`, [Note: offloaded inputs on meta]).

[Note: branches on meta]
A meta tensor has no values, so an `if` on one (its truth value) raises, and the estimate counted no activations.
transformers 5 branches so in every decoder's forward without a cache or an attention mask, that is with
`use_cache=False` as training configs set it: whether the position ids pack several sequences into a row
(`find_packed_sequence_indices`, then a packed mask is built). The estimate's batch is one sequence per row, for
which that test is true; every truth value asked of a meta tensor is answered true, what that batch answers there.
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

from hetero.activation import choose_blocks


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
    # owner -> its distinct storages (key -> bytes), a storage saved by several owners under each: what one block
    # saves again when it is recomputed, however much of it an earlier owner saved first
    keys: dict[str, dict[int, int]] = field(default_factory=dict)
    order: dict[int, int] = field(default_factory=dict)  # key -> how many storages were counted before it
    _seen: dict[int, torch.Tensor] = field(default_factory=dict)  # key -> a tensor keeping the storage alive

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key in self.exclude:
            return t.detach()
        n = t.untyped_storage().nbytes()
        self.keys.setdefault(self.owner, {})[key] = n
        if key not in self._seen:
            # Holding the tensor keeps its storage alive, so its key cannot be reused by another while we count.
            self._seen[key] = t
            self.order[key] = len(self.order)
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
    # The most activation bytes a step holds at once: the step's peak where the estimator ran forward and backward
    # on meta ([Note: a step's activation peak] in step_peak.py), else `saved_peak`.
    bytes: int
    saved: int  # saved for backward with no checkpointing
    checkpointed: bool
    note: str = ""
    forward_end: int = 0  # saved and held when forward returns (what backward starts from)
    saved_peak: int = 0  # the most saved for backward at once ([Note: what checkpointing keeps])
    storages: int = 0  # distinct storages saved without checkpointing (each one allocation on a device)


@dataclass
class ModuleTrace:
    """Filled by `meter_modules` when given: per labelled module, its tensor arguments by storage (the tensors kept,
    so that their keys stay theirs while counted), and how many storages had been saved when it returned."""

    args: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    ended_at: dict[str, int] = field(default_factory=dict)


def meter_modules(
    model: nn.Module,
    inputs: dict[str, Any],
    modules: dict[str, nn.Module],
    *,
    dtype: torch.dtype,
    trace: ModuleTrace | None = None,
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
            if trace is not None:
                tensors = _tensors((args, tuple(kwargs.values())))
                trace.args[label] = {storage_key(t): t for t in tensors if t.device.type == "meta"}

        def post(mod: nn.Module, args: tuple, out: Any, label: str = name) -> None:
            meter.owner = ""
            if trace is not None:
                trace.ended_at[label] = len(meter.order)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    try:
        with torch.device("meta"), FusedAttention(), autocast_off_on_meta(), meter.active():
            torch.func.functional_call(model, {**params, **buffers}, args=(), kwargs=inputs, tie_weights=True)
    finally:
        for h in handles:
            h.remove()
    return meter, firsts


@contextlib.contextmanager
def autocast_off_on_meta() -> Iterator[None]:
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
    checkpointing: bool | list[str] | tuple[str, ...] = False,
) -> ActivationEstimate:
    """Bytes a forward of `model` on `inputs` saves for backward, counted on the meta device: nothing is allocated
    (`meter_modules`). `checkpointing` is the config's `activation_checkpointing`: true, or a list of the blocks'
    class names or name patterns, chosen as the engine chooses them ([Note: what checkpointing keeps])."""
    blocks = [m for _, m in choose_blocks(model, checkpointing, strict=False)] if checkpointing else []
    labels = [f"block{i}" for i in range(len(blocks))]
    trace = ModuleTrace()
    meter, _ = meter_modules(model, inputs, dict(zip(labels, blocks)), dtype=dtype, trace=trace)
    storages = len(meter.order)
    if not blocks:
        total = meter.total
        return ActivationEstimate(total, total, False, forward_end=total, saved_peak=total, storages=storages)
    outside = meter.keys.get("", {})
    last_end = max(trace.ended_at.get(label, 0) for label in labels)
    before = {k: n for k, n in outside.items() if meter.order[k] < last_end}
    after = {k: n for k, n in outside.items() if meter.order[k] >= last_end}
    args = [{k: t.untyped_storage().nbytes() for k, t in trace.args.get(label, {}).items()} for label in labels]
    forward_end = _union(before, after, *args)
    recomputed = [_union(before, *args[: i + 1], meter.keys.get(label, {})) for i, label in enumerate(labels)]
    peak = max(forward_end, *recomputed)
    note = f"{len(blocks)} blocks"
    return ActivationEstimate(
        peak, meter.total, True, note, forward_end=forward_end, saved_peak=peak, storages=storages
    )


def _union(*parts: dict[int, int]) -> int:
    """Bytes of the distinct storages in `parts` (key -> bytes): one storage held by several counts once."""
    merged: dict[int, int] = {}
    for part in parts:
        merged.update(part)
    return sum(merged.values())


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
        with torch.device("meta"), FusedAttention(), autocast_off_on_meta(), meter.active():
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
        out = _fused_output(q, v)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, *extra)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # What the fused backward kernels return (their scratch inside the kernel is not seen on any device).
        q, k, v, *rest = ctx.saved_tensors
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), *([None] * (len(rest) - 2)))


def _fused_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The fused kernels' output: [batch, heads, seq, dv] laid out as [batch, seq, heads, dv] (CPU flash, CUDA flash
    and memory-efficient attention all allocate it so), so that the usual `y.transpose(1, 2).reshape(b, t, -1)`
    before the output projection is a view, and that projection saves this very storage. A contiguous stand-in made
    the reshape a copy: one more [tokens x hidden] tensor saved per layer than any real run holds."""
    if q.dim() != 4:
        return q.new_empty((*q.shape[:-1], v.shape[-1]))
    b, h, t, _ = q.shape
    return q.new_empty((b, t, h, v.shape[-1])).transpose(1, 2)


class FusedAttention(TorchFunctionMode):
    """Routes scaled_dot_product_attention to `_FlashStandIn` (see [Note: counting saved activations]); answers a
    branch on a meta tensor ([Note: branches on meta]). Every count on meta runs under it."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__bool__ and args[0].device.type == "meta":
            return True
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
        self.device_type = device_type  # count storages of this device type only (None: all but meta; "meta")
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
            kind = t.device.type
            if (kind == "meta" and self.device_type != "meta") or (self.device_type not in (None, kind)):
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
