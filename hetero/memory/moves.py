"""Moves between tiers: started on the driving thread, copied on worker threads, finished on the driving thread.

Workers copy bytes and nothing else; every ledger, state and trace change happens when a move is started or seen
finished (`poll`, `wait`), on the thread that drives the manager, so no lock guards the bookkeeping. See the
manager's [Note: making room] for how a move gets its destination's bytes, and [Note: reads chained behind
write-backs] for the chained reads started here.

[Note: FREE slots are not stored]
For a chunk whose owner guarantees that a FREE tensor holds nothing worth keeping (`Chunk.skip_free_head`: not every
chunk's slot states follow its data, a gathered parameter chunk keeps what a FREE slot held), a write to NVMe skips
the FREE slots at its head (`Chunk.free_head`) and records where the stored bytes begin (`stored_from`); a read
fills the payload from there and leaves the head as it finds it, its slots still FREE. The ZeRO optimizer chunk of
an fp32 stage-3 model with states on NVMe is the case it is for: its master slot, first, is FREE between updates
because the parameter shard holds the same values ([Note: the master follows the shard] in
`hetero/zero/master.py`), which takes a quarter of the optimizer's swap traffic away. A clean eviction (no
write) is allowed only while every slot with data lies in the stored range. The NVMe ledger still counts the whole
chunk: a later write may store all of it.

[Note: copies the host does not wait for]
A gradient reduced on the device goes down into its host chunk by a copy on a copy stream (hetero/zero/host_grads.py).
`Device.copy` would make the host wait until those bytes are in place, which is a wait for the GPU to reach the copy's
marker and, where the marker is taken when the copy is asked for (after an earlier micro-batch's sum is added, after
an NCCL reduction), for the whole queue of kernels. Instead the copy is started with `Device.copy_later` and the
chunk is handed to `land_later`: it stays pinned where it is (no eviction, no move, its host buffer never reused)
until the copy has landed, and whoever asks for it next through the manager (`wait`: an access, a move, a release,
the update's read) waits for that copy first. `poll` unpins the ones already done. The stand-in runs such a copy late
on its copy engine, so a read that skipped the wait sees the old bytes and the run differs from the plain one.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hetero.device import Device
from hetero.errors import NvmeError, add_note
from hetero.memory.chunk import Chunk, Move
from hetero.memory.states import ChunkState
from hetero.memory.storage import Storage
from hetero.memory.tier import Tier

if TYPE_CHECKING:
    from hetero.memory.room import RoomMaker


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


class Mover:
    """Starts, runs and finishes the moves of one manager's chunks."""

    def __init__(self, storage: Storage, device: Device, counters: Counter[str], *, workers: int) -> None:
        self.storage = storage
        self.device = device
        self.counters = counters  # the manager's: moves, evictions, chained reads, ...
        self.room: RoomMaker | None = None  # set by the manager: the destination's room is made through it
        self.moving: dict[int, Chunk] = {}  # chunks with a move in flight
        self.landing: dict[int, tuple[Chunk, Any]] = {}  # chunks a copy is still writing into (see land_later)
        self.moved: Counter[tuple[Tier, Tier]] = Counter()  # bytes moved per (src, dst)
        self.observers: list[Callable[[MoveEvent], None]] = []  # called on every finished move
        self.wait_seconds = 0.0  # time the driving thread spent waiting for moves
        self.workers = ThreadPoolExecutor(workers, thread_name_prefix="hetero-move")

    # ---- starting ---------------------------------------------------------------------------------------
    def start(
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
        storage, room = self.storage, self.room
        assert room is not None
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
            if not room.make(dst, chunk.nbytes, protect, blocking=blocking):
                return False
            storage.drop_payload(chunk)
            storage.allocate(chunk, dst)
            return True
        if dst is Tier.NVME and chunk.on_nvme and not chunk.dirty and chunk.free_head() >= chunk.stored_from:
            # The swap store already holds these exact bytes (every slot with data): evicting costs no write.
            storage.free_buffer(src, chunk.payload, chunk)
            chunk.payload, chunk.tier = None, Tier.NVME
            self.counters["clean_evictions"] += 1
            return True
        # Swap I/O reads and writes host memory through a numpy view, which pins a storage's size for good: a
        # transient chunk's storage must stay resizable, so it goes through a host buffer as device memory does.
        needs_staging = (self.device.separate_memory or chunk.transient) and {src, dst} == {Tier.DEVICE, Tier.NVME}
        if dst is Tier.NVME:
            if storage.store is None:
                raise room.oom(Tier.HOST, chunk.nbytes, extra="no memory.nvme_dir is set to spill to")
            if not chunk.on_nvme and not room.make(Tier.NVME, chunk.nbytes, protect, blocking=blocking):
                return False
        elif not room.make(dst, chunk.nbytes, protect, blocking=blocking):
            return False
        if needs_staging and not room.make(Tier.HOST, chunk.nbytes, protect, blocking=blocking):
            return False
        # The staging buffer first, and given back if the destination's is refused (an allocator out of memory):
        # a move that fails to start takes nothing, above all no swap slot for bytes it never writes.
        staging = storage.staging(chunk.nbytes).view(chunk.dtype) if needs_staging else None
        if dst is Tier.NVME:
            if not chunk.on_nvme:
                storage.take_nvme_slot(chunk)  # the ledger counts the whole chunk: a later write may need it all
            new_payload = None
            chunk.stored_from = head = chunk.free_head()  # [Note: FREE slots are not stored]
        else:
            try:
                new_payload = storage.new_buffer(dst, chunk)
            except BaseException:
                if staging is not None:
                    storage.release_staging(staging)
                raise
            head = chunk.stored_from if src is Tier.NVME else 0
        # Order the copy after compute queued so far: it may read what compute writes, or write a buffer compute
        # still reads (a pooled buffer's last user); see [Note: copies off the compute stream].
        marker = self.device.compute_marker() if Tier.DEVICE in (src, dst) else None
        args = (chunk.id, src, dst, chunk.payload, new_payload, staging, marker, head)
        if inline:
            future: Future[tuple[float, float]] = Future()
            try:
                future.set_result(self._copy_job(*args))
            except Exception as e:  # reported by finish, after the rollback, like a worker's error
                future.set_exception(e)
        elif staging is None and Tier.NVME in (src, dst):
            future = self._swap_job(chunk.id, dst is Tier.NVME, chunk.payload, new_payload, head)
        else:
            future = self.workers.submit(self._copy_job, *args)
        chunk.move = Move(
            src=src,
            dst=dst,
            future=future,
            new_payload=new_payload,
            staging=staging,
            prefetch=prefetch,
            skipped=head * chunk.dtype.itemsize,
        )
        chunk.transition(ChunkState.MOVING)
        self.moving[chunk.id] = chunk
        self.counters["moves"] += 1
        return True

    def chain_read(self, chunk: Chunk, tier: Tier) -> bool:
        """Move chunk up into `tier`, into the buffer of a move out of `tier` in flight: a read from NVMe into a
        write-back's host buffer, or a copy from the host into an eviction's device buffer. See [Note: reads chained
        behind write-backs]. True if started."""
        if chunk.state is not ChunkState.RESIDENT:
            return False
        if tier is Tier.HOST:
            if chunk.tier is not Tier.NVME:
                return False
        elif tier is not Tier.DEVICE or chunk.tier is not Tier.HOST or chunk.transient:
            return False  # only up; NVMe -> device needs a staging hop; a transient chunk's device storage is its own
        donor = next(
            (
                c
                for c in self.moving.values()
                if c.move.src is tier
                and not c.move.handed_off
                and c.move.staging is None
                and c.nbytes == chunk.nbytes
                and not (tier is Tier.DEVICE and c.transient)  # its device storage is its own (`kept`): never lent
                and not c.move.future.done()  # a finished one gives its buffer back at the next poll: use that
            ),
            None,
        )
        if donor is None:
            return False
        donor.move.handed_off = True
        after = donor.move.future
        buf = donor.payload.view(torch.uint8).view(chunk.dtype)
        if tier is Tier.HOST:
            future = self.workers.submit(self._chained_read_job, after, chunk.id, buf[chunk.stored_from :])
            skipped = chunk.stored_from * chunk.dtype.itemsize
        else:  # after compute queued so far, as any copy into device memory ([Note: copies off the compute stream])
            marker = self.device.compute_marker()
            future = self.workers.submit(self._chained_copy_job, after, buf, chunk.payload, marker)
            skipped = 0
        chunk.move = Move(
            src=chunk.tier, dst=tier, future=future, new_payload=buf, prefetch=True, after=after, skipped=skipped
        )
        chunk.transition(ChunkState.MOVING)
        self.moving[chunk.id] = chunk
        self.counters["moves"] += 1
        self.counters["chained_reads"] += 1
        return True

    # ---- worker side ------------------------------------------------------------------------------------
    def _copy_job(
        self,
        key: int,
        src: Tier,
        dst: Tier,
        src_buf: torch.Tensor | None,
        dst_buf: torch.Tensor | None,
        staging: torch.Tensor | None,
        marker: Any,
        head: int = 0,
    ) -> tuple[float, float]:
        """Runs on a worker thread: copy the bytes, nothing else (no bookkeeping). head: elements at the start of the
        payload that a swap write skips and a swap read leaves alone ([Note: FREE slots are not stored])."""
        store = self.storage.store
        start = time.perf_counter()
        if head:  # only ever set for a swap write or read
            src_buf, dst_buf = (b[head:] if b is not None else None for b in (src_buf, dst_buf))
            staging = staging[head:] if staging is not None else None
        if dst is Tier.NVME:
            if staging is not None:  # device -> host staging -> NVMe
                self.device.copy(staging, src_buf, after=marker)
                src_buf = staging
            store.write(key, src_buf).result()
        elif src is Tier.NVME:
            if staging is not None:  # NVMe -> host staging -> device
                store.read(key, staging).result()
                # The device buffer may be one compute just gave back: order the copy after that compute.
                self.device.copy(dst_buf, staging, after=marker)
            else:
                store.read(key, dst_buf).result()
        else:
            self.device.copy(dst_buf, src_buf, after=marker)
        return start, time.perf_counter()

    def _swap_job(
        self, key: int, write: bool, src_buf: torch.Tensor | None, dst_buf: torch.Tensor | None, head: int
    ) -> Future[tuple[float, float]]:
        """A swap write or read of memory the store can use as is, queued on the store at once.

        [Note: swap moves skip the workers]
        Such a move has no copy to make on this side: a worker would only block on the store's future. When one did,
        the two workers were the real queue of every swap move: a prefetch read waited behind two write-backs in
        the workers' FIFO before the store could even order it, and more workers put more writes ahead of it in the
        store's queue. Queued on the store at once, the store orders reads and writes itself ([Note: reads before
        writes] in lanes.py) and keeps all of them in flight."""
        start = time.perf_counter()
        done: Future[tuple[float, float]] = Future()
        store = self.storage.store
        try:
            # head: the FREE slots a swap skips ([Note: FREE slots are not stored]); 0 slices nothing
            inner = store.write(key, src_buf[head:]) if write else store.read(key, dst_buf[head:])
        except Exception as e:  # reported by finish, after the rollback, like a worker's error
            done.set_exception(e)
            return done

        def complete(f: Future[None]) -> None:
            error = f.exception()
            if error is None:
                done.set_result((start, time.perf_counter()))
            else:
                done.set_exception(error)

        inner.add_done_callback(complete)
        return done

    def _chained_read_job(self, after: Future, key: int, dst_buf: torch.Tensor) -> tuple[float, float]:
        """Runs on a worker thread: wait for the donor's write-back (raising its error), then read into its buffer."""
        after.result()
        start = time.perf_counter()
        self.storage.store.read(key, dst_buf).result()
        return start, time.perf_counter()

    def _chained_copy_job(
        self, after: Future, dst_buf: torch.Tensor, src_buf: torch.Tensor, marker: Any
    ) -> tuple[float, float]:
        """Runs on a worker thread: wait for the donor's eviction (raising its error: its bytes are still being read
        from this buffer until then), then copy the host payload into its device buffer."""
        after.result()
        start = time.perf_counter()
        self.device.copy(dst_buf, src_buf, after=marker)
        return start, time.perf_counter()

    # ---- finishing ----------------------------------------------------------------------------------------
    def land_later(self, chunk: Chunk, handle: Any, *, reads: bool = False) -> None:
        """A `Device.copy_later` into the chunk's payload is in flight ([Note: copies the host does not wait for]);
        reads: a copy on the compute stream reading it instead (`Device.compute_reached`)."""
        if handle is None:
            return
        entry = self.landing.get(chunk.id)
        if reads and entry is not None and entry[2]:
            self.landing[chunk.id] = (chunk, handle, True)  # reads on one stream end in order: the newer covers both
            return
        self.land(chunk)  # one copy in flight per chunk: the one before has landed
        chunk.pins += 1
        self.landing[chunk.id] = (chunk, handle, reads)

    def reading(self, chunk: Chunk) -> bool:
        """Whether the copies in flight on the chunk only read it: a read of it need not wait for them."""
        entry = self.landing.get(chunk.id)
        return entry is not None and entry[2]

    def land(self, chunk: Chunk, *, block: bool = True) -> bool:
        """Whether no copy is writing into the chunk any more (block: wait for it); unpins it once landed."""
        entry = self.landing.get(chunk.id)
        if entry is None:
            return True
        if not self.device.landed(entry[1], wait=block):
            return False
        del self.landing[chunk.id]
        chunk.pins -= 1
        return True

    def wait(self, chunk: Chunk) -> None:
        """Finish the chunk's move, if any, waiting for its bytes (and for a copy landing in it)."""
        self.land(chunk)
        move = chunk.move
        if move is None:
            return
        if not move.future.done():
            t0 = time.perf_counter()
            wait([move.future])  # an error is raised by finish, after the rollback
            self.wait_seconds += time.perf_counter() - t0
        self.finish(chunk)

    def poll(self) -> bool:
        """Finish every move that is done; True if any was."""
        if self.landing:
            for chunk, *_ in list(self.landing.values()):
                self.land(chunk, block=False)
        done = [c for c in self.moving.values() if c.move.future.done()]
        for chunk in done:
            self.finish(chunk)
        return bool(done)

    def synchronize(self) -> None:
        """Wait for every move in flight, and every copy landing. A failure is raised once all of them have ended (the
        first, the others noted on it): none is left in flight behind it, so the caller (a close above all) finds
        every chunk settled, RESIDENT where the move left it or where it was."""
        errors: list[Exception] = []
        for chunk, *_ in list(self.landing.values()):
            try:
                self.land(chunk)
            except Exception as e:
                errors.append(e)
        for chunk in list(self.moving.values()):
            try:
                self.wait(chunk)
            except Exception as e:
                errors.append(e)
        if errors:
            for other in errors[1:]:
                add_note(errors[0], f"hetero: another move failed too: {other!r}")
            raise errors[0]

    def finish(self, chunk: Chunk) -> None:
        move = chunk.move
        assert move is not None and move.future.done()
        storage = self.storage
        del self.moving[chunk.id]
        chunk.move = None
        chunk.transition(ChunkState.RESIDENT)
        if move.staging is not None:
            storage.release_staging(move.staging)
        error = move.future.exception()
        if error is not None:
            # The source copy is intact: the chunk stays where it was, and what the move took is given back.
            # A chained read's buffer is still its donor's if the donor's write-back failed.
            donor_failed = move.after is not None and move.after.exception() is not None
            if move.new_payload is not None and not donor_failed:
                storage.free_buffer(move.dst, move.new_payload, chunk)
            if move.dst is Tier.NVME:
                storage.drop_nvme_copy(chunk)
            if isinstance(error, NvmeError):  # the store knows keys only: name the chunk and the tensors in it
                where = f"{chunk.describe()} from the {move.src.label} to the {move.dst.label} tier"
                raise type(error)(f"moving {where} failed: {error}") from error
            raise error
        start, end = move.future.result()
        if move.src is not Tier.NVME and not move.handed_off:
            storage.free_buffer(move.src, chunk.payload, chunk)
        # A chunk read back from NVMe keeps its swap copy: it is clean until a tensor is computed on.
        chunk.payload = move.new_payload
        chunk.tier = move.dst
        if move.dst is Tier.NVME or move.src is Tier.NVME:
            chunk.dirty = False
        copied = chunk.nbytes - move.skipped  # a FREE head is not copied ([Note: FREE slots are not stored])
        self.moved[(move.src, move.dst)] += copied
        if move.dst > move.src:
            self.counters["evictions"] += 1
        event = MoveEvent(chunk.id, chunk.kind, move.src, move.dst, copied, start, end, move.prefetch)
        for observer in self.observers:
            observer(event)

    # ---- views for room-making ----------------------------------------------------------------------------
    def leaving(self, tier: Tier) -> list[Chunk]:
        """Chunks whose move will give bytes of `tier` back when done: a move out of it (not handed to a chained
        read), and on the host a device<->NVMe hop's staging buffer. Unseen, a full host with only staging buffers
        in flight besides what cannot move had nothing to wait for, and raised out of memory."""
        host = tier is Tier.HOST
        return [
            c
            for c in self.moving.values()
            if (c.move.src == tier and not c.move.handed_off) or (host and c.move.staging is not None)
        ]

    def arriving(self, tier: Tier) -> list[Chunk]:
        """Chunks with a move into or out of `tier` in flight."""
        return [c for c in self.moving.values() if tier in (c.move.src, c.move.dst)]
