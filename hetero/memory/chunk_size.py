"""Automatic choice of the chunk capacity, in the manner of Colossal-AI Gemini's chunk size search.

Chunks are contiguous fixed-capacity flat buffers. Tensors, given in order as element counts, are packed
greedily in that order: a tensor goes into the current chunk if it fits in what is left of it, else a new
chunk is opened. A tensor larger than the capacity gets a chunk of its own sized exactly to it ("oversize");
it closes the current chunk, so every chunk holds a contiguous run of tensors in the given (usually
execution) order, which keeps prefetching chunk by chunk in step with the model.

The waste of a capacity is the unused tail of every regular chunk (oversize chunks waste nothing). The
search tries every capacity in a range and keeps the one that wastes least, the smaller on ties, because
smaller chunks move between tiers at a finer grain.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetero.memory.chunk_budgets import budget_costs

logger = logging.getLogger("hetero.memory.chunk_size")


@dataclass(frozen=True, kw_only=True)
class ChunkPlan:
    """What packing a list of tensors at one chunk capacity gives."""

    chunk_numel: int  # capacity of regular chunks, in elements
    num_chunks: int  # regular chunks
    oversize: int  # tensors that got a chunk of their own
    total_numel: int  # sum of tensor numels
    allocated_numel: int  # numel of all chunks' capacity (regular + oversize)

    @property
    def waste_fraction(self) -> float:
        """Share of the allocated elements that hold no tensor: 1 - total / allocated."""
        if self.allocated_numel == 0:
            return 0.0
        return 1.0 - self.total_numel / self.allocated_numel

    @property
    def waste_numel(self) -> int:
        """Allocated elements that hold no tensor."""
        return self.allocated_numel - self.total_numel


def _check_numels(numels: Sequence[int]) -> list[int]:
    """Return the numels as plain ints, or raise ValueError saying which one is bad."""
    if len(numels) == 0:
        raise ValueError("numels is empty: there are no tensors to pack into chunks")
    sizes: list[int] = []
    for i, n in enumerate(numels):
        try:
            value = operator.index(n)
        except TypeError:
            raise ValueError(f"numels[{i}] = {n!r} is not an integer element count") from None
        if value <= 0:
            raise ValueError(
                f"numels[{i}] = {value}: every tensor must have at least one element "
                "(leave empty tensors out of chunk planning)"
            )
        sizes.append(value)
    return sizes


def _check_positive(name: str, value: int) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} = {value!r} must be an integer") from None
    if value <= 0:
        raise ValueError(f"{name} = {value} must be positive")
    return value


def _pack_sizes(sizes: Sequence[int], chunk_numel: int) -> list[list[int]]:
    chunks: list[list[int]] = []
    current: list[int] = []
    left = 0  # room left in the current chunk; 0 means no chunk is open
    for i, n in enumerate(sizes):
        if n > chunk_numel:
            # Its own exactly-sized chunk; the open chunk is closed so chunks stay contiguous runs in order.
            chunks.append([i])
            current, left = [], 0
        elif n > left:
            current = [i]
            chunks.append(current)
            left = chunk_numel - n
        else:
            current.append(i)
            left -= n
    return chunks


def pack(numels: Sequence[int], chunk_numel: int) -> list[list[int]]:
    """Pack tensors greedily in order into chunks of capacity ``chunk_numel``.

    Returns the tensor indices of each chunk, chunks in order; each chunk's indices are consecutive. A
    tensor larger than ``chunk_numel`` is alone in its chunk (sized exactly to it).
    """
    sizes = _check_numels(numels)
    chunk_numel = _check_positive("chunk_numel", chunk_numel)
    return _pack_sizes(sizes, chunk_numel)


def plan_chunks(numels: Sequence[int], chunk_numel: int) -> ChunkPlan:
    """Summarise the packing of :func:`pack` at capacity ``chunk_numel``."""
    sizes = _check_numels(numels)
    chunk_numel = _check_positive("chunk_numel", chunk_numel)
    chunks = _pack_sizes(sizes, chunk_numel)
    oversize = [c[0] for c in chunks if len(c) == 1 and sizes[c[0]] > chunk_numel]
    num_chunks = len(chunks) - len(oversize)
    return ChunkPlan(
        chunk_numel=chunk_numel,
        num_chunks=num_chunks,
        oversize=len(oversize),
        total_numel=sum(sizes),
        allocated_numel=num_chunks * chunk_numel + sum(sizes[i] for i in oversize),
    )


def _count_chunks(prefix: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Number of chunks (regular + oversize) the greedy packing makes at each capacity in ``caps``.

    All capacities are packed side by side, one chunk per loop turn: the end of the chunk that starts at
    tensor ``p`` is the last prefix sum within ``prefix[p] + cap`` (one ``searchsorted`` for all capacities
    at once). An oversize tensor never fits such a run, so it stops the chunk before it by itself; when the
    chunk starts at an oversize tensor the run is empty and the tensor is taken alone. Python loops once per
    chunk of the smallest capacity, and each turn costs a few numpy calls over the capacities still packing.
    """
    n = len(prefix) - 1
    counts = np.zeros(len(caps), dtype=np.int64)
    idx = np.arange(len(caps))  # which capacities are still packing
    cap = caps.astype(np.int64)
    pos = np.zeros(len(caps), dtype=np.int64)
    steps = 0
    while idx.size:
        steps += 1
        end = np.searchsorted(prefix, prefix[pos] + cap, side="right") - 1
        pos = np.maximum(end, pos + 1)
        done = pos >= n
        if done.any():
            counts[idx[done]] = steps
            keep = ~done
            idx, cap, pos = idx[keep], cap[keep], pos[keep]
    return counts


