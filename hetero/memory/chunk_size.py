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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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
