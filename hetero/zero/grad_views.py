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
`update_in_backward` that backward consumed them. `train_batch` makes that point itself: inside its `on_grads`
callback ([Note: gradients read inside train_batch]).

[Note: the whole model's gradients]
Under the `"parallel"` section `full_grads()` gives the whole model's gradients as `full_state_dict()` gives its
values (`gather_full_state`, hetero/parallel/full_state.py): the plain model's parameter names and shapes, a
tensor-parallel weight joined from its shards in tensor rank order, every pipeline stage's parameters collected, in
the model's key order; rank0_only as there. It used to return this rank's slice of each split weight ((32, 32) of a
(64, 32) gate_proj at tensor 2) and only this stage's names, while this note said it matched `full_state_dict`: a
loop's per-layer norms then differed from a plain run's by the tensor degree, and keys differed by rank. Whole, as
full_state_dict, because what users do with it (norms per layer, a comparison with a plain run, a spike's cause)
needs the model's own tensors, and the cost is full_state_dict's: every rank holds the whole fp32 gradient for a
moment (rank0_only: the ranks of rank 0's pipeline group). Joining the shards is exact because each piece already
is the whole gradient of its part: a column- or row-parallel shard's gradient is complete on its rank (the region's
collectives give every rank the whole upstream gradient); a parameter every tensor rank holds (a norm, a bias after
a row-parallel layer) has the same gradient on each, Megatron-SP's norms and `head_norm`s after their gradient
all-reduce over the tensor group (hetero/parallel/tensor.py) and 2.5D's depth replicas after theirs; a parameter
tied across pipeline stages is summed over its holders before the update ([Note: parameters tied across stages])
and taken from the first stage. A model split by hand (`apply_tensor_parallel` without the section) gets this
rank's shards, as its full_state_dict does. Under a pipeline `train_batch` runs its backwards and `step()` in one
call: `full_grads()` is called inside its `on_grads` callback ([Note: gradients read inside train_batch]).

[Note: gradients read inside train_batch]
With micro-batches or a pipeline, `train_batch` runs every micro-batch's forward and backward and the update in one
call, so a loop had no point at which to read the gradients (per-layer norms, a comparison with a plain run, a loss
spike's cause): the test of the whole model's gradients had to patch `engine.step`. `train_batch(..., on_grads=fn)`
calls `fn(engine)` on every rank where a plain loop would read them: after the batch's last backward, once the
gradients are what the update steps on, before the update and its clipping, and only for a batch that ends an
accumulation (the others' gradients are partial). The batch's ends have run by then: the copies of a parameter
tied across stages summed ([Note: parameters tied across stages]), stages 2-3's reduce-scatter of the batch ([Note:
one reduction per batch]). Stages 0-1 leave their reduction to the update, where a callback would read each rank's
own sum (measured: at stage 1 over two data-parallel ranks, the embedding's 0.64 from the mean, in norm): so the
update's reduction runs before the callback, the same collectives in the same order (`DenseReduce.reduce_now`), and
the update skips it, as it skips one a backward made (reduced twice, the second update's gradients were 0.12 off).
The gradients are then marked readable, as the backward that ends an accumulation marks them. Without micro-batches
and stages (`engine.backward`, then `step()`) the callback runs between the two. Pass it on every rank or on none:
the ranks with one run `full_grads()`'s gathers where the others run their update.
On a one-rank job a callback that raises drops the accumulation (as a batch that raises: [Note: a backward that
fails]) and its error reaches the caller; training may go on. Over several ranks, where each one stopped inside its
callback is not known: a rank's `full_grads()` gathers may wait for one that raised before its own, and the ranks
that returned wait in the update's collectives or the loss's (they hung until comm_timeout). So a rank whose
callback raised posts its failure for good ([Note: a rank's failure told to the others] in hetero/comm/watch.py),
as a tensor-parallel rank's failed forward does: the others stop at their next wait, within about a second
(measured 1.0-1.1 s), with RankFailedError naming it; its own error, with a note, reaches its caller; every rank
refuses further batches: fix the callback and resume from the last checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from hetero.memory import Tier
from hetero.zero.protocol import READ_GRADS, Checker

if TYPE_CHECKING:
    from hetero.parallel.mesh import Mesh
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


def named_full_grads(
    values: dict[int, torch.Tensor],
    module: nn.Module,
    mesh: Mesh,
    *,
    order: Sequence[str] = (),
    rank0_only: bool = False,
) -> dict[str, torch.Tensor]:
    """`full_grads`' values (by parameter id) under the model's parameter names, a tied parameter under each of its
    names, joined over the tensor and pipeline groups into the whole model's ([Note: the whole model's gradients]);
    every rank of the job calls it. order: the whole model's keys in its order, under a pipeline."""
    named = module.named_parameters(remove_duplicate=False)
    grads = {n: values[id(p)] for n, p in named if id(p) in values}
    from hetero.parallel.full_state import gather_full_state  # hetero.parallel is above hetero.zero

    return gather_full_state(grads, module, mesh, rank0_only=rank0_only, order=order)


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
