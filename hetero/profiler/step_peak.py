"""The activation memory of a whole training step (forward and backward), counted on the meta device.

[Note: a step's activation peak]
What forward saves for backward ([Note: counting saved activations]) is not all a step needs on top of the model
states: backward makes each activation's gradient while the saved tensors of the nodes still to run are held, the
caller keeps forward's output (the logits) until backward is done, an operator's temporaries live for its call, and
checkpointed blocks are recomputed. So the step itself is run on meta: forward and backward inside one
`functional_call` (the parameters replaced by meta tensors of the compute dtype for both, so that a recomputation
sees them too), the blocks checkpointed as the engine checkpoints them (torch's non-reentrant checkpoint, recomputed
under the fused-attention stand-in), each parameter's gradient dropped once accumulated (the engine moves it into
its chunk, a model state counted apart), and every storage an operator makes counted from its creation until it is
freed (`LiveBytes`). The peak is the most alive at once. A real step on the CPU, counted the same way, gives the same
figure to the byte (tests/test_estimator.py), as the saved bytes do, and with the same one exception (LayerNorm's
statistics in bf16, [Note: counting saved activations]). What no count of operators' outputs sees, on any device: a
kernel's scratch inside one call (flash attention's backward accumulators on CUDA, cuBLAS workspaces), the caching
allocator's rounding (up to 511 bytes a storage) and its fragmentation. The model's inputs are counted (they are
activations the step holds), as are the labels. `activation_offload` is run as the engine runs it ([Note:
offloaded inputs on meta]). Not modelled: tiled layers (they write weight gradients tile by tile into their chunks,
where this step makes each whole: an upper bound).

[Note: offloaded inputs on meta]
With `activation_offload` the engine copies a checkpointed block's floating-point inputs to a host chunk and drops
the device copy (hetero/activation.py, [Note: offloading block inputs]); when a block recomputes, its inputs come
back into fresh device tensors, and the inputs of the block before it in forward order are brought back ahead.
`Offload` does the same on meta, from the same stack: the checkpoint is given only a zero-size token, the inputs are
held by nobody once the block's forward has run, and each recomputation allocates its own inputs (and its
predecessor's) as new storages, counted as the engine's are. The host side is counted apart: every distinct tensor
(one given to several blocks is copied once, while unchanged) from its copy until the last block given it has
recomputed. The one assumption: the copies keep up with forward (the engine's copy thread runs beside it; a copy
that lags keeps its device tensor alive until it lands, at most every offloaded input at once).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hetero.activation import choose_blocks
from hetero.kv_cache import cache_off_when_recomputing
from hetero.profiler.activations import FusedAttention, LiveBytes, autocast_off_on_meta, meta_like, storage_key


class _Step(nn.Module):
    """Forward and backward of `model` as one call, so both run on the replaced parameters."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: dict[str, Any]) -> None:
        out = self.model(**inputs)  # held through backward, as a training loop holds it
        loss = _loss_of(out)
        loss.backward()


def _loss_of(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if first is None and isinstance(out, (tuple, list)):
        first = next((o for o in out if isinstance(o, torch.Tensor)), None)
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__}: no loss or tensor to run backward from")
    return first.float().sum()  # a loss of the output: its gradient is the output's size, as any loss's is


def on_meta() -> contextlib.ExitStack:
    """The meta device as the default, and the fused-attention stand-in on."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.device("meta"))
    stack.enter_context(FusedAttention())
    return stack


@contextlib.contextmanager
def checkpointed(blocks: list[nn.Module], offload: Offload | None = None) -> Iterator[None]:
    """The blocks' forwards under torch's non-reentrant checkpoint, on the instance, for the count only (its
    recomputation in backward finds the fused-attention stand-in on: `FusedAttention` keeps itself on for backward);
    with `offload`, their inputs offloaded as the engine's are ([Note: offloaded inputs on meta])."""
    saved = [(b, b.__dict__.get("forward")) for b in blocks]
    for b in blocks:
        if offload is not None:
            b.forward = functools.partial(offload.forward, b.forward)
        else:
            b.forward = functools.partial(
                checkpoint, b.forward, use_reentrant=False, preserve_rng_state=False, context_fn=_contexts
            )
    try:
        yield
    finally:
        for b, own in saved:
            if own is None:
                del b.forward
            else:
                b.forward = own


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), FusedAttention()


class _Moved:
    """One checkpointed call's offloaded inputs on meta: what the engine's `_Saved` holds, without the bytes."""

    def __init__(self, args: tuple, kwargs: dict[str, Any], shapes: dict[int | str, tuple]) -> None:
        self.args, self.kwargs = args, kwargs  # the inputs, offloaded ones replaced by None
        self.shapes = shapes  # input key -> (shape, dtype, requires_grad)
        self.copies: list[list[int]] = []  # its host copies, each [bytes, users]
        self.back: tuple[tuple, dict[str, Any]] | None = None  # the inputs brought back to the device


