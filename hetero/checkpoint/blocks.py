"""Block checksums of saved tensors: a rank that needs part of a segment reads and checks only the blocks it overlaps.

[Note: block checksums]
A segment's checksum covers all of it, so a rank keeping part of a segment (a checkpoint loaded into another
data-parallel world size, ZeRO stage or chunk size) either read it whole to check it, or read its part unchecked while
one other rank read it whole ([Note: one rank checks a shared segment] in plan.py): a world-1 checkpoint of a 126 MB
model loaded at world 4, stage 3, had its ranks read 41, 66, 41 and 22 MB where each keeps 31.5. So a save also
records, for every tensor longer than one block, the checksum of each BLOCK_BYTES block of its bytes (the last one
shorter), in the manifest beside the tensor's own checksum and with the same algorithm (the file's header names it:
[Note: checksum algorithms] in hetero/io/checksum.py): the manifest's file entry holds
`"blocks": {"bytes": BLOCK_BYTES, "sums": {key: [one checksum a block]}}`. A load then treats each block of such a
segment as a segment of its own: a block inside a rank's range is read and checked by that rank; one cut by two ranks'
ranges is read whole and checked by one of them, the other reading only its part. So no rank reads more than a block
beyond its range at each end of it, and every byte used is checked by some rank. The tensor's whole checksum is kept
(a whole segment is checked with it, at the same cost as its blocks), so older hetero versions, which ignore the
blocks, read these checkpoints as before; and files saved before blocks (none listed) load exactly as they did.
The blocks cost a save little: each block is checksummed once alone and once into the whole tensor's running
checksum while it is in the cache (XXH3 over 100 MB: 13-21 ms whole, 19-22 ms both ways).
1 MiB blocks: the reads over a rank's range (at most a block at each cut) stay small beside chunks of many MiB, and
the manifest grows by about 21 bytes a MiB (2 MB for a 100 GB checkpoint), which every rank parses once.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hetero.checkpoint.earlier import damaged
from hetero.io.checksum import Running, checksum_fn
from hetero.io.direct import as_bytes

BLOCK_BYTES = 1 << 20  # what a save uses; a multiple of every dtype's size (tests make it smaller)
_BLOCKS = "blocks"  # the key of a file's block checksums in the manifest
FILE_KEYS = (_BLOCKS,)  # what a rank's file entry holds of them


def digests(view: memoryview, algorithm: str, block_bytes: int | None) -> tuple[int, list[int] | None]:
    """The checksum `algorithm` of the bytes `view`, and of each `block_bytes` block of them when there are several
    (else None): one pass, each block checksummed alone and into the whole while in the cache."""
    fn = checksum_fn(algorithm)
    if not block_bytes or len(view) <= block_bytes:
        return fn(view), None
    whole, sums = Running(algorithm), []
    for i in range(0, len(view), block_bytes):
        block = view[i : i + block_bytes]
        sums.append(fn(block))
        whole.update(block)
    return whole.digest(), sums


def file_entry(block_bytes: int | None, sums: dict[str, list[int]]) -> dict[str, object]:
    """What a rank file's manifest entry records of its block checksums (nothing without blocks)."""
    return {_BLOCKS: {"bytes": block_bytes, "sums": sums}} if block_bytes and sums else {}


def from_entry(info: dict) -> tuple[int, dict[str, list[int]]]:
    """A manifest file entry's block size and block checksums by key ((0, {}) for files saved without them)."""
    blocked = info.get(_BLOCKS) or {}
    return int(blocked.get("bytes", 0)), blocked.get("sums", {})


def pieces(seg: Any, itemsize: int, directory: str) -> list[tuple[int, int, str]]:
    """The parts of a saved segment (an `manifest.Segment` of the checkpoint `directory`) that each have a checksum,
    as element ranges of the flattened tensor with a name (its blocks, or the segment whole for one saved without
    blocks)."""
    if not seg.blocks:
        return [(seg.start, seg.end, "")]
    if seg.block_bytes <= 0 or seg.block_bytes % itemsize:
        raise damaged(
            os.path.join(directory, seg.file),
            f"the manifest gives {seg.key!r} blocks of {seg.block_bytes} bytes, not a multiple of its {itemsize}-byte "
            "elements: the checkpoint is corrupt",
        )
    per = seg.block_bytes // itemsize
    return [(b, min(b + per, seg.end), f"#{i}") for i, b in enumerate(range(seg.start, seg.end, per))]


