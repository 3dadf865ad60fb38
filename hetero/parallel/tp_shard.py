"""How 1D tensor parallelism cuts one parameter (`TPShard`), and the cut itself both ways: a rank's shard of the
whole tensor (`shard_of`) and the whole tensor from every rank's shard (`unshard`).

A cut splits dimension `dim` into blocks, each split in `degree` equal slices; rank r holds slice r of every block,
concatenated in block order. A plain column or row cut is one block; a fused projection several, each cut on its
own: a fused gate/up's two halves, a fused q/k/v's three blocks, which differ in width under grouped-query
attention (`sizes`: q, then k and v of fewer heads; [Note: fused q/k/v projections] in fused_qkv.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hetero.errors import ConfigError


@dataclass(frozen=True)
class TPShard:
    """How a sharded parameter was cut: ``parts`` blocks along ``dim`` (3 for a fused q/k/v, 2 for a fused gate/up),
    each split in ``degree`` equal slices; rank ``rank`` holds slice ``rank`` of every block, concatenated."""

    dim: int
    parts: int
    degree: int
    rank: int
    full_shape: tuple[int, ...]
    sizes: tuple[int, ...] | None = None  # the blocks' widths along dim, whole; None: `parts` equal blocks

    def __post_init__(self) -> None:
        if self.sizes is not None and (len(self.sizes) != self.parts or sum(self.sizes) != self.full_shape[self.dim]):
            raise ValueError(f"block widths {self.sizes} must be {self.parts}, summing to {self.full_shape[self.dim]}")

    @property
    def blocks(self) -> tuple[int, ...]:
        """The blocks' widths along `dim` in the whole tensor."""
        return self.sizes or (self.full_shape[self.dim] // self.parts,) * self.parts

    @property
    def replicas(self) -> int:
        """Tensor ranks holding this same shard: 1 (a 2.5D block may have more, see grid/shard.py)."""
        return 1

    @property
    def stored_rank(self) -> int:
        """The tensor rank whose copy a checkpoint stores: this one."""
        return self.rank


def unshard(shards: Sequence[torch.Tensor], info: TPShard) -> torch.Tensor:
    """The full tensor from every tensor rank's shard, in rank order (checkpoints, tests); `BlockShard.join`'s twin."""
    if not isinstance(info, TPShard):
        return info.join(shards)
    if len(shards) != info.degree:
        raise ValueError(f"unshard needs {info.degree} shards (one per tensor rank), got {len(shards)}")
    slices = [w // info.degree for w in info.blocks]
    blocks = [s.split(slices, info.dim) for s in shards]
    return torch.cat([torch.cat([b[p] for b in blocks], info.dim) for p in range(info.parts)], info.dim)


def shard_of(full: torch.Tensor, info: TPShard) -> torch.Tensor:
    """Rank `info.rank`'s shard of the whole tensor (views of it, concatenated: a new tensor where several blocks)."""
    return torch.cat([b.chunk(info.degree, info.dim)[info.rank] for b in full.split(info.blocks, info.dim)], info.dim)


def check_divides(
    param: nn.Parameter, dim: int, parts: int, degree: int, what: str, sizes: tuple[int, ...] | None = None
) -> None:
    """Raise unless every block of `param` along `dim` (`parts` equal ones, or `sizes` wide) divides by `degree`."""
    n = param.shape[dim]
    if sizes is not None:
        if any(w % degree for w in sizes):
            raise ConfigError(
                f"{what}: dimension {dim} of shape {tuple(param.shape)} is cut in blocks of "
                f"{', '.join(map(str, sizes))}, each into {degree} tensor ranks, which does not divide them all; "
                "choose a tensor-parallel degree that divides the query and the key/value head counts"
            )
        return
    if n % (parts * degree):
        split = f"{parts} parts x {degree} tensor ranks" if parts > 1 else f"{degree} tensor ranks"
        raise ConfigError(
            f"{what}: dimension {dim} of shape {tuple(param.shape)} does not divide into {split}; choose a "
            "tensor-parallel degree that divides it (or pad the layer)"
        )