class Offload:
    """`activation_offload` on meta ([Note: offloaded inputs on meta]); `host_peak`: the most bytes on the host."""

    def __init__(self) -> None:
        self.host = self.host_peak = 0
        self._stack: list[_Moved] = []  # offloaded calls not yet recomputed, in forward order
        # id(tensor) -> (the tensor, weakly; its version when copied; its copy [bytes, users]): copied once
        self._copies: dict[int, tuple[weakref.ref, int, list[int]]] = {}

    def forward(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        inputs: dict[int | str, Any] = {**dict(enumerate(args)), **kwargs}
        moving = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
        kept = {k: (None if k in moving else v) for k, v in inputs.items()}
        shapes = {k: (v.shape, v.dtype, v.requires_grad) for k, v in moving.items()}
        moved = _Moved(tuple(kept[i] for i in range(len(args))), {k: kept[k] for k in kwargs}, shapes)
        for v in moving.values():
            entry = self._copies.get(id(v))
            if entry is not None and entry[0]() is v and entry[1] == v._version and entry[2][1] > 0:
                entry[2][1] += 1
                moved.copies.append(entry[2])
                continue
            copy = [max(1, v.numel()) * v.element_size(), 1]
            self._copies[id(v)] = (weakref.ref(v), v._version, copy)
            moved.copies.append(copy)
            self.host += copy[0]
            self.host_peak = max(self.host_peak, self.host)
        self._stack.append(moved)
        given = [(args, kwargs)]

        def run(_token: torch.Tensor) -> Any:
            if given[0] is not None:
                (a, kw), given[0] = given[0], None
                return original(*a, **kw)
            a, kw = self._fetch(moved)
            return original(*a, **kw)

        del args, kwargs, inputs, moving
        return checkpoint(run, torch.empty(0), use_reentrant=False, preserve_rng_state=False, context_fn=_contexts)

    def _fetch(self, moved: _Moved) -> tuple[tuple, dict[str, Any]]:
        """As the engine's `_fetch_for_recompute`: this call's inputs back, the one before it in forward order
        brought back ahead, this call's host copies released."""
        self._bring_back(moved)
        index = next((k for k, m in enumerate(self._stack) if m is moved), None)
        if index is not None and index > 0:
            self._bring_back(self._stack[index - 1])
        for copy in moved.copies:
            copy[1] -= 1
            if copy[1] == 0:
                self.host -= copy[0]
        moved.copies = []
        if index is not None:
            del self._stack[index]
        assert moved.back is not None
        return moved.back

    @staticmethod
    def _bring_back(moved: _Moved) -> None:
        if moved.back is not None:
            return
        landed = {
            k: torch.empty(shape, dtype=dtype).requires_grad_(grad) for k, (shape, dtype, grad) in moved.shapes.items()
        }
        args = tuple(landed.get(i, a) for i, a in enumerate(moved.args))
        moved.back = args, {k: landed.get(k, a) for k, a in moved.kwargs.items()}


def meta_step_peak(
    model: nn.Module,
    inputs: dict[str, Any],
    *,
    dtype: torch.dtype,
    checkpointing: bool | list[str] | tuple = False,
    offload: Offload | None = None,
) -> int:
    """The most bytes of storages a forward and backward of `model` on `inputs` hold at once, counted on meta
    ([Note: a step's activation peak]); `offload`: the checkpointed blocks' inputs offloaded, its `host_peak` the
    most they hold on the host ([Note: offloaded inputs on meta]). Raises what the meta step raised."""
    params = {f"model.{n}": meta_like(p, dtype) for n, p in model.named_parameters()}
    buffers = {f"model.{n}": meta_like(b, dtype) for n, b in model.named_buffers()}
    handles = [p.register_post_accumulate_grad_hook(_drop_grad) for p in params.values() if p.requires_grad]
    meta_inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    chosen = choose_blocks(model, checkpointing, strict=False) if checkpointing else []
    # As the engine: a Hugging Face model's KV cache off where blocks recompute ([Note: no KV cache under
    # recomputation]); it would hold every layer's keys and values through the step.
    cache_on = cache_off_when_recomputing(model, [n for n, _ in chosen]) if chosen else None
    live = step_bytes()
    try:
        with checkpointed([m for _, m in chosen], offload), autocast_off_on_meta(), on_meta(), live:
            # The inputs are made before the step starts (no operator makes them): counted by hand.
            live.current = live.peak = sum(_bytes_of(t) for t in _distinct(meta_inputs.values()))
            torch.func.functional_call(_Step(model), {**params, **buffers}, args=(meta_inputs,), tie_weights=True)
    finally:
        for h in handles:
            h.remove()
        if cache_on is not None:
            cache_on()
    return live.peak


class _StepBytes(LiveBytes):
    """`LiveBytes` on meta, answering a yes/no read of a meta tensor with yes. Data-dependent control flow cannot run
    on meta; a training forward of a Hugging Face decoder without a KV cache (checkpointing turns it off) has one
    such branch: `find_packed_sequence_indices` asks whether every row's positions run 0, 1, 2, ... (`.all()`),
    which for the unpacked batch the estimate describes is true. Any other read still fails (and says so)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        scalar = func is torch.ops.aten._local_scalar_dense.default
        if scalar and args[0].device.type == "meta" and args[0].dtype == torch.bool:
            return True
        return super().__torch_dispatch__(func, types, args, kwargs)


def step_bytes() -> LiveBytes:
    """A live-bytes count of meta storages, for a step run on meta (see `_StepBytes`)."""
    return _StepBytes("meta")


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def _distinct(values: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for v in values:
        if isinstance(v, torch.Tensor):
            seen.setdefault(storage_key(v), v)
    return list(seen.values())


def _bytes_of(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()
