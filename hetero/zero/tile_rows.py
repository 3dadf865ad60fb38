"""The row lookups of an embedding split into tiles ([Note: computing on tiles] in `hetero/zero/tiling.py`): one
tile's rows into the output, and the output's gradient into one tile's rows."""

from __future__ import annotations

import torch


def embedding_rows(
    out: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, lo: int, *, sync_free: bool | None = None
) -> torch.Tensor:
    """`out` (one row per id) with the rows of the tile `w` (the embedding's rows [lo, lo + len(w))) filled in where
    the ids fall in it. On a GPU without `nonzero`, which waits for the GPU to tell the host how many ids hit: every id
    looks a row up (clamped into the tile) and a select keeps the ones inside. The host a step ahead of the GPU is
    what keeps it busy (the H200: 42 ms waited per step). sync_free: separate_memory (None: not a CPU)."""
    local = ids - lo
    inside = (local >= 0) & (local < w.shape[0])
    if not (ids.device.type != "cpu" if sync_free is None else sync_free):
        hit = inside.nonzero().squeeze(1)
        if hit.numel():
            out[hit] = w.index_select(0, local[hit])
        return out
    return torch.where(inside.unsqueeze(1), w.index_select(0, local.clamp(0, w.shape[0] - 1)), out)


def embedding_grad_rows(
    g: torch.Tensor, dy2: torch.Tensor, ids: torch.Tensor, lo: int, *, sync_free: bool | None = None
) -> torch.Tensor:
    """The tile's gradient `g` (zeroed; rows [lo, lo + len(g)) of the embedding) with each id's output gradient (a row
    of `dy2`) added to its row, for the ids that fall in the tile; on a GPU without `nonzero`, as `embedding_rows`
    (ids outside add a zero row to a clamped one: the same sums)."""
    local = ids - lo
    inside = (local >= 0) & (local < g.shape[0])
    if not (ids.device.type != "cpu" if sync_free is None else sync_free):
        hit = inside.nonzero().squeeze(1)
        if hit.numel():
            g.index_add_(0, local[hit], dy2[hit])
        return g
    return g.index_add_(0, local.clamp(0, g.shape[0] - 1), torch.where(inside.unsqueeze(1), dy2, 0))
