"""Stages 0-1: the gradient reduction overlapped with backward, as DDP does it, with the chunks for buckets.

[Note: reducing during backward at stages 0-1]
Stages 0-1 accumulate the full local gradient over the micro-batches and need one reduction per update (stage 0 an
all-reduce, stage 1 a reduce-scatter: each rank updates its shard). Left to the update, that reduction runs after
backward with nothing to hide it. So the backward of the last micro-batch before an update reduces each chunk as
soon as its gradients are all in, asynchronously, while backward goes on to earlier layers. Chunks are the buckets:
a few MiB each, which is what DDP's 25 MiB buckets are for (few, large collectives, started early).

The order is the one stages 2-3 use (`Reducer`, `reduce_order`, [Note: every rank in step]): a chunk is issued once
its gradients are in and every chunk before it in the fixed order has been issued, so every rank issues the same
collectives in the same order whatever order its own gradients arrive in; a chunk some rank never completes (a
parameter it did not use) is reduced at the end of backward, in that order. Whether a backward reduces is decided
from the micro-step count, which every rank shares. `train_batch`'s micro-batches keep the reduction at the update.

Stage 0 all-reduces the gradient buffer in place (mean); stage 1 reduce-scatters it into a shard-size buffer and
copies that into this rank's range (the rest of the buffer is never read before it is zeroed). A gradient on the
host with a backend that reads device memory only (NCCL, the stand-in) is reduced where it was summed, on the device
(`keeps_sum`), and goes down once reduced; one accumulated on the host before (the update's reduction, a gradient
no hook summed) goes through a device copy. The gradient stays pinned while its collective runs. A group of one
reduces nothing: its chunks only count as reduced, so the host never waits here for a gradient's copy down (on a
GPU, a wait for every kernel queued before it, once a chunk).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hetero.comm import Comm
from hetero.comm.handles import Handle
from hetero.memory import ChunkManager, Tier
from hetero.zero.protocol import ALL_REDUCE, BATCH_REDUCE, REDUCE, Checker, Reducer

if TYPE_CHECKING:
    from hetero.zero.zero_chunk import ZeroChunk

IN_FLIGHT = 4  # collectives left running while backward goes on (stage 1 holds a shard-size buffer for each)


class DenseReduce:
    """Stages 0-1: the gradient reductions of one backward, issued in the fixed order as chunks complete."""

    def __init__(self, chunks: list[ZeroChunk], *, manager: ChunkManager, comm: Comm, check: Checker) -> None:
        self.manager = manager
        self.comm = comm
        stage0 = bool(chunks) and not chunks[0].layout.optim_sharded
        self.reducer = Reducer(
            chunks,
            check,
            in_flight=lambda zc: IN_FLIGHT,
            start=self._start,
            finish=self._finish,
            op=ALL_REDUCE if stage0 else REDUCE,
        )
        self.active = False  # this backward reduces (the last micro-batch before an update): shared by every rank
        self._running: dict[int, tuple[Handle, torch.Tensor, torch.Tensor, torch.Tensor | None, bool]] = {}
        self._reduced: set[int] = set()  # chunks reduced since the last update
        self._chunks = {id(zc): zc for zc in chunks}
        for zc in chunks:  # a gradient summed on the device stays there for a reduction there
            zc.host_sum.keep = self.keeps_sum

    def keeps_sum(self) -> bool:
        """Whether this backward reduces device memory (NCCL, the stand-in), where `HostSum` summed the gradient."""
        return self.active and self.comm.size > 1 and self.comm.needs_device_tensors

    def begin(self, *, last_micro_batch: bool) -> None:
        """A backward starts; it reduces when its micro-batch is the last before an update."""
        self.active = last_micro_batch

    def ready(self, zc: ZeroChunk) -> None:
        """All of `zc`'s gradients of this micro-batch are in."""
        if self.active:
            self.reducer.ready(zc)

    def end(self) -> None:
        """Backward is over: the chunks not yet issued are reduced now, in order, and every collective completes."""
        if self.active:
            self.reducer.flush()
        self.active = False

    def reopen(self) -> None:
        """A backward follows the one that reduced, before the update (a loop summing several backwards into one
        step, as plain PyTorch allows): at stage 1 each reduced chunk's buffer holds the mean over ranks in this
        rank's range only, and this rank's own sum elsewhere, which the next reduce-scatter would count again. So
        its range becomes the sum over ranks (the mean times the group's size) and the rest zeros: the next
        reduce-scatter's mean is then the earlier backwards' mean plus the new one's. Stage 0's buffer holds the
        mean everywhere, which the next all-reduce averages as it should."""
        if self.comm.size == 1:
            return
        for key in self._reduced:
            zc = self._chunks[key]
            if not zc.layout.optim_sharded:
                continue
            acc = zc.grad_buffer()  # its reduced range has landed ([Note: copies the host does not wait for])
            lo, hi = zc.kept_range()
            acc[:lo].zero_()
            acc[hi:].zero_()
            acc[lo:hi].mul_(self.comm.size)

    def reduce_now(self) -> None:
        """Every chunk's gradient reduced now, as the update would (`reduce_at_update`, in its order), and marked so
        that the update skips it: the end of a `train_batch` whose micro-batches left the reduction to the update,
        before its `on_grads` callback reads them ([Note: gradients read inside train_batch] in grad_views.py)."""
        for zc in self._chunks.values():
            self.reducer.check(BATCH_REDUCE, chunk=zc.spec.index)
            reduce_at_update(zc)
            self._reduced.add(id(zc))

    def forget(self) -> None:
        """The accumulation's gradients were dropped: no chunk counts as reduced (the next update reduces them all,
        unless a backward does first)."""
        self._reduced.clear()

    def take(self, zc: ZeroChunk) -> bool:
        """Whether `zc`'s gradient was reduced during backward (the update then skips its reduction); forgets it."""
        if id(zc) in self._reduced:
            self._reduced.discard(id(zc))
            return True
        return False

    # ---- one chunk ----------------------------------------------------------------------------------------
    def _start(self, zc: ZeroChunk) -> None:
        if self.comm.size == 1:  # a group of one: its mean is the gradient as it is, wherever it is still going
            return
        kept = zc.host_sum.take()  # the sum kept on the device for this reduction, if any: the gradient goes down after
        acc = zc.grad_buffer(whole=kept is not None)  # (stage 1 reads only its range of it before zeroing it)
        self.manager.pin(zc.grad)  # the collective reads and writes it until _finish
        staged = self.comm.needs_device_tensors and zc.grad.tier is not Tier.DEVICE
        buf = kept if kept is not None else zc.device.to_device(acc) if staged else acc
        what = f"the gradients of {zc.label}"
        target = None
        if not zc.layout.optim_sharded:  # stage 0: every rank updates the whole chunk
            handle = self.comm.all_reduce_async(buf, op="avg", what=what)
        else:  # stage 1: each rank updates its shard and needs only its shard's mean
            lo, hi = zc.kept_range()
            if staged or zc.grad.tier is Tier.DEVICE or not zc.device.separate_memory:
                target = zc.device.empty((hi - lo,), torch.float32)
                handle = self.comm.reduce_scatter_async(target, buf, op="avg", what=what)
            else:
                # A host gradient the group reduces where it is (gloo, or a group of one): into its own shard's
                # range, never through device memory (a device target would be filled from host memory).
                handle = self.comm.reduce_scatter_async(buf[lo:hi], buf, op="avg", what=what)
        self._running[id(zc)] = (handle, acc, buf, target, staged)

    def _finish(self, zc: ZeroChunk) -> None:
        if self.comm.size == 1:
            self._reduced.add(id(zc))
            return
        handle, acc, buf, target, staged = self._running.pop(id(zc))
        handle.wait()
        on_device = zc.grad.tier is Tier.DEVICE
        # Down to a host gradient by a copy into its pinned memory, not through fresh pageable memory ([Note:
        # gradients to the host through pinned memory]).
        # The copy lands while backward goes on ([Note: copies the host does not wait for]).
        if target is not None:
            if on_device or not zc.device.separate_memory:
                zc.kept(acc).copy_(target)
            else:
                later = zc.device.copy_later(zc.kept(acc), target, after=zc.device.compute_marker())
                self.manager.land_later(zc.grad, later)
        elif staged:
            self.manager.land_later(zc.grad, zc.device.copy_later(acc, buf, after=zc.device.compute_marker()))
        self.manager.unpin(zc.grad)
        self._reduced.add(id(zc))


def reduce_at_update(zc: ZeroChunk) -> None:
    """Stages 0-1, when backward did not reduce: the gradient accumulated over the micro-batches reduced (mean over
    ranks) in place."""
    if zc.layout.grads_sharded:
        return
    acc = zc.grad_buffer()
    staged = zc.comm.needs_device_tensors and zc.grad.tier is not Tier.DEVICE
    # NCCL reduces device memory only: a gradient kept on the host (optimizer offload) goes through the device.
    buf = zc.device.to_device(acc) if staged else acc
    what = f"the gradients of {zc.label}"
    if not zc.layout.optim_sharded:  # every rank updates the whole chunk
        zc.comm.all_reduce(buf, op="avg")
    else:  # each rank updates its shard: it needs only its shard's sum
        lo, hi = zc.kept_range()
        zc.comm.reduce_scatter(buf[lo:hi], buf, op="avg", what=what)
    if staged:
        zc.device.copy(acc, buf, after=zc.device.compute_marker())
