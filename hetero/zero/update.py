"""The optimizer update at an accumulation boundary: reduce, measure the gradient, scale, step every chunk, write
the parameters back; and, with states on NVMe, stream them through the host.

[Note: the update pipeline]
With optimizer states on NVMe the update streams them: chunk i steps while the states (and any gradient spilled to
NVMe) of chunk i+1 (and i+2 while chunks are small) are read and chunk i-1 is written back. A read that finds the
host full is chained behind a write-back of the same size (see the manager's [Note: reads chained behind
write-backs]), so it starts the moment that write ends, not at the next call into the manager. A stage-3 shard that
the update overwrites whole is marked FREE before anything can read it ahead (it gets fresh memory, not a read), and
a chunk's zeroed gradient is released as soon as it has stepped. Without clipping or loss scaling the gradient norm
is only reported: it is summed during the update instead of in a pass of its own, which would read every spilled
gradient twice.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hetero.comm import Comm
from hetero.config import Config
from hetero.errors import add_note
from hetero.memory import Chunk, ChunkManager, ChunkState, TensorState, Tier
from hetero.parallel.mesh import Mesh
from hetero.zero import master as master_weights
from hetero.zero.buckets import reduce_at_update
from hetero.zero.grad_norm import clip_coef, clip_coef_on_device, grad_stats, norm_on_device, sq_on_device, zc_sharded
from hetero.zero.host_grads import chunk_sum_of_squares
from hetero.zero.norms import SquareSum
from hetero.zero.optim import Algorithm, update
from hetero.zero.overflow import DeviceCheck, skips_itself
from hetero.zero.precision import LossScaler
from hetero.zero.protocol import UPDATE, Checker
from hetero.zero.read_ahead import read_ahead
from hetero.zero.segments import flags_to_step, remember_stepped, uncount_step
from hetero.zero.zero_chunk import ZeroChunk

if TYPE_CHECKING:
    from hetero.zero.delayed import DelayedUpdate
    from hetero.zero.in_backward import InBackward

log = logging.getLogger("hetero.zero")


class Updater:
    """Owns the update and its counters: steps taken and skipped, the last gradient norm, the loss scale."""

    def __init__(
        self,
        chunks: list[ZeroChunk],
        *,
        manager: ChunkManager,
        mesh: Mesh,
        config: Config,
        algorithm: Algorithm,
        check: Checker,
        comm: Comm | None = None,
    ) -> None:
        self.chunks = [zc for zc in chunks if zc.spec.trainable]  # in layout order: the same on every rank
        self.manager = manager
        self._write_out: list[Chunk] = []  # stepped states owed to NVMe, in order (`release_stepped`)
        self.mesh = mesh
        self.comm = comm if comm is not None else mesh.dp  # ZeRO's group (Chimera: both replicas of the stages)
        self.config = config
        self.algorithm = algorithm
        self.check = check
        self.param_groups: list[dict[str, Any]] = []  # the user's hyperparameters (the optimizer's param groups)
        # fp16's loss scale, as the config's loss_scale section sets it ([Note: the fp16 loss scale])
        self.scaler = LossScaler.configured(config.loss_scale) if config.precision == "fp16" else None
        # fp16's check where the kernels skip an overflowed update themselves ([Note: the overflow check on the device])
        self.overflow = DeviceCheck(manager.device) if self.scaler is not None else None
        self.loop_clip: float | None = None  # the loop's clip_grad_norm_ for the next update
        # The gradient's (sum of squares, finite) that clip_grad_norm_ computed, kept for the update it clips: the
        # same gradient, so not summed and all-reduced twice. Forgotten when gradients change (a backward, a zeroing).
        self.clip_stats: tuple[float, bool] | None = None
        self.global_steps = 0  # updates applied
        self.skipped_steps = 0  # updates skipped for fp16 overflow
        # The gradient's norm before clipping, like clip_grad_norm_'s return (None before any update): a float, or a
        # sum of squares left where it was summed until read ([Note: the norm read when asked]).
        self._norm: float | torch.Tensor | None = None
        self.last_update_skipped = False  # the last update was skipped for fp16 overflow (schedulers do not step)
        # Stages 0-1: whether backward already reduced a chunk's gradient (hetero/zero/buckets.py); set by the engine.
        self.reduced_early: Callable[[ZeroChunk], bool] = lambda zc: False
        self.delayed: DelayedUpdate | None = None  # delayed_param_update: the update runs during the next step
        self.in_backward: InBackward | None = None  # update_in_backward: the chunks step during backward
        self.on_span: Callable[[str, str, float, float], None] | None = None  # a chunk's math, timed (profiler)
        # The norm (and fp16's check) stays on the device: every rank's chunks step on a device with memory of its
        # own and the norm needs no group but the data-parallel one, agreed at start ([Note: the norm on the device,
        # agreed] in grad_norm.py).
        self.device_alone = norm_on_device(self.chunks, mesh=mesh, comm=self.comm, device=manager.device)

    # ---- the update -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        if self.in_backward is not None and self.in_backward.done:
            self.finish(self.in_backward.take())  # the backward before stepped every chunk: count the update
            return
        delayed = self.delayed
        was_pending = delayed is not None and delayed.pending
        if delayed is not None:
            delayed.finish()  # the update before: its last chunks stepped, the update counted
            delayed.boundary()  # the step since the last boundary paces the next delayed update
        plan = self.prepare()
        if delayed is not None:  # its parameters written back: towards this update's, when predicting
            delaying = plan is not None and self.global_steps >= self.config.delayed_param_update_warmup
            delayed.apply(plan if delaying else None)
        if plan is None:
            return
        # Exact for the first updates, then delayed: decided from global_steps, which every rank shares (and a
        # checkpoint restores). See [Note: warming up before delaying].
        if delayed is not None and self.global_steps >= self.config.delayed_param_update_warmup:
            delayed.start(plan)  # runs during the next forward and backward
            # The first update left pending (after the warm-up, a resume or a settle): this step ends without the
            # update's accesses, and the next one steps its chunks during forward. Neither looks like the steps
            # before, nor like each other: the trace is recorded afresh from the next step.
            self.manager.step_end(keep=was_pending)
            return
        # The buffers backward cached (gradients reduced and freed) sit idle through the update, while the update
        # reads states in: give them back first (on a CPU device, with states on NVMe, another 60 MB a rank there).
        self.manager.trim_idle()
        for i in range(len(self.chunks)):
            self.step_one(self.chunks, i, plan, plan.used_of[i])
        self.finish(plan)

    def step_one(self, order: list[ZeroChunk], i: int, plan: Plan, used: torch.Tensor, *, gather: bool = True) -> None:
        """Step chunk order[i] (the chunks step in `order`, whose next ones are read ahead with states on NVMe),
        write its parameters back and release its gradient. gather False: stages 1-2 leave the all-gather of the
        other ranks' parameters to the caller (`gather_params`)."""
        try:
            self._step_one(order, i, plan, used, gather=gather)
        except Exception as e:
            # The chunks before the i-th stepped, the rest did not: stepping again would step the first ones twice.
            done = "no chunk had stepped yet" if i == 0 else f"chunks 1-{i} of {len(order)} had stepped"
            add_note(
                e,
                f"hetero: the update stopped at chunk {i + 1} of {len(order)} ({done}; that one may have in part): "
                "the parameters and optimizer states may now mix two steps. Do not call step() again: load the "
                "last checkpoint (engine.load_checkpoint) once the cause is fixed",
            )
            raise

    def _step_one(self, order: list[ZeroChunk], i: int, plan: Plan, used: torch.Tensor, *, gather: bool) -> None:
        zc = order[i]
        streamed = zc.placement.optim is Tier.NVME
        if streamed:
            if zc.shard is not None and not zc.master_follows and zc.shard.slots[0].state is TensorState.HOLD:
                # Overwritten whole by the write-back below: say so now, before anything reads it ahead of use.
                zc.shard.set_state(zc.shard.slots[0], TensorState.FREE)
            self.prefetch(i, zc.placement.compute, order)
        grad = zc.grad_view()
        if plan.fused_norm:
            plan.sq.add(chunk_sum_of_squares(zc, grad))
        self._step_chunk(zc, grad, plan.coef, used, gather=gather, found_inf=plan.found_inf)
        if streamed:
            self.release_stepped(zc)
            self.prefetch(i + 1, zc.placement.compute, order)
        else:
            self.release_zeroed(zc)

    def prepare(self) -> Plan | None:
        """What every update does before its chunks step, collectives included: the reduction (stages 0-1, unless
        backward did it), the gradient's norm and fp16 overflow, the scale, which parameters any rank used. None when
        fp16 overflowed and the step is skipped."""
        self.check(UPDATE)
        for zc in self.chunks:
            if not self.reduced_early(zc):
                reduce_at_update(zc)
        inv_scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        clip_max, stats = self.clip_max(), self.clip_stats
        self.loop_clip = self.clip_stats = None  # this update's: [Note: the loop's clip_grad_norm_]
        # Under tensor or pipeline parallelism the norm needs more than the data-parallel sum: computed up front.
        fused_norm = self.scaler is None and clip_max is None and self.mesh.tp_size == 1 and self.mesh.pp_size == 1
        self.last_update_skipped = False
        clip = self._clip_on_device(fused_norm, clip_max) if stats is None else None
        if clip is not None:
            return Plan(coef=clip, used_of=self._used_of(), fused_norm=False, sq=SquareSum(), groups=self._groups())
        if stats is None and self._checks_on_device():
            return self._prepare_on_device(clip_max, inv_scale)
        sq, finite = (0.0, True) if fused_norm else stats or self.grad_stats()
        if self.scaler is not None:
            overflow = not finite
            self.scaler.update(overflow)
            self.last_update_skipped = overflow
            if overflow:
                self.skipped_steps += 1
                self.scaler.log_skipped()
                self.zero_grads()
                self.manager.step_end()
                return None
        coef = inv_scale
        if clip_max is not None:
            coef *= clip_coef(clip_max, math.sqrt(sq) * inv_scale)
        if not fused_norm:
            self.last_grad_norm = math.sqrt(sq) * inv_scale
        return Plan(coef=coef, used_of=self._used_of(), fused_norm=fused_norm, sq=SquareSum(), groups=self._groups())

    def _used_of(self) -> list[torch.Tensor]:
        """Per chunk, which parameters any rank used this update (they have a mean gradient)."""
        # A pipeline stage may hold no trainable chunk (a frozen first stage): nothing to tell, on every rank of it.
        none = torch.zeros(0, dtype=torch.uint8)
        used = torch.cat([flags_to_step(zc) for zc in self.chunks]) if self.chunks else none
        self.comm.control.all_reduce(used, op="max")
        split = list(used.split([len(zc.spec.params) for zc in self.chunks]))
        for zc, u in zip(self.chunks, split):
            remember_stepped(zc, u)
        return split

    def _groups(self) -> list[dict[str, Any]]:
        # The hyperparameters as they are now: a scheduler may change them before a delayed update runs.
        return [dict(g) for g in self.param_groups]

    def clip_max(self) -> float | None:
        """The norm the next update clips to: the config's `grad_clip_norm`, or the loop's `clip_grad_norm_` for
        this update ([Note: the loop's clip_grad_norm_]), the smaller where both are set."""
        given = [c for c in (self.config.grad_clip_norm, self.loop_clip) if c is not None]
        return min(given) if given else None

    def _clip_on_device(self, fused_norm: bool, clip_max: float | None) -> torch.Tensor | None:
        """Where clipping is all the norm is for and every chunk steps on a device with memory of its own: the
        clipping coefficient as a device scalar, the norm summed and all-reduced there, nothing read back ([Note: the
        norm read when asked]); else None. Decided from the config and the placement: the same on every rank."""
        if fused_norm or clip_max is None or self.scaler is not None or not self.device_alone:
            return None
        sq = sq_on_device(self.chunks, comm=self.comm, device=self.manager.device)
        self._norm = sq
        return clip_coef_on_device(sq, clip_max)

    def _checks_on_device(self) -> bool:
        """fp16's overflow check is left to the kernels ([Note: the overflow check on the device]); not where the
        chunks step later than `prepare` (the delayed update, which the config keeps to host-stepped states anyway)."""
        return (
            self.overflow is not None
            and skips_itself(self.algorithm)
            and self.delayed is None
            and self.in_backward is None
            and self.device_alone
        )

    def _prepare_on_device(self, clip_max: float | None, inv_scale: float) -> Plan:
        assert self.overflow is not None
        sq = sq_on_device(self.chunks, comm=self.comm, device=self.manager.device)
        used_of = self._used_of()
        coef, found_inf, norm_sq = self.overflow.check(
            sq, inv_scale=inv_scale, clip_max=clip_max, used_of=used_of, norm_before=self._norm
        )
        self._norm = norm_sq
        return Plan(
            coef=coef, used_of=used_of, fused_norm=False, sq=SquareSum(), groups=self._groups(), found_inf=found_inf
        )

    def _settle_overflow(self) -> None:
        """The host's books after an update checked on the device, as `prepare`'s host-side check keeps them."""
        pending = self.overflow.take() if self.overflow is not None else None
        if pending is None:
            return
        overflow = pending.overflowed
        assert self.scaler is not None and overflow is not None
        self.scaler.update(overflow)
        self.last_update_skipped = overflow
        if overflow:  # the kernels left every master and state as it was: undo what the update counted
            self.skipped_steps += 1
            self.global_steps -= 1
            self._norm = pending.norm_before
            for zc, used in zip(self.chunks, pending.used_of):
                uncount_step(zc, used)
            self.scaler.log_skipped()

    def finish(self, plan: Plan) -> None:
        """After every chunk stepped: the norm summed during the update, the step counted, the trace step ended."""
        self.write_out(block=True)
        if plan.fused_norm:
            device = self.manager.device
            if device.separate_memory:  # [Note: the norm read when asked]
                sq = plan.sq.on_device(device)
                if zc_sharded(self.chunks):
                    self.comm.all_reduce(sq, op="sum")
                self._norm = sq
            else:
                sq = plan.sq.total(device)
                if zc_sharded(self.chunks):
                    self.comm.control.all_reduce(sq, op="sum")
                self.last_grad_norm = math.sqrt(float(sq))
        self.global_steps += 1
        # Buffers cached for reuse would sit through the next forward, where the step's memory peaks (activations):
        # give them back, but those the forward takes again ([Note: what the forward takes again]). Backward takes
        # what it needs again. On a CPU device the host tier's go too: the states streamed from NVMe leave about a
        # chunk of buffers per chunk in flight cached, as much memory again as the parameters the forward gathers
        # (the 22.6M Llama race: 50 MB a rank of peak RSS).
        self.manager.trim_idle()
        self.manager.step_end()  # a no-op unless backward left the step open for the update
        self._settle_overflow()  # last: the host waits for the device to pass the check, the update queued behind it

    def release_stepped(self, zc: ZeroChunk) -> None:
        """A streamed chunk has stepped: its states written back while the next chunk steps, its zeroed gradient
        released."""
        self._write_out.append(zc.optim)
        self.write_out(block=False)
        self.release_zeroed(zc)

    def write_out(self, *, block: bool) -> None:
        """Start the NVMe writes of stepped states, in order, once no copy up to the device reads their master
        (block: all, waiting for that): [Note: writing parameters up without a wait] in copy_up.py."""
        while self._write_out and (block or self.manager.in_flight(self._write_out[0], reads=True) is None):
            self.manager.move(self._write_out.pop(0), Tier.NVME, wait=False)

    def release_zeroed(self, zc: ZeroChunk) -> None:
        """Stages 2-3: a stepped chunk's gradient holds no data until the next reduce-scatter writes it whole, so it
        holds no memory either (FSDP2 frees its sharded gradients at zero_grad too)."""
        if zc.grad.all_free and zc.grad.state is not ChunkState.EMPTY:
            self.manager.release(zc.grad)

    def _step_chunk(
        self,
        zc: ZeroChunk,
        grad: torch.Tensor,
        coef: float | torch.Tensor,
        used: torch.Tensor,
        *,
        gather: bool = True,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """The user's algorithm on the chunk's runs of used parameters, then the write-back."""
        with self.manager.pinned(zc.grad):
            views = master_weights.in_place_views(zc)  # [Note: stepping the shard in place] (master.py)
            master, states = views if views is not None else zc.optimizer_views()
            with self.manager.pinned(zc.optim):
                t0 = time.perf_counter()
                group = self.param_groups[zc.spec.group]
                step_chunk(self.algorithm, group, zc, used, master, grad, states, coef, found_inf=found_inf)
                if self.on_span is not None:
                    self.on_span("optimizer", f"step chunk {zc.spec.index}", t0, time.perf_counter())
                zc.write_back(master, gather=gather, source=zc.optim if views is None else None)

    def prefetch(self, i: int, tier: Tier, order: list[ZeroChunk] | None = None) -> None:
        """Bring chunk order[i]'s gradient and states (and the next ones') to `tier` (order: the chunks in the order
        they step, layout order by default); see [Note: the update pipeline]."""
        read_ahead(self.manager, self.chunks if order is None else order, i, tier)

    # ---- the gradient's norm --------------------------------------------------------------------------------
    def grad_stats(self) -> tuple[float, bool]:
        """The global (scaled) gradient's sum of squares and whether it is finite, read on the host."""
        return grad_stats(self.chunks, mesh=self.mesh, comm=self.comm, device=self.manager.device)

    def stats_to_clip(self) -> tuple[float, bool]:
        """The loop's clip_grad_norm_: the gradient's `grad_stats`, computed once and kept for the update it clips
        ([Note: the loop's clip_grad_norm_])."""
        if self.clip_stats is None:
            self.clip_stats = self.grad_stats()
        return self.clip_stats

    def clip_to(self, max_norm: float) -> None:
        """The next update clips to `max_norm` (the smaller, where the loop clipped twice)."""
        self.loop_clip = max_norm if self.loop_clip is None else min(max_norm, self.loop_clip)

    def zero_grads(self, set_to_none: bool | None = None) -> None:
        self.clip_stats = None
        for zc in self.chunks:
            zc.zero_grad(set_to_none)

    # [Note: the norm read when asked]
    # Every update reports the gradient's norm. Where it is the only use of the norm (nothing clips, no fp16 scale,
    # `fused_norm`) it is summed chunk by chunk as they step, and on a GPU the sum is a device tensor: reading it at the
    # update's end made the host wait there, every step, for all the update's kernels before it could queue the next
    # forward. So on a device with memory of its own the sum stays there, the group's all-reduce included (on the data
    # group, on the device's stream), and `last_grad_norm` reads it when someone asks (metrics, a sink, a checkpoint).
    # Clipping needs the norm before the first chunk steps; read back, the host waited there for the whole backward
    # before it could queue the update. Where every chunk steps on such a device (and no fp16 scale or tensor or
    # pipeline group joins the norm), the coefficient min(1, clip / (norm + 1e-6)) is computed there too, in float64
    # as the host computes it, and multiplies the gradients as a device scalar (`_clip_on_device`); stepped on the
    # host, the gradients need it on the host, as ZeRO-Offload's do.
    @property
    def last_grad_norm(self) -> float | None:
        if isinstance(self._norm, torch.Tensor):
            self._norm = math.sqrt(float(self._norm))
        return self._norm

    @last_grad_norm.setter
    def last_grad_norm(self, value: float | None) -> None:
        self._norm = value

    # ---- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "global_steps": self.global_steps,
            "skipped_steps": self.skipped_steps,
            "last_grad_norm": self.last_grad_norm,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_steps = state["global_steps"]
        self.skipped_steps = state["skipped_steps"]
        if state.get("last_grad_norm") is not None:
            self.last_grad_norm = state["last_grad_norm"]
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])


