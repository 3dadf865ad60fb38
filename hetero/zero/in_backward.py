"""`"update_in_backward": true`: each chunk steps during the backward before an update, once its gradient is final.

[Note: the update in backward]
After backward, the update reads every chunk's gradient and optimizer states, steps it and writes it back. With the
states on NVMe that is most of the step's I/O (the 416M Llama of benchmarks/bigger_than_ram.py: 5.7 s of a 10 s
step), and nothing overlaps it; and every gradient the host cannot hold until then goes to NVMe and back. Yet a
chunk's reduced gradient is final long before backward ends: once its reduction completes in the backward of the
last micro-batch before an update. Stepping it then (PyTorch's optimizer-in-backward) does the same arithmetic, reads
the states while backward computes earlier layers, and consumes each gradient as it is made.

It is exact when no chunk's step depends on the whole gradient: no clipping (the global norm), no fp16 loss scaling
(the overflow check), no delayed update. The config refuses those together. What changes for the user:
  - the hyperparameters are those of the param groups when that backward starts (an LR scheduler stepped after
    `engine.step()`, as usual, has already set them; one changed between backward and `step()` is too late);
  - the parameters hold their new values once backward returns; `engine.step()` then only counts the update (the
    reported gradient norm, the step count, the LR scheduler) and must follow every backward at a boundary.

Keeping every rank in step ([Note: every rank in step]):
  - the chunks step in the reduce order, each when its reduction completes: completions may come sooner or later on
    one rank (it decides how many reductions stay in flight from its own memory), so a step issues no data-group
    collective. Stage 3 writes its own shard, stage 0 its whole chunk; stages 1-2 write their part of the parameters
    and gather the others' at the end of backward, every chunk in layout order;
  - which parameters any rank used (PyTorch's optimizers skip a parameter without a gradient) is agreed by a max
    all-reduce on the control group posted when the chunk's reduction is issued, right after the collective check
    (a point every rank reaches in the same sequence), and waited for when the chunk steps, not at the issue, where
    it held every rank at every reduction until the slowest came ([Note: checks posted, verified at the wait]);
  - the reported norm's sum of squares is all-reduced at `engine.step()`, as the update after backward does.
The manager's access trace sees the update inside backward every step alike, so its replay (prefetch, eviction)
reads the states ahead in the order they are used.

[Note: the update in backward off the autograd thread]
On a GPU, backward's hooks run on autograd's device thread, which also queues backward's kernels. A chunk stepped
there with its states in host memory first waited for its gradient's copy down (`grad_to_host`: a copy the host
does not wait for, until it reads it), which is a wait for the GPU to run everything queued before it, then ran the
optimizer's math on the host while no kernel was queued: the GPU idled through every chunk's step (one H100,
`benchmarks/gpu_race.py`: 0.418 s a step in backward against 0.422 s after it, eighth session). So where the
optimizer steps in host memory and the device's memory is its own, the chunk's math goes to a worker thread, which
waits for the gradient's copy itself (`ChunkManager.in_flight`, `Device.landed`); the autograd thread only takes the
views and pins them, and goes on queuing kernels. One chunk's math runs at a time: the next chunk's reduction first
takes the last one back (`_reap`: the parameters written from the stepped master, the gradient released), on the
autograd thread, as the manager is used from one thread only; backward's end takes the last. The worker touches
the chunk's pinned gradient, master and states only, so the arithmetic and its order are those of the update after
backward. States on NVMe keep stepping on the autograd thread (their reads and writes are the manager's), and so
does a CPU device, whose compute and update share the same cores.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from hetero.comm.handles import Handle
from hetero.errors import add_note
from hetero.memory import Tier
from hetero.zero.norms import SquareSum, sum_of_squares
from hetero.zero.protocol import UPDATE, reduce_order
from hetero.zero.segments import flags_to_step, remember_stepped
from hetero.zero.update import Plan, Updater, step_chunk

if TYPE_CHECKING:
    from hetero.zero.zero_chunk import ZeroChunk


class InBackward:
    """The update of one engine, run chunk by chunk in the backward before it; see [Note: the update in backward]."""

    def __init__(self, updater: Updater) -> None:
        self.updater = updater
        self.order = reduce_order(updater.chunks)  # the order reductions complete in: the same on every rank
        self.plan: Plan | None = None  # the update running in this backward
        self.done = False  # a backward stepped every chunk; `take` (engine.step) counts the update
        # chunk id -> which parameters some rank used, and the agreement's handle (posted at issue, waited at use)
        self._used: dict[int, tuple[torch.Tensor, Handle]] = {}
        self._next = 0  # position in `order` of the next chunk to step
        # [Note: the update in backward off the autograd thread]: the chunk whose math runs, its master, the future
        self._running: tuple[ZeroChunk, torch.Tensor, Future[tuple[torch.Tensor, float, float]]] | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._aborted = False  # this backward failed: its chunks not stepped yet stay as they are (`abort`)

    def adopt(self, order: list[ZeroChunk]) -> None:
        """The reducer's order changed ([Note: the reduce order learnt from a backward]): step in it too."""
        if {id(zc) for zc in order} != {id(zc) for zc in self.order}:
            raise RuntimeError("update_in_backward: the reduce order does not hold every chunk (internal error)")
        self.order = list(order)

    def begin(self, *, boundary: bool) -> None:
        """A backward starts; it updates when its micro-batch is the last before an update (shared by every rank)."""
        if self.done:
            raise RuntimeError(
                "update_in_backward: a backward before an update already stepped the parameters, and another "
                "backward ran before engine.step(); call engine.step() after every backward"
            )
        self._reap()
        self.plan, self._aborted = None, False
        if not boundary or not self.order:
            return
        u = self.updater
        # No scale and no clipping (the config refuses them): the norm is only reported, summed as chunks step.
        groups = [dict(g) for g in u.param_groups]
        self.plan = Plan(coef=1.0, used_of=[], fused_norm=True, sq=SquareSum(), groups=groups)
        self._next = 0
        self._used.clear()
        first = self.order[0]
        if first.placement.optim is Tier.NVME:  # the first states read while backward starts
            u.prefetch(0, first.placement.compute, self.order)

    def issued(self, zc: ZeroChunk) -> None:
        """`zc`'s reduction is being issued (its gradients of this backward are all in): agree on its used
        parameters, every rank at this point of the control group's sequence. Posted, not waited for here (a
        rendezvous at every reduction otherwise); the chunk's step waits for it."""
        if self.plan is None:
            return
        used = flags_to_step(zc)
        # A parameter any rank used has a (mean) gradient.
        self._used[id(zc)] = (used, self.updater.comm.control.all_reduce_async(used, op="max"))

    def reduced(self, zc: ZeroChunk) -> None:
        """`zc`'s reduced gradient is complete: step it now."""
        plan = self.plan
        if plan is None:
            return
        i = self._next
        if i >= len(self.order) or self.order[i] is not zc:
            raise RuntimeError(f"update_in_backward: {zc.label} completed out of the reduce order (internal error)")
        self._next += 1
        u = self.updater
        u.reduced_early(zc)  # stages 0-1: forget the early reduction, which the update after backward would skip
        used, agreed = self._used.pop(id(zc))
        agreed.wait()
        if self._aborted:
            return
        remember_stepped(zc, used)
        with zc.device.update_context():
            if not self.off_thread(zc):
                u.step_one(self.order, i, plan, used, gather=False)
                return
            self._reap()
            self._submit(zc, plan, used)

    @staticmethod
    def off_thread(zc: ZeroChunk) -> bool:
        """Whether `zc` steps on the worker ([Note: the update in backward off the autograd thread])."""
        p = zc.placement
        return zc.device.separate_memory and p.optim is Tier.HOST and p.compute is Tier.HOST

    def _submit(self, zc: ZeroChunk, plan: Plan, used: torch.Tensor) -> None:
        """Pin the chunk's gradient (still landing, maybe), master and states; its math goes to the worker."""
        u = self.updater
        m = u.manager
        landing = m.in_flight(zc.grad)  # the reduced gradient's copy down: the worker waits for it, not this thread
        grad = zc.grad_view() if landing is None else zc.grad_view(_landing_buffer(zc))
        m.pin(zc.grad)
        master, states = zc.optimizer_views()
        m.pin(zc.optim)
        pre, zc.grad_sq = zc.grad_sq, None  # taken on the device on the gradient's way down: not again
        algorithm, coef = u.algorithm, plan.coef
        # The step is counted here, in order; the generic path counts it in its own update, on the worker.
        runs = zc.update_segments(used) if algorithm.generic is None else None
        group, device = plan.groups[zc.spec.group], zc.device

        def math() -> tuple[torch.Tensor, float, float]:
            t0 = time.perf_counter()
            device.landed(landing)  # (None: nothing in flight)
            with torch.no_grad():
                sq = sum_of_squares(grad) if pre is None else pre
                step_chunk(algorithm, group, zc, used, master, grad, states, coef, runs)
            return sq, t0, time.perf_counter()

        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="hetero-update")
        self._running = (zc, master, self._worker.submit(math))

    def _reap(self) -> None:
        """Take back the chunk whose math runs: write its parameters back, release its gradient."""
        if self._running is None:
            return
        zc, master, future = self._running
        self._running = None
        u, m = self.updater, self.updater.manager
        waited = time.perf_counter()
        try:
            sq, t0, t1 = future.result()
            if self.plan is not None:
                self.plan.sq.add(sq)
            if u.on_span is not None:
                name = f"step chunk {zc.spec.index} (in backward)"
                u.on_span("optimizer", name, t0, t1)
                u.on_span("optimizer waited", name, waited, max(waited, t1))  # the autograd thread blocked
            with zc.device.update_context():
                # pinned still: making room for the shard must not evict it
                zc.write_back(master, gather=False, source=zc.optim)
        finally:
            m.unpin(zc.grad)
            m.unpin(zc.optim)
        u.release_zeroed(zc)

    def close(self) -> None:
        """Wait for the math in flight (its result dropped) and stop the worker."""
        if self._running is not None:
            zc, _, future = self._running
            self._running = None
            future.exception()
            self.updater.manager.unpin(zc.grad)
            self.updater.manager.unpin(zc.optim)
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def abort(self, error: BaseException) -> None:
        """The backward failed with `error` ([Note: a backward that fails] in engine.py): the chunk whose math runs
        finishes, no other steps. The backward then ends as any failed one (the reductions complete and their
        agreements are waited for, in the same sequence as on a rank where it went on) and its gradients are dropped.
        Where chunks had stepped, `error` says so and what to do: they stepped on this update's gradient, the others
        did not."""
        if self.plan is None:  # a backward before the update: nothing stepped, dropped as without the option
            return
        self._aborted = True
        self._reap()
        if self._next:
            add_note(
                error,
                f"hetero: update_in_backward had stepped {self._next} of {len(self.order)} chunks in this backward "
                "(the rest did not step): the parameters and optimizer states now mix two updates, on this rank "
                "at least. Load the last checkpoint (engine.load_checkpoint) before training on",
            )

    def end(self) -> None:
        """Backward is over (every reduction completed): stages 1-2 gather the parameters, in layout order."""
        if self.plan is None:
            return
        self._reap()
        if self._aborted:  # [Note: a backward that fails]: nothing gathered, the update not counted
            self.plan, self._aborted = None, False
            return
        if self._next != len(self.order):
            missing = [zc.label for zc in self.order[self._next :]]
            raise RuntimeError(f"update_in_backward: chunks {missing} did not step in backward (internal error)")
        u = self.updater
        u.check(UPDATE)
        for zc in u.chunks:
            zc.gather_params()
        self.done = True

    def take(self) -> Plan:
        """The update this backward ran, to be counted (`Updater.finish`); the next backward may update again."""
        plan = self.plan
        assert plan is not None and self.done
        self.plan = None
        self.done = False
        return plan


def _landing_buffer(zc: ZeroChunk) -> torch.Tensor:
    """The gradient buffer of a chunk whose copy down is still landing, without waiting for it: the chunk is pinned
    where it is (host memory) until the copy is done, so its payload is the buffer the copy writes."""
    acc = zc.grad.payload
    assert acc is not None and zc.grad.tier is zc.placement.compute
    return acc