def read_checked(reader: Any, seg: Any, a: int, out: torch.Tensor) -> None:
    """Fill `out` with elements [a, a + out.numel()) of the saved segment `seg` (blocked, in `reader`'s file), reading
    only the blocks that overlap them, each checked against its checksum ([Note: block checksums]). The blocks inside
    the range are read into `out` itself; a block sticking out of it at either end into scratch memory."""
    e = reader.entry(seg.key)
    if out.device.type != "cpu" or out.dtype != e.dtype or not out.is_contiguous():
        tmp = torch.empty(out.numel(), dtype=e.dtype)
        read_checked(reader, seg, a, tmp)
        out.copy_(tmp.view(out.shape))
        return
    size, isz, n = seg.block_bytes, e.dtype.itemsize, e.nbytes
    _check_count(reader, seg, n)
    lo = (a - seg.start) * isz  # the bytes wanted, within the tensor
    hi = lo + out.numel() * isz
    raw = out.reshape(-1).view(torch.uint8)
    inner_lo, inner_hi = -(-lo // size) * size, (n if hi == n else hi // size * size)  # whole blocks inside
    regions: list[tuple[int, torch.Tensor, bool]] = []  # (first byte in the tensor, memory, scratch), in file order
    if lo < min(inner_lo, hi) or inner_lo >= inner_hi:  # a block cut at the start (or the range inside one or two)
        head = lo // size * size
        regions.append((head, torch.empty(min(head + size, n) - head, dtype=torch.uint8), True))
    if inner_lo < inner_hi:
        regions.append((inner_lo, raw[inner_lo - lo : inner_hi - lo], False))
    tail = inner_hi if inner_lo < inner_hi else regions[-1][0] + size
    if tail < hi:  # a block cut at the end
        regions.append((tail, torch.empty(min(tail + size, n) - tail, dtype=torch.uint8), True))
    reader.read_spans([(e.begin + first, mem) for first, mem, _ in regions], [seg.key] * len(regions))
    for first, mem, _ in regions:
        _check(reader, seg, first, as_bytes(mem))
    for first, mem, scratch in regions:
        if scratch:  # its part inside the range
            x, y = max(first, lo), min(first + mem.numel(), hi)
            raw[x - lo : y - lo] = mem[x - first : y - first]


def check_whole(reader: Any, seg: Any, t: torch.Tensor) -> None:
    """Check every block checksum of a segment read whole into `t` (`verify`: the manifest's blocks are what a
    resharded load relies on), if it has any."""
    if seg.blocks:
        view = as_bytes(t)
        _check_count(reader, seg, len(view))
        _check(reader, seg, 0, view)


def _check_count(reader: Any, seg: Any, nbytes: int) -> None:
    size = seg.block_bytes
    if size <= 0 or size % reader.entry(seg.key).dtype.itemsize or len(seg.blocks) != -(-nbytes // size):
        raise damaged(
            reader.path,
            f"the manifest lists {len(seg.blocks)} checksums of {size}-byte blocks for {seg.key!r} ({nbytes} bytes): "
            "the checkpoint is corrupt",
        )


def _check(reader: Any, seg: Any, first: int, view: memoryview) -> None:
    """Check the blocks held by `view`: bytes from `first` (a block's start) of the segment's tensor."""
    fn, size = checksum_fn(reader.checksum), seg.block_bytes
    for off in range(0, len(view), size):
        k = (first + off) // size
        if fn(view[off : off + size]) != seg.blocks[k]:
            at = reader.entry(seg.key).begin + first + off
            raise damaged(
                reader.path,
                f"tensor {seg.key!r} fails its {reader.checksum.upper()} check in block {k} (file bytes {at}-"
                f"{at + min(size, len(view) - off)}): the file is corrupt",
            )
