"""What a rank writes into its checkpoint file: each tensor's key, dtype, size and where its bytes are (a chunk's
slot, or a tensor given), in the order the file holds them; and where a tensor's first byte must sit for direct
reads ([Note: direct reads] in format.py)."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from hetero.checkpoint import blocks
from hetero.checkpoint import manifest as mf
from hetero.checkpoint import model_parallel as par
from hetero.checkpoint.format import DIRECT_ALIGN
from hetero.memory import Tier

if TYPE_CHECKING:
    from hetero.engine import Engine


@dataclasses.dataclass
class Item:
    key: str
    dtype: torch.dtype
    numel: int
    chunk: Any  # the manager chunk to read it from, or None (the tensor is given)
    slot: int | None = 0  # which slot of the chunk; None: the whole payload (a full parameter chunk)
    offset: int = 0  # first element within that slot's view (or the payload)
    tensor: torch.Tensor | None = None


def owned_range(zc: Any, rank: int) -> tuple[int, int]:
    """The element range [lo, hi) of a chunk this rank saves: its shard, even at stage 0 (where every rank holds the
    whole chunk, the ranks split the writing between them)."""
    s = zc.shard_numel
    return rank * s, (rank + 1) * s


def plan_items(engine: Engine) -> list[Item]:
    rank, stage = engine.comm.rank, engine.stage
    replicas = par.saves_replicated(engine)  # see [Note: parallel layouts in a checkpoint]
    pending = engine.accumulated != 0
    items: list[Item] = []
    for zc in engine.chunks:
        lo, hi = owned_range(zc, rank)
        if zc.optim is not None:
            base = 0 if stage == 0 else lo  # the optim buffer holds the whole chunk at stage 0, the shard otherwise
            kinds = ["master"] + [f"state.{n}" for n in engine.algorithm.state_names]
            # In the optim buffer's own order (master, then each state), which a load of the same layout reads
            # back in the same order: sequential on both sides.
            for j, kind in enumerate(kinds):
                for info, a, b in zc.spec.overlaps(lo, hi):
                    if par.saves(info, replicas):
                        k = mf.key(kind, par.stored_name(info), info.element(a))
                        # A master that follows its shard is saved from the shard (zero/master.py).
                        src = (zc.shard, 0, a - lo) if j == 0 and zc.master_follows else (zc.optim, j, a - base)
                        items.append(Item(k, torch.float32, b - a, *src))
        else:
            src, slot, base = (zc.shard, 0, lo) if stage == 3 else (zc.full, None, 0)
            for info, a, b in zc.spec.overlaps(lo, hi):
                if par.saves(info, replicas):
                    k = mf.key("frozen", par.stored_name(info), info.element(a))
                    items.append(Item(k, zc.dtype, b - a, src, slot, a - base))
        if pending and zc.grad is not None:
            # The gradient accumulated so far: rank-local and unreduced at stages 0-1 (the whole chunk), this rank's
            # reduced shard at stages 2-3. Read back only by the same rank of the same layout. A chunk that holds no
            # data yet (stages 2-3 before their first reduce-scatter) is given its zeros first.
            zc.grad_buffer()
            glo, ghi = (lo, hi) if stage >= 2 else (0, zc.spec.capacity)
            for info, a, b in zc.spec.overlaps(glo, ghi):
                k = mf.key("grad", par.stored_name(info), info.element(a))
                items.append(Item(k, torch.float32, b - a, zc.grad, 0, a - glo))
    if rank == 0 and replicas:
        for name, t in model_buffers(engine).items():
            items.append(Item(mf.key("buffer", name), t.dtype, t.numel(), None, tensor=t.detach()))
    items.append(Item(mf.key("rng", "torch_cpu"), torch.uint8, 0, None, tensor=torch.get_rng_state()))
    cuda = engine.device.rng_state()
    if cuda is not None:
        items.append(Item(mf.key("rng", "cuda"), torch.uint8, 0, None, tensor=cuda.cpu()))
    for it in items:
        if it.tensor is not None:
            it.numel = it.tensor.numel()
    return items


def chunk_runs(plan: list[Item]) -> Iterator[tuple[Any, list[Item]]]:
    """The plan's items in runs: those of one chunk together (chunk, items), a buffer or random state alone
    (None, [item])."""
    i = 0
    while i < len(plan):
        chunk = plan[i].chunk
        j = i + 1
        while chunk is not None and j < len(plan) and plan[j].chunk is chunk:
            j += 1
        yield chunk, plan[i:j]
        i = j


def read_tier(chunk: Any) -> tuple[Tier, bool]:
    """Where a save reads a chunk (where it is; the host for one on NVMe, or on its way there), and whether it came
    from NVMe (then it goes back, clean: no write)."""
    was_nvme = chunk.tier is Tier.NVME or (chunk.move is not None and chunk.move.dst is Tier.NVME)
    return (chunk.tier if chunk.tier in (Tier.DEVICE, Tier.HOST) and not was_nvme else Tier.HOST), was_nvme


def item_views(chunk: Any, items: list[Item]) -> list[tuple[str, torch.Tensor]]:
    """Each item's key and its view of the chunk's data (on the tier it was brought to)."""
    out = []
    for it in items:
        data = chunk.payload if it.slot is None else chunk.view(chunk.slots[it.slot])
        out.append((it.key, data.narrow(0, it.offset, it.numel)))
    return out


def model_buffers(engine: Engine) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by state_dict key (one entry per buffer object)."""
    params = {id(p) for p in engine.module.parameters()}
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in params or id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t
    return out


