"""How the NVMe tier moves one request: cut into `block_bytes` blocks, each block a chain of stages on two thread pools.

`io_threads` workers only sit in os.pwrite/os.preadv, so that many requests are always queued on the device (what an
NVMe drive needs to reach its bandwidth); `cpu_threads` workers do the staging copies and the per-block checksums
around them ([Note: checksum algorithms]). All of these release the GIL. Under O_DIRECT, a block whose memory or
length is too unaligned for the file goes through a page-aligned staging buffer from a bounded pool; others (the host
tier's page-aligned buffers, and on NVMe with Linux >= 6.0 any 64-byte aligned torch tensor) are read and written in
place. A request is done (its `finish` called) only after every chain of every block has ended.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hetero.errors import NvmeCorruptError, NvmeError
from hetero.io.checksum import checksum_fn
from hetero.io.direct import ALIGN, AlignedBuffer, align_up, read_full, write_full
from hetero.memory.aligned import StagingPool
from hetero.memory.lanes import LanePool
from hetero.memory.swap_file import SwapFile, io_error

_FADVISE = getattr(os, "posix_fadvise", None)
# Said with every corrupt read: the store wrote and checksummed these bytes itself, so the file changed under it.
_LOST = (
    "something other than this store changed the file (another program, a disk fault); these values are lost: "
    "restart from the last checkpoint"
)


@dataclass(eq=False)
class Entry:
    """One version of one key: its slot [offset, offset + length) holds nbytes, with one crc per block."""

    offset: int
    length: int
    nbytes: int
    crcs: list[int]
    failed: BaseException | None = None  # set when the write of this version failed; reads then refuse


class Op:
    """One read or write of one key: its future completes only after every block has finished, so the
    caller's tensor is never touched once the future is done."""

    __slots__ = (
        "entry",
        "error",
        "finish",
        "future",
        "io_seconds",
        "key",
        "lock",
        "mem",
        "ptr",
        "remaining",
        "tensor",
        "write",
    )

    def __init__(self, key: int, write: bool, t: torch.Tensor) -> None:
        self.key, self.write = key, write
        self.entry: Entry  # set by the store once the request is accepted
        self.finish: Callable[[Op], None]  # the store's bookkeeping, called once when the request is done
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.tensor = t.detach().reshape(-1).view(torch.uint8)  # bytes of any dtype, bf16 included
        self.mem = memoryview(self.tensor.numpy())  # buffer for os.pwrite/os.preadv; keeps the tensor alive
        self.ptr = t.data_ptr()
        self.remaining = 0
        self.io_seconds = 0.0
        self.error: BaseException | None = None
        self.lock = threading.Lock()


class Block:
    """One block_bytes piece [start, stop) of a request, moving through its stages."""

    __slots__ = ("buf", "index", "io_seconds", "start", "stop")

    def __init__(self, index: int, start: int, stop: int) -> None:
        self.index, self.start, self.stop = index, start, stop
        self.io_seconds = 0.0
        self.buf: AlignedBuffer | None = None  # staging buffer held between stages, released at the end


_Next = tuple[LanePool, "_Stage"] | None  # next stage of a block, None when done
_Stage = Callable[[Op, Block], _Next]