def search_chunk_size(
    numels: Sequence[int],
    *,
    min_numel: int = 1 << 20,
    max_numel: int = 64 << 20,
    step_numel: int = 1 << 16,
    align_numel: int = 1 << 10,
    max_oversize_fraction: float = 0.0,
) -> ChunkPlan:
    """Pick the chunk capacity that wastes least when ``numels`` are packed by :func:`pack`.

    Capacities tried are multiples of ``align_numel`` from the lower bound up to ``max_numel`` in steps of
    ``step_numel``. The lower bound is ``min_numel``, raised to what the largest tensor needs so it fits a
    regular chunk: tensors larger than ``max_numel`` cannot fit and are oversize whatever the capacity, and
    besides them at most ``max_oversize_fraction`` of all elements may sit in oversize chunks (the largest
    tensors first). Ties in waste go to the smaller capacity.
    """
    sizes = _check_numels(numels)
    min_numel = _check_positive("min_numel", min_numel)
    max_numel = _check_positive("max_numel", max_numel)
    step_numel = _check_positive("step_numel", step_numel)
    align_numel = _check_positive("align_numel", align_numel)
    if min_numel > max_numel:
        raise ValueError(f"min_numel = {min_numel} is larger than max_numel = {max_numel}")
    if not 0.0 <= max_oversize_fraction <= 1.0:
        raise ValueError(f"max_oversize_fraction = {max_oversize_fraction} must lie in [0, 1]")
    lo = -(-min_numel // align_numel) * align_numel
    hi = max_numel // align_numel * align_numel
    if lo > hi:
        raise ValueError(
            f"no multiple of align_numel = {align_numel} lies in [min_numel, max_numel] = "
            f"[{min_numel}, {max_numel}]: widen the range or lower align_numel"
        )

    arr = np.asarray(sizes, dtype=np.int64)
    total = int(arr.sum())
    # Tensors above the largest capacity are oversize whatever we pick; they do not count against the budget.
    eligible = np.sort(arr[arr <= hi])[::-1]
    budget = max_oversize_fraction * total
    # The largest k tensors may be oversize by choice while their sum stays within budget; the next must fit.
    k = int(np.searchsorted(np.cumsum(eligible), budget, side="right")) if eligible.size else 0
    need = int(eligible[k]) if k < eligible.size else 1
    start = max(lo, -(-need // align_numel) * align_numel)

    caps = np.arange(start, hi + 1, step_numel, dtype=np.int64)
    if step_numel % align_numel:
        # Steps that are not multiples of the alignment would give unaligned capacities: round them up.
        caps = np.unique(-(-caps // align_numel) * align_numel)
        caps = caps[caps <= hi]

    prefix = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(arr)])
    chunks = _count_chunks(prefix, caps)
    # Oversize tensors at a capacity are exactly those larger than it: the greedy packing never puts them in a
    # regular chunk, and any smaller tensor fits a freshly opened one.
    sorted_sizes = np.sort(arr)
    sorted_prefix = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(sorted_sizes)])
    first_over = np.searchsorted(sorted_sizes, caps, side="right")
    n_over = arr.size - first_over
    over_numel = total - sorted_prefix[first_over]
    allocated = (chunks - n_over) * caps + over_numel
    best = int(np.argmin(allocated))  # first minimum = smallest capacity among ties
    plan = plan_chunks(sizes, int(caps[best]))
    logger.debug(
        "chunk size search over %d capacities [%d, %d]: picked %d (%d chunks, %d oversize, %.2f%% waste)",
        caps.size,
        int(caps[0]),
        int(caps[-1]),
        plan.chunk_numel,
        plan.num_chunks,
        plan.oversize,
        100 * plan.waste_fraction,
    )
    return plan


# ---- packing with tiles ---------------------------------------------------------------------------------------
# [Note: tiles]
# A tensor larger than a chunk is split over several chunks of its own by element range, whole rows each (rows of
# dim 0): a *tile*. Tiles of one tensor are balanced (as equal as whole rows allow) and each chunk holds exactly one
# tile, sized to it, so a tile costs no padding. The chunk open before the tiles is closed and trimmed to what it
# holds, so the only padding left is the tail of regular chunks that the next tensor did not fit, the last chunk of
# a run, and the rounding of capacities to the data-parallel size. Those stay at the full capacity, as `pack` gives
# them: chunks of one size reuse each other's freed buffers in the tiers' pools, where every extra size keeps buffers
# of its own cached (the estimator's peaks count on it). Only tensors that may be computed
# on tile by tile are split (`rows` gives their elements per row, None for the others): a tensor larger than a
# chunk that may not be tiled gets an exactly sized chunk of its own, as `pack` gives it.


@dataclass(frozen=True)
class Packed:
    """One chunk of a tiled packing: its members and its capacity (before rounding to the data-parallel size)."""

    members: tuple[tuple[int, int, int], ...]  # (tensor index, first element, elements), in order
    capacity: int  # elements
    tile: bool  # holds one tile of a tensor split over several chunks


def _walk(numels: Sequence[int], rows: Sequence[int | None], chunk_numel: int) -> Iterator[tuple[Any, ...]]:
    """The packing of [Note: tiles], step by step, shared by `pack_tiled` (which builds the chunks) and
    `packed_capacity` (which only counts them): ("chunk", members, used, trim) for a chunk closed (trim: before
    tiles, to what it holds; else at full capacity), ("tiles", i, row, parts, base, more) for a tensor split into
    `parts` tiles of `base` rows (the first `more` one row more), ("whole", i, n) for an oversize tensor that may
    not be."""
    chunk_numel = _check_positive("chunk_numel", chunk_numel)
    members: list[tuple[int, int, int]] = []
    used = 0
    for i, n in enumerate(numels):
        row = rows[i] if rows else None
        if n > chunk_numel:
            tiles = _tiles(n, row, chunk_numel)
            if members:
                yield "chunk", tuple(members), used, tiles is not None
            members, used = [], 0
            yield ("tiles", i, row, *tiles) if tiles is not None else ("whole", i, n)
        elif n > chunk_numel - used:
            if members:
                yield "chunk", tuple(members), used, False
            members, used = [(i, 0, n)], n
        else:
            members.append((i, 0, n))
            used += n
    if members:
        yield "chunk", tuple(members), used, False


def pack_tiled(numels: Sequence[int], rows: Sequence[int | None], chunk_numel: int, *, align: int = 1) -> list[Packed]:
    """Pack tensors in order into chunks of `chunk_numel`, splitting those larger than a chunk into tiles where
    `rows[i]` (elements per row) allows; see [Note: tiles]. Trimmed capacities are rounded up to `align`."""
    out: list[Packed] = []
    for step in _walk(numels, rows, chunk_numel):
        if step[0] == "chunk":
            _, members, used, trim = step
            out.append(Packed(members, _round_up(used, align) if trim else chunk_numel, False))
        elif step[0] == "whole":
            _, i, n = step
            out.append(Packed(((i, 0, n),), n, False))
        else:
            _, i, row, parts, base, more = step
            first = 0
            for k in range(parts):
                take = base + (1 if k < more else 0)
                out.append(Packed(((i, first * row, take * row),), _round_up(take * row, align), True))
                first += take
    return out


def _tiles(n: int, row: int | None, chunk_numel: int) -> tuple[int, int, int] | None:
    """How a tensor of `n` elements larger than a chunk splits into tiles of whole rows: (tiles, rows in each, how
    many of the first tiles take one row more), balanced as evenly as whole rows allow; None where it may not."""
    if row is None or not 0 < row <= chunk_numel or n % row:
        return None
    total_rows = n // row
    parts = -(-total_rows // (chunk_numel // row))
    return parts, total_rows // parts, total_rows % parts


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def packed_capacity(numels: Sequence[int], rows: Sequence[int | None], chunk_numel: int, *, align: int = 1) -> int:
    """The elements `pack_tiled` allocates, sum(p.capacity), counted without building the chunks: a tensor tiled
    into a million tiles (a 13B model under a small budget's chunk size) costs one step here, not a million objects
    (the estimator's chunk-size search on such a model took 14 s in `pack_tiled`)."""
    allocated = 0
    for step in _walk(numels, rows, chunk_numel):
        if step[0] == "chunk":
            allocated += _round_up(step[2], align) if step[3] else chunk_numel
        elif step[0] == "whole":
            allocated += step[2]
        else:
            _, i, row, parts, base, more = step
            allocated += more * _round_up((base + 1) * row, align) + (parts - more) * _round_up(base * row, align)
    return allocated


def tiled_waste(runs: Sequence[tuple[Sequence[int], Sequence[int | None]]], chunk_numel: int, *, align: int) -> int:
    """Padding elements of `pack_tiled` over several runs (optimizer param groups), each packed on its own."""
    allocated = total = 0
    for numels, rows in runs:
        allocated += packed_capacity(numels, rows, chunk_numel, align=align)
        total += sum(numels)
    return allocated - total


def search_tiled(
    runs: Sequence[tuple[Sequence[int], Sequence[int | None]]],
    *,
    min_numel: int,
    max_numel: int,
    align_numel: int = 1 << 10,
    candidates: int = 256,
    allowed: float = 0.02,
) -> int:
    """The chunk capacity for `pack_tiled` over the runs: among about `candidates` aligned capacities in
    [min_numel, max_numel], the largest whose padding is at most `allowed` of all elements (or, if none is, the one
    with the least padding, the smaller on ties). Larger chunks mean fewer collectives and moves, and once tiles keep
    the padding low nothing is gained by going smaller; the budgets bound `max_numel`."""
    lo = max(align_numel, _round_up(min_numel, align_numel))
    hi = max(lo, max_numel // align_numel * align_numel)
    step = max(align_numel, (hi - lo) // candidates // align_numel * align_numel)
    caps = list(range(lo, hi + 1, step))
    if caps[-1] != hi:
        caps.append(hi)
    total = sum(sum(numels) for numels, _ in runs)
    waste = [tiled_waste(runs, c, align=align_numel) for c in caps]
    ok = [c for c, w in zip(caps, waste) if w <= allowed * total]
    chosen = max(ok) if ok else caps[waste.index(min(waste))]
    logger.debug(
        "tiled chunk size search over %d capacities [%d, %d]: picked %d (%.2f%% padding)",
        len(caps),
        lo,
        hi,
        chosen,
        100 * waste[caps.index(chosen)] / max(1, total),
    )
    return chosen


def budget_cap(**sizing: Any) -> int | None:
    """The largest chunk capacity (elements) whose working set fits the budgets with room to spare: `budget_costs`,
    whose keywords it takes. None: no budget limits it."""
    caps = [int(value / cost) for value, cost in budget_costs(**sizing).values()]
    return min(caps) if caps else None
