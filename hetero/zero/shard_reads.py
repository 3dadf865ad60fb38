"""A tensor-parallel rank's shard of a weight, read from the files without reading the whole tensor.

[Note: reading a tensor-parallel shard]
Files hold whole tensors; a weight that tensor parallelism cut (`TPShard` in hetero/parallel/tp_shard.py, a grid's
`BlockShard` in hetero/parallel/grid/shard.py) is, on each rank, the whole tensor indexed along every dimension by a
few intervals of that dimension (one where the dimension is cut, one per block where a fused q/k/v or gate/up is
cut block by block, whatever the blocks' widths, the whole dimension elsewhere), in increasing order. In the file's
row-major order such a shard is a set of contiguous runs: everything after the last cut dimension is whole, so each
run is one interval of that dimension times the whole inner dimensions. A row split (dim 0 of a Linear weight) is
one run per interval, one positioned read; a column split (dim 1) is one run per row, each row's share read on its
own. Each rank therefore reads its shard's bytes and holds only them (before, every tensor rank read each whole
tensor and sliced it: over T tensor ranks T times the bytes, and the whole tensor plus its slice in host memory at
once). A range of the shard's elements (a stage-3 rank's part of its chunk, a tile's rows) reads only the runs that
range covers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

Intervals = list[tuple[int, int]]  # [start, stop) intervals of one dimension of the whole tensor, in shard order


def shard_intervals(cut: Any) -> list[Intervals]:
    """Per dimension of the whole tensor, the intervals this rank's shard takes (see the note above)."""
    shape = tuple(cut.full_shape)
    out: list[Intervals] = [[(0, n)] for n in shape]
    if hasattr(cut, "indices"):  # a grid's BlockShard: blocks along `dims`, the fused dimension cut in each third
        for d, p, i in zip(cut.dims, cut.parts, cut.indices[cut.rank]):
            thirds = cut.fused if d == cut.fused_dim else 1
            size = shape[d] // thirds
            step = size // p
            out[d] = [(f * size + i * step, f * size + (i + 1) * step) for f in range(thirds)]
        return out
    # 1D's TPShard: slice `rank` of `degree` in each block along `dim` (`parts` equal ones, or `sizes` wide).
    sizes = getattr(cut, "sizes", None) or (shape[cut.dim] // cut.parts,) * cut.parts
    out[cut.dim], start = [], 0
    for width in sizes:
        step = width // cut.degree
        out[cut.dim].append((start + cut.rank * step, start + (cut.rank + 1) * step))
        start += width
    return out


def shard_runs(shape: tuple[int, ...], index: list[Intervals], a: int, b: int) -> Iterator[tuple[int, int, int]]:
    """(position in the shard's flattened elements, position in the whole tensor's, length) of each contiguous run
    that elements [a, b) of the shard cover, in order; runs adjacent in the file are joined."""
    cut = [d for d, ix in enumerate(index) if ix != [(0, shape[d])]]
    k = cut[-1] if cut else 0
    inner = math.prod(shape[k + 1 :])
    outer_sizes = [sum(e - s for s, e in ix) for ix in index[:k]]
    row = sum(e - s for s, e in index[k]) * inner  # one outer index's elements in the shard
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    pending: list[int] | None = None  # [shard position, file position, length] of the run being joined
    if row == 0 or b <= a:
        return
    for o in range(a // row, (b - 1) // row + 1):
        base, rest = 0, o
        for d in range(k - 1, -1, -1):  # the outer index's whole-tensor coordinates, innermost first
            rest, c = divmod(rest, outer_sizes[d])
            base += _through(index[d], c) * strides[d]
        at = o * row
        for s, e in index[k]:
            n = (e - s) * inner
            lo, hi = max(a, at), min(b, at + n)
            if lo < hi:
                start = base + s * inner + (lo - at)
                if pending is not None and pending[1] + pending[2] == start:
                    pending[2] += hi - lo
                else:
                    if pending is not None:
                        yield tuple(pending)  # type: ignore[misc]
                    pending = [lo, start, hi - lo]
            at += n
    if pending is not None:
        yield tuple(pending)  # type: ignore[misc]


def _through(ix: Intervals, c: int) -> int:
    """The whole-tensor coordinate of the shard's coordinate `c` along a dimension taking intervals `ix`."""
    for s, e in ix:
        if c < e - s:
            return s + c
        c -= e - s
    raise IndexError(c)


def read_shard(source: Any, key: str, cut: Any, a: int, b: int) -> torch.Tensor:
    """Elements [a, b) of this rank's shard (`cut`) of the files' tensor `key`, flattened, read run by run (see the
    note above) through the source's `read_elements`, each run straight into its place in the result: no more of the
    tensor is read or held."""
    shape = tuple(source.shape(key))
    buf: memoryview | None = None
    out = None
    size = 0
    for at, start, n in shard_runs(shape, shard_intervals(cut), a, b):
        if out is None:
            first = source.read_elements(key, start, start + n)  # its dtype sizes the result
            if at == a and n == b - a:
                return first  # one run: the read itself
            size = first.element_size()
            data = bytearray((b - a) * size)
            buf = memoryview(data)
            out = torch.frombuffer(data, dtype=torch.uint8).view(first.dtype)
            out.narrow(0, at - a, n).copy_(first)
            continue
        source.read_elements(key, start, start + n, buf[(at - a) * size : (at - a + n) * size])
    return out if out is not None else source.read_elements(key, 0, 0)
