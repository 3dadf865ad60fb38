"""One chunk of a model under ZeRO: its parameters, gradients, master weights and optimizer states.

[Note: what each stage keeps]
Every chunk of `capacity` elements (a multiple of the data-parallel size N) has up to five buffers, all chunks of
the manager, so each lives on a tier under a budget:

  buffer      dtype    elements      stage 0      stage 1      stage 2        stage 3
  full        compute  capacity      persistent   persistent   persistent     gathered for use, then released
  shard       compute  capacity/N    -            -            -              persistent, on offload.params
  grad        fp32     cap or cap/N  full, local  full, local  shard          shard
  grad_full   fp32     capacity      -            -            per micro-batch, reduce-scattered into `grad`
  optim       fp32     (1+k)*S       master + k optimizer states, S = capacity (stage 0) or capacity/N

Stages 0 and 1 accumulate the full local gradient over micro-batches and communicate once, at the update (all-reduce
at stage 0; reduce-scatter at stage 1, since each rank only updates its shard). Stages 2 and 3 reduce-scatter every
micro-batch, so no rank ever holds more than a shard of accumulated gradient. After the update, stage 0 copies the
master into the full parameters; stages 1 and 2 copy their shard in and all-gather the rest; stage 3 writes its
shard only, and the full chunk is gathered again at its next use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hetero.comm import Comm
from hetero.memory import Chunk, ChunkManager, ChunkState, TensorSlot, TensorState, Tier
from hetero.zero.layout import ChunkSpec, ParamInfo

_T = TensorState
KEEP_HORIZON = 8  # accesses: a gathered chunk needed again this soon is kept (see maybe_release)


@dataclass(frozen=True)
class Homes:
    """Where each kind of buffer lives between uses, and where the optimizer computes."""

    params: Tier  # the stage-3 shard's home (full chunks are on the device while used)
    optim: Tier  # master weights and optimizer states
    compute: Tier  # where the optimizer step runs and gradients accumulate: the device, or the host


class ZeroChunk:
    def __init__(
        self,
        spec: ChunkSpec,
        *,
        manager: ChunkManager,
        comm: Comm,
        stage: int,
        dtype: torch.dtype,
        homes: Homes,
        state_names: tuple[str, ...],
    ) -> None:
        self.spec = spec
        self.m = manager
        self.comm = comm
        self.stage = stage
        self.dtype = dtype  # compute dtype of the parameters
        self.homes = homes
        n = comm.size
        self.shard_numel = spec.capacity // n  # elements of one rank's shard
        self.in_use: dict[int, int] = {}  # param id -> active uses (a parameter may be used twice at once)
        self.device = manager.device.torch_device

        self.full = manager.new_chunk(dtype=dtype, capacity=spec.capacity, kind="param", transient=stage == 3)
        self.slots: list[TensorSlot] = [self.full.add_tensor(p.name, p.shape) for p in spec.params]
        self.shard: Chunk | None = None
        if stage == 3:
            self.shard = manager.new_chunk(dtype=dtype, capacity=self.shard_numel, kind="param_shard")
            self.shard.add_tensor(f"{spec.params[0].name}..shard", (self.shard_numel,))
        self.grad: Chunk | None = None
        self.grad_full: Chunk | None = None
        self.optim: Chunk | None = None
        self.param_steps = [0] * len(spec.params)  # optimizer steps each parameter has taken (see update_segments)
        self.used = torch.zeros(len(spec.params), dtype=torch.uint8)  # got a gradient since the last update
        self._index = {id(p.param): i for i, p in enumerate(spec.params)}
        self.grads_seen: set[int] = set()  # trainable param ids whose gradient this micro-batch has arrived
        self.n_trainable = sum(1 for p in spec.params if p.trainable)
        self.used_numel = sum(p.numel for p in spec.params)  # elements before the padding
        self.grad_fresh = True  # the accumulated gradient is all zeros (nothing added since the update)
        self._reducing: tuple | None = None  # a reduce-scatter in flight: (handle, target, wrote into grad directly)
        # Stages 2-3 in train_batch: sum the full gradient over the batch's micro-batches, reduce once at its end.
        self.accumulate_full = False
        self.batch_seen: set[int] = set()  # param ids with a gradient in grad_full this batch (accumulate_full)
        if spec.trainable:
            sharded_grads = stage >= 2
            grad_numel = self.shard_numel if sharded_grads else spec.capacity
            self.grad = manager.new_chunk(dtype=torch.float32, capacity=grad_numel, kind="grad")
            self.grad.add_tensor(f"{spec.params[0].name}..grad", (grad_numel,))
            if sharded_grads:
                self.grad_full = manager.new_chunk(dtype=torch.float32, capacity=spec.capacity, kind="grad_full")
                self.grad_full.add_tensor(f"{spec.params[0].name}..grad_full", (spec.capacity,))
            s = spec.capacity if stage == 0 else self.shard_numel
            self.optim = manager.new_chunk(dtype=torch.float32, capacity=s * (1 + len(state_names)), kind="optim")
            self.optim.add_tensor(f"{spec.params[0].name}..master", (s,))
            for name in state_names:
                self.optim.add_tensor(f"{spec.params[0].name}..{name}", (s,))

    # ---- set-up -------------------------------------------------------------------------------------------
    def load(self, flat: torch.Tensor) -> None:
        """Fill every buffer from the full flat fp32 parameter values (the same on every rank)."""
        r, s = self.comm.rank, self.shard_numel
        mine = flat if self.stage == 0 else flat[r * s : (r + 1) * s]
        if self.stage < 3:
            # Stages 0-2 keep full parameters on the device for the model's whole life: pinned, so that nothing
            # autograd saved in forward can move before backward.
            self.m.access(self.full, Tier.DEVICE)
            self.full.payload.copy_(flat)
            for slot in self.slots:
                self.full.set_state(slot, _T.HOLD)
                self.full.set_state(slot, _T.COMPUTE)
            self._point_params()
        else:
            self.m.access(self.shard, Tier.DEVICE if self.homes.params is Tier.DEVICE else Tier.HOST)
            self.shard.payload.copy_(mine)
            self.shard.set_state(self.shard.slots[0], _T.HOLD)
            if self.homes.params is Tier.NVME:
                self.m.move(self.shard, Tier.NVME)
            # Point the parameters at the transient full chunk once; dropped, its storage has zero bytes until the
            # next gather (see [Note: transient chunks] in the manager).
            self.m.access(self.full, Tier.DEVICE)
            self._point_params()
            self.m.release(self.full)
        if self.optim is not None:
            self.m.access(self.optim, self.homes.compute)
            self.optim.payload.zero_()
            self.optim.view(self.optim.slots[0]).copy_(mine)
            for slot in self.optim.slots:
                self.optim.set_state(slot, _T.HOLD)
            if self.homes.optim is Tier.NVME:
                self.m.move(self.optim, Tier.NVME)
        if self.grad is not None:
            self.zero_grad()

    # ---- parameters ---------------------------------------------------------------------------------------
    def fetch(self) -> None:
        """Stage 3: make the full parameters resident on the device (the module's parameters view them already)."""
        full = self.full
        if full.state is not ChunkState.EMPTY:
            self.m.access(full, Tier.DEVICE)  # records the use for the trace; a transient chunk never moves
            return
        shard = self.m.access(self.shard, self._readable(self.shard), write=False)
        with self.m.pinned(self.shard):  # making room for `full` must not evict the shard being read
            self.m.access(full, Tier.DEVICE)
            with self.m.pinned(full):  # nor may anything drop `full` while its tensors are FREE
                self.comm.all_gather(full.payload, shard.to(self.device))
        for slot in self.slots:
            if slot.state is not _T.HOLD:  # FREE after a release; HOLD_AFTER_* if the manager dropped it
                full.set_state(slot, _T.HOLD)

    def enter(self, info: ParamInfo, slot: TensorSlot) -> None:
        k = id(info.param)
        self.in_use[k] = self.in_use.get(k, 0) + 1
        if self.in_use[k] == 1:
            self.full.set_state(slot, _T.COMPUTE)

    def exit(self, info: ParamInfo, slot: TensorSlot, after: TensorState) -> None:
        k = id(info.param)
        uses = self.in_use.get(k, 0)
        if uses == 0:
            return
        self.in_use[k] = uses - 1
        if uses == 1:
            self.full.set_state(slot, after)

    def maybe_release(self, phase: TensorState) -> None:
        """Stage 3: drop the gathered parameters once every one of them has finished this phase.

        [Note: keeping the tail of forward]
        The chunks forward uses last are the ones backward needs first: dropping them at the end of forward only to
        gather them again a moment later doubles their communication. While the access trace replays, a chunk
        whose next use lies within KEEP_HORIZON accesses stays gathered after forward (it is droppable, like any
        transient chunk, if the device budget needs the room). After backward a chunk is always dropped: the
        update is about to change its shard, so the gathered copy would be stale.
        """
        if self.stage < 3 or self.full.state is ChunkState.EMPTY:
            return
        if not all(s.state is phase for s in self.slots):
            return
        trace = self.m.trace
        if phase is _T.HOLD_AFTER_FWD and trace.replaying and trace.next_use(self.full.id) <= KEEP_HORIZON:
            return
        self.release()

    def release(self) -> None:
        """Stage 3: drop the gathered parameters (every use must have ended)."""
        if self.stage < 3 or self.full.state is ChunkState.EMPTY:
            return
        for slot in self.slots:
            if slot.state is _T.COMPUTE:
                self.full.set_state(slot, _T.HOLD)
            if slot.state is not _T.FREE:
                self.full.set_state(slot, _T.FREE)
        self.in_use.clear()
        self.m.release(self.full)

    def settle(self) -> None:
        """End of a backward pass: stage 3 drops what is still gathered (frozen or unused parameters)."""
        self.grads_seen.clear()
        self.release()

    def _point_params(self) -> None:
        for info, slot in zip(self.spec.params, self.slots):
            if info.param.is_meta:
                # A meta tensor cannot take another device's data: swap in an empty one first, which keeps the
                # Parameter object (the optimizer's and every tied module's reference) and its attributes.
                empty = torch.empty(0, dtype=self.dtype, device=self.device)
                torch.utils.swap_tensors(info.param, nn.Parameter(empty, requires_grad=info.param.requires_grad))
            info.param.data = self.full.view(slot)

    def _readable(self, chunk: Chunk) -> Tier:
        """The nearest tier a collective can read the chunk on: NCCL reads the GPU; gloo and the CPU "device" read
        host memory, where a chunk already on the device or the host stays."""
        if self.m.device.is_cuda:
            return Tier.DEVICE if self.comm.backend == "nccl" or self.comm.size == 1 else Tier.HOST
        return chunk.tier if chunk.tier in (Tier.DEVICE, Tier.HOST) else Tier.HOST

    # ---- gradients ----------------------------------------------------------------------------------------
    def add_grad(self, info: ParamInfo, slot: TensorSlot, grad: torch.Tensor) -> bool:
        """Take one parameter's gradient of this micro-batch. True when the chunk has all of them."""
        flat = grad.reshape(-1)
        if self.grad_full is not None:
            # A fresh buffer each micro-batch: each parameter's gradient is copied in once (autograd has already
            # summed a parameter used twice); regions no gradient reached are zeroed before the reduction.
            if self.grad_full.state is ChunkState.EMPTY:
                self.m.access(self.grad_full, Tier.DEVICE)
                self.grad_full.set_state(self.grad_full.slots[0], _T.COMPUTE)
            region = self.grad_full.payload.narrow(0, info.offset, info.numel)
            if self.accumulate_full and id(info.param) in self.batch_seen:
                region.add_(flat)
            else:
                region.copy_(flat)
            if self.accumulate_full:
                self.batch_seen.add(id(info.param))
        else:
            buf = self._grad_buffer()
            buf.narrow(0, info.offset, info.numel).add_(flat.to(buf.device, torch.float32))
            self.grad_fresh = False
        self.grads_seen.add(id(info.param))
        self.used[self._index[id(info.param)]] = 1
        return len(self.grads_seen) == self.n_trainable

    def reduce_micro_batch(self) -> None:
        """Stages 2-3: reduce-scatter this micro-batch's gradient into the accumulated shard (mean over ranks)."""
        self.start_reduce()
        self.finish_reduce()

    def start_reduce(self) -> None:
        """Issue the reduce-scatter of this micro-batch's gradient; `finish_reduce` completes it. Backward goes on
        meanwhile: the collective runs on the backend's own thread, in the order issued on every rank."""
        if self.grad_full is None or self.grad_full.state is ChunkState.EMPTY:
            self.grads_seen.clear()
            return
        full = self.grad_full.payload
        for info in self.spec.params:
            if id(info.param) not in self.grads_seen:
                full.narrow(0, info.offset, info.numel).zero_()
        self.grads_seen.clear()
        full[self.used_numel :].zero_()  # padding
        acc = self.m.access(self.grad, self.homes.compute)
        direct = self.grad_fresh and acc.device == full.device  # the first micro-batch lands in place
        if direct:
            self.m.pin(self.grad)  # the collective writes it until finish_reduce
            self._grad_holds()
            target = acc
        else:
            target = torch.empty(self.shard_numel, dtype=torch.float32, device=full.device)
        self.grad_fresh = False
        self._reducing = (self.comm.reduce_scatter_async(target, full, op="avg"), target, direct)

    def finish_reduce(self) -> None:
        if self._reducing is None:
            return
        handle, target, direct = self._reducing
        self._reducing = None
        handle.wait()
        if direct:
            self.m.unpin(self.grad)
        else:
            acc = self._grad_buffer()
            acc.add_(target.to(acc.device))
        self.grad_full.set_state(self.grad_full.slots[0], _T.HOLD)
        self.grad_full.set_state(self.grad_full.slots[0], _T.FREE)
        self.m.release(self.grad_full)

    def reduce_batch(self) -> None:
        """Stages 2-3, accumulate_full: reduce-scatter the gradient summed over the batch's micro-batches (mean over
        ranks) into the accumulated shard, once; regions no micro-batch reached are zeroed first."""
        self.grads_seen, self.batch_seen = self.batch_seen, set()
        self.reduce_micro_batch()

    def reduce_at_update(self) -> None:
        """Stages 0-1: reduce the gradient accumulated over the micro-batches (mean over ranks), in place."""
        acc = self._grad_buffer()
        if self.stage == 0:
            self.comm.all_reduce(acc, op="avg")
        elif self.stage == 1:
            r, s = self.comm.rank, self.shard_numel
            self.comm.reduce_scatter(acc[r * s : (r + 1) * s], acc, op="avg")

    def grad_view(self) -> torch.Tensor:
        """This rank's reduced gradient (the whole chunk at stage 0), fp32, on the compute tier."""
        acc = self._grad_buffer()
        if self.stage == 1:
            r, s = self.comm.rank, self.shard_numel
            return acc[r * s : (r + 1) * s]
        return acc

    def zero_grad(self) -> None:
        self.grads_seen.clear()
        self.used.zero_()
        self.grad_fresh = True
        slot = self.grad.slots[0]
        if slot.state is _T.HOLD:
            self.grad.set_state(slot, _T.FREE)
        if self.stage >= 2:
            # Nothing is accumulated until the first reduce-scatter, which writes the buffer whole: meanwhile the
            # chunk holds no data, so evicting it costs nothing (released, not written to NVMe and read back).
            return
        self._grad_buffer()  # zeros; one on NVMe gets fresh memory rather than being read back

    def _grad_buffer(self) -> torch.Tensor:
        """The accumulated gradient on the compute tier: zeros where nothing has been accumulated yet."""
        acc = self.m.access(self.grad, self.homes.compute)
        if self.grad.slots[0].state is _T.FREE:
            acc.zero_()
            self._grad_holds()
        return acc

    def _grad_holds(self) -> None:
        if self.grad.slots[0].state is _T.FREE:
            self.grad.set_state(self.grad.slots[0], _T.HOLD)

    # ---- update -------------------------------------------------------------------------------------------
    def update_segments(self, used: torch.Tensor) -> list[tuple[int, int, int]]:
        """(start, end, steps taken) runs of this rank's optimizer shard to update, then count the step.

        [Note: parameters without a gradient]
        PyTorch's optimizers skip a parameter whose .grad is None: no weight decay, no moment decay, no step
        count. A flat update would do all three to a parameter that a step did not use (a skipped branch), so the
        update runs on runs of parameters that did get a gradient (on any rank: `used` is all-reduced), and each
        parameter keeps its own step count for Adam's bias correction. In the common case, every parameter used and
        all counts equal, that is one run: the whole shard in one fused call.
        """
        lo = 0 if self.stage == 0 else self.comm.rank * self.shard_numel
        hi = lo + (self.spec.capacity if self.stage == 0 else self.shard_numel)
        runs: list[tuple[int, int, int]] = []
        for i, info in enumerate(self.spec.params):
            a, b = max(info.offset, lo), min(info.offset + info.numel, hi)
            if not used[i]:
                continue
            if a < b:
                if runs and runs[-1][1] == a - lo and runs[-1][2] == self.param_steps[i]:
                    runs[-1] = (runs[-1][0], b - lo, runs[-1][2])
                else:
                    runs.append((a - lo, b - lo, self.param_steps[i]))
            self.param_steps[i] += 1
        return runs

    def optimizer_views(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self.m.access(self.optim, self.homes.compute)
        views = [self.optim.view(s) for s in self.optim.slots]
        return views[0], views[1:]

    def write_back(self, master: torch.Tensor, *, clear_grad: bool = True) -> None:
        """Copy the updated master weights into the parameters, then clear the accumulated gradient (unless
        clear_grad is False: a checkpoint load clears it only where it is not already zero)."""
        r, s = self.comm.rank, self.shard_numel
        if self.stage == 3:
            tier = Tier.DEVICE if self.homes.params is Tier.DEVICE else Tier.HOST
            slot = self.shard.slots[0]
            if slot.state is _T.HOLD:
                self.shard.set_state(slot, _T.FREE)  # overwritten whole: one on NVMe gets fresh memory, no read
            shard = self.m.access(self.shard, tier)
            self.shard.set_state(slot, _T.COMPUTE)  # written: any swap copy is stale from here
            shard.copy_(master)
            self.shard.set_state(slot, _T.HOLD)
            if self.homes.params is Tier.NVME:
                self.m.move(self.shard, Tier.NVME, wait=False)
        else:
            full = self.m.access(self.full, Tier.DEVICE)
            if self.stage == 0:
                full.copy_(master)
            else:
                full[r * s : (r + 1) * s].copy_(master)
                self.comm.all_gather(full, full[r * s : (r + 1) * s])
        if clear_grad:
            self.zero_grad()

    def full_values(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value (CPU copies), gathering a stage-3 chunk for the purpose."""
        gathered = self.full.state is ChunkState.EMPTY
        if gathered:
            self.fetch()
        out = {
            info.name: self.full.view(slot).detach().to("cpu", copy=True)
            for info, slot in zip(self.spec.params, self.slots)
        }
        if gathered:
            self.release()
        return out


def flat_values(spec: ChunkSpec) -> torch.Tensor:
    """The chunk's parameters as one flat fp32 CPU tensor of `capacity` elements, zero-padded."""
    flat = torch.zeros(spec.capacity, dtype=torch.float32)
    for info in spec.params:
        flat.narrow(0, info.offset, info.numel).copy_(info.param.detach().reshape(-1))
    return flat
