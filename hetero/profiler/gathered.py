"""Stage 3's peak of gathered parameter bytes as the estimator counts it: the engine's own units and release rules
([Note: units]), and one tile of a weight split into tiles."""

from __future__ import annotations

import torch
from torch import nn

from hetero.zero.layout import ChunkSpec
from hetero.zero.unit_rules import KEEP_UNITS, ahead_fits, gathered_peak
from hetero.zero.units import unit_parameters


def gathered_bytes(
    model: nn.Module,
    specs: list[ChunkSpec],
    dtype: torch.dtype,
    budget: int | None,
    *,
    ahead: bool = True,
    host_budget: int | None = None,
    shards_via_host: bool = False,
    world: int = 1,
) -> int:
    """Stage 3's peak of gathered parameter bytes, as `Gathers` keeps them: units in module order forward, reverse
    backward, the last KEEP_UNITS kept after forward where the device budget has room for them, the next unit
    gathered ahead where `ahead_fits` (shards_via_host: the shards, a world-th of each chunk, are read through host
    memory); plus one tile of a weight split into tiles, gathered alone while it is computed on ([Note: computing on
    tiles])."""
    index = {id(info.param): spec.index for spec in specs for info in spec.params if not spec.tile}
    per_unit = [sorted({index[id(p)] for p in ps if id(p) in index}) for _, _, ps in unit_parameters(model)]
    nbytes = {spec.index: spec.capacity * dtype.itemsize for spec in specs}
    sizes = sorted((sum(nbytes[c] for c in u) for u in per_unit), reverse=True)
    keep = KEEP_UNITS if budget is None or budget >= 1.5 * sum(sizes[: KEEP_UNITS + 1]) else 0
    tile = max((nbytes[spec.index] for spec in specs if spec.tile), default=0)
    shards = sizes[0] // world if shards_via_host and sizes else 0
    ahead = ahead and ahead_fits(sizes, keep, budget, host_shards=shards, host_budget=host_budget)
    return gathered_peak(per_unit, nbytes, keep, ahead=ahead) + tile
