"""`hetero.profile(engine, out_dir)`: record where every byte of a run lived, when, and what moved.

[Note: observing through hook points]
The profiler subscribes on enter and unsubscribes on exit, so a run that is not profiled pays nothing. It observes
only through the hook points its subjects offer: the engine's `events` (the phases of a step, and close, to stop
before the engine does), the manager's `events` ("move": a `MoveEvent` per finished move; "done": a call into the
manager returned, every chunk it touched now labelled with its tier), the tier ledgers' `observers` (every byte
hetero holds passes through a ledger, so the recorded per-tier series is exact and its maximum is the ledger's
peak), the manager's counters (prefetch hits and misses, evictions), module forward hooks and saved-tensor hooks
(activations, attributed to the module running). On entry the ledgers' peaks are reset, so the summary's peaks and
`engine.memory_stats()` peaks cover the same window.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetero.device import allocated_bytes
from hetero.errors import ConfigError
from hetero.memory import Tier
from hetero.memory.manager import MoveEvent
from hetero.profiler.activations import storage_key
from hetero.profiler.kinds import by_kind, holds
from hetero.profiler.micro_batches import MicroBatches
from hetero.profiler.rss import RssSampler

log = logging.getLogger("hetero.profiler")

# Seconds between by-kind samples after manager operations, at most: a burst of operations (an update, evictions)
# is sampled at its end; module boundaries, steps and new peaks are always sampled.
SAMPLE_INTERVAL = 1e-3
RSS_INTERVAL = 5e-3  # seconds between samples of the process's RSS


@dataclass(frozen=True)
class MoveRecord:
    chunk: int
    kind: str
    src: str
    dst: str
    nbytes: int
    start: float  # seconds since the recording began
    end: float
    prefetch: bool

    @property
    def seconds(self) -> float:
        return max(self.end - self.start, 1e-9)

    @property
    def bandwidth(self) -> float:
        """Bytes per second achieved by this move."""
        return self.nbytes / self.seconds


@dataclass
class ModuleSpan:
    name: str
    phase: str  # "forward" or "backward"
    start: float
    end: float = 0.0
    saved: int = 0  # forward: bytes saved for backward by this module and its children; backward: bytes released
    allocated: int = 0  # CUDA: allocator bytes held after forward minus before (0 on the CPU)


@dataclass
class Peak:
    bytes: int = 0
    time: float = 0.0
    where: str = ""  # the module and phase running then
    holders: list[tuple[str, str, int]] = field(default_factory=list)  # (holder, kind, bytes), largest first


class Profile:
    """Records one engine's memory over a window of training; writes summary.txt, summary.json, trace.json and
    timeline.png into out_dir on exit. Use as `with hetero.profile(engine, out_dir) as prof:`."""

    def __init__(
        self,
        engine: Any,
        out_dir: str | os.PathLike,
        *,
        max_steps: int | None = None,
        plot: bool = True,
        on_stop: Callable[[Profile], None] | None = None,
        per_rank: bool = True,
    ) -> None:
        self.engine = engine
        # Every rank of a job profiles its own process: each writes into out_dir/rank<global rank>, where they would
        # otherwise overwrite each other's files (per_rank=False: the caller chose the folder per rank itself).
        world = job_of(engine)
        self.rank = world.global_rank(world.rank)
        self.out_dir = Path(out_dir) / f"rank{self.rank}" if per_rank and world.size > 1 else Path(out_dir)
        self.max_steps = max_steps  # stop by itself after this many optimizer steps (tools/memprof.py)
        self.plot = plot
        self.on_stop = on_stop
        self.manager = engine.manager
        self.active = False
        self.finished = False
        # Recorded data; times are seconds since start.
        self.t0 = 0.0
        self.t0_unix = 0.0  # the start on the system clock, which ranks share: their traces line up by it
        self.series: dict[str, list[tuple[float, int]]] = {t.label: [] for t in Tier}  # exact ledger totals
        self.samples: list[tuple[float, dict[str, dict[str, int]]]] = []  # by-kind breakdown per tier
        self.moves: list[MoveRecord] = []
        self.spans: list[tuple[str, str, float, float]] = []  # (track, name, start, end): collectives, optimizer math
        self.modules: list[ModuleSpan] = []
        self.steps: list[tuple[float, int]] = []  # (time, global step) after each optimizer update
        self.phases: list[tuple[str, float, float]] = []  # (forward / backward / update, start, end)
        self.peaks: dict[str, Peak] = {t.label: Peak() for t in Tier}
        self.activation_series: list[tuple[float, int]] = []  # saved-for-backward bytes held
        self.counters: dict[str, int] = {}  # the manager's counters over the window
        self.stats: dict[str, Any] = {}  # engine.memory_stats() at the end
        self.batches = MicroBatches(engine)  # engine.step() calls, the micro-batches they stepped on
        self.duration = 0.0  # seconds recorded
        self._undo: list[Callable[[], None]] = []
        self._stack: list[ModuleSpan] = []  # forward spans open now
        self._last_sample = -1.0
        self._dirty = False  # a ledger changed since the last by-kind sample
        self._changes: Counter[Tier] = Counter()  # ledger changes per tier
        self._relabel: dict[Tier, int] = {}  # tiers whose peak was reached inside a manager operation under way
        self._sampled_inside = False  # a by-kind sample was taken at a peak inside the manager operation under way
        self._counters0: Counter[str] = Counter()
        self._steps0 = 0
        self._saved: dict[int, tuple[str, int, torch.Tensor]] = {}  # storage key -> (owner, bytes, tensor)
        self._released: set[int] = set()
        self._held = 0  # activation bytes saved and not yet used by backward
        self._saved_total = 0  # activation bytes saved in this micro-batch's forward
        self._params: set[int] = set()
        self._bwd: dict[str, ModuleSpan] = {}  # module -> its backward span (first to last use of what it saved)
        self._phase_start: float | None = None
        self._backward_start: float | None = None  # when the backward in progress began
        self._update_start = 0.0  # when the update in progress began
        self._stop_after_step = False  # max_steps reached: stop once the step's bookkeeping is done
        self._device = engine.device.torch_device
        self.rss_series: list[tuple[float, int]] = []  # the process's RSS ([Note: what the ledgers do not see])
        self.rss_interval = RSS_INTERVAL
        self._rss: RssSampler | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def __enter__(self) -> Profile:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.active or self.finished:
            raise RuntimeError("a Profile records one window: make a new one to record again")
        check_writable(self.out_dir, what="profile out_dir")
        self.active = True
        self.manager.synchronize()
        self.manager.reset_peaks()
        self.t0 = time.perf_counter()
        self.t0_unix = time.time()
        self._counters0 = Counter(self.manager.counters)
        self._steps0 = self.engine.global_steps
        self._params = {storage_key(p) for p in self.engine.module.parameters()}
        for tier, ledger in self.manager.ledgers.items():
            ledger.observers.append(self._on_ledger)
            self._undo.append(lambda ledger=ledger: ledger.observers.remove(self._on_ledger))
            self.series[tier.label].append((0.0, ledger.used))
            self._new_peak(tier, ledger.used, 0.0)
        self._undo.append(self.manager.events.subscribe("move", self._on_move))
        self._undo.append(self.manager.events.subscribe("done", self._after_manager))
        self._hook_modules(self.engine.module)
        self._undo += self.batches.subscribe(self.engine.events)  # before _micro_step, which may stop: counted first
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._undo.append(lambda: hooks.__exit__(None, None, None))
        for name, fn in (
            ("backward_begin", self._backward_begin),
            ("backward_end", self._backward_end),
            ("update_begin", self._update_begin),
            ("update_end", self._update_end),
            ("micro_step", self._micro_step),
            ("close", self._stop_in_engine),
            ("span", self._on_span),
        ):
            self._undo.append(self.engine.events.subscribe(name, fn))
        self._sample(0.0, force=True)
        self._rss = RssSampler(self.t0, interval=self.rss_interval)
        self._rss.start()

    def stop(self) -> None:
        """Remove every hook, then write the outputs. Idempotent."""
        if not self.active:
            return
        self.active = False
        now = self._now()
        self.manager.synchronize()  # moves in flight finish, and are recorded, before the hooks go
        self._sample(self._now(), force=True)
        while self._undo:
            self._undo.pop()()
        if self._rss is not None:
            self._rss.stop()
            self.rss_series, self._rss = self._rss.series, None
        self._stack.clear()
        self._saved.clear()
        self.counters = {k: v - self._counters0.get(k, 0) for k, v in self.manager.counters.items()}
        self.stats = self.engine.memory_stats()  # the manager's, with the tiled weights ([Note: computing on tiles])
        self.duration = now
        self.finished = True
        self.write()
        if self.on_stop is not None:
            self.on_stop(self)

    def write(self) -> None:
        from hetero.profiler.summary import summary_data, summary_text
        from hetero.profiler.trace import chrome_trace
        from hetero.progress import bar

        self.out_dir.mkdir(parents=True, exist_ok=True)
        # A long recording takes a while to write (a minute for hundreds of steps, the plot most): a bar says so
        shown = bar(3 + self.plot, "hetero.profile: writing", unit="file", rank=self.rank,
                    config=getattr(getattr(self.engine, "config", None), "progress", True))  # fmt: skip
        data = summary_data(self)
        (self.out_dir / "summary.json").write_text(json.dumps(data, indent=1))
        (self.out_dir / "summary.txt").write_text(summary_text(data))
        shown.update(2)
        (self.out_dir / "trace.json").write_text(json.dumps(chrome_trace(self)))
        shown.update()
        if self.plot:
            try:
                from hetero.profiler.plot import timeline_png
            except ImportError:  # matplotlib is an optional dependency (hetero[profile])
                log.warning("matplotlib is not installed: timeline.png not written (pip install matplotlib)")
            else:
                timeline_png(self, self.out_dir / "timeline.png")
        shown.close()

    # ---- ledgers and the manager ---------------------------------------------------------------------------
    def _on_ledger(self, tier: Tier, used: int) -> None:
        t = self._now()
        self.series[tier.label].append((t, used))
        self._dirty = True
        self._changes[tier] += 1
        if used > self.peaks[tier.label].bytes:
            self._new_peak(tier, used, t)
            self._sample(t, force=True)
            self._sampled_inside = True
            self._relabel[tier] = self._changes[tier]

    def _after_manager(self) -> None:
        """Sample the by-kind breakdown when a manager operation that changed a ledger returns: by then every chunk
        it touched is labelled with its tier (inside, a buffer is taken before its chunk is marked resident)."""
        for tier, change in list(self._relabel.items()):
            # A peak reached inside the operation: the buffer that made it was taken before its chunk was marked
            # resident. If the ledger has not changed since, list the holders again, now labelled.
            del self._relabel[tier]
            if self._changes[tier] == change:
                peak = self.peaks[tier.label]
                self._new_peak(tier, peak.bytes, peak.time, where=peak.where)
        inside, self._sampled_inside = self._sampled_inside, False
        if inside and not self._dirty:
            # The sample at that peak labelled the buffer being taken "staging" (its chunk was not resident yet).
            # No ledger changed since: the bytes now are the bytes then, and now every chunk has its label.
            self.samples[-1] = (self.samples[-1][0], by_kind(self.manager))
        elif self._dirty:
            # Forced after a peak sample: the rate limit would leave that mislabelled sample standing for a while.
            self._sample(self._now(), force=inside)

    def _new_peak(self, tier: Tier, used: int, t: float, where: str | None = None) -> None:
        holders: list[tuple[str, str, int]] = []
        for c in self.manager.chunks:
            if holds(c, tier):
                names = ", ".join(s.name for s in c.slots[:2]) + (", ..." if len(c.slots) > 2 else "")
                holders.append((f"chunk {c.id} ({names})", c.kind, c.nbytes))
        ledger = self.manager.ledgers[tier]
        if ledger.cached:
            holders.append(("free buffers kept for reuse", "cached", ledger.cached))
        rest = used - sum(h[2] for h in holders)
        if rest > 0:  # taken by a move or an allocation that is under way (staging, a buffer being filled)
            holders.append(("buffers being allocated or staged", "staging", rest))
        holders.sort(key=lambda h: -h[2])
        if where is None:
            where = f"{self._stack[-1].phase} of {self._stack[-1].name}" if self._stack else self._phase_name()
        self.peaks[tier.label] = Peak(bytes=used, time=t, where=where, holders=holders)

    def _sample(self, t: float, *, force: bool = False) -> None:
        if not force and t - self._last_sample < SAMPLE_INTERVAL:
            return  # still dirty: the next operation or module boundary samples it
        self._last_sample = t
        self._dirty = False
        self.samples.append((t, by_kind(self.manager)))

    # ---- moves --------------------------------------------------------------------------------------------
    def _on_span(self, track: str, name: str, start: float, end: float) -> None:
        self.spans.append((track, name, start - self.t0, end - self.t0))

    def _on_move(self, e: MoveEvent) -> None:
        self.moves.append(
            MoveRecord(
                e.chunk_id, e.kind, e.src.label, e.dst.label, e.nbytes, e.start - self.t0, e.end - self.t0, e.prefetch
            )
        )

    # ---- modules and activations --------------------------------------------------------------------------
    def _hook_modules(self, root: nn.Module) -> None:
        for name, module in root.named_modules():
            label = name or type(module).__name__
            pre = module.register_forward_pre_hook(lambda m, a, label=label: self._enter(label), prepend=True)
            post = module.register_forward_hook(lambda m, a, o, label=label: self._exit(label))
            self._undo.append(pre.remove)
            self._undo.append(post.remove)

    def _enter(self, label: str) -> None:
        t = self._now()
        if not self._stack and self._phase_start is None:
            self._phase_start = t  # a forward begins
        if self._dirty:
            self._sample(t, force=True)
        span = ModuleSpan(label, "forward", t, saved=self._saved_total, allocated=allocated_bytes(self._device))
        self._stack.append(span)

    def _exit(self, label: str) -> None:
        if not self._stack or self._stack[-1].name != label:
            return  # a hook raised in between: the stack is unreliable for this forward
        span = self._stack.pop()
        span.end = self._now()
        span.saved = self._saved_total - span.saved
        span.allocated = allocated_bytes(self._device) - span.allocated
        self.modules.append(span)
        if self._dirty:
            self._sample(span.end, force=True)

    def _pack(self, t: torch.Tensor) -> tuple[str, int, torch.Tensor]:
        key = storage_key(t)
        owner = self._stack[-1].name if self._stack else ""
        if key not in self._saved and key not in self._params:
            n = t.untyped_storage().nbytes()
            self._saved[key] = (owner, n, t)
            self._held += n
            self._saved_total += n
            self.activation_series.append((self._now(), self._held))
        # Detached: the packed object must not hold the tensor's grad_fn, which holds it (a cycle for saved outputs).
        return owner, key, t.detach()

    def _unpack(self, packed: tuple[str, int, torch.Tensor]) -> torch.Tensor:
        owner, key, t = packed
        now = self._now()
        span = self._bwd.get(owner)
        if span is None:
            span = self._bwd[owner] = ModuleSpan(owner or "(outside modules)", "backward", now)
            self.modules.append(span)
        span.end = now
        if key in self._saved and key not in self._released:
            # Autograd frees what a node saved once the node has run: count the bytes gone at their first use.
            self._released.add(key)
            n = self._saved[key][1]
            span.saved += n
            self._held -= n
            self.activation_series.append((now, self._held))
        return t

    # ---- engine -------------------------------------------------------------------------------------------
    def _backward_begin(self) -> None:
        start = self._now()
        if self._phase_start is not None:
            self.phases.append(("forward", self._phase_start, start))
            self._phase_start = None
        self._backward_start = start

    def _backward_end(self) -> None:
        end = self._now()
        start = self._backward_start if self._backward_start is not None else end
        self._backward_start = None
        self.phases.append(("backward", start, end))
        self._end_micro_batch()

    def _update_begin(self) -> None:
        self._update_start = self._now()

    def _update_end(self) -> None:
        end = self._now()
        if self.engine.global_steps > (self.steps[-1][1] if self.steps else self._steps0):
            self.phases.append(("update", self._update_start, end))
            self.steps.append((end, self.engine.global_steps))
            self._sample(end, force=True)
            if self.max_steps is not None and self.engine.global_steps - self._steps0 >= self.max_steps:
                self._stop_after_step = True

    def _micro_step(self) -> None:
        if self._stop_after_step:
            self._stop_in_engine()

    def _stop_in_engine(self) -> None:
        """Stop from inside engine.step or engine.close (max_steps, or the engine closing): outputs that cannot be
        written (the disk filled, the folder went away) lose the profile, not the training run it observed."""
        try:
            self.stop()
        except OSError as e:
            log.error("the memory profile could not be written to %s (%s); training goes on", self.out_dir, e)

    def _end_micro_batch(self) -> None:
        # What backward did not use is freed with the graph.
        self._saved.clear()
        self._released.clear()
        self._bwd.clear()
        self._saved_total = 0
        if self._held:
            self._held = 0
            self.activation_series.append((self._now(), 0))

    def _phase_name(self) -> str:
        if self._phase_start is not None:
            return "forward, outside any module"
        return self.phases[-1][0] if self.phases else "outside a step"

    def _now(self) -> float:
        return time.perf_counter() - self.t0


def check_writable(folder: Path, *, what: str) -> None:
    """Make `folder` and write a file there, or raise a ConfigError naming it: the outputs are written when the
    window ends, and a folder that cannot take them should stop the run before it, not after it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(
            f"{what} {str(folder)!r}: cannot write there ({e.strerror or e}); choose a writable directory"
        ) from None


def job_of(engine: Any) -> Any:
    """The Comm of every rank of the engine's job (its own comm is the data-parallel group)."""
    mesh = getattr(engine, "mesh", None)
    return mesh.world if mesh is not None else engine.comm


def profile(engine: Any, out_dir: str | os.PathLike, **kwargs: Any) -> Profile:
    """Profile an engine's memory: `with hetero.profile(engine, "prof") as prof:` around training steps. On exit it
    writes summary.txt (and .json), timeline.png and trace.json (Perfetto / chrome://tracing) into out_dir; in a job
    of several ranks, each into out_dir/rank<global rank>."""
    return Profile(engine, out_dir, **kwargs)
