"""The NVMe tier's swap file: one file in the store's private directory, opened with O_DIRECT where the file system
takes it, and the space in it: 4096-aligned slots from a free list that reuses discarded ones, so that the file grows
only to the high-water mark of live data, preallocated as it grows ([Note: preallocating the swap file])."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import stat
import time
from bisect import bisect_left

from hetero.errors import NvmeError, NvmeSpaceError, NvmeUnavailableError, disk_trouble
from hetero.io.direct import fallocate, memory_file_system, open_direct, probe_mem_align, shared_file_system
from hetero.memory.swap_sigterm import disown, own

log = logging.getLogger("hetero.memory.nvme")

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
RESERVE_MAX = 2 << 30  # the most a growth reserves beyond what it needs ([Note: preallocating the swap file])
PREFIX = "hetero-swap-"  # the name of every store's private directory starts so, once its swap file is locked
MAKING = "hetero-making-"  # ... and so before ([Note: swap directories left by a killed process])
ORPHAN_AGE_S = 60.0  # how old a directory still being made must be to be taken for an orphan (same note)
_HINTS = {  # what to do after a transfer failed with this errno (a full disk is NvmeSpaceError's)
    errno.EROFS: "the file system became read-only (a disk error remounts ext4 so: see dmesg); point nvme_dir at a "
    "writable drive and restart from the last checkpoint",
    errno.EIO: "the drive reported an I/O error (see dmesg); check it, or point nvme_dir at another drive, and restart "
    "from the last checkpoint",
}


def io_error(e: OSError, what: str, key: int, offset: int, n: int, path: str) -> NvmeError:
    """The error for a failed transfer of n bytes of key at offset: NvmeSpaceError when the disk is full."""
    msg = f"{what} {n} B of key {key} at offset {offset} of swap file {path!r} failed"
    if e.errno in SPACE_ERRNOS:
        # A spent quota is not a full disk ([Note: what a failed disk operation means] in hetero/errors.py).
        return NvmeSpaceError(f"{msg}: {disk_trouble(e, os.path.dirname(path))}; or point nvme_dir at a larger drive")
    msg = f"{msg}: {e}"
    hint = _HINTS.get(e.errno)
    return NvmeError(f"{msg}; {hint}" if hint else msg)


def free_bytes(fd: int) -> int:
    """Free bytes (for an unprivileged user) of the file system holding the open file fd: asked of the file, not of
    its directory's path, which someone may have deleted while the file is still open and in use."""
    st = os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


def dir_prefix() -> str:
    """The start of the name of this machine's swap directories: PREFIX, the host name (no '-' in it), then '-'
    ([Note: swap directories left by a killed process])."""
    return f"{PREFIX}{_host()}-"


def making_prefix() -> str:
    """The start of the name of this machine's swap directories until their file is locked: MAKING, host, '-'."""
    return f"{MAKING}{_host()}-"


