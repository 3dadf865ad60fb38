"""One chunk of a model under ZeRO: its parameters, gradients, master weights and optimizer states.

Its buffers follow the stage's layout (`hetero/zero/stages.py`, [Note: what each stage keeps]); how and when its
collectives run is the protocol's ([Note: every rank in step]).
"""

from __future__ import annotations

from typing import Any

import torch

from hetero.comm import Comm
from hetero.memory import Chunk, ChunkManager, TensorSlot, TensorState, Tier
from hetero.zero import copy_up, param_gather, released
from hetero.zero import master as master_weights
from hetero.zero.host_grads import HostSum, grad_to_host
from hetero.zero.layout import ChunkSpec
from hetero.zero.meta_swap import give_memory
from hetero.zero.segments import update_segments
from hetero.zero.stages import STAGES, Placement, master_is_shard
from hetero.zero.units import Entry

_T = TensorState


class ZeroChunk:
    def __init__(
        self,
        spec: ChunkSpec,
        *,
        manager: ChunkManager,
        comm: Comm,
        stage: int,
        dtype: torch.dtype,
        placement: Placement,
        state_names: tuple[str, ...],
        keep_master: bool = False,
    ) -> None:
        self.spec = spec
        self.manager = manager
        self.comm = comm
        self.stage = stage
        self.layout = STAGES[stage]  # what this stage keeps ([Note: what each stage keeps])
        self.dtype = dtype  # compute dtype of the parameters
        self.placement = placement
        self.device = manager.device
        n = comm.size
        self.shard_numel = spec.capacity // n  # elements of one rank's shard
        self._uses: dict[int, int] = {}  # param id -> uses in progress (a parameter may be used twice at once)

        layout = self.layout
        self.full = manager.new_chunk(
            dtype=dtype, capacity=spec.capacity, kind="param", transient=layout.params_sharded
        )
        self.slots: list[TensorSlot] = [self.full.add_tensor(p.name, p.shape) for p in spec.params]
        self.gathered = not layout.params_sharded  # the full parameters are here (a state every rank shares)
        self._gathering: param_gather.InFlight | None = None  # a gather issued, not completed yet
        self.shard: Chunk | None = None
        self.master_is_shard = master_is_shard(layout, spec.trainable, dtype, placement)  # see the note there
        if layout.params_sharded and not self.master_is_shard:
            self.shard = manager.new_chunk(dtype=dtype, capacity=self.shard_numel, kind="param_shard")
            self.shard.add_tensor(f"{spec.params[0].name}..shard", (self.shard_numel,))
        # [Note: the master follows the shard] (master.py); keep_master: the shard holds a prediction instead
        # ([Note: predicting past the delay]), so the master keeps its own copy.
        self.master_follows = not keep_master and master_weights.follows(self)
        self.grad: Chunk | None = None
        self.grad_full: Chunk | None = None
        self.optim: Chunk | None = None
        self.param_steps = [0] * len(spec.params)  # optimizer steps each parameter has taken (see update_segments)
        self._used = bytearray(len(spec.params))  # got a gradient since the last update (set with no tensor call)
        self.used = torch.frombuffer(self._used, dtype=torch.uint8)  # the same bytes, for the collectives
        self.kept_grads = torch.zeros(len(spec.params), dtype=torch.uint8)  # [Note: zero gradients kept]
        self.keeps_zero_grads = False  # the loop's last zero_grad was set_to_none=False
        self._index = {id(p.param): i for i, p in enumerate(spec.params)}
        self.grads_seen: set[int] = set()  # trainable param ids whose gradient this micro-batch has arrived
        self.n_trainable = sum(1 for p in spec.params if p.trainable)
        self.used_numel = sum(p.numel for p in spec.params)  # elements before the padding
        self.grad_is_zero = True  # nothing accumulated into the gradient since the last update
        self.grad_sq: torch.Tensor | None = None  # see hetero/zero/host_grads.py
        self.host_sum = HostSum(self)  # stages 0-1, a gradient on the host: summed on the device first (ibid.)
        # A reduce-scatter in flight: (handle, target, into the gradient itself, first since the update, a marker of
        # its completion where it is known when issued).
        self._reducing: tuple | None = None
        # Stages 2-3 in train_batch: sum the full gradient over the batch's micro-batches, reduce once at its end.
        self.accumulate_full = False
        self.batch_seen: set[int] = set()  # param ids with a gradient in grad_full this batch (accumulate_full)
        if spec.trainable:
            grad_numel = layout.grad_numel(spec.capacity, n)
            self.grad = manager.new_chunk(dtype=torch.float32, capacity=grad_numel, kind="grad")
            self.grad.add_tensor(f"{spec.params[0].name}..grad", (grad_numel,))
            if layout.grads_sharded:
                self.grad_full = manager.new_chunk(dtype=torch.float32, capacity=spec.capacity, kind="grad_full")
                self.grad_full.add_tensor(f"{spec.params[0].name}..grad_full", (spec.capacity,))
            s = layout.optim_numel(spec.capacity, n)
            self.optim = manager.new_chunk(dtype=torch.float32, capacity=s * (1 + len(state_names)), kind="optim")
            for name in ("master", *state_names):
                self.optim.add_tensor(f"{spec.params[0].name}..{name}", (s,))

    @property
    def label(self) -> str:
        """How errors name this chunk."""
        return f"chunk {self.spec.index} ({self.spec.label()})"

    # ---- set-up -------------------------------------------------------------------------------------------
    def load(self, flat: torch.Tensor) -> None:
        """Fill every buffer from the full flat fp32 parameter values (the same on every rank)."""
        m = self.manager
        mine = self.kept(flat)
        if not self.layout.params_sharded:
            # Stages 0-2 keep full parameters on the device for the model's whole life: pinned, so that nothing
            # autograd saved in forward can move before backward.
            m.access(self.full, Tier.DEVICE)
            self.full.payload.copy_(flat)
            for slot in self.slots:
                self.full.set_state(slot, _T.HOLD)
                self.full.set_state(slot, _T.COMPUTE)
            self._point_params()
        else:
            if self.shard is not None:  # else the master, filled below, is the shard
                m.access(self.shard, Tier.DEVICE if self.placement.params is Tier.DEVICE else Tier.HOST)
                self.shard.payload.copy_(mine)
                self.shard.set_state(self.shard.slots[0], _T.HOLD)
                if self.placement.params is Tier.NVME:
                    m.move(self.shard, Tier.NVME)
            # Point the parameters at the transient full chunk once; dropped, its storage has zero bytes until the
            # next gather (see [Note: transient chunks] in the manager), and the parameters are released.
            m.access(self.full, Tier.DEVICE)
            self._point_params()
            m.release(self.full)
            whole = [i for i in self.spec.params if not i.tiled]  # a tiled parameter is the engine's (tiling.py)
            released.release([i.param for i in whole], [i.name for i in whole])
        if self.optim is not None:
            m.access(self.optim, self.placement.compute)
            self.optim.payload.zero_()
            self.optim.view(self.optim.slots[0]).copy_(mine)
            for slot in self.optim.slots:
                self.optim.set_state(slot, _T.HOLD)
            master_weights.in_shard(self)
            if self.placement.optim is Tier.NVME:
                m.move(self.optim, Tier.NVME)
        if self.grad is not None:
            self.zero_grad()

    # ---- parameters ---------------------------------------------------------------------------------------
    def unshard(self) -> None:
        """Stage 3: the full parameters resident on the device, gathered (or the gather `start_gather` began,
        completed). A collective: see [Note: every rank in step] for who decides when."""
        self.complete_gather()
        if self.gathered:
            self.manager.access(self.full, Tier.DEVICE)  # back from wherever this rank's memory pressure moved it
            return
        self.start_gather(wait=True)

    def start_gather(self, *, wait: bool = False) -> None:
        """Stage 3: issue the gather and return, the chunk gathered from now on (shared state); the next `unshard`
        or `reshard` completes it ([Note: gathering ahead] in hetero/zero/gathers.py)."""
        if not self.gathered:
            self._gathering = param_gather.issue(self, wait=wait)
            self.gathered = True
            if self._gathering.handle is None:  # waited for, or done as issued: nothing stays pinned
                self._finish_gather()

    def complete_gather(self) -> None:
        """A gather issued ahead completes now: before anything else reads, moves or writes its shard or full."""
        if self._gathering is not None:
            self._finish_gather()

    def _finish_gather(self) -> None:
        pending, self._gathering = self._gathering, None
        param_gather.complete(self, pending)
        for slot in self.slots:
            self.full.set_state(slot, _T.HOLD)

    def reshard(self) -> None:
        """Stage 3: drop the gathered parameters (no use may be in progress); only this rank's shard stays."""
        if not self.layout.params_sharded or not self.gathered:
            return
        self.complete_gather()  # issued on every rank: it completes, then goes
        busy = [s.name for s in self.slots if s.state is _T.COMPUTE]
        if busy:
            raise RuntimeError(f"{self.label} cannot be released while {busy[:3]} are being computed on")
        for slot in self.slots:
            if slot.state is not _T.FREE:
                self.full.set_state(slot, _T.FREE)
        self._uses.clear()
        self.manager.release(self.full)
        self.gathered = False

    def enter(self, e: Entry) -> None:
        """A use of a parameter begins: its slot is COMPUTE (pinned to the device), its values readable (stage 3)."""
        if not self.layout.params_sharded:
            return
        k = id(e.info.param)
        uses = self._uses.get(k, 0)
        self._uses[k] = uses + 1
        if uses == 0:
            self.full.set_state(e.slot, _T.COMPUTE)
            released.restore([e.info.param])

    def exit(self, e: Entry, after: TensorState) -> None:
        """A use of a parameter ends (after: HOLD_AFTER_FWD, HOLD_AFTER_BWD or HOLD)."""
        if not self.layout.params_sharded:
            return
        k = id(e.info.param)
        uses = self._uses.get(k, 0)
        if uses == 0:
            return
        self._uses[k] = uses - 1
        if uses == 1:
            self.full.set_state(e.slot, after)
            released.release([e.info.param], [e.info.name])

    def _point_params(self) -> None:
        for info, slot in zip(self.spec.params, self.slots):
            if info.tiled:
                continue  # never whole: its module computes on the tiles ([Note: computing on tiles])
            if info.param.is_meta:
                # A meta tensor cannot take another device's data: swap in an empty one, keeping the Parameter object
                # (the optimizer's and tied modules' reference), its attributes and hooks ([Note: hooks across
                # swap_tensors]).
                give_memory(info.param, torch.empty(0, dtype=self.dtype, device=self.device.torch_device))
            info.param.data = self.full.view(slot)

    # ---- gradients ----------------------------------------------------------------------------------------
    def add_grad(self, e: Entry, grad: torch.Tensor) -> bool:
        """Take one parameter's gradient of this micro-batch. True when the chunk has all of them."""
        info = e.info
        flat = grad.reshape(-1)
        if self.grad_full is not None:
            # A fresh buffer each micro-batch: each parameter's gradient is copied in once (autograd has already
            # summed a parameter used twice); regions no gradient reached are zeroed before the reduction.
            region = self._micro_grad().narrow(0, info.offset, info.numel)
            if self._has_part(id(info.param)):  # a tile of a weight used twice (tiling.py), or accumulate_full
                region.add_(flat)
            elif flat.data_ptr() != region.data_ptr():  # else computed in place (`grad_target`)
                region.copy_(flat)
            if self.accumulate_full:
                self.batch_seen.add(id(info.param))
        elif self.placement.compute is not Tier.DEVICE and self.device.separate_memory:
            self.host_sum.add(info.offset, flat)
        else:
            self.grad_buffer().narrow(0, info.offset, info.numel).add_(flat)
            self.grad_is_zero = False
        self.grads_seen.add(id(info.param))
        self._used[self._index[id(info.param)]] = 1
        if len(self.grads_seen) < self.n_trainable:
            return False
        self.host_sum.flush()
        return True

    def grad_target(self, e: Entry) -> torch.Tensor | None:
        """Where `e`'s gradient may be computed in place (a tile's: tiling.py): its region of grad_full, or None."""
        if self.grad_full is None or self.dtype != torch.float32 or self._has_part(id(e.info.param)):
            return None
        return self._micro_grad().narrow(0, e.info.offset, e.info.numel).view(e.info.shape)

    def _has_part(self, i: int) -> bool:  # some of param i's gradient is in grad_full already (add the rest)
        return i in self.grads_seen or (self.accumulate_full and i in self.batch_seen)

    def _micro_grad(self) -> torch.Tensor:
        """Stages 2-3: this micro-batch's full gradient on the device (unwritten regions hold garbage)."""
        chunk = self.grad_full
        buf = self.manager.access(chunk, Tier.DEVICE)
        if chunk.slots[0].state is _T.FREE:
            chunk.set_state(chunk.slots[0], _T.HOLD)
        return buf

    def start_reduce(self) -> None:
        """Issue the reduce-scatter of this micro-batch's gradient (mean over ranks); `finish_reduce` completes it.
        Backward goes on meanwhile: the collective runs on the backend's own thread, in the order issued on every
        rank. A chunk no gradient of this rank reached takes part with zeros: another rank's may have."""
        m = self.manager
        full = self._micro_grad()
        for info in self.spec.params:
            if id(info.param) not in self.grads_seen:
                full.narrow(0, info.offset, info.numel).zero_()
        self.grads_seen.clear()
        full[self.used_numel :].zero_()  # padding
        m.pin(self.grad_full)  # the collective reads it until finish_reduce
        acc = m.access(self.grad, self.placement.compute)
        # The first micro-batch since the update lands in place, where the buffer is memory the collective writes.
        direct = self.grad_is_zero and (self.grad.tier is Tier.DEVICE or not self.device.separate_memory)
        if direct:
            m.pin(self.grad)  # the collective writes it until finish_reduce
            self._grad_holds()
            target = acc
        else:
            target = self.device.empty((self.shard_numel,), torch.float32)
        first = self.grad_is_zero
        self.grad_is_zero = False
        what = f"the gradients of {self.label}"
        handle = self.comm.reduce_scatter_async(target, full, op="avg", what=what)
        # A group of one "reduces" with a copy on the compute stream: done at this marker, which a gradient on its way
        # to the host waits for (hetero/zero/host_grads.py).
        to_host = not direct and self.grad.tier is not Tier.DEVICE and self.device.separate_memory
        early = self.device.compute_marker() if to_host and self.comm.size == 1 else None
        self._reducing = (handle, target, direct, first, early)

    def finish_reduce(self) -> None:
        if self._reducing is None:
            return
        handle, target, direct, first, early = self._reducing
        self._reducing = None
        handle.wait()
        m = self.manager
        if direct:
            m.unpin(self.grad)
        elif self.grad.tier is not Tier.DEVICE and self.device.separate_memory:
            self.grad_sq = grad_to_host(self, target, first=first, ready=early)
        else:  # the gradient where the target is (on the device, or a CPU device's host memory)
            self.grad_buffer().add_(target)
        m.unpin(self.grad_full)
        self.grad_full.set_state(self.grad_full.slots[0], _T.FREE)
        m.release(self.grad_full)

    def reduce_batch(self) -> None:
        """Stages 2-3, accumulate_full: reduce-scatter the batch's summed gradient (mean over ranks) into the shard,
        once; regions no micro-batch reached are zeroed first."""
        self.grads_seen, self.batch_seen = self.batch_seen, set()
        self.start_reduce()
        self.finish_reduce()

    def grad_view(self, acc: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's reduced gradient (the whole chunk at stage 0), fp32, on the compute tier (of `acc`, the
        gradient buffer, where the caller holds it without an access)."""
        acc = self.grad_buffer() if acc is None else acc
        if self.layout.optim_sharded and not self.layout.grads_sharded:  # stage 1: the shard of a full buffer
            return self.kept(acc)
        return acc

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Drop the accumulated gradient; `set_to_none` given: the loop's zero_grad ([Note: zero gradients kept])."""
        if set_to_none is not None:
            self.keeps_zero_grads = not set_to_none
            if set_to_none:
                self.kept_grads.zero_()
        self.grads_seen.clear()
        self.host_sum.drop()  # a batch that failed before its sums went down
        self.batch_seen.clear()  # a pipeline batch that failed: its partial sum in grad_full is not added to
        self.used.zero_()
        self.grad_is_zero = True
        self.grad_sq = None
        slot = self.grad.slots[0]
        if slot.state is _T.HOLD:
            self.grad.set_state(slot, _T.FREE)
        if self.layout.grads_sharded:
            # Nothing is accumulated until the first reduce-scatter, which writes the buffer whole: meanwhile the
            # chunk holds no data, so evicting it costs nothing (released, not written to NVMe and read back).
            return
        self.grad_buffer()  # zeros; one on NVMe gets fresh memory rather than being read back

    def grad_buffer(self, *, whole: bool = False) -> torch.Tensor:
        """The accumulated gradient on the compute tier: zeros where none is yet, unless the caller writes it whole."""
        acc = self.manager.access(self.grad, self.placement.compute)
        if self.grad.slots[0].state is _T.FREE and not whole:
            acc.zero_()
        self._grad_holds()
        return acc

    def _grad_holds(self) -> None:
        if self.grad.slots[0].state is _T.FREE:
            self.grad.set_state(self.grad.slots[0], _T.HOLD)

    # ---- update -------------------------------------------------------------------------------------------
    def update_segments(self, used: torch.Tensor) -> list[tuple[int, int, int]]:
        """(start, end, steps taken) runs of this rank's optimizer shard to update, then count the step."""
        return update_segments(self, used)  # [Note: parameters without a gradient] (segments.py)

    def optimizer_views(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self.manager.access(self.optim, self.placement.compute)
        # A master filled from a shard on the device comes down on a copy stream, into the optimizer chunk's pinned
        # memory at the bus's speed; the host waits for that copy ([Note: the master copied up late] in master.py).
        self.device.landed(master_weights.fill(self))
        views = [self.optim.view(s) for s in self.optim.slots]
        return views[0], views[1:]

    def state_views(self) -> list[torch.Tensor]:
        """The optimizer states alone, resident where the optimizer steps (the master left as it is)."""
        self.manager.access(self.optim, self.placement.compute)
        return [self.optim.view(s) for s in self.optim.slots[1:]]

    def write_back(
        self, master: torch.Tensor, *, clear_grad: bool = True, gather: bool = True, source: Chunk | None = None
    ) -> None:
        """Copy the updated master weights into the parameters, then clear the accumulated gradient (unless
        clear_grad is False: a checkpoint load clears it only where it is not already zero). gather False: stages
        1-2 leave the other ranks' parts to a later `gather_params`. source: the chunk holding `master`
        ([Note: writing parameters up without a wait])."""
        if self.layout.params_sharded:
            self.write_shard(master, source=source)
            master_weights.in_shard(self)
        else:
            copy_up.copy_up(self, self.kept(self.manager.access(self.full, Tier.DEVICE)), master, source)
            if gather:
                self.gather_params()
        if clear_grad:
            self.zero_grad()

    def gather_params(self) -> None:
        """Stages 1-2: gather the parts of the parameters the other ranks updated (a no-op at stages 0 and 3)."""
        if not self.layout.params_sharded and self.layout.optim_sharded:
            full = self.manager.access(self.full, Tier.DEVICE)
            self.comm.all_gather(full, self.kept(full), what=f"the parameters of {self.label}")

    def write_shard(self, values: torch.Tensor, *, source: Chunk | None = None) -> None:
        """Stage 3: this rank's shard of the parameters becomes `values` (the shard's numel, or the full chunk);
        source: the chunk holding `values` ([Note: writing parameters up without a wait])."""
        copy_up.write_shard(self, values, source)

    def kept_range(self) -> tuple[int, int]:
        """The chunk elements [lo, hi) this rank keeps master weights and optimizer states for (all at stage 0)."""
        return self.layout.kept_range(self.spec.capacity, self.comm.size, self.comm.rank)

    def kept(self, full: torch.Tensor) -> torch.Tensor:
        """The part of a full-chunk tensor that this rank's master weights cover."""
        return full[slice(*self.kept_range())]

    # ---- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Besides its buffers, a checkpoint keeps each parameter's step count, used flag, and whether grad is 0."""
        return {
            "param_steps": list(self.param_steps),
            "used": [int(u) for u in self.used.tolist()],
            "grad_is_zero": self.grad_is_zero,
            "kept_grads": [int(u) for u in self.kept_grads.tolist()],
            "keeps_zero_grads": self.keeps_zero_grads,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`; keys left out keep their values (a checkpoint without pending gradients)."""
        if "param_steps" in state:
            self.param_steps = list(state["param_steps"])
        if "used" in state:
            self.used.copy_(torch.tensor(state["used"], dtype=torch.uint8))
        if "grad_is_zero" in state:
            self.grad_is_zero = bool(state["grad_is_zero"])
        if "kept_grads" in state:
            self.kept_grads.copy_(torch.tensor(state["kept_grads"], dtype=torch.uint8))
            self.keeps_zero_grads = bool(state["keeps_zero_grads"])

    def full_values(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value (CPU copies; a tile's rows); at stage 3 the chunk must be gathered first."""
        self.complete_gather()
        full = self.manager.access(self.full, Tier.DEVICE, write=False)
        return {
            info.name: self.device.to_host(full.narrow(0, info.offset, info.numel).view(info.shape), copy=True)
            for info in self.spec.params
        }