def file_size(plan: list[Item]) -> int:
    # The header is a few dozen bytes per tensor: estimate it generously; padding is under DIRECT_ALIGN per tensor.
    return sum(it.numel * it.dtype.itemsize + 160 + len(it.key) + DIRECT_ALIGN for it in plan) + DIRECT_ALIGN


def residue(it: Item) -> int | None:
    """Where the tensor's first byte sits in its chunk's buffer, modulo DIRECT_ALIGN: the file places it at the same
    residue, so that a load into the same layout (page-aligned chunk buffers) can read it with O_DIRECT in place
    ([Note: direct reads] in format.py)."""
    if it.chunk is None:
        return None
    first = (it.chunk.slots[it.slot].offset if it.slot is not None else 0) + it.offset
    return first * it.chunk.dtype.itemsize % DIRECT_ALIGN


# [Note: one rank checks a shared segment]
# A saved segment is checked as a whole (its checksum covers all of it), so a rank that keeps only part of it read it
# whole into scratch memory. In the layout that saved a checkpoint no segment is shared (each rank's file holds its
# own shard), but loading into another one (another data-parallel world size, another chunk size) cuts segments
# between ranks: each rank then read every segment it touched whole, up to the whole checkpoint per rank (a chunk
# holding one large weight, loaded at world W, was read W times: a world-1 checkpoint of the test GPT with 64-wide
# layers, 1.27 MB, loaded at world 2 stage 1, had each rank read 1.23-1.26 MB of it). Now the rank keeping the largest
# part of a shared segment (one chosen by the segment's key among equal parts) reads it whole and checks it; the
# others read only their part, by offset (there: 0.83 and 1.04 MB, 1.5 times the file in all instead of twice).
# A checksum that fails is that rank's error, which the load's agreement after the reads makes every rank's ([Note:
# a load every rank agrees on] in agree.py), so no rank trains on bytes no one checked. This relies on every rank
# reading the same files, which a load requires already (one checkpoint at one path on a file system all mount).
# A segment saved with block checksums ([Note: block checksums] in blocks.py) is cut into its blocks first, and each
# block is a segment here: a rank reads and checks the blocks inside its range, and only the block cut at each end of
# it is read whole by one rank and in part by the other.
class Checkers:
    """Which data-parallel rank reads whole and checks each saved segment of a trainable parameter that several ranks
    keep a part of ([Note: one rank checks a shared segment]). The same answer on every rank: it follows from the
    chunk layout alone."""

    def __init__(self, engine: Engine) -> None:
        # each trainable parameter's stored name -> (chunk, ParamInfo) of each place it lives in (tiles: several)
        self.places: dict[str, list[tuple[Any, Any]]] = {}
        for zc in engine.chunks:
            if zc.optim is not None:
                for info in zc.spec.params:
                    self.places.setdefault(par.stored_name(info), []).append((zc, info))

    def share(self, name: str, start: int, end: int, rank: int) -> int:
        """How many of elements [start, end) of tensor `name` the data-parallel rank `rank` keeps."""
        n = 0
        for zc, info in self.places.get(name, ()):
            lo, hi = zc.layout.kept_range(zc.spec.capacity, zc.comm.size, rank)
            a, b = max(info.offset, lo), min(info.offset + info.numel, hi)
            if a < b:
                n += max(0, min(info.element(b), end) - max(info.element(a), start))
        return n

    def checks(self, piece: str, name: str, start: int, end: int, rank: int, world: int) -> bool:
        """Whether `rank` (of `world`) is the one that reads elements [start, end) of tensor `name` whole and
        checks them: a saved segment, or a block of one ([Note: block checksums] in blocks.py), named `piece`."""
        shares = [self.share(name, start, end, r) for r in range(world)]
        tied = [r for r, n in enumerate(shares) if n == max(shares)]
        # Equal shares (a weight cut evenly) are common: spread them by the piece's name (the same on every rank),
        # or one rank would read them all whole.
        return tied[zlib.crc32(piece.encode()) % len(tied)] == rank

    def split(self, index: mf.Index, comm: Any, wanted: tuple, checked: list, parts_only: list) -> None:
        """Route the read of `wanted`, (kind, name, lo, out): elements [lo, lo + out.numel()) of (kind, name) into
        `out`. To `checked` (read and checked by `Index`) go the pieces with a checksum (segments, or their blocks:
        [Note: block checksums] in blocks.py) that `comm`'s rank keeps whole or checks, adjacent ones as one request;
        to `parts_only` (seg, its first element wanted, out's part) those another rank checks."""
        kind, name, lo, out = wanted
        hi = lo + out.numel()
        segs = [s for s in index.segments.get((kind, name), ()) if s.start < hi and s.end > lo]
        if sum(min(s.end, hi) - max(s.start, lo) for s in segs) != hi - lo:
            checked.append(wanted)  # not covered: `Index` says what is missing
            return
        for seg in segs:
            run = None  # [first, end) of the adjacent pieces read so far that this rank checks
            for p, q, tag in blocks.pieces(seg, index.reader(seg.file).entry(seg.key).dtype.itemsize, index.directory):
                a, b = max(p, lo), min(q, hi)
                if a >= b:
                    continue
                if (a, b) == (p, q) or self.checks(seg.key + tag, name, p, q, comm.rank, comm.size):
                    run = (run[0] if run else a, b)
                    continue
                parts_only.append((seg, a, out[a - lo : b - lo]))
                if run:
                    checked.append((kind, name, run[0], out[run[0] - lo : run[1] - lo]))
                    run = None
            if run:
                checked.append((kind, name, run[0], out[run[0] - lo : run[1] - lo]))


def read_part(index: mf.Index, seg: mf.Segment, a: int, target: torch.Tensor) -> None:
    """Elements [a, a + target.numel()) of a segment, in a piece another rank checks, read by offset alone (no
    checksum here: [Note: one rank checks a shared segment])."""
    reader = index.reader(seg.file)
    dtype = reader.entry(seg.key).dtype
    if target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous():
        reader.read_into(seg.key, target, start=a - seg.start)
    else:
        tmp = torch.empty(target.numel(), dtype=dtype)
        reader.read_into(seg.key, tmp, start=a - seg.start)
        target.copy_(tmp)
