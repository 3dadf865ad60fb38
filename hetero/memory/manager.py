"""The chunk manager: where every chunk lives, and every move between tiers.

The manager is driven from one thread (the training loop's). Copies and swap I/O run on worker threads and report
back through futures; all bookkeeping (ledgers, chunk states, the trace) changes on the driving thread only, when a
move is started or seen finished, so no lock guards it.

[Note: making room]
A move reserves its bytes on the destination tier when it starts and gives back the source's bytes when it
finishes; a ledger therefore never undercounts, and a tier never exceeds its budget, even with many moves in
flight. To make room on a tier the manager, in this order: reaps moves that have finished; frees cached
buffers; waits for moves already leaving the tier; evicts a victim (the furthest next use by the trace, else the
least recently used) one tier down, where a chunk whose tensors are all FREE is simply released. Prefetch makes room
the same way but never blocks: it starts evictions and tries again at the next access (see `policy.py`).

[Note: prefetch needs room first]
A prefetch cannot start its copy until the chunks it displaces have left (the ledger, like the memory, must not
go over budget in between). So each access looks `prefetch_depth` chunks ahead: for the nearer ones it starts the
copy, whose room was freed by evictions started at an earlier access; for the farther ones it only starts those
evictions, earmarking the bytes on their way out so that two prefetches do not count the same room. The lead of a
prefetch over its use is therefore `prefetch_depth - 1` accesses once the device is full.

[Note: reads chained behind write-backs]
When the host is full of dirty chunks, the room a read from NVMe needs appears only once a write-back has finished,
which is usually while the training thread is computing, not calling into the manager: a prefetch that waits for
the next access to start would start late or not at all (and the access then reads inline). So a prefetch from NVMe
to the host that finds no room may claim a write-back in flight of the same size and read into that chunk's host
buffer as soon as its write is done, on the worker thread. The buffer changes hands without going back to the pool:
the ledger keeps its bytes, now the incoming chunk's, so the budget holds throughout. If the write-back fails, its
chunk keeps the buffer and the chained read fails too (the chunk stays on NVMe). A chained job waits only for a job
submitted before it, and the workers take jobs in order, so the wait cannot deadlock.

[Note: transient chunks]
A transient chunk holds, on the device, a copy of data whose home is elsewhere (ZeRO-3's gathered parameters: the
home is each rank's shard). Tensors outside hetero view its payload: module parameters, and views autograd saved in
forward for backward. So its device payload is always the same storage object (`chunk.kept`): dropping the chunk
resizes that storage to zero bytes, and giving it memory again grows the same storage back, so every view of it is
valid again once the bytes are back, without anyone re-pointing it. A transient chunk whose tensors are all FREE is
released, never copied, when room is needed; one whose tensors hold data (gathered, but not being computed on) is
moved down like any chunk, and coming back to the device its bytes are copied into the regrown storage. Whether the
data is gathered is the owner's decision, taken from state every rank shares; where its bytes sit is this rank's.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from hetero.config import MemoryConfig, format_size, parse_size
from hetero.device import Device, make_device
from hetero.errors import TierOutOfMemoryError
from hetero.memory.chunk import Chunk, Move
from hetero.memory.policy import AccessTrace, choose_victim
from hetero.memory.pool import BufferPool
from hetero.memory.states import ChunkState, TensorState
from hetero.memory.tier import Tier, TierLedger

log = logging.getLogger("hetero.memory")


@dataclass(frozen=True)
class MoveEvent:
    """A finished move, as observers (the profiler) see it."""

    chunk_id: int
    kind: str
    src: Tier
    dst: Tier
    nbytes: int
    start: float  # time.perf_counter() when the worker began the copy
    end: float  # when the bytes were in place
    prefetch: bool


class ChunkManager:
    """Places chunks on the device, host and NVMe tiers under per-tier budgets."""

    def __init__(
        self,
        *,
        device: Device | None = None,
        device_budget: int | str | None = None,
        host_budget: int | str | None = None,
        nvme_dir: str | None = None,
        nvme_budget: int | str | None = None,
        prefetch_depth: int = 2,
        move_workers: int = 2,
        nvme_options: dict[str, Any] | None = None,
    ) -> None:
        self.device = device if device is not None else make_device()
        device_budget, host_budget, nvme_budget = (
            None if b is None else parse_size(b, key=k)
            for b, k in ((device_budget, "device_budget"), (host_budget, "host_budget"), (nvme_budget, "nvme_budget"))
        )
        self._store = None  # the NVMe swap store, when nvme_dir is given
        if nvme_dir is not None:
            from hetero.memory.nvme import NvmeStore

            self._store = NvmeStore(nvme_dir, budget=nvme_budget, **(nvme_options or {}))
        self._store_dir = nvme_dir
        self.ledgers = {
            Tier.DEVICE: TierLedger(Tier.DEVICE, _default_device_budget(self.device, device_budget)),
            Tier.HOST: TierLedger(Tier.HOST, _default_host_budget(host_budget)),
            Tier.NVME: TierLedger(Tier.NVME, self._nvme_budget(nvme_budget)),
        }
        # On a CPU compute device its chunks take page-aligned memory as the host's do, so that checkpoint loads and
        # the NVMe tier can read into them with O_DIRECT in place (torch.empty is only 64-byte aligned).
        dev = self.device
        shared = not dev.separate_memory
        self.pools = {  # reused chunk buffers, per tier
            Tier.DEVICE: BufferPool(
                dev.empty_host if shared else dev.empty_bytes,
                self.ledgers[Tier.DEVICE],
                free=dev.free_host if shared else dev.free_bytes,
                on_release=dev.released,
            ),
            Tier.HOST: BufferPool(dev.empty_host, self.ledgers[Tier.HOST], free=dev.free_host, on_release=dev.released),
        }
        self.trace = AccessTrace()  # recorded chunk order: prefetch and OPT eviction
        self.prefetch_depth = prefetch_depth  # chunks to move ahead of use while the trace replays
        self.observers: list[Callable[[MoveEvent], None]] = []  # called on every finished move
        self._chunks: dict[int, Chunk] = {}  # every live chunk by id
        self._moving: dict[int, Chunk] = {}  # chunks with a move in flight
        self._next_id = 0
        self._clock = 0  # access counter, for LRU
        self._workers = ThreadPoolExecutor(move_workers, thread_name_prefix="hetero-move")
        self._closed = False
        self.counters: Counter[str] = Counter()  # accesses, prefetch hits/misses, evictions, moves, ...
        self.moved: Counter[tuple[Tier, Tier]] = Counter()  # bytes moved per (src, dst)
        self.wait_seconds = 0.0  # time the driving thread spent waiting for moves
        # Called at every access and step_begin, before anything moves: automatic placement adjusts the device
        # budget there (hetero/memory/auto.py).
        self.before_access: Callable[[], None] | None = None
        self.on_step_begin: Callable[[], None] | None = None
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._store)

    @classmethod
    def from_config(
        cls, memory: MemoryConfig, *, device: Device | None = None, prefetch_depth: int = 2
    ) -> ChunkManager:
        return cls(
            device=device,
            device_budget=memory.device_budget,
            host_budget=memory.host_budget,
            nvme_dir=memory.nvme_dir,
            nvme_budget=memory.nvme_budget,
            prefetch_depth=prefetch_depth,
        )

    # ---- chunks -------------------------------------------------------------------------------------------
    def new_chunk(self, *, dtype: torch.dtype, capacity: int, kind: str = "param", transient: bool = False) -> Chunk:
        """An EMPTY chunk; add tensors to it, then `access` it on a tier to give it memory.

        transient: the payload is a device-side cache of data kept elsewhere; see [Note: transient chunks].
        """
        if capacity <= 0:
            raise ValueError(f"chunk capacity must be positive, got {capacity}")
        chunk = Chunk(id=self._next_id, dtype=dtype, capacity=capacity, kind=kind, transient=transient)
        self._next_id += 1
        self._chunks[chunk.id] = chunk
        return chunk

    @property
    def chunks(self) -> list[Chunk]:
        return list(self._chunks.values())

    def free_chunk(self, chunk: Chunk) -> None:
        """Forget a chunk altogether, releasing its memory on every tier."""
        self._wait(chunk)
        self._drop_payload(chunk)
        self._drop_nvme_copy(chunk)
        del self._chunks[chunk.id]

    # ---- access and movement ------------------------------------------------------------------------------
    def access(self, chunk: Chunk, tier: Tier = Tier.DEVICE, *, write: bool = True) -> torch.Tensor | None:
        """Make the chunk resident on `tier` and return its payload (None on NVMe).

        Waits only for this chunk's own move. The payload stays where it is until the next call into the manager;
        put its tensors in COMPUTE, or pin it, to keep it there beyond that. write=False promises the caller only
        reads the payload, so a clean swap copy stays valid and a later eviction costs no write.
        """
        self._check_open()
        self._poll()
        if self.before_access is not None:
            self.before_access()
        self._clock += 1
        self.counters["accesses"] += 1
        self.trace.record(chunk.id, tier)
        if chunk.state is ChunkState.EMPTY:
            self._allocate(chunk, tier)
        else:
            arriving = chunk.tier == tier if chunk.move is None else chunk.move.dst == tier
            if chunk.prefetched and arriving:
                self.counters["prefetch_hits"] += 1
            self._wait(chunk)
            if chunk.tier != tier:
                self.counters["prefetch_misses"] += 1
                self._start_move(chunk, tier, blocking=True, inline=True)
                self._wait(chunk)
        chunk.prefetched = False
        if write:
            chunk.dirty = True
        chunk.last_access = self._clock
        self._prefetch_ahead(protect={chunk.id})
        return chunk.payload

    def move(self, chunk: Chunk, tier: Tier, *, wait: bool = True) -> None:
        """Move a chunk to a tier explicitly (e.g. offload it now), without recording an access."""
        self._check_open()
        self._poll()
        self._wait(chunk)
        if chunk.state is ChunkState.EMPTY or chunk.tier == tier:
            return
        self._start_move(chunk, tier, blocking=True, inline=wait)
        if wait:
            self._wait(chunk)

    def prefetch(self, chunks: Iterable[Chunk], tier: Tier = Tier.DEVICE, *, keep: Iterable[Chunk] = ()) -> None:
        """Start moving chunks to `tier` and return at once; a later `access` waits only for what it needs.

        keep: chunks that making room must not evict (e.g. the others of the list, needed as soon)."""
        self._check_open()
        self._poll()
        protect = {c.id for c in keep}
        for chunk in chunks:
            # While the trace replays, evict only what is needed after this chunk (as the trace's own prefetch).
            horizon = self.trace.next_use(chunk.id) if self.trace.replaying else None
            self._try_prefetch(chunk, tier, horizon=horizon, protect=protect)

    def pin(self, chunk: Chunk) -> None:
        """Keep a chunk where it is until `unpin` (no eviction, no move), without marking it written."""
        chunk.pins += 1

    def unpin(self, chunk: Chunk) -> None:
        if chunk.pins <= 0:
            raise RuntimeError(f"{chunk.describe()} is not pinned")
        chunk.pins -= 1

    @contextlib.contextmanager
    def pinned(self, *chunks: Chunk) -> Iterator[None]:
        """Keep chunks where they are (no eviction, no move) for the duration, without marking them written."""
        for c in chunks:
            c.pins += 1
        try:
            yield
        finally:
            for c in chunks:
                c.pins -= 1

    def release(self, chunk: Chunk) -> None:
        """Drop a chunk's payload (every tensor must be FREE); it becomes EMPTY and holds no memory."""
        if not chunk.all_free:
            held = [s.name for s in chunk.slots if s.state is not TensorState.FREE]
            raise ValueError(f"cannot release {chunk.describe()}: tensors still hold data: {held[:5]}")
        self._wait(chunk)
        self._drop_payload(chunk)
        self._drop_nvme_copy(chunk)

    def set_budget(self, tier: Tier, budget: int) -> int:
        """Change a tier's budget (automatic placement), evicting what no longer fits. Chunks that cannot move now
        (being computed on, pinned) stay: the budget then settles at what they hold. Returns the budget set."""
        ledger = self.ledgers[tier]
        ledger.budget = max(0, budget)
        if ledger.free < 0:
            try:
                self._make_room(tier, 0, set(), blocking=True)
            except TierOutOfMemoryError:
                ledger.budget = ledger.used
        return ledger.budget

    def synchronize(self) -> None:
        """Wait for every move in flight."""
        for chunk in list(self._moving.values()):
            self._wait(chunk)

    # ---- steps and trace ----------------------------------------------------------------------------------
    def step_begin(self) -> None:
        if self.on_step_begin is not None:
            self.on_step_begin()
        self.trace.step_begin()
        self._prefetch_ahead(protect=set())

    def step_end(self) -> None:
        self.trace.step_end()

    # ---- stats --------------------------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, Any]:
        """Per tier: current, cached, peak and budget bytes; bytes moved per tier pair; counters."""
        self._poll()
        out: dict[str, Any] = {}
        for tier, ledger in self.ledgers.items():
            out[tier.label] = {
                "current": ledger.current,
                "cached": ledger.cached,
                "peak": ledger.peak,
                "budget": ledger.budget,
            }
        # The swap store's own O_DIRECT staging (bounded, outside the ledgers: only unaligned I/O uses it).
        out["nvme"]["staging"] = self._store.staging_bytes if self._store is not None else 0
        out["moved"] = {f"{s.label}->{d.label}": n for (s, d), n in sorted(self.moved.items())}
        out["counters"] = dict(self.counters)
        out["wait_seconds"] = self.wait_seconds
        return out

    def reset_peaks(self) -> None:
        for ledger in self.ledgers.values():
            ledger.reset_peak()

    def close(self) -> None:
        """Wait for moves, free every buffer, delete swap files. Idempotent."""
        if self._closed:
            return
        try:
            self.synchronize()
        finally:
            self._closed = True
            for chunk in list(self._chunks.values()):
                self._drop_payload(chunk)
                if chunk.kept is not None:
                    self.device.free_bytes(chunk.kept)
            self._chunks.clear()
            for pool in self.pools.values():
                pool.trim()
            self._finalizer()

    def __enter__(self) -> ChunkManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals: allocation ----------------------------------------------------------------------------
    def _allocate(self, chunk: Chunk, tier: Tier) -> None:
        if tier is Tier.NVME:
            raise ValueError(f"{chunk.describe()} is EMPTY: give it memory on the device or host tier first")
        if chunk.transient and tier is not Tier.DEVICE:
            raise ValueError(f"{chunk.describe()} is transient: it lives on the device tier only")
        self._make_room(tier, chunk.nbytes, {chunk.id}, blocking=True)
        chunk.payload = self._new_buffer(tier, chunk)
        chunk.tier = tier
        chunk.transition(ChunkState.RESIDENT)

    def _new_buffer(self, tier: Tier, chunk: Chunk) -> torch.Tensor:
        if chunk.transient and tier is Tier.DEVICE:
            # [Note: transient chunks] The same storage object grows back. It takes no pooled buffer, so a cached one
            # that made room must be freed for real.
            ledger = self.ledgers[tier]
            if ledger.free < chunk.nbytes:
                self.pools[tier].trim(chunk.nbytes - ledger.free)
            ledger.take(chunk.nbytes)
            if chunk.kept is None:
                chunk.kept = self.device.empty_bytes(chunk.nbytes).view(chunk.dtype)
            else:
                self.device.regrow(chunk.kept, chunk.nbytes)
            return chunk.kept
        return self.pools[tier].acquire(chunk.nbytes).view(chunk.dtype)

    def _free_buffer(self, tier: Tier, buf: torch.Tensor, chunk: Chunk | None = None) -> None:
        if chunk is not None and chunk.transient and tier is Tier.DEVICE:
            self.ledgers[tier].give(chunk.nbytes)
            buf.untyped_storage().resize_(0)  # frees the memory; views of it stay valid objects
            return
        self.pools[tier].release(buf)

    def _drop_payload(self, chunk: Chunk) -> None:
        if chunk.state is ChunkState.EMPTY:
            return
        if chunk.payload is not None:
            self._free_buffer(chunk.tier, chunk.payload, chunk)
        chunk.payload = None
        chunk.tier = None
        chunk.transition(ChunkState.EMPTY)

    def _drop_nvme_copy(self, chunk: Chunk) -> None:
        if chunk.on_nvme:
            assert self._store is not None
            self._store.discard(chunk.id)
            self.ledgers[Tier.NVME].give(chunk.nbytes)
            chunk.on_nvme = False

    def _nvme_budget(self, nvme_budget: int | None) -> int:
        if self._store is None:
            return 0
        if nvme_budget is not None:
            return nvme_budget
        return shutil.disk_usage(self._store_dir).free

    # ---- internals: moves ---------------------------------------------------------------------------------
    def _start_move(
        self,
        chunk: Chunk,
        dst: Tier,
        *,
        blocking: bool,
        prefetch: bool = False,
        protect: frozenset[int] = frozenset(),
        inline: bool = False,
    ) -> bool:
        """Start moving a RESIDENT chunk to dst. Returns False if (non-blocking) room could not be made yet.

        inline: the caller waits for the move at once, so copy on this thread: no hand-off to a worker, and the
        copy gets this thread's intra-op parallelism.

        protect: chunks that making room must not evict: this one, and every chunk an outer call is moving (making
        room for a victim must never evict the chunk the victim is making room for).
        """
        protect = protect | {chunk.id}
        src = chunk.tier
        assert chunk.state is ChunkState.RESIDENT and src is not None and src != dst
        if dst > src and not chunk.movable:
            why = "is being computed on" if chunk.computing else "is pinned"
            raise RuntimeError(f"{chunk.describe()} {why}: it cannot leave the {src.label} tier")
        if dst > src:
            chunk.prefetched = False  # evicted before its use: no longer owed a place (see choose_victim)
        if chunk.all_free and dst is not Tier.NVME:
            # Nothing worth copying: give it fresh memory where it is wanted.
            if not self._make_room(dst, chunk.nbytes, protect, blocking=blocking):
                return False
            self._drop_payload(chunk)
            self._allocate(chunk, dst)
            return True
        if dst is Tier.NVME and chunk.on_nvme and not chunk.dirty:
            # The swap store already holds these exact bytes: evicting costs no write.
            self._free_buffer(src, chunk.payload, chunk)
            chunk.payload, chunk.tier = None, Tier.NVME
            self.counters["clean_evictions"] += 1
            return True
        # Swap I/O reads and writes host memory through a numpy view, which pins a storage's size for good: a
        # transient chunk's storage must stay resizable, so it goes through a host buffer as device memory does.
        needs_staging = (self.device.separate_memory or chunk.transient) and {src, dst} == {Tier.DEVICE, Tier.NVME}
        if dst is Tier.NVME:
            if self._store is None:
                raise self._oom(Tier.HOST, chunk.nbytes, extra="no memory.nvme_dir is set to spill to")
            if not chunk.on_nvme and not self._make_room(Tier.NVME, chunk.nbytes, protect, blocking=blocking):
                return False
        elif not self._make_room(dst, chunk.nbytes, protect, blocking=blocking):
            return False
        if needs_staging and not self._make_room(Tier.HOST, chunk.nbytes, protect, blocking=blocking):
            return False
        if dst is Tier.NVME:
            if not chunk.on_nvme:
                self.ledgers[Tier.NVME].take(chunk.nbytes)
                chunk.on_nvme = True  # the slot is ours from now; its contents are valid once the move ends
            new_payload = None
        else:
            new_payload = self._new_buffer(dst, chunk)
        staging = self.pools[Tier.HOST].acquire(chunk.nbytes).view(chunk.dtype) if needs_staging else None
        # Order the copy after compute queued so far: it may read what compute writes, or write a buffer compute
        # still reads (a pooled buffer's last user); see [Note: copies off the compute stream].
        marker = self.device.compute_marker() if Tier.DEVICE in (src, dst) else None
        args = (chunk.id, src, dst, chunk.payload, new_payload, staging, marker)
        if inline:
            future: Future[tuple[float, float]] = Future()
            try:
                future.set_result(self._copy_job(*args))
            except Exception as e:  # reported by _finish, after the rollback, like a worker's error
                future.set_exception(e)
        else:
            future = self._workers.submit(self._copy_job, *args)
        chunk.move = Move(src=src, dst=dst, future=future, new_payload=new_payload, staging=staging, prefetch=prefetch)
        chunk.transition(ChunkState.MOVING)
        self._moving[chunk.id] = chunk
        self.counters["moves"] += 1
        return True

    def _copy_job(
        self,
        key: int,
        src: Tier,
        dst: Tier,
        src_buf: torch.Tensor | None,
        dst_buf: torch.Tensor | None,
        staging: torch.Tensor | None,
        marker: Any,
    ) -> tuple[float, float]:
        """Runs on a worker thread: copy the bytes, nothing else (no bookkeeping)."""
        start = time.perf_counter()
        if dst is Tier.NVME:
            if staging is not None:  # device -> host staging -> NVMe
                self.device.copy(staging, src_buf, after=marker)
                src_buf = staging
            self._store.write(key, src_buf).result()
        elif src is Tier.NVME:
            if staging is not None:  # NVMe -> host staging -> device
                self._store.read(key, staging).result()
                # The device buffer may be one compute just gave back: order the copy after that compute.
                self.device.copy(dst_buf, staging, after=marker)
            else:
                self._store.read(key, dst_buf).result()
        else:
            self.device.copy(dst_buf, src_buf, after=marker)
        return start, time.perf_counter()

    def _wait(self, chunk: Chunk) -> None:
        """Finish the chunk's move, if any, waiting for its bytes."""
        move = chunk.move
        if move is None:
            return
        if not move.future.done():
            t0 = time.perf_counter()
            wait([move.future])  # an error is raised by _finish, after the rollback
            self.wait_seconds += time.perf_counter() - t0
        self._finish(chunk)

    def _finish(self, chunk: Chunk) -> None:
        move = chunk.move
        assert move is not None and move.future.done()
        del self._moving[chunk.id]
        chunk.move = None
        chunk.transition(ChunkState.RESIDENT)
        if move.staging is not None:
            self.pools[Tier.HOST].release(move.staging)
        error = move.future.exception()
        if error is not None:
            # The source copy is intact: the chunk stays where it was, and what the move took is given back.
            # A chained read's buffer is still its donor's if the donor's write-back failed.
            donor_failed = move.after is not None and move.after.exception() is not None
            if move.new_payload is not None and not donor_failed:
                self._free_buffer(move.dst, move.new_payload, chunk)
            if move.dst is Tier.NVME:
                self._drop_nvme_copy(chunk)
            raise error
        start, end = move.future.result()
        if move.src is not Tier.NVME and not move.handed_off:
            self._free_buffer(move.src, chunk.payload, chunk)
        # A chunk read back from NVMe keeps its swap copy: it is clean until a tensor is computed on.
        chunk.payload = move.new_payload
        chunk.tier = move.dst
        if move.dst is Tier.NVME or move.src is Tier.NVME:
            chunk.dirty = False
        self.moved[(move.src, move.dst)] += chunk.nbytes
        if move.dst > move.src:
            self.counters["evictions"] += 1
        event = MoveEvent(chunk.id, chunk.kind, move.src, move.dst, chunk.nbytes, start, end, move.prefetch)
        for observer in self.observers:
            observer(event)

    def _poll(self) -> bool:
        """Finish every move that is done; True if any was."""
        done = [c for c in self._moving.values() if c.move.future.done()]
        for chunk in done:
            self._finish(chunk)
        return bool(done)

    # ---- internals: room, eviction, prefetch --------------------------------------------------------------
    def _make_room(
        self,
        tier: Tier,
        nbytes: int,
        protect: set[int] | frozenset[int],
        *,
        blocking: bool,
        horizon: float | None = None,
        earmarked: int = 0,
    ) -> bool:
        """Make nbytes free on the tier (see [Note: making room]).

        Non-blocking: start evictions and return whether the room is there now. horizon: only evict chunks next
        used later than this many accesses ahead. earmarked: bytes already on their way out that belong to other
        prefetches, so this one must free its own on top.
        """
        ledger = self.ledgers[tier]
        if nbytes > ledger.budget:
            raise self._oom(tier, nbytes, extra="the request alone exceeds the budget")
        while self._room(tier, nbytes) < nbytes:
            if self._poll():
                continue
            if ledger.cached:
                self.pools[tier].trim(nbytes - ledger.free)
                continue
            leaving = [c for c in self._moving.values() if c.move.src == tier and not c.move.handed_off]
            if self._room(tier, nbytes) + sum(c.nbytes for c in leaving) < nbytes + earmarked:
                # Not enough on its way out: evict one more.
                if tier is Tier.NVME:
                    victim = self._nvme_victim(protect)
                    if victim is not None:
                        self._drop_nvme_copy(victim)
                        continue
                else:
                    victim = self._victim(tier, protect, horizon)
                    if victim is not None and victim.all_free:
                        self._drop_payload(victim)
                        self.counters["released"] += 1
                        continue
                    if victim is not None and self._start_move(
                        victim, tier.below, blocking=blocking, protect=frozenset(protect)
                    ):
                        continue
                if not leaving:
                    if not blocking:
                        return False
                    # What is left is arriving (prefetches, reads chained into handed-off buffers): once in, it
                    # can be evicted.
                    arriving = [c for c in self._moving.values() if tier in (c.move.src, c.move.dst)]
                    if not arriving:
                        raise self._oom(tier, nbytes)
                    self._wait(arriving[0])
                    continue
            if not blocking:
                return False  # room is on its way; a later call tries again
            self._wait(leaving[0])
        return True

    def _room(self, tier: Tier, nbytes: int) -> int:
        """Bytes a request of nbytes can have now: free budget, or a cached buffer of exactly its size."""
        pool = self.pools.get(tier)
        if pool is not None and pool.has_cached(nbytes):
            return max(nbytes, self.ledgers[tier].free)
        return self.ledgers[tier].free

    def _leaving_bytes(self, tier: Tier) -> int:
        return sum(c.nbytes for c in self._moving.values() if c.move.src == tier and not c.move.handed_off)

    def _victim(self, tier: Tier, protect: set[int], horizon: float | None) -> Chunk | None:
        candidates = [
            c
            for c in self._chunks.values()
            if c.state is ChunkState.RESIDENT and c.tier == tier and c.movable and c.id not in protect
        ]
        if horizon is not None:
            candidates = [c for c in candidates if self.trace.next_use(c.id) > horizon]
        return choose_victim(candidates, self.trace)

    def _nvme_victim(self, protect: set[int]) -> Chunk | None:
        """A swap copy that is not the chunk's only copy (it is resident above): dropping it loses nothing."""
        copies = [
            c
            for c in self._chunks.values()
            if c.on_nvme and c.tier is not Tier.NVME and not c.moving and c.id not in protect
        ]
        return min(copies, key=lambda c: (not c.dirty, c.last_access), default=None)

    def _prefetch_ahead(self, protect: set[int]) -> None:
        """Start moving the next chunks of the trace; see [Note: prefetch needs room first]."""
        earmarked = {Tier.DEVICE: 0, Tier.HOST: 0}
        for cid, tier in self.trace.upcoming(self.prefetch_depth, skip=protect):
            chunk = self._chunks.get(cid)
            if chunk is None or tier is Tier.NVME:
                continue
            # Evict only what is needed later than this chunk; else prefetching would evict what comes sooner.
            horizon = self.trace.next_use(cid)
            if self._try_prefetch(chunk, tier, horizon=horizon, protect=protect | {cid}, earmarked=earmarked[tier]):
                continue
            if self._room(tier, chunk.nbytes) + self._leaving_bytes(tier) >= earmarked[tier] + chunk.nbytes:
                earmarked[tier] += chunk.nbytes  # its room is on the way: its move starts at a later access
                continue
            break  # nothing evictable before this chunk's use: the ones after it cannot fare better

    def _try_prefetch(
        self, chunk: Chunk, tier: Tier, *, horizon: float | None, protect: set[int], earmarked: int = 0
    ) -> bool:
        """Start moving chunk to tier without blocking; True if it is there or on its way."""
        if chunk.move is not None:
            return chunk.move.dst == tier
        if chunk.state is ChunkState.EMPTY or chunk.tier == tier:
            return True
        if tier > chunk.tier:
            return True  # a chunk wanted lower down will be evicted there when room is needed
        room = self._make_room(
            tier, chunk.nbytes, protect | {chunk.id}, blocking=False, horizon=horizon, earmarked=earmarked
        )
        if not room or earmarked > self._room(tier, chunk.nbytes) - chunk.nbytes:
            return self._chain_read(chunk, tier)
        started = self._start_move(chunk, tier, blocking=False, prefetch=True, protect=frozenset(protect))
        if started:
            chunk.prefetched = True
            self.counters["prefetches"] += 1
        return started

    def _chain_read(self, chunk: Chunk, tier: Tier) -> bool:
        """Read chunk from NVMe into the host buffer of a write-back in flight; see [Note: reads chained behind
        write-backs]. True if started."""
        if tier is not Tier.HOST or chunk.tier is not Tier.NVME or chunk.state is not ChunkState.RESIDENT:
            return False
        donor = next(
            (
                c
                for c in self._moving.values()
                if c.move.src is Tier.HOST
                and c.move.dst is Tier.NVME
                and not c.move.handed_off
                and c.move.staging is None
                and c.nbytes == chunk.nbytes
                and not c.move.future.done()  # a finished one gives its buffer back at the next poll: use that
            ),
            None,
        )
        if donor is None:
            return False
        donor.move.handed_off = True
        after = donor.move.future
        buf = donor.payload.view(torch.uint8).view(chunk.dtype)
        future = self._workers.submit(self._chained_read_job, after, chunk.id, buf)
        chunk.move = Move(src=Tier.NVME, dst=tier, future=future, new_payload=buf, prefetch=True, after=after)
        chunk.transition(ChunkState.MOVING)
        self._moving[chunk.id] = chunk
        self.counters["moves"] += 1
        self.counters["chained_reads"] += 1
        chunk.prefetched = True
        self.counters["prefetches"] += 1
        return True

    def _chained_read_job(self, after: Future, key: int, dst_buf: torch.Tensor) -> tuple[float, float]:
        """Runs on a worker thread: wait for the donor's write-back (raising its error), then read into its buffer."""
        after.result()
        start = time.perf_counter()
        self._store.read(key, dst_buf).result()
        return start, time.perf_counter()

    def _oom(self, tier: Tier, nbytes: int, extra: str = "") -> TierOutOfMemoryError:
        ledger = self.ledgers[tier]
        holders = sorted(
            (c for c in self._chunks.values() if c.tier == tier or (c.move is not None and c.move.dst == tier)),
            key=lambda c: -c.nbytes,
        )
        lines = []
        for c in holders[:8]:
            why = "being computed on" if not c.movable else ("moving" if c.moving else "resident")
            lines.append(f"  {c.describe()} ({why})")
        if len(holders) > 8:
            lines.append(f"  ... and {len(holders) - 8} more chunks")
        advice = {
            Tier.DEVICE: "raise memory.device_budget, offload more to 'host'/'nvme', or use smaller chunks",
            Tier.HOST: "raise memory.host_budget or set memory.nvme_dir to spill to NVMe",
            Tier.NVME: "raise memory.nvme_budget or free space in memory.nvme_dir",
        }[tier]
        msg = (
            f"{tier.label} tier out of memory: needed {format_size(nbytes)} ({nbytes} B) with "
            f"{format_size(ledger.used)} held of a {format_size(ledger.budget)} budget"
            f"{'; ' + extra if extra else ''}. Nothing more can be evicted. Held by:\n"
            + ("\n".join(lines) if lines else "  (no chunks: cached buffers only)")
            + f"\nTo fix: {advice}."
        )
        return TierOutOfMemoryError(msg, tier=tier.label, needed=nbytes, held=ledger.used, budget=ledger.budget)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ChunkManager is closed")


def _shutdown(workers: ThreadPoolExecutor, store: Any) -> None:
    workers.shutdown(wait=True)
    if store is not None:
        store.close()


def _default_device_budget(device: Device, budget: int | None) -> int:
    if budget is not None:
        return budget
    if device.is_cuda:
        return int(device.available_memory() * 0.9)
    return device.available_memory() // 2  # the CPU "device" shares RAM with the host tier


def _default_host_budget(budget: int | None) -> int:
    if budget is not None:
        return budget
    import psutil

    return psutil.virtual_memory().available // 2
