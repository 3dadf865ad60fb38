"""A stand-in for a process group that only shapes tensors: a group's size and this rank's place in it, with
collectives that return tensors of the right shape and no communication.

It lets a layout be applied and run without processes: checks before anything changes, tests of the blocks every
rank would hold, and the estimator's forward on the meta device (`hetero/profiler/parallel_shapes.py`), where values
do not exist and only shapes (and so bytes) matter. On real tensors the values it returns are copies, not results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


class _Done:
    def wait(self) -> bool:
        return True


@dataclass(frozen=True)
class ShapeComm:
    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        return None

    def all_gather_dim(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([t.detach()] * self.size, dim)

    def reduce_scatter_dim(self, t: torch.Tensor, dim: int, op: str = "sum") -> torch.Tensor:
        return t.detach().chunk(self.size, dim)[self.rank].contiguous()

    def all_to_all_dim(self, t: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        part = t.detach().chunk(self.size, scatter_dim)[0]
        return torch.cat([part] * self.size, gather_dim)

    def batch_p2p(self, ops: Sequence[tuple[str, torch.Tensor, int, int]]) -> list[Any]:
        return [_Done() for _ in ops]
