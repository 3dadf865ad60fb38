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
activations the step holds), as are the labels. Not modelled: `activation_offload` (the checkpointed blocks'
arguments on the host, so the figure is an upper bound for the device then) and tiled layers (they write weight
gradients tile by tile into their chunks, where this step makes each whole: an upper bound again).
"""

from __future__ import annotations

import contextlib
import functools
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


def _on_meta() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(torch.device("meta"))
    stack.enter_context(FusedAttention())
    return stack


@contextlib.contextmanager
def _checkpointed(blocks: list[nn.Module]) -> Iterator[None]:
    """The blocks' forwards under torch's non-reentrant checkpoint, on the instance, for the count only (its
    recomputation in backward finds the fused-attention stand-in on: `FusedAttention` keeps itself on for backward)."""
    saved = [(b, b.__dict__.get("forward")) for b in blocks]
    for b in blocks:
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


def meta_step_peak(
    model: nn.Module, inputs: dict[str, Any], *, dtype: torch.dtype, checkpointing: bool | list[str] | tuple = False
) -> int:
    """The most bytes of storages a forward and backward of `model` on `inputs` hold at once, counted on meta
    ([Note: a step's activation peak]). Raises what the meta step raised."""
    params = {f"model.{n}": meta_like(p, dtype) for n, p in model.named_parameters()}
    buffers = {f"model.{n}": meta_like(b, dtype) for n, b in model.named_buffers()}
    handles = [p.register_post_accumulate_grad_hook(_drop_grad) for p in params.values() if p.requires_grad]
    meta_inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    chosen = choose_blocks(model, checkpointing, strict=False) if checkpointing else []
    # As the engine: a Hugging Face model's KV cache off where blocks recompute ([Note: no KV cache under
    # recomputation]); it would hold every layer's keys and values through the step.
    cache_on = cache_off_when_recomputing(model, [n for n, _ in chosen]) if chosen else None
    live = _StepBytes("meta")
    try:
        with _checkpointed([m for _, m in chosen]), autocast_off_on_meta(), _on_meta(), live:
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
