"""Our own streaming reader and writer of the safetensors file format: no dependency, no pickle, nothing held whole.

A safetensors file is: 8 bytes (little-endian u64) giving the header's length N, N bytes of JSON mapping each tensor's
name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data area that follows, plus an optional
"__metadata__" of strings), then the raw little-endian bytes of every tensor back to back. So a writer must know
every tensor's name, dtype and shape before it writes a byte of data: `TensorWriter` takes that plan, writes the
header, then the tensors in plan order, alone or as runs written on I/O threads ([Note: overlapped writes]).
`TensorReader` parses the header and reads any tensor, or element range of one, straight into a caller's buffer
with `preadv` (O_DIRECT where the layout and buffer allow, [Note: direct reads]): it never holds more than asked.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
import zlib
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hetero.checkpoint.blocks import digests
from hetero.checkpoint.dtype_codes import CODE_DTYPES, DTYPE_CODES
from hetero.checkpoint.earlier import damaged, unreadable
from hetero.errors import CheckpointError
from hetero.io import direct as direct_io
from hetero.io.checksum import DEFAULT, LEGACY, checksum_fn
from hetero.io.direct import align_down, align_up, as_bytes, memory_at, read_full, write_full
from hetero.io.direct import resident_share as _resident_share

_ALIGN = 8  # the header is padded with spaces so that the data starts 8-byte aligned, as the reference writer does
_MAX_HEADER = 1 << 30  # a header length beyond this is a corrupt file, not a real header
_WRITE_THREADS = 2  # one checksums a run while the other is in a write call (both release the GIL)
_PAD_PREFIX = "__padding__:"  # names of the filler tensors of an aligned layout; no manifest lists them
CHECKSUM_KEY = "hetero.checksum"  # the header metadata naming the tensors' checksum ([Note: checksum algorithms])
DIRECT_ALIGN = direct_io.ALIGN  # O_DIRECT's file offset, length and memory alignment ([Note: direct I/O])
_DIRECT_MIN = 1 << 20  # a smaller stretch is read through the page cache: O_DIRECT pays off on large requests
PAD_MAX = DIRECT_ALIGN  # padding between two tensors is shorter than this; a read may step over it
_O_DIRECT = direct_io.O_DIRECT


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


class TensorWriter:
    """Writes one safetensors file: `plan` fixes every (name, dtype, shape[, residue]) in order; `write` streams one
    tensor, `submit` a run of them on the I/O threads.

    The file is fsync'd on `close`. `crcs` holds each tensor's checksum once written (the algorithm `checksum`, which
    the header records: [Note: checksum algorithms]), `blocks` its blocks' or None ([Note: block checksums], blocks.py).

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
        checksum: str = DEFAULT,
        block_bytes: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.checksum, self.block_bytes = checksum, block_bytes
        checksum_fn(checksum)  # the package is there, or the error now
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
        header["__metadata__"] = {**(metadata or {}), CHECKSUM_KEY: checksum}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(len(raw) + 8) % align)
        self.header_bytes = struct.pack("<Q", len(raw)) + raw
        self.data_start = len(self.header_bytes)
        self.size = self.data_start + offset  # the file's final size in bytes
        self.header_crc = zlib.crc32(self.header_bytes)  # the manifest records it; a load checks it first
        self.crcs: dict[str, int] = {}
        self.blocks: dict[str, list[int] | None] = {}
        self._zeros = memoryview(bytes(align))
        self._next = 0
        self._pool: ThreadPoolExecutor | None = None  # made on the first `submit`
        self._futures: list[Future] = []
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        write_full(self._fd, memoryview(self.header_bytes), 0)

    def write(self, name: str, t: torch.Tensor) -> None:
        """Write the next planned tensor (any device; converted to the planned dtype if it differs)."""
        self.submit([(name, t)]).result()

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
        sums = [digests(v, self.checksum, self.block_bytes) for v in views]
        if not entries:
            return
        start = self.data_start + entries[0].begin - self._gaps.get(entries[0].name, 0)
        padded = []
        for e, v in zip(entries, views):
            if e.name in self._gaps:
                padded.append(self._zeros[: self._gaps[e.name]])
            padded.append(v)
        end = start + write_full(self._fd, padded, start)
        direct_io.start_writeback(self._fd, start, end - start)
        for e, s in zip(entries, sums):
            self.crcs[e.name], self.blocks[e.name] = s

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


