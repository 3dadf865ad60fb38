"""Our own streaming reader and writer of the safetensors file format: no dependency, no pickle, nothing held whole.

A safetensors file is: 8 bytes (little-endian u64) giving the header's length N, N bytes of JSON mapping each
tensor's name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data area that follows, plus an
optional "__metadata__" of strings), then the raw little-endian bytes of every tensor back to back. Because the
header comes first, a writer must know every tensor's name, dtype and shape before it writes a byte of data:
`TensorWriter` takes that plan up front, writes the header, then takes the tensors in plan order, alone or as runs
that it writes on I/O threads (see [Note: overlapped writes]). `TensorReader` parses the header and reads any
tensor, or any element range of one, straight into a caller's buffer with `preadv` (O_DIRECT where the file's
layout and the buffer allow, see [Note: direct reads]), so a reader never holds more than it asks for.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import mmap
import os
import struct
import zlib
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hetero.errors import CheckpointError

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_ALIGN = 8  # the header is padded with spaces so that the data starts 8-byte aligned, as the reference writer does
_MAX_HEADER = 1 << 30  # a header length beyond this is a corrupt file, not a real header
_IO_BLOCK = 64 << 20  # bytes per write call: large enough to stream at disk speed, small enough to bound copies
_IOV_MAX = 512  # buffers per preadv call (the system's limit is at least 1024)
_WRITE_THREADS = 2  # one checksums a run while the other is in a write call (both release the GIL)
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of a range's dirty pages, without waiting for it
_PAD_PREFIX = "__padding__:"  # names of the filler tensors of an aligned layout; no manifest lists them
DIRECT_ALIGN = 4096  # O_DIRECT's file offset, length and memory alignment (every block size in practice)
_DIRECT_MIN = 1 << 20  # a smaller stretch is read through the page cache: O_DIRECT pays off on large requests
PAD_MAX = DIRECT_ALIGN  # padding between two tensors is shorter than this; a read may step over it
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _writeback_starter() -> object | None:
    """Linux's sync_file_range, or None where there is none (then the final fsync does all the work)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_START_WRITEBACK = _writeback_starter()


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: where its bytes are (absolute file offsets) and what they are."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offset of the first byte in the file
    end: int  # one past the last byte

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def as_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes without a copy (little-endian on every platform torch supports)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class TensorWriter:
    """Writes one safetensors file: `plan` fixes every (name, dtype, shape[, residue]) in order; `write` streams one
    tensor, `submit` a run of them on the I/O threads.

    The file is fsync'd on `close`. `crcs` holds each tensor's CRC32 once written; `header_crc` the header's.

    [Note: aligned layout]
    The header is padded with spaces so that the data area starts at a multiple of `align` (8 by default, as the
    reference writer does). A planned `residue` asks for the tensor to start at a file offset equal to it modulo
    `align`: where the previous tensor ends elsewhere, a zero-filled U8 tensor named `__padding__:<offset>` fills
    the gap, because the format allows no holes in the data area. Checkpoints use align=DIRECT_ALIGN with each
    chunk tensor's residue in its chunk buffer, so that a load reads chunks with O_DIRECT in place ([Note: direct
    reads]); padding tensors are in no manifest, and the file stays readable by any safetensors reader.

    [Note: overlapped writes]
    Every tensor's place in the file is fixed by the plan, so a run can be written with `pwritev` (one call for many
    tensors) on a thread while the caller prepares the next run (brings a chunk back from NVMe, copies it off the
    device). The thread checksums the run and then, once written, asks the kernel to start writing those pages to
    disk (sync_file_range, Linux): the disk works while later runs are still being copied into the page cache, and
    the final fsync, which alone makes the file durable, finds little left to do. The caller keeps each run's
    memory unchanged until its future is done.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        plan: Iterable[tuple],
        *,
        metadata: Mapping[str, str] | None = None,
        align: int = _ALIGN,
    ) -> None:
        self.path = os.fspath(path)
        header: dict[str, object] = {}
        self._order: list[Entry] = []
        self._gaps: dict[str, int] = {}  # padding bytes written just before a tensor ([Note: aligned layout])
        offset = 0
        for item in plan:
            name, dtype, shape = item[:3]
            residue = item[3] if len(item) > 3 else None
            if name in header:
                raise ValueError(f"tensor {name!r} is planned twice in {self.path}")
            if residue is not None and (gap := (residue - offset) % align):
                header[f"{_PAD_PREFIX}{offset}"] = {
                    "dtype": "U8",
                    "shape": [gap],
                    "data_offsets": [offset, offset + gap],
                }
                self._gaps[name] = gap
                offset += gap
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": DTYPE_CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._order.append(Entry(name, dtype, tuple(shape), offset, offset + nbytes))
            offset += nbytes
        if metadata:
            header["__metadata__"] = dict(metadata)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(len(raw) + 8) % align)
        self.header_bytes = struct.pack("<Q", len(raw)) + raw
        self.data_start = len(self.header_bytes)
        self.size = self.data_start + offset  # the file's final size in bytes
        self.header_crc = zlib.crc32(self.header_bytes)
        self.crcs: dict[str, int] = {}
        self._zeros = memoryview(bytes(align))
        self._next = 0
        self._pool: ThreadPoolExecutor | None = None  # made on the first `submit`
        self._futures: list[Future] = []
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._write(memoryview(self.header_bytes))

    def write(self, name: str, t: torch.Tensor) -> None:
        """Write the next planned tensor (any device; converted to the planned dtype if it differs)."""
        self.submit([(name, t)]).result()

    def write_parts(self, name: str, numel: int, parts: Iterable[torch.Tensor]) -> None:
        """Write the next planned tensor (`numel` elements) from consecutive flat CPU parts, each written before the
        next is asked for: a tensor need never be whole in memory (consolidation writes tiles this way)."""
        self._drain()  # runs submitted before are written first: offsets and checksums stay in plan order
        if (
            self._next >= len(self._order)
            or self._order[self._next].name != name
            or self._order[self._next].numel != numel
        ):
            raise ValueError(f"{self.path}: wrote {name!r} ({numel} elements) out of the plan's order or size")
        entry = self._order[self._next]
        self._next += 1
        offset = self.data_start + entry.begin
        if name in self._gaps:
            gap = self._gaps[name]
            os.pwrite(self._fd, self._zeros[:gap], offset - gap)
        crc, end = 0, self.data_start + entry.end
        for part in parts:
            view = as_bytes(part if part.dtype == entry.dtype else part.to(entry.dtype))
            crc = zlib.crc32(view, crc)
            while len(view):
                n = os.pwrite(self._fd, view[:_IO_BLOCK], offset)
                offset += n
                view = view[n:]
        if offset != end:
            raise ValueError(f"{self.path}: {name!r}: its parts hold {offset - self.data_start - entry.begin} bytes")
        self.crcs[name] = crc

    def submit(self, run: list[tuple[str, torch.Tensor]]) -> Future:
        """Write the next planned tensors (any device; converted to the planned dtype if it differs) on an I/O
        thread; the returned future is done once they are written and checksummed. The caller must leave CPU
        tensors unchanged until then (device tensors are copied to the host here first)."""
        entries, views = [], []
        for name, t in run:
            if self._next >= len(self._order) or self._order[self._next].name != name:
                expected = self._order[self._next].name if self._next < len(self._order) else "nothing (plan done)"
                raise ValueError(f"{self.path}: wrote {name!r} but the plan expects {expected!r} next")
            entry = self._order[self._next]
            if t.numel() != entry.numel:
                raise ValueError(f"{self.path}: {name!r} has {t.numel()} elements, the plan says {entry.numel}")
            if t.dtype != entry.dtype:
                t = t.to(entry.dtype)
            entries.append(entry)
            views.append(as_bytes(t))
            self._next += 1
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_WRITE_THREADS, thread_name_prefix="hetero-ckpt-write")
        future = self._pool.submit(self._write_run, entries, views)
        self._futures.append(future)
        return future

    def _write_run(self, entries: list[Entry], views: list[memoryview]) -> None:
        crcs = [zlib.crc32(v) for v in views]
        if not entries:
            return
        start = offset = self.data_start + entries[0].begin - self._gaps.get(entries[0].name, 0)
        padded = []
        for e, v in zip(entries, views):
            if e.name in self._gaps:
                padded.append(self._zeros[: self._gaps[e.name]])
            padded.append(v)
        views = padded
        i = 0
        while i < len(views):
            batch, size = views[i : i + _IOV_MAX], 0
            for j, v in enumerate(batch):  # bound the bytes of one call, as `_write` does
                size += len(v)
                if size >= _IO_BLOCK:
                    batch = batch[: j + 1]
                    break
            n = os.pwritev(self._fd, batch, offset)
            offset += n
            i = _consume(views, i, n)
        if _START_WRITEBACK is not None and offset > start:
            _START_WRITEBACK(self._fd, start, offset - start, _SYNC_FILE_RANGE_WRITE)  # only a hint: ignore errors
        for e, c in zip(entries, crcs):
            self.crcs[e.name] = c

    def _drain(self) -> None:
        """Wait for every submitted run; raises the first failure after all have finished."""
        futures, self._futures = self._futures, []
        errors = [f.exception() for f in futures]
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            self._drain()
            if self._next != len(self._order):
                missing = [e.name for e in self._order[self._next :]]
                raise ValueError(f"{self.path}: {len(missing)} planned tensors were never written: {missing[:5]}")
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1

    def abort(self) -> None:
        if self._fd >= 0:
            try:
                self._drain()  # no thread may write into a closed (or reused) descriptor
            except Exception:
                pass
            finally:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> TensorWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _write(self, data: memoryview) -> None:
        for i in range(0, len(data), _IO_BLOCK):
            block = data[i : i + _IO_BLOCK]
            while len(block):
                n = os.write(self._fd, block)
                block = block[n:]


def _consume(views: list[memoryview], i: int, n: int) -> int:
    """After a vectored call from views[i] moved n bytes: drop the buffers it finished, trim a partly done one, and
    return the index of the first unfinished buffer."""
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    if n:
        views[i] = views[i][n:]
    return i


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _align_up(n: int) -> int:
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN


def _mapper() -> tuple | None:
    """libc's mmap, mincore and munmap (Linux and most Unix), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mmap_, mincore, munmap = libc.mmap, libc.mincore, libc.munmap
    except (OSError, AttributeError):
        return None
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    mmap_.restype = ctypes.c_void_p
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    mincore.restype = ctypes.c_int
    munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    munmap.restype = ctypes.c_int
    return mmap_, mincore, munmap