@dataclass
class Plan:
    """One update, decided before its chunks step (the same on every rank)."""

    coef: float | torch.Tensor  # the gradient's multiplier: loss unscaling and clipping in one (a device scalar:
    # clipping on the device, `_clip_on_device`)
    used_of: list[torch.Tensor]  # per chunk: which parameters got a gradient on some rank
    fused_norm: bool  # the norm is only reported: summed while the chunks step, into `sq`
    sq: SquareSum  # the gradient's sum of squares (fused_norm)
    groups: list[dict[str, Any]]  # the param groups' hyperparameters at the update
    found_inf: torch.Tensor | None = None  # fp16 checked on the device: 1.0 where the kernels skip the update


def step_chunk(
    algorithm: Algorithm,
    group: dict[str, Any],
    zc: ZeroChunk,
    used: torch.Tensor,
    master: torch.Tensor,
    grad: torch.Tensor,
    states: list[torch.Tensor],
    coef: float | torch.Tensor,
    runs: list[tuple[int, int, int]] | None = None,
    *,
    found_inf: torch.Tensor | None = None,
) -> None:
    """The optimizer's step on one chunk's flat master weights, in place: on the runs (start, end, steps taken) of
    used parameters (`runs`, or counted now from `used`), or per parameter through the generic path."""
    if isinstance(coef, torch.Tensor) or coef != 1.0:  # a device scalar is never compared: that would wait for it
        grad.mul_(coef)
    names = algorithm.state_names
    if algorithm.generic is not None:  # any other elementwise torch optimizer, per parameter (counts the step)
        algorithm.generic.update(zc, used, group, master, grad, dict(zip(names, states)))
        return
    for a, b, steps in runs if runs is not None else zc.update_segments(used):
        seg_states = {n: st[a:b] for n, st in zip(names, states)}
        # torch.full, not torch.tensor: on a GPU a tensor made from Python data is a copy that waits for the device.
        step = torch.full((), float(steps), dtype=torch.float32, device=master.device)
        update(algorithm, group, master[a:b], grad[a:b], seg_states, step, steps, found_inf=found_inf)