class TensorReader:
    """Reads tensors, or element ranges of them, from one safetensors file by offset; checks what it can."""

    def __init__(self, path: str | os.PathLike, *, direct: bool = True) -> None:
        self.path = os.fspath(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise damaged(self.path, "file is missing; the checkpoint is incomplete") from None
        except OSError as e:  # a permission, an I/O error: the file named, and what to load instead
            raise unreadable(self.path, e) from None
        self._dfd = -1  # the same file opened with O_DIRECT, where it can be (see [Note: direct reads])
        self._direct_ok = False
        try:
            if hasattr(os, "posix_fadvise"):  # larger read-ahead: readers mostly go through a file front to back
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self.size = os.fstat(self._fd).st_size
            self.header_bytes, self.entries, self.metadata = self._parse()
            # Files written before the checksum was recorded used CRC32 ([Note: checksum algorithms]).
            self.checksum = self.metadata.get(CHECKSUM_KEY, LEGACY)
            try:
                self._checksum = checksum_fn(self.checksum)
            except (ValueError, ImportError) as e:
                raise CheckpointError(f"{self.path}: cannot check its tensors: {e}") from None
            if direct and _O_DIRECT and self.size >= _DIRECT_MIN:
                try:
                    self._dfd = direct_io.open_direct(self.path, os.O_RDONLY)
                    self._direct_ok = True
                except OSError:  # tmpfs and some others refuse the flag (EINVAL): the page cache it is
                    self._dfd = -1
        except BaseException as e:
            os.close(self._fd)
            if isinstance(e, OSError):  # the header's read failed: [Note: a disk error reading a checkpoint]
                raise unreadable(self.path, e) from None
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
        self.read_spans([(offset, out)], [name])
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
        self.read_spans(spans, [name for name, _, _ in items])
        if check:
            self.check_many(items)

    def read_spans(self, spans: list[tuple[int, torch.Tensor]], names: list[str]) -> None:
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
        try:
            self._read_stretches(spans, names)
        except OSError as e:  # the system's read failed (an I/O error): the file named, and what to load instead
            raise unreadable(self.path, e) from None

    def _read_stretches(self, spans: list[tuple[int, torch.Tensor]], names: list[str]) -> None:
        pending: list[memoryview] = []  # buffered reads gathered into one vectored call, from file offset `start`
        start = end = 0
        scratch = None
        i = 0
        while i < len(spans):
            # the stretch [i, j): adjacent in the file and in memory
            j, begin, ptr = i + 1, spans[i][0], spans[i][1].data_ptr()
            stop = begin + spans[i][1].nbytes
            while j < len(spans) and spans[j][0] == stop and spans[j][1].data_ptr() == ptr + stop - begin:
                stop += spans[j][1].nbytes
                j += 1
            lo, hi = align_up(begin), align_down(stop)
            if (
                self._direct_ok
                and hi - lo >= _DIRECT_MIN
                and (ptr + lo - begin) % DIRECT_ALIGN == 0
                and _resident_share(self._fd, lo, hi - lo) < 0.5
            ):
                if pending:
                    self._read_buffered(pending, start, names[i])
                    pending = []
                mem = memory_at(ptr, stop - begin)
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
        if read_full(self._dfd, mem, offset, direct=True) < len(mem):
            raise CheckpointError(f"{self.path}: short read near {name!r}: the file is truncated")

    def _read_buffered(self, views: list[memoryview], offset: int, name: str, *, skip: int = 0) -> None:
        """Read `views` back to back from `offset` through the page cache; with `skip`, the first view is read at
        `offset` and the second `skip` bytes after its end (the ragged ends around a direct read)."""
        if skip:
            head, tail = views
            self._read_buffered([head], offset, name)
            self._read_buffered([tail], offset + len(head) + skip, name)
            return
        if read_full(self._fd, views, offset) < sum(len(v) for v in views):
            raise CheckpointError(f"{self.path}: short read near {name!r}: the file is truncated")

    def check_many(self, items: list[tuple[str, torch.Tensor, int]]) -> None:
        """Check the checksums of tensors read by `read_many(..., check=False)`."""
        for name, out, crc in items:
            if self._checksum(as_bytes(out)) != crc:
                what = f"tensor {name!r} fails its {self.checksum.upper()} check: the file is corrupt"
                raise damaged(self.path, what)

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
