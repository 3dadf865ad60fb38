"""How a parameter is cut over a 2D, 2.5D or 3D grid: a block of a block grid, the same description on every rank.

A 1D cut (`TPShard`) splits one dimension over the tensor ranks. Grid layouts split up to two dimensions, by
different groups, sometimes into sub-parts (3D weights: the input dimension in q x q parts), and may hold the same
block on several ranks (2.5D: every depth layer holds the whole q x q grid of weights). `BlockShard` says, for
every tensor rank, which block of each split dimension it holds; a fused dimension (GPT-2's q/k/v `c_attn`) is cut
the same way inside each of its `fused` thirds, as the 1D cut does.

Invariants the engine and checkpoints rely on (generalising the 1D ones): `replicas` ranks of the tensor group hold
the same values (1 unless the layout replicates the block, as 2.5D over depth), their gradients are complete and
equal after backward, so the global gradient norm counts each rank's squares divided by `replicas`; the lowest of
them (`stored_rank`) is the one a checkpoint stores it from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class BlockShard:
    full_shape: tuple[int, ...]
    dims: tuple[int, ...]  # the split dimensions
    parts: tuple[int, ...]  # blocks along each split dimension
    indices: tuple[tuple[int, ...], ...]  # per tensor rank: its block along each split dimension
    rank: int  # this rank in the tensor group
    fused: int = 1  # equal blocks of `fused_dim` cut alike (3: a fused q/k/v projection)
    fused_dim: int = 0

    def __post_init__(self) -> None:
        if self.fused > 1 and self.fused_dim not in self.dims:
            raise ValueError(f"fused dimension {self.fused_dim} must be one of the split dimensions {self.dims}")

    @property
    def degree(self) -> int:
        return len(self.indices)

    @property
    def replicas(self) -> int:
        """Tensor ranks holding the same block as this one (this one included)."""
        return sum(ix == self.indices[self.rank] for ix in self.indices)

    @property
    def stored_rank(self) -> int:
        """The lowest tensor rank holding this block: the one whose copy a checkpoint stores."""
        return self.indices.index(self.indices[self.rank])

    def stored_ranks(self) -> list[int]:
        """One tensor rank per distinct block, in rank order."""
        return sorted({self.indices.index(ix) for ix in self.indices})

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        for d, p in zip(self.dims, self.parts):
            shape[d] //= p
        return tuple(shape)

    def _slices(self, rank: int) -> list[tuple[slice, ...]]:
        """Where rank's block sits in the full tensor: one index per fused block (concatenated in the shard)."""
        out = []
        for f in range(self.fused):
            index = [slice(None)] * len(self.full_shape)
            for d, p, i in zip(self.dims, self.parts, self.indices[rank]):
                size = self.full_shape[d] // (self.fused if d == self.fused_dim else 1)
                base = f * size if d == self.fused_dim else 0
                step = size // p
                index[d] = slice(base + i * step, base + (i + 1) * step)
            out.append(tuple(index))
        return out

    def shard_of(self, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """This rank's (or `rank`'s) block of the full tensor, a new contiguous tensor."""
        pieces = [full[s] for s in self._slices(self.rank if rank is None else rank)]
        return torch.cat(pieces, self.fused_dim).contiguous() if len(pieces) > 1 else pieces[0].contiguous().clone()

    def join(self, shards: Sequence[torch.Tensor] | Mapping[int, torch.Tensor]) -> torch.Tensor:
        """The full tensor from the shards of every tensor rank (a list in rank order) or of the stored ranks (a
        mapping tensor rank -> shard). Replicated blocks are taken from their stored rank."""
        by_rank = dict(enumerate(shards)) if not isinstance(shards, Mapping) else dict(shards)
        wanted = self.stored_ranks()
        if not set(wanted) <= by_rank.keys():
            raise ValueError(
                f"joining {self.full_shape} needs the shards of tensor ranks {wanted}, got {sorted(by_rank)}"
            )
        first = by_rank[wanted[0]]
        full = first.new_empty(self.full_shape)
        for r in wanted:
            pieces = by_rank[r].chunk(self.fused, self.fused_dim) if self.fused > 1 else [by_rank[r]]
            for s, piece in zip(self._slices(r), pieces):
                full[s] = piece
        return full

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description (checkpoint manifests); `from_dict` inverts it for any rank."""
        return {
            "full_shape": list(self.full_shape),
            "dims": list(self.dims),
            "parts": list(self.parts),
            "indices": [list(ix) for ix in self.indices],
            "fused": self.fused,
            "fused_dim": self.fused_dim,
            "degree": self.degree,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], rank: int = 0) -> BlockShard:
        return cls(
            full_shape=tuple(d["full_shape"]),
            dims=tuple(d["dims"]),
            parts=tuple(d["parts"]),
            indices=tuple(tuple(ix) for ix in d["indices"]),
            rank=rank,
            fused=d.get("fused", 1),
            fused_dim=d.get("fused_dim", 0),
        )
