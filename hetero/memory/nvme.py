"""NVMe tier: chunk bytes swapped to one file on a local disk, with large aligned requests kept in flight.

`NvmeStore` is a key -> bytes store. Its pieces, one file each: the swap file and the slots in it
(`swap_file.py`: a private 0700 directory, O_DIRECT where the file system takes it, 4096-aligned slots reused when
freed, the file preallocated as it grows), and the block pipeline that moves each request (`swap_blocks.py`: blocks
of `block_bytes` on I/O and CPU thread pools, staging buffers, checksums). This file keeps the key table, the budget
and the order of requests: requests on one key run in the order they were made (each starts when the previous one
on the key is done); requests on different keys overlap freely.

O_DIRECT keeps swap traffic out of the page cache, which would otherwise compete with the host tier for RAM.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import torch

from hetero.config_values import nvme_dir_problem
from hetero.errors import NvmeError, NvmeSpaceError, NvmeUnavailableError
from hetero.io.checksum import DEFAULT, checksum_fn
from hetero.io.direct import ALIGN, align_up
from hetero.memory.lanes import LanePool
from hetero.memory.swap_blocks import BlockPipeline, Entry, Op
from hetero.memory.swap_file import SwapFile, making_prefix, remove_orphans

log = logging.getLogger("hetero.memory.nvme")


@dataclass
class NvmeStats:
    """Counters of completed requests (a failed request counts nowhere)."""

    bytes_written: int = 0
    bytes_read: int = 0
    writes: int = 0
    reads: int = 0
    # Thread-seconds spent inside pwrite/preadv. Divided by wall time x io_threads, this is how full the
    # device queue was kept: near 1 means the tier is not the bottleneck.
    write_io_seconds: float = 0.0
    read_io_seconds: float = 0.0


def _check_tensor(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{what} must be a CPU tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")


def _make_private_dir(directory: str | os.PathLike) -> str:
    d = os.fspath(directory)
    hint = "set nvme_dir to a writable directory on a local NVMe drive"
    if not os.path.exists(d):
        # The docs' placeholder pasted as it is gets said to be one (config_values.nvme_dir_problem).
        raise NvmeUnavailableError(nvme_dir_problem(d) or f"NVMe directory {d!r} does not exist; {hint}")
    if not os.path.isdir(d):
        raise NvmeUnavailableError(f"NVMe directory {d!r} is not a directory; {hint}")
    if not os.access(d, os.W_OK | os.X_OK):
        raise NvmeUnavailableError(
            f"NVMe directory {d!r} is not writable by this process; fix its permissions or {hint}"
        )
    # First, so that the default budget counts the space freed ([Note: swap directories left by a killed process]).
    remove_orphans(d)
    try:
        # Mode 0700: swapped weights stay private. Renamed once its file is locked (`publish`).
        return tempfile.mkdtemp(prefix=making_prefix(), dir=d)
    except OSError as e:
        raise NvmeUnavailableError(f"cannot create a swap directory in {d!r} ({e}); {hint}") from e


def _cleanup(pools: tuple[LanePool, ...], swap: SwapFile) -> None:
    """Release the store's resources; run once, by close() or when the store is garbage-collected."""
    for pool in pools:
        pool.shutdown(wait=False)  # idle: close() drained them, and a collected store has nothing in flight
    swap.close()


def _write_backlog(value: int | str | None) -> int | None:
    """The store's write backlog in blocks: "auto" takes HETERO_NVME_WRITE_BACKLOG, else 0, writes first
    ([Note: writes first by default] in lanes.py)."""
    where = "write_backlog"
    if value == "auto":
        env = os.environ.get("HETERO_NVME_WRITE_BACKLOG", "").strip()
        if not env:
            return 0
        value, where = env, f"HETERO_NVME_WRITE_BACKLOG={env!r}"
    if value is None or (isinstance(value, str) and value.lower() == "none"):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0 or isinstance(value, bool):
        raise ValueError(
            f"{where}: expected a number of blocks >= 0, None or 'none' (reads always first), got {value!r}"
        )
    return n


