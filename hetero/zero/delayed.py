"""ZeRO-Offload's delayed parameter update (`"delayed_param_update": true`).

[Note: the delayed parameter update]
With the optimizer on the host (or streamed from NVMe through it), the update is host work and I/O that the device
waits for: nothing runs on the device between one step's backward and the next one's forward. ZeRO-Offload
(Ren et al., 2021, section 4.2) overlaps them: the host steps update t while the device runs the forward and
backward of step t+1, which therefore use the parameters of update t-1. Written out, with g(θ) a gradient at θ:

    exact:    θ_t = θ_{t-1} - U(g(θ_{t-1}))
    delayed:  θ_t = θ_{t-1} - U(g(θ_{t-2}))      (θ_{-1} = θ_0: the first two steps see the initial weights)

The master weights and optimizer states go through the same sequence of updates; only the point at which each
gradient is taken lags one update. The paper reports that this does not hurt convergence after the first few dozen
steps (their GPT-2 and BERT loss curves coincide with the exact update's), and so does hetero: the first
`delayed_param_update_warmup` updates (default 40) are exact; see [Note: warming up before delaying].

How it runs, on the thread that drives the manager (whose bookkeeping has no locks):
  - At the boundary of update t (`Updater.step`), update t-1 is finished (its remaining chunks step, it is
    counted), update t is prepared as usual (its collectives: reduction, norm, overflow, used parameters), then
    every chunk's parameters take update t-1's values, in layout order (stages 1-2 all-gather: every rank the same
    order; with `delayed_param_update_prediction` moved towards update t's first: [Note: predicting past the
    delay] in predict.py), and update t is left pending.
  - During the next forward and backward, at points paced over the step ([Note: pacing the delayed update]), it
    advances one chunk at a time: the previous chunk's step is waited for, its states are written back to NVMe (in
    the background) and its gradient zeroed; the next chunk's gradient and states are accessed, pinned, and its
    optimizer math handed to a worker thread, while chunks further on are read ahead. The math runs beside the
    device's forward and backward; every manager call stays on the driving thread, at points fixed by the model's
    own hooks, so each step's access trace is the same and its replay (prefetch, eviction) holds.
  - The new parameter values go to a chunk of their own per chunk (`param_next`, compute dtype, this rank's range,
    on the host), not into the parameters: the forward running meanwhile must see update t-1's parameters in every
    chunk on every rank (a stage-3 shard written midway would be gathered new on one rank and old on another).
  - A gradient of step t+1 arriving for a chunk whose update t has not stepped yet steps it first (`settle`): the
    gradient buffer it would add into still holds step t's gradient.
  - Anything that reads the parameters or the states outside a step (`full_state_dict`, `gathered_parameters`,
    checkpoints) completes the pending update first; so does the next update. `close` waits for the math and drops
    the rest.
The norm that is only reported (no clipping, no loss scale) is summed on the worker and all-reduced at completion,
so `last_grad_norm` and `global_steps` count an update once it is applied.

[Note: warming up before delaying]
A stale gradient costs most where the weights move fastest: early in training, where the loss falls steeply and a
learning-rate warm-up is still ramping up. ZeRO-Offload (section 4.2) therefore runs the first 40 iterations with
the exact update and delays only from then on. hetero does the same with `delayed_param_update_warmup` (K, default
40): updates 1..K are exact (stepped at their boundary, as without the option), and from update K+1 on each update
is left pending, so the forward of step K+2 is the first to see stale weights:

    θ_t = θ_{t-1} - U(g(θ_{t-1}))   for t <= K + 1        θ_t = θ_{t-1} - U(g(θ_{t-2}))   for t > K + 1

  - Which mode an update takes is decided in `Updater.step` from `global_steps` (updates applied, after the
    pending one is completed): every rank holds the same count, so every rank switches at the same boundary and
    runs the same collectives, and a checkpoint, which stores the count, resumes in the same mode. fp16 steps
    skipped for overflow are not counted, as they do not count towards `global_steps`.
  - The access trace ([Note: replaying the trace]) changes shape where an update is first left pending (after the
    warm-up; also after a resume, or after a checkpoint or a view applied the pending update): that step ends
    without the update's accesses, and the next one steps chunks during forward. The step is ended without being
    kept and the trace is dropped (`AccessTrace.forget`), so the next step is recorded afresh and the delayed steps
    after it replay it; at the switch no replay breaks off. (The one step after a checkpoint or a view in the
    delayed phase, whose forward has nothing to step, still breaks off its replay, which then falls back to
    recording, as any changed step does.)
  - A checkpoint applies the pending update before it saves, so the run that saved and the run resumed from it go
    on identically; both saw update t applied at that boundary instead of one step later (a checkpoint in the
    delayed phase is one exact update in the sequence above).

[Note: pacing the delayed update]
The hook points of a step are counted as ticks: each forward pre-hook of a module with parameters, each gradient's
arrival. Advancing one chunk per tick from the first tick on, waiting for the previous chunk's math each time, started
every chunk within the first few modules of forward, and the driving thread then waited on the worker at nearly every
module: on a 23M GPT with one compute thread, states on the host (the worker on the other core), the delayed step
took 0.321 s against 0.316 s exact, its forward 0.132 s against 0.099. So each boundary (`boundary`, every update's,
exact or delayed) sets the next update's plan from the step before it, which the next step repeats:
  - the order: chunks by the tick their first gradient arrived at (then layout order), so the chunk whose gradient
    comes back first in backward (the last layers', and a tied embedding's head) steps first and `settle` rarely has
    to force one;
  - the pacing: the k-th of n chunks starts at tick k * span / n (span: that step's ticks), and no later than the
    tick before its gradient's first arrival. The chunks spread over forward and backward, and each chunk's math has
    the compute of span / n ticks to run in before the driving thread waits for it.
Only when each chunk starts and which chunk's states are read depend on it, never a collective (those run at the
boundary), so ranks may pace differently; a step of another shape (a branch taken) only paces the next update less
well. The first delayed update is paced by the exact step before it (or, with no warm-up, the first step's).
A forward compiled with torch.compile has no ticks: the tick hook returns at once where the compiler traces it.
Traced, it took the tracer into the manager and the update's bookkeeping (110 frames compiled on the tiny GPT at
stage 0, against one), guarded on the pending update's position (a recompile at each chunk started) and cut the
model's one graph into 17 at its graph breaks. The update then paces over backward's gradient arrivals alone, which
run in autograd's engine, outside the trace (tests/test_compile.py).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hetero.memory import Chunk, TensorState, Tier
from hetero.zero import master as master_weights
from hetero.zero.norms import sum_of_squares
from hetero.zero.outside_inference import outside_inference_mode
from hetero.zero.predict import Prediction
from hetero.zero.update import Plan, Updater, step_chunk

if TYPE_CHECKING:
    from hetero.zero.zero_chunk import ZeroChunk

log = logging.getLogger("hetero.zero")


class DelayedUpdate:
    """The pending update of one engine and the hooks that advance it; see [Note: the delayed parameter update]."""

    def __init__(self, updater: Updater, model: nn.Module, predict: Prediction | None = None) -> None:
        self.updater = updater
        self.predict = predict  # [Note: predicting past the delay]; None: the parameters get the values as they are
        self._ready = False  # the last update stepped every chunk; its values are not in the parameters yet
        self.manager = updater.manager
        self.chunks = updater.chunks  # layout order
        self._layout = {id(zc): i for i, zc in enumerate(self.chunks)}
        self.plan: Plan | None = None  # the update pending, if any
        # The order chunks step in and the tick each is started at ([Note: pacing the delayed update]).
        self.order: list[ZeroChunk] = list(self.chunks)
        self._due: list[int] = [0] * len(self.chunks)
        self._ticks = 0  # hook points passed since the last boundary: forward pre-hooks and gradient arrivals
        self._first: dict[int, int] = {}  # per chunk (id): the tick its first gradient arrived at, since the boundary
        self._next = 0  # index into `order` of the next chunk to step
        # The chunk whose math runs now, and its result: (sum of squares, start, end).
        self._running: tuple[ZeroChunk, Future[tuple[torch.Tensor, float, float]]] | None = None
        self._stepped: set[int] = set()  # chunks of the pending update that have stepped (ids)
        # Per chunk: its new parameter values (compute dtype, this rank's range) until they are applied.
        self._values: dict[int, Chunk] = {}
        for zc in self.chunks:
            lo, hi = zc.kept_range()
            nxt = self.manager.new_chunk(dtype=zc.dtype, capacity=hi - lo, kind="param_next")
            nxt.add_tensor(f"{zc.spec.params[0].name}..next", (hi - lo,))
            self._values[id(zc)] = nxt
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="hetero-update")
        self._handles: list[RemovableHandle] = []

        def hook(module: nn.Module, args: object) -> None:
            # Skipped where torch.compile traces the forward ([Note: pacing the delayed update]).
            if not torch.compiler.is_compiling():
                with outside_inference_mode():  # [Note: hetero's memory under inference mode]
                    self.tick()

        for m in model.modules():
            if any(True for _ in m.parameters(recurse=False)):
                self._handles.append(m.register_forward_pre_hook(hook))

    @property
    def pending(self) -> bool:
        return self.plan is not None

    # ---- the engine's calls -------------------------------------------------------------------------------
    def boundary(self) -> None:
        """An update's boundary (every one, exact or not; no update pending): the step since the last one sets the
        next update's order and pacing ([Note: pacing the delayed update])."""
        span, first = self._ticks, self._first
        self._ticks, self._first = 0, {}
        if span == 0:
            return
        late = span + 1  # a chunk no gradient reached steps last, in layout order
        self.order = sorted(self.chunks, key=lambda zc: (first.get(id(zc), late), self._layout[id(zc)]))
        n = len(self.order)
        self._due = [min(k * span // n, first.get(id(zc), late) - 1) for k, zc in enumerate(self.order)]

    def start(self, plan: Plan) -> None:
        """Update t is prepared (its collectives done): it steps during the next forward and backward."""
        self.plan = plan
        self._next = 0
        self._stepped.clear()
        self._read_ahead(0)

    def tick(self) -> None:
        """A module with parameters is about to run forward: start the chunks that are due."""
        self._ticks += 1
        self._paced()

    def advance(self) -> None:
        """One chunk further: finish the chunk whose math runs, start the next one's."""
        if self.plan is None:
            return
        self._reap()
        if self._next < len(self.order):
            self._submit(self._next)
            self._next += 1

    def settle(self, zc: ZeroChunk) -> None:
        """A gradient of the next step arrives for `zc`: its pending step runs first (its gradient buffer is read)."""
        self._ticks += 1
        self._first.setdefault(id(zc), self._ticks)
        if self.plan is None or id(zc) not in self._values:
            return
        while id(zc) not in self._stepped:
            self.advance()
        self._paced()

    def _paced(self) -> None:
        while self.plan is not None and self._next < len(self.order) and self._due[self._next] <= self._ticks:
            self.advance()

    def complete(self) -> None:
        """From outside a step (a checkpoint, a view, `settle_update`): step what is left and give every chunk the
        pending update's exact values."""
        self.finish()
        self.apply(None)

    def finish(self) -> None:
        """Step what is left of the pending update and count it; its values wait for `apply`."""
        plan = self.plan
        if plan is None:
            return
        while self._next < len(self.order):
            self.advance()
        self._reap()
        self.plan = None
        self._ready = True
        self.updater.finish(plan)

    def apply(self, plan: Plan | None) -> None:
        """Give every chunk the finished update's values, in layout order (stages 1-2 all-gather). `plan`: the next
        update's, prepared (its gradient reduced, its multiplier known), which the values are moved towards when
        predicting ([Note: predicting past the delay]); None: the exact values."""
        if not self._ready:
            return
        self._ready = False
        predict = self.predict
        if predict is not None and plan is not None:
            predict.refresh()  # the scales of the update just finished, for the next one's fresh part and drift
        elif predict is not None:
            predict.reset()
        for zc in self.chunks:
            nxt = self._values[id(zc)]
            values = self.manager.access(nxt, Tier.HOST, write=predict is not None)
            with self.manager.pinned(nxt):  # writing the parameters back makes room: it must not evict `values`
                if predict is not None and plan is None:
                    values.copy_(zc.optimizer_views()[0])  # the values hold a prediction: the master is exact
                elif predict is not None:
                    assert plan is not None
                    predict.fresh(zc, plan.groups[zc.spec.group], values, zc.grad_view(), plan.coef)
                zc.write_back(values, clear_grad=False, source=nxt)
            nxt.set_state(nxt.slots[0], TensorState.FREE)
            if self.manager.in_flight(nxt, reads=True) is None:
                self.manager.release(nxt)
            # else the device reads it late ([Note: writing parameters up without a wait]): released here it would
            # wait for that; it stays, FREE, until its chunk steps again (`_submit` takes it back, landed by then).

    def close(self) -> None:
        """The engine closes: the pending update applied where the parameters keep their values and that needs no
        other rank, else dropped ([Note: the pending update at close]); the hooks removed."""
        if self.plan is not None or self._ready:
            self._settle_at_close()
        if self._running is not None:
            zc, future = self._running
            self._running = None
            future.exception()
            self.manager.unpin(zc.grad)
            self.manager.unpin(zc.optim)
            self.manager.unpin(self._values[id(zc)])
        self.plan = None
        self._worker.shutdown(wait=True)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _settle_at_close(self) -> None:
        # [Note: the pending update at close]
        # At stages 0-2 the model keeps its parameters' values after `engine.close()`: a loop saves it
        # (`model.state_dict()`, `save_pretrained`), evaluates it or hands it to another engine. The last `step()`
        # leaves its update pending, and close dropped it: the model lacked the last update, and with the
        # prediction held a prediction, weights no update gave. So close applies it where the parameters keep
        # their values (stages 0-2) and nothing needs another rank: at stage 0, whose ranks each step the whole
        # chunk, or with one rank in ZeRO's group. Over several ranks at stages 1-2, applying it gathers each
        # rank's part (and sums the reported norm), and close sends nothing: a rank may close after an error, and
        # the others would wait on it. There it is dropped with a warning naming what keeps it
        # (`engine.settle_update()` on every rank first). At stage 3 close releases the parameters anyway.
        stage = self.chunks[0].stage if self.chunks else 3
        if stage == 3:
            return
        if stage > 0 and self.updater.comm.size > 1:
            log.warning(
                "engine.close(): the last update (delayed_param_update) was still pending and is dropped: the "
                "model keeps the weights before it. At zero_stage %d over several ranks applying it gathers from "
                "every rank, which close does not do; call engine.settle_update() on every rank before closing "
                "(engine.full_state_dict() and save_checkpoint apply it too)",
                stage,
            )
            return
        try:
            self.complete()
        except Exception as e:  # a close after an error: free what is held, as before
            log.warning(
                "engine.close(): applying the pending update (delayed_param_update) failed: %r",
                e,
                extra={"all_ranks": True},
            )

    # ---- one chunk ----------------------------------------------------------------------------------------
    def _submit(self, i: int) -> None:
        plan = self.plan
        assert plan is not None
        zc = self.order[i]
        m = self.manager
        streamed = zc.placement.optim is Tier.NVME
        if streamed:
            self._read_ahead(i)
        nxt = self._values[id(zc)]
        if nxt.slots[0].state is TensorState.FREE:
            nxt.set_state(nxt.slots[0], TensorState.HOLD)
        # The worker reads and writes these three until _reap. Each is pinned as soon as it is accessed: making room
        # for the next one must not evict it, or the worker would write into a buffer the pool has given to another
        # chunk (under tight budgets that corrupted other chunks' swap data, caught as checksum mismatches).
        grad = zc.grad_view()
        m.pin(zc.grad)
        master, states, landing = master_weights.views_filling(zc)  # [Note: the master copied up late]
        m.pin(zc.optim)
        values = m.access(nxt, Tier.HOST)
        m.pin(nxt)
        used = plan.used_of[self._layout[id(zc)]]
        algorithm, coef, fused = self.updater.algorithm, plan.coef, plan.fused_norm
        # Taken on the device on the gradient's way to the host (hetero/zero/host_grads.py): the worker skips it.
        pre, zc.grad_sq = zc.grad_sq, None
        # The step is counted here, in order; the generic path counts it in its own update, on the worker.
        runs = zc.update_segments(used) if algorithm.generic is None else None
        group = plan.groups[zc.spec.group]
        predict = self.predict
        # Read here, on the driving thread, which owns the counts: the tensors' steps after this one, which stepped.
        steps, flags = (list(zc.param_steps), used.tolist()) if predict is not None else ([], [])
        # The drift is the next update's part ([Note: predicting past the delay]): its hyperparameters, as the
        # groups hold them now (a scheduler steps after step(), before this forward), not this update's.
        upcoming = dict(self.updater.param_groups[zc.spec.group]) if predict is not None else group

        device = zc.device

        def math() -> tuple[torch.Tensor, float, float]:
            t0 = time.perf_counter()
            device.landed(landing)  # (None: nothing in flight)
            with torch.no_grad():
                sq = (sum_of_squares(grad) if pre is None else pre) if fused else torch.zeros((), dtype=torch.float64)
                step_chunk(algorithm, group, zc, used, master, grad, states, coef, runs)
                values.copy_(master)
                if predict is not None:
                    predict.drift(zc, upcoming, states, values, steps, flags)
            return sq, t0, time.perf_counter()

        self._running = (zc, self._worker.submit(math))

    def _reap(self) -> None:
        """Wait for the chunk whose math runs, then write its states back and zero its gradient."""
        if self._running is None:
            return
        zc, future = self._running
        self._running = None
        m = self.manager
        waited = time.perf_counter()
        try:
            sq, t0, t1 = future.result()
        finally:
            m.unpin(zc.grad)
            m.unpin(zc.optim)
            m.unpin(self._values[id(zc)])
        if self.plan is not None and self.plan.fused_norm:
            self.plan.sq.add(sq)  # one on the GPU is read at the update's end
        if self.updater.on_span is not None:
            name = f"step chunk {zc.spec.index} (delayed)"
            self.updater.on_span("optimizer", name, t0, t1)
            self.updater.on_span("optimizer waited", name, waited, max(waited, t1))  # the driving thread blocked
        zc.zero_grad()
        self._stepped.add(id(zc))
        if zc.placement.optim is Tier.NVME:
            self.updater.release_stepped(zc)
            self._read_ahead(self._next)  # `zc` is order[_next - 1]: one chunk's math runs at a time
        else:
            self.updater.release_zeroed(zc)

    def _read_ahead(self, i: int) -> None:
        if i < len(self.order) and self.order[i].placement.optim is Tier.NVME:
            self.updater.prefetch(i, self.order[i].placement.compute, self.order)
