"""Direct I/O: alignment, page-aligned host buffers, full vectored reads and writes, and O_DIRECT with its probes.

[Note: direct I/O]
O_DIRECT moves bytes between the disk and user memory with no page-cache copy: the cores stay free for checksums,
swap and checkpoint traffic does not compete with the host tier for RAM, and throughput does not swing with the
kernel's read-ahead. It needs the file offset, the length and the memory address of every request aligned to the
device's logical block size; ALIGN (4096) covers every block size in practice (512e and 4Kn drives alike), and
anonymous mmap memory is page-aligned, so an mmap-backed buffer satisfies the memory side for free. Since Linux 6.0
the block layer asks memory only for the device's DMA alignment (4 bytes on NVMe), which `probe_mem_align` finds.
Some file systems refuse the flag at open (tmpfs before Linux 6.6: EINVAL), others accept it at open and fail the
first request: `open_direct` proves it with one aligned write, `probe_mem_align` with writes read back (a file system
may take direct writes and refuse direct reads, or return other bytes), and callers fall back to the page cache when
either raises. A read or write call may move fewer bytes than asked (signals, the end of the file, limits per call):
`read_full` and `write_full` go on from where the last call stopped, with `advance` stepping over the buffers that
call finished.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable, Sequence

import torch

ALIGN = 4096  # file offset, length and memory alignment of O_DIRECT requests
O_DIRECT: int = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none
IOV_MAX = 512  # buffers per vectored call (the system's limit is at least 1024)
CALL_BYTES = 64 << 20  # bytes per call: large enough to stream at disk speed, small enough to bound one copy
_SYNC_FILE_RANGE_WRITE = 2  # sync_file_range: start writeback of a range's dirty pages, without waiting


def align_up(n: int, align: int = ALIGN) -> int:
    """Round n up to a multiple of align."""
    return -(-n // align) * align


def align_down(n: int, align: int = ALIGN) -> int:
    """Round n down to a multiple of align."""
    return n // align * align


def is_aligned(n: int, align: int = ALIGN) -> bool:
    return n % align == 0


class AlignedBuffer:
    """A page-aligned block of anonymous memory, seen as a memoryview and as a uint8 tensor.

    Both views share the mmap's memory; the tensor is used for GIL-free memcpy (torch's copy_ releases it),
    the memoryview for os.pwrite/os.preadv.
    """

    __slots__ = ("size", "_map", "view", "tensor")

    def __init__(self, size: int) -> None:
        self.size = align_up(max(size, 1))
        self._map = mmap.mmap(-1, self.size)
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)


def as_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes without a copy (little-endian on every platform torch supports)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def memory_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of nbytes of memory at address, which must stay allocated while the view is used."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


# ---- full reads and writes -------------------------------------------------------------------------------------
def advance(views: list[memoryview], i: int, n: int) -> int:
    """After a vectored call from views[i] moved n bytes: drop the buffers it finished, trim a partly done one, and
    return the index of the first unfinished buffer."""
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    if n:
        views[i] = views[i][n:]
    return i


def _batch(views: list[memoryview], i: int, call_bytes: int) -> list[memoryview]:
    """The buffers of one call from views[i]: at most IOV_MAX of them and call_bytes in all (the last one cut)."""
    batch, size = [], 0
    for v in views[i : i + IOV_MAX]:
        if size + len(v) >= call_bytes:
            batch.append(v[: call_bytes - size])
            break
        batch.append(v)
        size += len(v)
    return batch


def _views(views: memoryview | Sequence[memoryview]) -> list[memoryview]:
    if isinstance(views, memoryview):
        views = [views]
    return [v for v in views if len(v)]


def write_full(fd: int, views: memoryview | Sequence[memoryview], offset: int, *, call_bytes: int = CALL_BYTES) -> int:
    """Write `views` back to back at `offset`, in as many calls as it takes (pwrite for one buffer, pwritev for
    several); returns the bytes written. An OSError from the system propagates; a call that writes nothing raises."""
    views = _views(views)
    done = i = 0
    while i < len(views):
        batch = _batch(views, i, call_bytes)
        n = os.pwrite(fd, batch[0], offset + done) if len(batch) == 1 else os.pwritev(fd, batch, offset + done)
        if n <= 0:  # cannot happen for a regular file, but a zero return must not loop forever
            raise OSError(errno.EIO, f"write at offset {offset + done} made no progress")
        done += n
        i = advance(views, i, n)
    return done


def read_full(
    fd: int,
    views: memoryview | Sequence[memoryview],
    offset: int,
    *,
    direct: bool = False,
    call_bytes: int = CALL_BYTES,
) -> int:
    """Fill `views` back to back from `offset` with preadv, in as many calls as it takes; returns the bytes read,
    fewer than asked only at the end of the file (a truncated file: callers check). With `direct`, a read that ends
    off ALIGN also ends it: that is the end of the file, and a retry from there would be misaligned anyway."""
    views = _views(views)
    done = i = 0
    while i < len(views):
        n = os.preadv(fd, _batch(views, i, call_bytes), offset + done)
        if n <= 0:
            break
        done += n
        i = advance(views, i, n)
        if direct and n % ALIGN:
            break
    return done


# ---- O_DIRECT --------------------------------------------------------------------------------------------------
def open_direct(path: str, flags: int, mode: int = 0o600, *, probe: bool = False) -> int:
    """Open `path` with O_DIRECT; with `probe` (flags must allow writing), prove it with one aligned write at offset
    0, since some file systems accept the flag at open and refuse the first request. Raises OSError (the fd closed)
    when the platform has no O_DIRECT, the file system refuses it, or the probe fails ([Note: direct I/O])."""
    if not O_DIRECT:
        raise OSError(errno.EINVAL, "this platform has no O_DIRECT")
    fd = os.open(path, flags | O_DIRECT, mode)
    try:
        if probe and os.pwrite(fd, AlignedBuffer(ALIGN).view, 0) != ALIGN:
            raise OSError(errno.EIO, "short probe write")
    except BaseException:
        os.close(fd)
        raise
    return fd


def probe_mem_align(fd: int) -> int:
    """The smallest memory alignment (64, 512 or 4096) O_DIRECT accepts on the writable fd (it writes and reads back
    the file's first ALIGN bytes). Since Linux 6.0 the block layer asks only for the device's DMA alignment (4 bytes on
    NVMe), so torch's 64-byte aligned tensors can often be written straight from their own memory, with no staging
    copy. Raises OSError when even page-aligned memory fails to round-trip: a file system that took the probe write
    refuses direct reads, or returns other bytes than were written ([Note: direct I/O]); callers fall back to the page
    cache then, as for a refused open."""
    src, dst = AlignedBuffer(2 * ALIGN), AlignedBuffer(2 * ALIGN)
    src.tensor.copy_(torch.arange(2 * ALIGN).remainder(251).add(1))  # no zero byte: a read that moved nothing shows
    failure = OSError(errno.EIO, "")
    for align in (64, 512, ALIGN):
        data, out = src.view[align : align + ALIGN], dst.view[align : align + ALIGN]
        dst.tensor.zero_()
        try:
            if os.pwrite(fd, data, 0) != ALIGN or os.preadv(fd, [out], 0) != ALIGN:
                failure = OSError(errno.EIO, "a direct transfer of one aligned block was short")
            elif out != data:
                failure = OSError(errno.EIO, "a direct read returned other bytes than were written")
            else:
                return align
        except OSError as e:
            failure = e
    raise OSError(failure.errno, f"direct I/O of page-aligned memory failed: {failure.strerror or failure}")


# ---- the page cache around direct I/O --------------------------------------------------------------------------
def _libc(name: str, argtypes: list, restype: object) -> Callable | None:
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


_SYNC_FILE_RANGE = _libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int)
_MMAP = _libc(
    "mmap",
    [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64],
    ctypes.c_void_p,
)
_MINCORE = _libc("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p], ctypes.c_int)
_MUNMAP = _libc("munmap", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int)
_FALLOCATE = _libc("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], ctypes.c_int)
_STATFS = _libc("statfs", [ctypes.c_char_p, ctypes.c_void_p], ctypes.c_int)
_IN_MEMORY = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}  # statfs f_type of the file systems held in RAM
_SHARED = {  # statfs f_type of file systems other machines may mount too (FUSE: could be either, taken as shared)
    0x6969: "nfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x517B: "smb",
    0x00C36400: "ceph",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0x19830326: "beegfs",
    0x65735546: "fuse",
    0x01021997: "9p",
    0x5346414F: "afs",
    0x7461636F: "ocfs2",
    0x01161970: "gfs2",
    0xAAD7AAEA: "panfs",
    0x20030528: "orangefs",
}
_SAMPLES = 16  # pages of a range whose residency is asked for


def fallocate(fd: int, offset: int, length: int) -> bool:
    """Allocate [offset, offset + length) of the file, extending it, as Linux's fallocate does: extents are mapped and
    no byte is written. False where the platform or the file system cannot; OSError for a full disk and other
    failures. Never glibc's posix_fallocate, which writes zeros where the file system cannot, doubling the write
    traffic of what follows."""
    if _FALLOCATE is None or length <= 0:
        return _FALLOCATE is not None
    if _FALLOCATE(fd, 0, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(err, os.strerror(err))


def _fs_type(path: str) -> int | None:
    """statfs's f_type of the file system holding `path`, or None where that cannot be told."""
    if _STATFS is None:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on x86-64); f_type, a long, comes first
    if _STATFS(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def memory_file_system(path: str) -> str | None:
    """ "tmpfs" or "ramfs" when `path` is on a file system held in RAM (preallocating a file there takes memory), else
    None (also where that cannot be told)."""
    return _IN_MEMORY.get(_fs_type(path))


def shared_file_system(path: str) -> str | None:
    """The name of the network or cluster file system holding `path` (nfs, lustre, beegfs, ...: other machines may
    mount it too, and a lock taken here may not reach them), else None (also where that cannot be told)."""
    return _SHARED.get(_fs_type(path))


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range's dirty pages to disk now (Linux's sync_file_range), without waiting:
    a later fsync then finds little left to do. Only a hint: a no-op where there is none, errors ignored."""
    if _SYNC_FILE_RANGE is not None and length > 0:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def resident_share(fd: int, offset: int, length: int) -> float:
    """The share of a file range's pages that are in the page cache now, from a sample of _SAMPLES pages (0 where that
    cannot be told): reading cached pages through the cache is a memory copy, reading them with O_DIRECT would go to
    the disk again. Sampled because asking for every page took 20 us per MiB, 7% of a warm load."""
    if _MMAP is None or _MINCORE is None or _MUNMAP is None or length <= 0:
        return 0.0
    page = mmap.PAGESIZE
    base = align_down(offset, page)
    size = offset + length - base
    addr = _MMAP(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, base)  # maps only: no page is read
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return 0.0
    try:
        pages = -(-size // page)
        picks = sorted({k * (pages - 1) // max(_SAMPLES - 1, 1) for k in range(_SAMPLES)})
        vec = ctypes.c_ubyte()
        resident = 0
        for k in picks:
            if _MINCORE(addr + k * page, page, ctypes.byref(vec)) != 0:
                return 0.0
            resident += vec.value & 1  # bit 0: resident; the others are reserved
        return resident / len(picks)
    finally:
        _MUNMAP(addr, size)