class BlockPipeline:
    """The thread pools, the staging pool and the block stages of one store's swap file."""

    def __init__(
        self,
        swap: SwapFile,
        block_bytes: int,
        threads: tuple[int, int],
        staging_buffers: int,
        checksum: str | None,
        write_backlog: int | None = None,
    ) -> None:
        """threads: (I/O, CPU) workers; checksum: the algorithm every block is checked with, None for no checks;
        write_backlog: write blocks each pool lets wait behind reads ([Note: a bounded write backlog])."""
        io_threads, cpu_threads = threads
        self.swap = swap
        self.block_bytes = block_bytes
        self.verify = checksum is not None
        self.checksum = checksum  # the algorithm of every block's checksum ([Note: checksum algorithms])
        self._checksum = checksum_fn(checksum) if checksum is not None else None
        self.staging = StagingPool(staging_buffers, block_bytes)
        # Two pools, so the copies and checksums never hold an I/O thread: io_threads requests stay queued
        # on the device while cpu_threads workers stage and check the blocks around them. Both order reads and
        # writes by one backlog ([Note: reads before writes], [Note: writes first by default] in lanes.py).
        self.io = LanePool(io_threads, name="hetero-nvme-io", backlog=write_backlog)
        self.cpu = LanePool(cpu_threads, name="hetero-nvme-cpu", backlog=write_backlog)

    def start(self, op: Op) -> None:
        """Queue every block of op; op.finish(op) runs once all are done (at once if there is nothing to move)."""
        # Runs as a done-callback: an exception escaping it would be swallowed and op.future never completed.
        try:
            if not op.write and op.entry.failed is not None:
                raise NvmeError(f"key {op.key} cannot be read: its last write failed ({op.entry.failed})")
            n, bb = op.entry.nbytes, self.block_bytes
            blocks = [Block(i, a, min(a + bb, n)) for i, a in enumerate(range(0, n, bb))]
        except BaseException as e:
            op.error = e
            blocks = []
        if not blocks:
            op.finish(op)
            return
        # One chain of stages per block, and a second one for a write's checksum of unstaged memory: it runs beside
        # the write ([Note: checksums beside writes]).
        unstaged = [b for b in blocks if not self._staged(op, b)] if op.write and self.verify else []
        op.remaining = len(blocks) + len(unstaged)
        for b in unstaged:
            self._step(self.cpu, self._write_checksum, op, Block(b.index, b.start, b.stop))
        for b in blocks:
            if not op.write:
                first = (self.io, self._read_io)
            elif self._staged(op, b):
                first = (self.cpu, self._write_prep)
            else:
                first = (self.io, self._write_io)
            if self._staged(op, b):
                # Take the staging buffer before the block enters a pool, without blocking anyone: a worker
                # waiting for a buffer could be the very one needed to finish the block that holds it.
                self.staging.acquire_async(lambda buf, b=b, first=first: self._staged_start(op, b, buf, first))
            else:
                self._step(*first, op, b)

    def _staged_start(self, op: Op, b: Block, buf: AlignedBuffer, first: tuple) -> None:
        b.buf = buf
        self._step(*first, op, b)

    def _step(self, pool: LanePool, fn: _Stage, op: Op, b: Block) -> None:
        try:
            pool.submit(self._run, fn, op, b, urgent=not op.write)
        except BaseException as e:  # only after shutdown, which close() defers until nothing is in flight
            self._end_block(op, b, e)

    def _run(self, fn: _Stage, op: Op, b: Block) -> None:
        """Run one stage of a block; it returns the next stage's (pool, function), or None when done."""
        nxt, exc = None, None
        try:
            if op.error is None:  # after a failed block the request is lost anyway: skip the rest
                nxt = fn(op, b)
        except BaseException as e:
            exc = e
        if nxt is None:
            self._end_block(op, b, exc)
        else:
            self._step(nxt[0], nxt[1], op, b)

    def _end_block(self, op: Op, b: Block, exc: BaseException | None) -> None:
        if b.buf is not None:
            self.staging.release(b.buf)
            b.buf = None
        with op.lock:
            if exc is not None and op.error is None:
                op.error = exc
            op.remaining -= 1
            op.io_seconds += b.io_seconds
            last = op.remaining == 0
        if last:
            op.finish(op)

    def _staged(self, op: Op, b: Block) -> bool:
        """Whether O_DIRECT forces this block through a staging buffer (unaligned memory or length)."""
        return self.swap.direct and ((b.stop - b.start) % ALIGN != 0 or (op.ptr + b.start) % self.swap.mem_align != 0)

    def _write_prep(self, op: Op, b: Block) -> _Next:
        """CPU stage: copy into an aligned staging buffer, and checksum it."""
        n = b.stop - b.start
        b.buf.tensor[:n].copy_(op.tensor[b.start : b.stop])  # torch's copy releases the GIL
        padded = align_up(n)
        if padded != n:
            b.buf.tensor[n:padded].zero_()  # deterministic padding, no stale staging bytes on disk
        if self.verify:
            op.entry.crcs[b.index] = self._checksum(b.buf.view[:n])  # releases the GIL for large buffers
        return self.io, self._write_io

    def _write_checksum(self, op: Op, b: Block) -> _Next:
        """CPU stage beside an unstaged block's write: its checksum, from the caller's memory.

        [Note: checksums beside writes]
        The bytes a write sends are the caller's, unchanged until the request is done, so their checksum need not
        come first: the block goes to the disk at once while a CPU worker checksums the same memory, and the
        request completes when both have. A checksum computed before the write delayed every block by a thread
        hand-off and the checksum itself, which cost the tier a fifth of its write bandwidth against fio on the
        loaded 2-core VM (1.59 vs 1.93 GB/s without verification, XXH3 and CRC32 alike)."""
        op.entry.crcs[b.index] = self._checksum(op.mem[b.start : b.stop])  # releases the GIL for large buffers
        return None

    def _write_io(self, op: Op, b: Block) -> _Next:
        n = b.stop - b.start
        data = op.mem[b.start : b.stop] if b.buf is None else b.buf.view[: align_up(n)]
        offset = op.entry.offset + b.start
        t0 = time.perf_counter()
        try:
            write_full(self.swap.fd, data, offset)
        except OSError as e:
            raise io_error(e, "writing", op.key, offset, len(data), self.swap.path) from e
        b.io_seconds = time.perf_counter() - t0
        return None

    def _read_io(self, op: Op, b: Block) -> _Next:
        n = b.stop - b.start
        offset = op.entry.offset + b.start
        if b.buf is not None:
            data = b.buf.view[: align_up(n)]
        else:
            data = op.mem[b.start : b.stop]
        t0 = time.perf_counter()
        try:
            got = read_full(self.swap.fd, data, offset, direct=self.swap.direct)
        except OSError as e:
            raise io_error(e, "reading", op.key, offset, len(data), self.swap.path) from e
        b.io_seconds = time.perf_counter() - t0
        if got < n:  # checked whether or not verify is on: a short file must never pass as data
            raise NvmeCorruptError(
                f"swap file {self.swap.path!r} is truncated: key {op.key} needs {n} B at offset {offset} "
                f"but only {got} B could be read; {_LOST}"
            )
        if not self.swap.direct and _FADVISE is not None:
            # These pages will not be read again soon: keep host RAM for the host tier.
            _FADVISE(self.swap.fd, offset, n, os.POSIX_FADV_DONTNEED)
        return (self.cpu, self._read_post) if b.buf is not None or self.verify else None

    def _read_post(self, op: Op, b: Block) -> _Next:
        """CPU stage: check the block's checksum, then copy it out of its staging buffer if it used one."""
        n = b.stop - b.start
        data = op.mem[b.start : b.stop] if b.buf is None else b.buf.view[:n]
        if self.verify:
            crc = self._checksum(data)
            if crc != op.entry.crcs[b.index]:
                raise NvmeCorruptError(
                    f"checksum mismatch in swap file {self.swap.path!r}: key {op.key}, {n} B at offset "
                    f"{op.entry.offset + b.start} ({self.checksum} {crc:#x}, expected {op.entry.crcs[b.index]:#x}); "
                    f"{_LOST}"
                )
        if b.buf is not None:
            op.tensor[b.start : b.stop].copy_(b.buf.tensor[:n])
        return None