def remove_orphans(parent: str) -> list[str]:
    """Delete the swap directories in `parent` that no live store holds; returns them.

    [Note: swap directories left by a killed process]
    A store deletes its directory on close(), at exit and on SIGTERM ([Note: swap directories removed on SIGTERM]),
    but a process killed by SIGKILL (the OOM killer, a scheduler's hard limit) runs none of them, and its swap file,
    preallocated to the tier's high-water mark and beyond, stays: a crash loop filled the disk one swap file per
    kill. Each store holds an flock on its swap file for as long as the file is open (the kernel drops it when the
    process dies, however it dies; it holds across PID namespaces, where a PID recorded in a name would not), so a
    directory of this user whose file nobody locks is an orphan. A store is made under a name of its own (MAKING)
    and renamed to its PREFIX name once it locks its file (`publish`), so an unlocked file under a PREFIX name is an
    orphan at any age: a restart right after a SIGKILL (torchrun's elastic restart, a crash loop) removes the killed
    run's file. Formerly every directory had to be older than ORPHAN_AGE_S, since a store being made has not locked
    its file yet, and each quick restart added a swap file. Only directories still under a MAKING name (a store
    being made now, or one killed while it was) and PREFIX ones without a file (as an earlier hetero made them)
    wait for ORPHAN_AGE_S; they hold next to nothing. Failures are ignored: this is housekeeping, and the new
    store's own checks say what is wrong.
    On a file system other machines mount too (NFS, Lustre, BeeGFS, ...: `shared_file_system`) a lock may stay on the
    machine that took it (NFS mounted `nolock`, Lustre `localflock`, BeeGFS's default), so another node's live swap
    directory looked like an orphan here, and removing it failed that node's next swap read (ESTALE): two jobs of one
    user, or nodes of one job started a minute apart, sharing a scratch directory. There only directories named for
    this machine are considered (the name carries the host: `dir_prefix`); another machine's orphans wait for a store
    made there."""
    removed, freed = [], 0
    prefixes = (PREFIX, MAKING) if shared_file_system(parent) is None else (dir_prefix(), making_prefix())
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefixes)]
    except OSError:
        return removed
    now = time.time()
    for name in names:
        d = os.path.join(parent, name)
        try:
            st = os.lstat(d)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        young = now - st.st_mtime < ORPHAN_AGE_S
        if young and name.startswith(MAKING):  # perhaps being made now: its file is not locked yet
            continue
        try:
            fd = os.open(os.path.join(d, "swap"), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:  # made, then killed before its file was: nothing holds it either
            if young:  # or an earlier hetero's being made
                continue
            fd = -1
        except OSError:
            continue
        try:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live store: BlockingIOError
                freed += os.fstat(fd).st_blocks * 512
                shutil.rmtree(d, ignore_errors=True)
            else:  # only an empty one: a directory of this name holding other things is not a store's
                os.rmdir(d)
            removed.append(d)
        except OSError:
            continue
        finally:
            if fd >= 0:
                os.close(fd)
    if removed:
        log.warning(
            "removed %d swap directories (%s on disk) left in %s by processes that ended without closing their store: "
            "%s",
            len(removed),
            f"{freed / (1 << 30):.1f} GiB" if freed >= 1 << 30 else f"{freed / (1 << 20):.1f} MiB",
            parent,
            ", ".join(os.path.basename(d) for d in removed),
            extra={"all_ranks": True},  # this node's disk: rank 0 may sit on another
        )
    return removed


class Slots:
    """First-fit-by-size allocator of aligned extents in the swap file, with coalescing free list."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []  # (offset, length), sorted by offset, never adjacent
        self.end = 0  # high-water mark: the file never needs to be longer

    def _best(self, length: int) -> int | None:
        best = None
        for i, (_, n) in enumerate(self.free):
            if n >= length and (best is None or n < self.free[best][1]):
                best = i
        return best

    def _tail_free(self) -> int:
        """Length of the free extent that ends at the high-water mark (it can be extended in place)."""
        if self.free and self.free[-1][0] + self.free[-1][1] == self.end:
            return self.free[-1][1]
        return 0

    def growth(self, length: int) -> int:
        """How many bytes alloc(length) would add to the file."""
        return 0 if self._best(length) is not None else length - self._tail_free()

    def alloc(self, length: int) -> int:
        i = self._best(length)
        if i is not None:
            off, n = self.free[i]
            if n == length:
                del self.free[i]
            else:
                self.free[i] = (off + length, n - length)
            return off
        if self._tail_free():
            off = self.free.pop()[0]
        else:
            off = self.end
        self.end = off + length
        return off

    def release(self, off: int, length: int) -> None:
        i = bisect_left(self.free, (off, 0))
        if i < len(self.free) and self.free[i][0] == off + length:  # merge with the next extent
            length += self.free.pop(i)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == off:  # merge with the previous one
            off, length = self.free[i - 1][0], self.free[i - 1][1] + length
            i -= 1
            del self.free[i]
        self.free.insert(i, (off, length))


def _open(path: str, direct: bool | None) -> tuple[int, bool, int]:
    """Create the swap file (0600); use O_DIRECT if asked, or if direct is None and a probe write works.

    Returns the fd, whether it is O_DIRECT, and the memory alignment its I/O needs.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    reason = ""
    if direct is not False:
        fd = -1
        try:
            fd = open_direct(path, flags, 0o600, probe=True)  # [Note: direct I/O]
            mem_align = probe_mem_align(fd)
            os.ftruncate(fd, 0)
            return fd, True, mem_align
        except OSError as e:
            reason = str(e)
            if fd >= 0:
                os.close(fd)
            if os.path.exists(path):  # the open may have created it before refusing the flag
                os.unlink(path)
    if direct:
        raise NvmeUnavailableError(
            f"O_DIRECT is not supported for {path!r} ({reason}); pass direct=None to fall back to buffered "
            "I/O or put nvme_dir on a file system that supports it (ext4, xfs on a local NVMe drive)"
        )
    if direct is None:
        log.info("O_DIRECT unavailable for %s (%s); using buffered I/O", path, reason, extra={"all_ranks": True})
    try:
        return os.open(path, flags, 0o600), False, 1
    except OSError as e:
        raise NvmeUnavailableError(f"cannot create swap file {path!r} ({e})") from e


def publish(directory: str) -> str:
    """Rename a store's directory from its MAKING name to its PREFIX one, now that its file is locked; returns the
    name it has ([Note: swap directories left by a killed process]). One that cannot be renamed keeps its name:
    the sweep takes it only when old and unlocked."""
    base = os.path.basename(directory)
    if not base.startswith(MAKING):
        return directory
    final = os.path.join(os.path.dirname(directory), PREFIX + base[len(MAKING) :])
    own(final)  # first: a SIGTERM during the rename finds it under one of the names
    try:
        os.rename(directory, final)
    except OSError as e:
        disown(final)
        log.debug("cannot rename swap directory %s to %s (%s): it keeps its name", directory, final, e)
        return directory
    disown(directory)
    return final


class SwapFile:
    """The file `swap` in a store's private `directory` and its slots. Not thread-safe: the store serializes calls.

    `direct` says whether O_DIRECT is in use and `mem_align` the memory alignment it needs; `fd` is -1 once closed.
    """

    def __init__(self, directory: str, direct: bool | None) -> None:
        self.pid = os.getpid()  # the process that made it: the only one that removes it
        own(directory)  # [Note: swap directories removed on SIGTERM]
        try:
            self.fd, self.direct, self.mem_align = _open(os.path.join(directory, "swap"), direct)
        except BaseException:
            disown(directory)
            raise
        try:
            # Held while the file is open: other stores tell this live directory from a killed process's
            # ([Note: swap directories left by a killed process]).
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:  # a file system without locks (ENOLCK): other stores cannot lock it either, and skip it
            log.debug("cannot lock %s (%s): a killed run's copy of it will not be cleaned up", directory, e)
        self.directory = publish(directory)  # its name once locked; the open file goes with it
        self.path = os.path.join(self.directory, "swap")
        self.slots = Slots()
        # [Note: preallocating the swap file], except where files are held in RAM (tmpfs): that would take memory early.
        self.prealloc = memory_file_system(self.directory) is None  # the published name: the making one is gone
        self.reserved = 0  # bytes preallocated from the start of the file (at least `slots.end` while prealloc)

    @property
    def size(self) -> int:
        """Bytes in the file (its high-water mark; discarded slots are reused, not returned to the file system)."""
        return os.fstat(self.fd).st_size if self.fd >= 0 else 0

    def allocate(self, key: int, length: int) -> int:
        """Offset of a free slot of length bytes for key, growing the file if none fits. Raises NvmeSpaceError, before
        any byte is queued, when the file system has no room for the growth."""
        if length == 0:
            return 0
        growth, free = self.slots.growth(length), 0
        if self.prealloc:  # what the file has preallocated beyond its slots needs no more free space
            growth = max(0, self.slots.end + growth - self.reserved)
        if growth:
            # Check before queueing anything, so a full disk is a clear error now rather than a failed write.
            free = free_bytes(self.fd)
            if growth > free:
                raise NvmeSpaceError(
                    f"not enough free space for the NVMe tier in {self.directory!r}: key {key} needs {growth} B "
                    f"more swap file but the file system has {free} B free; free disk space or point nvme_dir "
                    "at a larger drive"
                )
        offset = self.slots.alloc(length)
        if self.prealloc and self.slots.end > self.reserved:
            self._preallocate(key, offset, length, free)
        return offset

    def _preallocate(self, key: int, offset: int, length: int, free: int) -> None:
        """[Note: preallocating the swap file]
        Preallocating turns the block writes into overwrites of allocated extents, which file systems run in
        parallel (appending direct writes serialize on the inode), and reserves the space. Whether to is decided
        from what the file system is, never from how long a call took: a former check that turned preallocation off
        when fallocate ran under 50 GB/s (to catch tmpfs, which allocates RAM, and glibc's emulation, which writes
        zeros) fired on a busy ext4 too, after which appending writes cost the tier a quarter of its write bandwidth
        (1.6-1.8 vs 2.3 GB/s for 4 GiB). Now tmpfs is known by its statfs type and `fallocate` never emulates.

        Each growth reserves ahead, as much again as the file holds (at most RESERVE_MAX, and at most an eighth of
        the free space): ext4's fallocate waits for every direct write in flight on the file (`inode_dio_wait`), so
        preallocating each chunk's slot as it came drained the write queue once a chunk. On a 2-core AMD EPYC VM
        (`benchmarks/nvme_bandwidth.py --no-fio`, 1 GiB in 16 chunks of 64 MiB, a fresh store a pass) the tier
        wrote 1.8-2.1 GB/s against 2.5-3.0 for a Python loop of O_DIRECT writes into a file preallocated at once; one
        fallocate for the whole file, 2.8. A reservation that finds no room falls back to the growth alone."""
        need = self.slots.end - self.reserved
        ahead = max(need, min(self.reserved, RESERVE_MAX, free // 8))
        start = self.reserved
        try:
            try:
                done = self._fallocate(start, ahead)
            except OSError:
                if ahead == need:
                    raise
                ahead = need  # no room for the reservation: the growth alone
                done = self._fallocate(start, ahead)
        except OSError as e:
            self.slots.release(offset, length)
            raise io_error(e, "preallocating", key, start, need, self.path) from e
        if not done:
            self.prealloc = False  # not supported here: extending writes grow the file instead
            log.debug("fallocate unsupported for %s; not preallocating", self.path)
            return
        self.reserved = start + ahead

    def _fallocate(self, start: int, length: int) -> bool:
        """Preallocate; False where the file system cannot. A full disk raises OSError."""
        try:
            return fallocate(self.fd, start, length)
        except OSError as e:
            if e.errno in SPACE_ERRNOS:
                raise
            return False

    def release(self, offset: int, length: int) -> None:
        """Give a slot back (a zero-length one is no slot)."""
        if length:
            self.slots.release(offset, length)

    def close(self) -> None:
        """Close the file and delete the directory with it (in the process that made it: a forked child closes its
        copy of the descriptor only). Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if os.getpid() == self.pid:
            shutil.rmtree(self.directory, ignore_errors=True)
            disown(self.directory)  # after: a SIGTERM meanwhile still finds it