_MAPPER = _mapper()
_SAMPLES = 16  # pages of a range whose residency is asked for


def _resident_share(fd: int, offset: int, length: int) -> float:
    """The share of a file range's pages that are in the page cache now, from a sample of _SAMPLES pages (0 where that
    cannot be told): reading cached pages through the cache is a memory copy, reading them with O_DIRECT would go to
    the disk again. Sampled because asking for every page took 20 us per MiB, 7% of a warm load."""
    if _MAPPER is None or length <= 0:
        return 0.0
    mmap_, mincore, munmap = _MAPPER
    page = mmap.PAGESIZE
    base = offset // page * page
    size = offset + length - base
    addr = mmap_(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, base)  # maps only: no page is read
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return 0.0
    try:
        pages = -(-size // page)
        picks = sorted({k * (pages - 1) // max(_SAMPLES - 1, 1) for k in range(_SAMPLES)})
        vec = ctypes.c_ubyte()
        resident = 0
        for k in picks:
            if mincore(addr + k * page, page, ctypes.byref(vec)) != 0:
                return 0.0
            resident += vec.value & 1  # bit 0: resident; the others are reserved
        return resident / len(picks)
    finally:
        munmap(addr, size)


class TensorReader:
    """Reads tensors, or element ranges of them, from one safetensors file by offset; checks what it can."""

    def __init__(self, path: str | os.PathLike, *, direct: bool = True) -> None:
        self.path = os.fspath(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file is missing; the checkpoint is incomplete") from None
        if hasattr(os, "posix_fadvise"):  # larger read-ahead: readers mostly go through a file front to back
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self._dfd = -1  # the same file opened with O_DIRECT, where it can be (see [Note: direct reads])
        self._direct_ok = False
        try:
            self.size = os.fstat(self._fd).st_size
            self.header_bytes, self.entries, self.metadata = self._parse()
            if direct and _O_DIRECT and self.size >= _DIRECT_MIN:
                try:
                    self._dfd = os.open(self.path, os.O_RDONLY | _O_DIRECT)
                    self._direct_ok = True
                except OSError:  # tmpfs and some others refuse the flag (EINVAL): the page cache it is
                    self._dfd = -1
        except BaseException:
            os.close(self._fd)
            raise

    def _parse(self) -> tuple[bytes, dict[str, Entry], dict[str, str]]:
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise CheckpointError(f"{self.path}: truncated ({self.size} bytes): no safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > self.size:
            raise CheckpointError(f"{self.path}: header length {n} does not fit the file's {self.size} bytes")
        raw = os.pread(self._fd, n, 8)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: the header is not valid JSON ({e}): the file is corrupt") from None
        start = 8 + n
        meta = header.pop("__metadata__", None) or {}
        entries: dict[str, Entry] = {}
        for name, info in header.items():
            try:
                begin, end = info["data_offsets"]
                dtype = CODE_DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: malformed header entry for {name!r}") from None
            if end - begin != math.prod(shape) * dtype.itemsize or start + end > self.size:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} lies outside the file ({self.size} bytes): the file is truncated "
                    "or corrupt"
                )
            entries[name] = Entry(name, dtype, shape, start + begin, start + end)
        return head + raw, entries, meta

    @property
    def direct(self) -> bool:
        """Whether this file's large runs bypass the page cache (O_DIRECT): its file system takes the flag and it has
        the aligned layout (its data area starts at a multiple of DIRECT_ALIGN; an older file's, by chance only)."""
        return self._direct_ok and len(self.header_bytes) % DIRECT_ALIGN == 0

    def read_into(self, name: str, out: torch.Tensor, *, start: int = 0, crc: int | None = None) -> None:
        """Read elements [start, start + out.numel()) of tensor `name` into the contiguous CPU tensor `out`
        (same dtype). With `crc`, the read must cover the whole tensor and match it."""
        entry = self.entry(name)
        if out.dtype != entry.dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"read_into needs a contiguous CPU {entry.dtype} tensor, got {out.dtype} {out.device}")
        offset = entry.begin + start * entry.dtype.itemsize
        nbytes = out.numel() * entry.dtype.itemsize
        if offset + nbytes > entry.end:
            raise ValueError(f"{self.path}: elements [{start}, {start + out.numel()}) exceed {name!r}")
        self._read_spans([(offset, out)], [name])
        if crc is not None:
            if start != 0 or nbytes != entry.nbytes:
                raise ValueError("a checksum covers a whole tensor: read all of it to check it")
            self.check_many([(name, out, crc)])

    def read_many(self, items: list[tuple[str, torch.Tensor, int]], *, check: bool = True) -> None:
        """Read whole tensors (name, contiguous CPU out of the same dtype, CRC32) that lie back to back in the file
        (or with only an aligned layout's padding between them) in large requests, then check each checksum (unless
        check is False: the caller then calls `check_many`). A run of many tensors then reaches the disk as one
        large sequential request, as a plain file copy would (see [Note: direct reads])."""
        entries = [self.entry(name) for name, _, _ in items]
        for a, b in zip(entries, entries[1:]):
            if not 0 <= b.begin - a.end < PAD_MAX:
                raise ValueError(f"{self.path}: read_many needs adjacent tensors; {a.name!r} and {b.name!r} are not")
        spans = []
        for e, (_, out, _) in zip(entries, items):
            if out.dtype != e.dtype or not out.is_contiguous() or out.device.type != "cpu" or out.numel() != e.numel:
                raise ValueError(f"read_many needs a contiguous CPU {e.dtype} tensor of {e.numel} elements")
            spans.append((e.begin, out))
        self._read_spans(spans, [name for name, _, _ in items])
        if check:
            self.check_many(items)

    def _read_spans(self, spans: list[tuple[int, torch.Tensor]], names: list[str]) -> None:
        """Fill each (file offset, contiguous CPU tensor) of `spans`, which follow each other in the file with at most
        PAD_MAX bytes between two (padding, read into scratch memory).

        [Note: direct reads]
        A cold read through the page cache costs a CPU copy of every byte, and its throughput swings with the
        kernel's read-ahead; O_DIRECT moves the bytes from the disk straight into the destination, many large
        requests in flight, and leaves the cores to the checksums. It needs the file offset, the length and the
        memory address aligned (to DIRECT_ALIGN here), so it applies to a stretch of spans contiguous both in the
        file and in memory whose memory address and file offset agree modulo DIRECT_ALIGN: a checkpoint saved
        with `align=DIRECT_ALIGN` places every chunk's tensors so (padding tensors in between), and the chunk
        buffers of the host tier (and of a CPU compute device) are page-aligned, so loading into the layout that
        saved a checkpoint reads each chunk in place. Those buffers also use huge pages (`Device.empty_host`):
        a direct read into 4 KiB pages scattered over physical memory was measured slower than a buffered one.
        The aligned middle of a stretch goes direct, its ragged ends (under DIRECT_ALIGN bytes each) through the
        page cache; anything else (older or unaligned files, other layouts' scratch buffers, small stretches, a
        file whose pages are mostly cached already, file systems without O_DIRECT) is read through the page
        cache with vectored reads as before."""
        pending: list[memoryview] = []  # buffered reads gathered into one vectored call, from file offset `start`
        start = end = 0
        scratch = None
        i = 0
        while i < len(spans):
            # the stretch [i, j): adjacent in the file and in memory
            j, begin, ptr = i + 1, spans[i][0], spans[i][1].data_ptr()
            stop = begin + _nbytes(spans[i][1])
            while j < len(spans) and spans[j][0] == stop and spans[j][1].data_ptr() == ptr + stop - begin:
                stop += _nbytes(spans[j][1])
                j += 1
            lo, hi = _align_up(begin), stop // DIRECT_ALIGN * DIRECT_ALIGN
            if (
                self._direct_ok
                and hi - lo >= _DIRECT_MIN
                and (ptr + lo - begin) % DIRECT_ALIGN == 0
                and _resident_share(self._fd, lo, hi - lo) < 0.5
            ):
                if pending:
                    self._read_buffered(pending, start, names[i])
                    pending = []
                mem = memoryview((ctypes.c_char * (stop - begin)).from_address(ptr)).cast("B")
                try:
                    self._read_direct(mem[lo - begin : hi - begin], lo, names[i])
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._direct_ok = False  # accepted at open but refused on I/O: the page cache from here on
                else:
                    self._read_buffered([mem[: lo - begin], mem[hi - begin :]], begin, names[i], skip=hi - lo)
                    i = j
                    continue
            if pending and begin != end:  # padding between: stepped over into scratch memory
                scratch = scratch or memoryview(bytearray(PAD_MAX))
                pending.append(scratch[: begin - end])
            if not pending:
                start = begin
            pending += [as_bytes(t) for _, t in spans[i:j]]
            end = stop
            i = j
        if pending:
            self._read_buffered(pending, start, names[-1])

    def _read_direct(self, mem: memoryview, offset: int, name: str) -> None:
        done = 0
        while done < len(mem):
            n = os.preadv(self._dfd, [mem[done : done + _IO_BLOCK]], offset + done)
            if n <= 0 or (n % DIRECT_ALIGN and done + n < len(mem)):
                raise CheckpointError(f"{self.path}: short read near {name!r}: the file is truncated")
            done += n

    def _read_buffered(self, views: list[memoryview], offset: int, name: str, *, skip: int = 0) -> None:
        """Read `views` back to back from `offset` through the page cache; with `skip`, the first view is read at
        `offset` and the second `skip` bytes after its end (the ragged ends around a direct read)."""
        if skip:
            head, tail = views
            self._read_buffered([head], offset, name)
            self._read_buffered([tail], offset + len(head) + skip, name)
            return
        views = [v for v in views if len(v)]
        i = 0
        while i < len(views):
            n = os.preadv(self._fd, views[i : i + _IOV_MAX], offset)
            if n <= 0:
                raise CheckpointError(f"{self.path}: short read near {name!r}: the file is truncated")
            offset += n
            i = _consume(views, i, n)

    def check_many(self, items: list[tuple[str, torch.Tensor, int]]) -> None:
        """Check the CRC32 of tensors read by `read_many(..., check=False)`."""
        for name, out, crc in items:
            if zlib.crc32(as_bytes(out)) != crc:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} fails its CRC32 check: the file is corrupt. Load an earlier "
                    "checkpoint (every checkpoint directory under the root holds a complete one)"
                )

    def read(self, name: str, *, crc: int | None = None) -> torch.Tensor:
        entry = self.entry(name)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_into(name, out.view(-1), crc=crc)
        return out

    def entry(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: has no tensor {name!r}; the checkpoint is incomplete") from None

    def close(self) -> None:
        self._direct_ok = False
        for fd in (self._fd, self._dfd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._dfd = -1

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