class NvmeStore:
    """Key -> bytes store on NVMe. write()/read() return futures at once; requests on one key run in order.

    Besides the documented arguments, `cpu_threads` sets the workers that copy and checksum blocks (default:
    half the cores, at least 2, at most io_threads) and `checksum` the algorithm of the per-block checksums
    (`hetero.io.checksum.ALGORITHMS`), `write_backlog` the write blocks each pool lets wait behind reads before a
    write goes first (default 0, writes first, or the environment's HETERO_NVME_WRITE_BACKLOG; None or "none": reads
    always first; [Note: writes first by default] in lanes.py). After construction `direct` says whether O_DIRECT
    is in use and `mem_align` the memory alignment it needs for a tensor to skip staging.
    Do not call close() from a future's done-callback: it waits for those very requests.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        budget: int | None = None,
        io_threads: int = 8,  # requests in flight: fio needs iodepth 8 to reach this project's VM disk's speed
        block_bytes: int = 8 << 20,
        staging_buffers: int = 8,
        direct: bool | None = None,
        verify: bool = True,
        cpu_threads: int | None = None,
        checksum: str = DEFAULT,
        write_backlog: int | str | None = "auto",
    ) -> None:
        write_backlog = _write_backlog(write_backlog)
        if block_bytes <= 0 or block_bytes % ALIGN:
            raise ValueError(f"block_bytes must be a positive multiple of {ALIGN}, got {block_bytes}")
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if staging_buffers < 1:
            raise ValueError(f"staging_buffers must be >= 1, got {staging_buffers}")
        if cpu_threads is None:
            cpu_threads = max(2, min(io_threads, (os.cpu_count() or 2) // 2))
        if cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {cpu_threads}")
        if budget is not None and budget < 0:
            raise ValueError(f"budget must be >= 0 or None, got {budget}")
        checksum_fn(checksum)  # an unknown name fails here, before anything is made
        self.block_bytes = block_bytes
        self.io_threads = io_threads
        self.budget = budget
        self.verify = verify
        self.stats = NvmeStats()
        self.directory = _make_private_dir(directory)
        try:
            self._file = SwapFile(self.directory, direct)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self.directory = self._file.directory  # its name once its file is locked
        self.path, self.direct, self.mem_align = self._file.path, self._file.direct, self._file.mem_align
        try:
            checks = checksum if verify else None
            self._blocks = BlockPipeline(
                self._file, block_bytes, (io_threads, cpu_threads), staging_buffers, checks, write_backlog
            )
        except BaseException:
            self._file.close()
            raise
        self.checksum = checksum  # the algorithm of every block's checksum ([Note: checksum algorithms])
        self._staging = self._blocks.staging
        self._finalizer = weakref.finalize(self, _cleanup, (self._blocks.io, self._blocks.cpu), self._file)
        # One re-entrant lock guards the key table, the slots and the chains: done-callbacks that take it may
        # run synchronously inside add_done_callback while it is held.
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._entries: dict[int, Entry] = {}
        self._tails: dict[int, concurrent.futures.Future] = {}  # last request queued per key
        self._inflight: set[concurrent.futures.Future] = set()
        self._used = 0
        self._closed = False
        # Called with the error of every request that fails (on the thread that saw it), before the caller learns
        # of it: the engine posts it to the other ranks ([Note: a rank's failure told to the others], comm/watch.py).
        self.on_failure: Callable[[BaseException], None] | None = None
        log.debug(
            "NVMe store at %s: direct=%s (memory alignment %d), %d I/O + %d CPU threads, %d B blocks",
            self.path,
            self.direct,
            self.mem_align,
            io_threads,
            cpu_threads,
            block_bytes,
        )

    # ------------------------------------------------------------------ public interface

    def write(self, key: int, src: torch.Tensor) -> concurrent.futures.Future[None]:
        """Store src's bytes under key (replacing any earlier value). src must stay unchanged until done.

        Raises at once: NvmeSpaceError (budget or file-system free space short), ValueError/TypeError (src not
        a contiguous CPU tensor), NvmeError (store closed). The future raises NvmeSpaceError/NvmeError when the
        disk fails the write, after which the key is absent.
        """
        _check_tensor(src, "src")
        op = Op(key, True, src)  # before touching any state: this is what can fail on odd tensors
        nbytes = len(op.mem)
        length = align_up(nbytes)
        with self._lock:
            self._check_open()
            old = self._entries.get(key)
            others = self._used - (old.nbytes if old is not None else 0)
            if self.budget is not None and others + nbytes > self.budget:
                err = NvmeSpaceError(
                    f"NVMe tier budget exhausted: key {key} needs {nbytes} B but only "
                    f"{self.budget - others} B of the {self.budget} B budget are free in "
                    f"{self.directory!r}; raise the NVMe budget or discard keys"
                )
                self._failed(err)
                raise err
            crcs = [0] * -(-nbytes // self.block_bytes)
            if old is not None and length <= old.length < 2 * length:
                # Same-size overwrite (the common case for a chunk): keep the slot. Earlier requests on the
                # key still using it finish first because requests on one key run in order.
                entry = Entry(old.offset, old.length, nbytes, crcs)
            else:
                try:
                    offset = self._file.allocate(key, length)
                except NvmeError as err:
                    self._failed(err)
                    raise
                entry = Entry(offset, length, nbytes, crcs)
                if old is not None:
                    self._retire(key, old)
            self._entries[key] = entry
            self._used = others + nbytes
            op.entry = entry
            return self._submit(op)

    def read(self, key: int, dst: torch.Tensor) -> concurrent.futures.Future[None]:
        """Fill dst with the bytes stored under key, after any earlier request on key has finished.

        Raises at once: KeyError (unknown key), ValueError (dst's size differs from what was stored). The
        future raises NvmeCorruptError (swap file truncated, or checksum mismatch with verify=True) or
        NvmeError (I/O error, or the write it was queued behind failed).
        """
        _check_tensor(dst, "dst")
        op = Op(key, False, dst)
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
            if entry is None:
                raise KeyError(key)
            if len(op.mem) != entry.nbytes:
                raise ValueError(f"dst holds {len(op.mem)} B but key {key} stores {entry.nbytes} B")
            op.entry = entry
            return self._submit(op)

    def discard(self, key: int) -> None:
        """Forget key (no-op if absent); its slot is reused once requests already queued on it finish."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._used -= entry.nbytes
                self._retire(key, entry)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def nbytes(self, key: int) -> int:
        with self._lock:
            return self._entries[key].nbytes

    @property
    def used_bytes(self) -> int:
        """Bytes stored under live keys (what counts against the budget; slot padding excluded)."""
        return self._used

    @property
    def file_bytes(self) -> int:
        """Size of the swap file (its high-water mark; discarded slots are reused, not returned to the fs)."""
        return self._file.size

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def staging_bytes(self) -> int:
        """Host bytes held by the O_DIRECT staging buffers created so far (bounded; unaligned requests only)."""
        return self._staging.created * self._staging.size

    def close(self) -> None:
        """Wait for every queued request, then delete the swap file and directory. Idempotent."""
        with self._lock:
            self._closed = True  # refuse new requests; the ones queued still run
            while self._inflight:
                self._idle.wait()
        self._blocks.io.shutdown(wait=True)
        self._blocks.cpu.shutdown(wait=True)
        self._finalizer()

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NvmeStore({self.path!r}, keys={len(self._entries)}, used={self._used}, direct={self.direct})"

    # ------------------------------------------------------------------ request plumbing

    def _check_open(self) -> None:
        if self._closed:
            raise NvmeError(f"NVMe store {self.directory!r} is closed")

    def _retire(self, key: int, entry: Entry) -> None:
        """Free entry's slot once the requests already queued on key (which may still use it) are done."""
        if entry.length == 0:
            return
        tail = self._tails.get(key)
        if tail is None:
            self._file.release(entry.offset, entry.length)
        else:
            tail.add_done_callback(lambda _f: self._release(entry.offset, entry.length))

    def _release(self, off: int, length: int) -> None:
        with self._lock:
            self._file.release(off, length)

    def _submit(self, op: Op) -> concurrent.futures.Future[None]:
        """Queue op behind the previous request on its key (caller holds the lock)."""
        fut = op.future
        fut.set_running_or_notify_cancel()  # a swap request cannot be cancelled once accepted
        # First callback, so the bookkeeping is done before anything chained on fut runs.
        fut.add_done_callback(lambda f, key=op.key: self._forget(key, f))
        prev = self._tails.get(op.key)
        self._tails[op.key] = fut
        self._inflight.add(fut)
        op.finish = self._finish
        if prev is None:
            self._blocks.start(op)
        else:
            prev.add_done_callback(lambda _f: self._blocks.start(op))
        return fut

    def _forget(self, key: int, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._inflight.discard(fut)
            if self._tails.get(key) is fut:
                del self._tails[key]
            if not self._inflight:
                self._idle.notify_all()

    def _finish(self, op: Op) -> None:
        err = op.error
        with self._lock:
            if err is None:
                if op.write:
                    self.stats.writes += 1
                    self.stats.bytes_written += op.entry.nbytes
                    self.stats.write_io_seconds += op.io_seconds
                else:
                    self.stats.reads += 1
                    self.stats.bytes_read += op.entry.nbytes
                    self.stats.read_io_seconds += op.io_seconds
            elif op.write:
                op.entry.failed = err
                if self._entries.get(op.key) is op.entry:  # a failed write leaves the key absent
                    del self._entries[op.key]
                    self._used -= op.entry.nbytes
                    # Free the slot now, not after op.future's callbacks: the caller may write again as soon
                    # as it sees the error. Nothing queued behind a failed write touches its slot (reads of it
                    # fail without I/O; a later write that took the slot over would have made it not current).
                    self._file.release(op.entry.offset, op.entry.length)
        if err is None:
            op.future.set_result(None)
        else:
            log.debug("NVMe %s of key %s failed: %s", "write" if op.write else "read", op.key, err)
            self._failed(err)  # before the future: whoever waits for it may stop the process
            op.future.set_exception(err)

    def _failed(self, err: BaseException) -> None:
        """Report a failed request to `on_failure`, which must not hide the error itself."""
        if self.on_failure is not None:
            try:
                self.on_failure(err)
            except Exception as e:
                log.debug("on_failure raised for %s: %s", err, e)
