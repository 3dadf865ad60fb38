"""Full gradients on demand: `engine.full_grads()`.

[Note: reading the gradients]
hetero adds each parameter's gradient into its chunk the moment it is complete and frees `param.grad`, so a loop that
inspects gradients (per-layer norms, gradient noise, a loss spike's cause) finds none there. `full_grads()` returns
what the next update steps on: the gradient of the accumulated loss (the micro-batches' losses as `engine.backward`
divided them), averaged over the data-parallel ranks, unscaled (fp16), before clipping; fp32 CPU tensors under the
model's parameter names, on every rank (DeepSpeed's `safe_get_full_grad`, for every parameter at once).

Reading changes nothing. The backward that ends an accumulation reduces over the ranks ([Note: reducing during
backward at stages 0-1]; stages 2-3 reduce-scatter in every backward): at stage 0 every rank holds the whole mean; a
stage-1 gradient holds the mean only in this rank's range, and a stage 2-3 gradient is this rank's shard: their
ranges are all-gathered into a copy. Chunk by chunk in layout order, each gather announced to the schedule's check,
and whether one runs decided by the stage, which every rank shares ([Note: every rank in step]).

When: after the backward that ends an accumulation (the next `step()` updates) and before that `step()`. Earlier, a
stage 2-3 gradient may sit unreduced in the batch's buffer; after it, the update has consumed it. With
`update_in_backward` that backward consumed them. With tensor parallelism a split weight's gradient is this rank's
slice, as `full_state_dict` gives its values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hetero.memory import Tier
from hetero.zero.protocol import READ_GRADS, Checker

if TYPE_CHECKING:
    from hetero.zero.zero_chunk import ZeroChunk


def full_grads(chunks: list[ZeroChunk], *, check: Checker, scale: float) -> dict[int, torch.Tensor]:
    """Each trainable parameter's full mean gradient (by `id` of the parameter; a tiled weight assembled from its
    tiles' rows), divided by `scale` (the fp16 loss scale). Only after a backward that ends an accumulation, which
    reduced every chunk's gradient (the engine checks)."""
    out: dict[int, torch.Tensor] = {}
    for zc in chunks:
        full = _chunk_grad(zc, check)
        if scale != 1.0:
            full.div_(scale)
        for info in zc.spec.params:
            value = full.narrow(0, info.offset, info.numel).view(info.shape)
            if info.tiled:  # a tile's rows of the whole gradient
                whole = out.setdefault(id(info.param), torch.empty(info.param.shape, dtype=torch.float32))
                a, b = info.rows
                whole[a:b].copy_(value)
            else:
                out[id(info.param)] = value.clone()
    return out


def _chunk_grad(zc: ZeroChunk, check: Checker) -> torch.Tensor:
    """The chunk's whole mean gradient, fp32, on the CPU."""
    device, comm, m = zc.device, zc.comm, zc.manager
    with m.pinned(zc.grad):
        acc = zc.grad_buffer()
        if comm.size == 1 or not zc.layout.optim_sharded:  # stage 0: backward's all-reduce left the whole mean here
            return device.to_host(acc, torch.float32, copy=True)
        # This rank holds the mean of its range only: the stage-1 buffer's, or a stage 2-3 shard. NCCL gathers device
        # memory only: a gradient kept on the host goes through the device.
        shard = zc.kept(acc) if not zc.layout.grads_sharded else acc
        staged = comm.needs_device_tensors and zc.grad.tier is not Tier.DEVICE
        n = shard.numel() * comm.size
        on_device = comm.needs_device_tensors or zc.grad.tier is Tier.DEVICE
        whole = device.empty((n,), torch.float32) if on_device else torch.empty(n, dtype=torch.float32)
        check(READ_GRADS, chunk=zc.spec.index)
        what = f"the gradients of {zc.label} (full_grads)"
        comm.all_gather(whole, device.to_device(shard) if staged else shard, what=what)
        return device.to_host(whole, torch.float32, copy=True)[: zc.spec.capacity]
