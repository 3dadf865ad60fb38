"""The chunk manager: where every chunk lives, and every move between tiers.

The manager is driven from one thread (the training loop's). Copies and swap I/O run on worker threads and report
back through futures; all bookkeeping (ledgers, chunk states, the trace) changes on the driving thread only, when a
move is started or seen finished, so no lock guards it. It is a small front over four rooms, each one concept:
`storage.py` (budgets, ledgers, buffer pools, the swap store), `moves.py` (starting, copying and finishing moves),
`room.py` (making room: eviction) and `prefetch.py` (moving ahead of use); the notes below say how they meet.

[Note: making room]
A move reserves its bytes on the destination tier when it starts and gives back the source's bytes when it finishes; a
ledger therefore never undercounts, and a tier never exceeds its budget, even with many moves in flight. To make room on
a tier the manager in turn reaps moves that have finished; frees cached buffers; waits for moves already leaving the
tier; evicts a victim (the furthest next use by the trace, else the least recently used) one tier down, where a chunk
whose tensors are all FREE is simply released. Prefetch makes room the same way but never blocks: it starts evictions
and tries again at the next access, or chains behind one ([Note: reads chained behind write-backs]).

[Note: prefetch needs room first]
A prefetch cannot start its copy until the chunks it displaces have left (the ledger, like the memory, must not
go over budget in between). So each access looks `prefetch_depth` chunks ahead: for the nearer ones it starts the
copy, whose room was freed by evictions started at an earlier access; for the farther ones it only starts those
evictions, earmarking the bytes on their way out so that two prefetches do not count the same room. The lead of a
prefetch over its use is therefore `prefetch_depth - 1` accesses once the device is full.

[Note: reads chained behind write-backs]
When a tier is full, the room a move up needs appears only once a move out of it ends, usually while the training thread
computes, not while it calls into the manager: a prefetch waiting for the next access would start late or not at all. So
a prefetch that finds no room may claim a same-size move out of the tier in flight and copy into that chunk's buffer
once it is done, on the worker thread: a read from NVMe into a write-back's host buffer, or a copy from the host into an
eviction's device buffer (never a transient chunk's: its storage is its own). The buffer changes hands without going
back to the pool: the ledger keeps its bytes, now the incoming chunk's, so the budget holds. A donor whose move fails
keeps the buffer, and the chained copy fails too. A chained job waits only for a write-back queued on the NVMe store,
whose threads need nothing from the workers ([Note: swap moves skip the workers] in moves.py), or for a job submitted
before it, which the workers (taking jobs in order) run first: it cannot deadlock.

[Note: transient chunks]
A transient chunk holds, on the device, a copy of data whose home is elsewhere (ZeRO-3's gathered parameters: the
home is each rank's shard). Tensors outside hetero view its payload: module parameters, and views autograd saved in
forward for backward. So its device payload is always the same storage object (`chunk.kept`): dropping the chunk
resizes that storage to zero bytes, and giving it memory again grows the same storage back, so every view of it is
valid again once the bytes are back, without anyone re-pointing it (on a CPU device the bytes are a pooled
buffer's, lent to the storage: [Note: transient storage on pooled memory] in io/swap.py). A transient chunk whose
tensors are all FREE is released, never copied, when room is needed; one whose tensors hold data (gathered, but not
being computed on) is moved down like any chunk, and coming back to the device its bytes are copied into the regrown
storage. Whether the data is gathered is the owner's decision, taken from state every rank shares; where its bytes
sit is this rank's.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hetero.config import MemoryConfig, parse_size
from hetero.device import Device, make_device
from hetero.errors import TierOutOfMemoryError
from hetero.events import Events
from hetero.memory.chunk import Chunk
from hetero.memory.moves import MoveEvent, Mover
from hetero.memory.policy import AccessTrace
from hetero.memory.prefetch import Prefetcher
from hetero.memory.room import RoomMaker
from hetero.memory.states import ChunkState, TensorState
from hetero.memory.storage import Storage, nvme_io
from hetero.memory.tier import Tier

log = logging.getLogger("hetero.memory")

__all__ = ["ChunkManager", "MoveEvent"]


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
        self.storage = Storage(
            self.device,
            device_budget=device_budget,
            host_budget=host_budget,
            nvme_dir=nvme_dir,
            nvme_budget=nvme_budget,
            nvme_options=nvme_options,
        )
        self.ledgers = self.storage.ledgers  # per tier: budget, bytes held, peak
        self.pools = self.storage.pools  # reused chunk buffers, per tier
        self.trace = AccessTrace()  # recorded chunk order: prefetch and OPT eviction
        self.counters: Counter[str] = Counter()  # accesses, prefetch hits/misses, evictions, moves, ...
        self._chunks: dict[int, Chunk] = {}  # every live chunk by id
        self._mover = Mover(self.storage, self.device, self.counters, workers=move_workers)
        self._room = RoomMaker(self.storage, self._mover, self._chunks, self.trace, self.counters)
        self._mover.room = self._room
        self._prefetcher = Prefetcher(
            self._room, self._mover, self._chunks, self.trace, self.counters, depth=prefetch_depth
        )
        self._next_id = 0
        self._clock = 0  # access counter, for LRU
        self._trim_host_later = False  # trim_idle ran while write-backs were in flight: trim once they land
        self._last: Chunk | None = None  # the last access recorded: its chunk and tier
        self._last_tier: Tier | None = None
        self._forward_need: dict[int, int] | None = None  # see [Note: what the forward takes again]
        self._forward_seen = False  # this step's first forward has ended (`forward_end`)
        self._closed = False
        # Hook points, any number of subscribers each: "access" and "step_begin" run before anything moves
        # (automatic placement adjusts the device budget there, hetero/memory/auto.py); "move" gets every finished
        # move (a MoveEvent); "done" runs when a call into the manager that may have changed a ledger returns (the
        # profiler samples there, when every chunk touched is labelled with its tier).
        self.events = Events(("access", "step_begin", "move", "done"))
        self._mover.observers.append(lambda event: self.events.emit("move", event))
        self._finalizer = weakref.finalize(self, _shutdown, self._mover, self.storage.store)

    @classmethod
    def from_config(
        cls, memory: MemoryConfig, *, device: Device | None = None, prefetch_depth: int = 2
    ) -> ChunkManager:
        where = {k: getattr(memory, k) for k in ("device_budget", "host_budget", "nvme_dir", "nvme_budget")}
        return cls(device=device, prefetch_depth=prefetch_depth, nvme_options=nvme_io(memory), **where)

    @property
    def prefetch_depth(self) -> int:
        return self._prefetcher.depth

    @property
    def store(self) -> Any:
        """The NVMe swap store (None without nvme_dir)."""
        return self.storage.store

    # ---- chunks -------------------------------------------------------------------------------------------
    def new_chunk(self, *, dtype: torch.dtype, capacity: int, kind: str = "param", transient: bool = False) -> Chunk:
        """An EMPTY chunk; add tensors to it, then `access` it on a tier to give it memory.

        transient: the payload is a device-side cache of data kept elsewhere; see [Note: transient chunks].
        """
        if capacity <= 0:
            raise ValueError(f"chunk capacity must be positive, got {capacity}")
        chunk = Chunk(id=self._next_id, dtype=dtype, capacity=capacity, kind=kind, transient=transient)
        self.storage.reserve(chunk)
        self._next_id += 1
        self._chunks[chunk.id] = chunk
        return chunk

    @property
    def chunks(self) -> list[Chunk]:
        return list(self._chunks.values())

    def free_chunk(self, chunk: Chunk) -> None:
        """Forget a chunk altogether, releasing its memory on every tier."""
        self._mover.wait(chunk)
        self.storage.drop_payload(chunk)
        self.storage.drop_nvme_copy(chunk)
        del self._chunks[chunk.id]
        if self._last is chunk:
            self._last = None
        self.events.emit("done")

    # ---- access and movement ------------------------------------------------------------------------------
    def access(self, chunk: Chunk, tier: Tier = Tier.DEVICE, *, write: bool = True) -> torch.Tensor | None:
        """Make the chunk resident on `tier` and return its payload (None on NVMe).

        Waits only for this chunk's own move. The payload stays where it is until the next call into the manager;
        put its tensors in COMPUTE, or pin it, to keep it there beyond that. write=False promises the caller only
        reads the payload, so a clean swap copy stays valid and a later eviction costs no write.
        """
        self._check_open()
        # [Note: an access repeated] in policy.py: decided from the calls alone, never from what is in flight.
        repeat = chunk is self._last and tier is self._last_tier and not self.events.has("access")
        if repeat and not self._trim_host_later and self._settled(chunk, tier):
            if write:
                chunk.dirty = True
            return chunk.payload
        mover = self._mover
        mover.poll()
        if self._trim_host_later and not self._writing():
            self._trim_host_later = False
            self.trim(Tier.HOST)
        self.events.emit("access")
        if not repeat:
            self._clock += 1
            self.counters["accesses"] += 1
            if chunk.traced:  # [Note: chunks of one step] in policy.py
                self.trace.record(chunk.id, tier)
        if chunk.state is ChunkState.EMPTY:
            self._allocate(chunk, tier)
        else:
            arriving = chunk.tier == tier if chunk.move is None else chunk.move.dst == tier
            if chunk.prefetched and arriving:
                self.counters["prefetch_hits"] += 1
            if write or chunk.move is not None or chunk.tier != tier or not mover.reading(chunk):
                mover.wait(chunk)  # (the device reading it too is no reason to wait for a read)
            if chunk.tier != tier:
                self.counters["prefetch_misses"] += 1
                mover.start(chunk, tier, blocking=True, inline=True)
                mover.wait(chunk)
        chunk.prefetched = False
        if write:
            chunk.dirty = True
        chunk.last_access = self._clock
        self._prefetcher.ahead(protect={chunk.id})
        self.events.emit("done")
        self._last, self._last_tier = chunk, tier
        return chunk.payload

    def _settled(self, chunk: Chunk, tier: Tier) -> bool:  # resident on `tier` with nothing in flight to wait for
        here = chunk.state is ChunkState.RESIDENT and chunk.tier == tier
        return here and chunk.move is None and chunk.id not in self._mover.landing

    def move(self, chunk: Chunk, tier: Tier, *, wait: bool = True) -> None:
        """Move a chunk to a tier explicitly (e.g. offload it now), without recording an access."""
        self._check_open()
        mover = self._mover
        self._last = None  # a chunk moved by the caller: its next access is recorded ([Note: an access repeated])
        mover.poll()
        mover.wait(chunk)
        if chunk.state is ChunkState.EMPTY or chunk.tier == tier:
            return
        mover.start(chunk, tier, blocking=True, inline=wait)
        if wait:
            mover.wait(chunk)
        self.events.emit("done")

    def prefetch(self, chunks: Iterable[Chunk], tier: Tier = Tier.DEVICE, *, keep: Iterable[Chunk] = ()) -> None:
        """Start moving chunks to `tier` and return at once; a later `access` waits only for what it needs.

        keep: chunks that making room must not evict (e.g. the others of the list, needed as soon)."""
        self._check_open()
        self._mover.poll()
        protect = {c.id for c in keep}
        for chunk in chunks:
            # While the trace replays, evict only what is needed after this chunk (as the trace's own prefetch).
            horizon = self.trace.next_use(chunk.id) if self.trace.replaying else None
            self._prefetcher.start(chunk, tier, horizon=horizon, protect=protect)
        self.events.emit("done")

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

    def land_later(self, chunk: Chunk, handle: Any, *, reads: bool = False) -> None:
        """A `Device.copy_later` is writing into the chunk's payload, or a copy on the compute stream reading it
        (reads, `handle` from `Device.compute_reached`): it stays where it is, unchanged, until the copy is done, and
        the next call that needs it waits for that, but for a read of a chunk being read ([Note: copies the host does
        not wait for] in moves.py, [Note: the compute stream reads host memory late] in hetero/standin.py)."""
        self._mover.land_later(chunk, handle, reads=reads)

    def in_flight(self, chunk: Chunk, *, reads: bool = False) -> Any:
        """The handle of a copy still writing into the chunk (`land_later`), else None; reads: of one still reading it,
        asked without waiting. It stays pinned where it is until then: another thread may read its payload once
        `Device.landed` says the copy is done."""
        entry = None if reads and self._mover.land(chunk, block=False) else self._mover.landing.get(chunk.id)
        return None if entry is None or entry[2] != reads else entry[1]

    def release(self, chunk: Chunk) -> None:
        """Drop a chunk's payload (every tensor must be FREE); it becomes EMPTY and holds no memory."""
        if not chunk.all_free:
            held = [s.name for s in chunk.slots if s.state is not TensorState.FREE]
            raise ValueError(f"cannot release {chunk.describe()}: tensors still hold data: {held[:5]}")
        self._mover.wait(chunk)
        self.storage.drop_payload(chunk)
        self.storage.drop_nvme_copy(chunk)
        self.events.emit("done")

    def set_budget(self, tier: Tier, budget: int) -> int:
        """Change a tier's budget (automatic placement), evicting what no longer fits. Chunks that cannot move now
        (being computed on, pinned) stay: the budget then settles at what they hold. Returns the budget set."""
        ledger = self.ledgers[tier]
        ledger.budget = max(0, budget)
        if ledger.free < 0:
            try:
                self._room.make(tier, 0, set(), blocking=True)
            except TierOutOfMemoryError:
                ledger.budget = ledger.used
        return ledger.budget

    def synchronize(self) -> None:
        """Wait for every move in flight."""
        self._mover.synchronize()
        self.events.emit("done")

    # ---- steps and trace ----------------------------------------------------------------------------------
    def step_begin(self, kind: str = "train", *, nested: bool = False) -> None:
        """A step of `kind` begins: it replays the trace of the last step of that kind (the engine's kinds: "train",
        "eval"; [Note: one trace per kind of step] in policy.py) and prefetches its first chunks. nested: a step open
        of another kind is set aside and resumes at this one's end ([Note: a step within a step] in policy.py)."""
        self.events.emit("step_begin")
        self.pools[Tier.DEVICE].mark()  # what is in use now is not the forward's take
        self._forward_seen = False
        # A step set aside resumes with its last access: whether its next one repeats it is as without this step.
        self.trace.step_begin(kind, nested=nested, carry=(self._last, self._last_tier))
        self._last = None  # a step's first access is always recorded
        self._prefetcher.ahead(protect=set())
        self.events.emit("done")

    def forward_end(self) -> None:
        """The model's forward has run: the device buffers it held at once are what the next step's forward will
        take again ([Note: what the forward takes again]). Only the step's first forward counts (a micro-batch's
        forward after a backward would count the backward's buffers too)."""
        if not self._forward_seen:
            self._forward_seen = True
            self._forward_need = self.pools[Tier.DEVICE].taken_since_mark()

    @property
    def forward_take(self) -> dict[int, int]:
        """Buffer size -> how many device buffers the last step's first forward held at once beyond those in use as
        it began: what `trim_idle` leaves cached ([Note: what the forward takes again])."""
        return dict(self._forward_need or {})

    def step_end(self, *, keep: bool = True) -> None:
        """The step's accesses are over. keep=False: the step is not kept as the trace to replay, and the next one
        is recorded afresh (a caller that knows the steps change shape here: `AccessTrace.forget`)."""
        resumed = self.trace.step_end() if keep else self.trace.forget()
        if not keep:
            self._prefetcher.end_partial()  # [Note: a partial step takes its prefetches back] in prefetch.py
        if resumed is not None:  # a step set aside ([Note: a step within a step] in policy.py)
            self._last, self._last_tier = resumed
            self._prefetcher.ahead(protect=set())  # what it needs next, which the nested step may have evicted

    # ---- stats --------------------------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, Any]:
        """Per tier: current, cached, peak and budget bytes; bytes moved per tier pair; counters."""
        self._mover.poll()
        out = self.storage.stats()
        out["moved"] = {f"{s.label}->{d.label}": n for (s, d), n in sorted(self._mover.moved.items())}
        out["counters"] = dict(self.counters)
        out["wait_seconds"] = self._mover.wait_seconds
        return out

    @property
    def wait_seconds(self) -> float:
        """Time the driving thread spent waiting for moves."""
        return self._mover.wait_seconds

    @property
    def moved(self) -> Counter[tuple[Tier, Tier]]:
        """Bytes moved per (source, destination) tier pair."""
        return self._mover.moved

    def trim(self, tier: Tier, *, keep: dict[int, int] | None = None) -> int:
        """Free the buffers cached for reuse on `tier` (they count in its ledger and in the process's memory), but
        `keep[size]` of each size; returns the bytes freed."""
        freed = self.pools[tier].trim(keep=keep)
        if freed:
            self.events.emit("done")
        return freed

    def trim_idle(self) -> int:
        """Between the phases of a step: give back the cached buffers that cost little to get again, the device
        tier's (but those the next forward takes again) and, where host memory is not pinned (a CPU device), the host
        tier's. Pinned ones stay: freeing pinned memory waits for the whole GPU, and pinning it again costs more than
        the copies it serves. Returns the bytes freed.

        [Note: what the forward takes again]
        Buffers cached through the next forward add to the step's peak, where the activations are: `trim_idle` gives
        them back between a step's phases. But the forward takes some of them again at once (stage 3's gathered
        chunks), and those count in that peak either way; freed, they were mapped afresh every step and, on a CPU
        device, faulted in 4 KiB at a time (the 22.6M Llama race of benchmarks/step_time.py: 35,000 page faults and
        0.43 s of system time a rank a step). So, size by size, as many stay cached as the last step's first
        forward held at once beyond those already in use when it began (a CPU device's masters and states, which
        persist); the rest go (the reduced gradients' shards, which no forward takes): 16,000-18,000 faults and
        0.20 s there, the peak RSS unchanged. Which buffers stay cached is the rank's own business: it decides no
        collective."""
        freed = self.trim(Tier.DEVICE, keep=self._forward_need)
        if not self.device.separate_memory:
            freed += self.trim(Tier.HOST)
            # The update's last write-backs to NVMe land after it returns, and give their host buffers to the pool
            # then: the next access after they have all landed gives those back too.
            self._trim_host_later = self._writing()
        return freed

    def _writing(self) -> bool:
        return any(c.move is not None and c.move.dst is Tier.NVME for c in self._mover.moving.values())

    def reset_peaks(self) -> None:
        for ledger in self.ledgers.values():
            ledger.reset_peak()

    def close(self) -> None:
        """Wait for moves, free every buffer, delete swap files. Idempotent. A move failing now is logged, not raised:
        its bytes go with the rest, and a close (in a `finally`, after a failure) must not hide the caller's error."""
        if self._closed:
            return
        self._closed = True
        try:
            self._mover.synchronize()  # every move ends, failed or not, before it raises
        except Exception as e:
            log.warning("closing the manager: a move in flight failed (%s); chunk freed", e, extra={"all_ranks": True})
        finally:
            for chunk in self._chunks.values():
                if chunk.move is None:  # still moving (an interrupted wait): a worker may write its buffers yet
                    self.storage.forget(chunk)
            self._chunks.clear()
            self.storage.trim()
            self._finalizer()

    def __enter__(self) -> ChunkManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------------------
    def _allocate(self, chunk: Chunk, tier: Tier) -> None:
        if tier is not Tier.NVME:
            self._room.make(tier, chunk.nbytes, {chunk.id}, blocking=True)
        self.storage.allocate(chunk, tier)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ChunkManager is closed")


def _shutdown(mover: Mover, store: Any) -> None:
    mover.workers.shutdown(wait=True)
    if store is not None:
        store.close()
