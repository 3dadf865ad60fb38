"""Which parameter goes into which chunk, at which offset.

Parameters are packed in the order the model registers them (for most models the order forward uses them, which
keeps a chunk's tensors needed together and makes prefetch effective), one param group of the user's optimizer at a
time: every chunk belongs to exactly one group, so a chunk's optimizer update uses one set of hyperparameters.
Parameters that will not be trained (requires_grad False, or in no optimizer group) go to frozen chunks, which are
placed and sharded like the others but get no gradients and no optimizer state.

Every chunk's capacity is a multiple of the data-parallel world size, so it splits into equal shards, one per rank.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from hetero.memory.chunk_size import pack, search_chunk_size

log = logging.getLogger("hetero.zero")


@dataclass(eq=False)
class ParamInfo:
    name: str  # fully qualified name (the first, when a parameter is shared)
    param: nn.Parameter
    offset: int = 0  # first element within its chunk
    trainable: bool = True  # gets a gradient and an update
    registered: int = 0  # position in model.named_parameters(): roughly forward order (see reduce_order)

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def shape(self) -> torch.Size:
        return self.param.shape


@dataclass(eq=False)
class ChunkSpec:
    index: int  # position in the layout: the order of reduction and of the optimizer pass, the same on every rank
    group: int | None  # the optimizer param group; None for frozen chunks
    capacity: int  # elements, a multiple of the world size
    params: list[ParamInfo] = field(default_factory=list)

    @property
    def trainable(self) -> bool:
        return self.group is not None

    def overlaps(self, lo: int, hi: int) -> Iterator[tuple[ParamInfo, int, int]]:
        """Each parameter that meets the chunk's element range [lo, hi), with the range [a, b) they share (in chunk
        elements): how a rank's shard, a saved segment or a gradient region maps onto parameters."""
        for info in self.params:
            a, b = max(info.offset, lo), min(info.offset + info.numel, hi)
            if a < b:
                yield info, a, b


def build_layout(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, *, chunk_numel: int | None, world: int
) -> list[ChunkSpec]:
    """Chunks for every parameter of the model. chunk_numel None: search the size that wastes least. optimizer None
    (inference): every chunk is frozen."""
    names = {id(p): n for n, p in model.named_parameters()}  # shared parameters appear once, by first name
    group_of: dict[int, int] = {}
    for g, group in enumerate(optimizer.param_groups if optimizer is not None else []):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"the optimizer's param group {g} holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                    "of the model: build the optimizer from model.parameters()"
                )
            if id(p) in group_of:
                raise ValueError(f"parameter {names[id(p)]!r} appears in two optimizer param groups")
            group_of[id(p)] = g
    buckets: dict[int | None, list[ParamInfo]] = {}
    for position, (name, p) in enumerate(model.named_parameters()):
        g = group_of.get(id(p)) if p.requires_grad else None
        if p.requires_grad and g is None and optimizer is not None:
            log.warning("parameter %r requires grad but is in no optimizer group: it is treated as frozen", name)
        if p.numel() == 0:
            continue
        info = ParamInfo(name=name, param=p, trainable=g is not None, registered=position)
        buckets.setdefault(g, []).append(info)
    if not buckets:
        raise ValueError("the model has no parameters to place")
    all_numels = [info.numel for infos in buckets.values() for info in infos]
    if chunk_numel is None:
        chunk_numel = _auto_chunk_numel(all_numels)
    specs: list[ChunkSpec] = []
    order = sorted(buckets, key=lambda g: (g is None, g if g is not None else 0))
    for g in order:
        infos = buckets[g]
        for indices in pack([i.numel for i in infos], chunk_numel):
            members = [infos[i] for i in indices]
            used = sum(m.numel for m in members)
            capacity = _round_up(max(used, chunk_numel if used <= chunk_numel else used), world)
            spec = ChunkSpec(index=len(specs), group=g, capacity=capacity)
            offset = 0
            for m in members:
                m.offset = offset
                offset += m.numel
                spec.params.append(m)
            specs.append(spec)
    return specs


def _auto_chunk_numel(numels: list[int]) -> int:
    """The least wasteful capacity, within a range scaled to the model so that small models still get several
    chunks (at least ~8 for fine-grained movement) and large ones stay under 64M elements per chunk."""
    total, largest = sum(numels), max(numels)
    lo = max(1024, min(1 << 20, total // 8))
    hi = max(lo, min(64 << 20, max(largest, total // 4)))
    step = max(1024, (hi - lo) // 256)
    plan = search_chunk_size(numels, min_numel=lo, max_numel=hi, step_numel=step, align_numel=1024)
    return plan.chunk_numel


def _round_up(n: int, k: int) -> int:
    return int(math.ceil(n / k)) * k
