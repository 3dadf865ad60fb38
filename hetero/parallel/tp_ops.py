"""The communication of tensor and sequence parallelism as autograd functions.

Each function is one collective in forward and its conjugate in backward (Megatron-LM, Shoeybi et al. 2019, and
sequence parallelism, Korthikanti et al. 2022). With ``t`` ranks in the tensor group:

| function | forward | backward | where |
| --- | --- | --- | --- |
| ``copy_to_region`` (the paper's f) | identity | all-reduce | entering a column-parallel layer |
| ``reduce_from_region`` (g) | all-reduce | identity | leaving a row-parallel layer |
| ``gather_seq`` | all-gather along the sequence | reduce-scatter | entering a column-parallel layer under SP |
| ``reduce_scatter_seq`` | reduce-scatter along the sequence | all-gather | leaving a row-parallel layer under SP |
| ``scatter_seq`` | keep this rank's part of the sequence | all-gather | entering the sequence-parallel region |
| ``gather_seq_exact`` | all-gather along the sequence | keep this rank's part | leaving the sequence-parallel region |
| ``all_to_all`` | all-to-all (scatter one dim, gather another) | the reverse all-to-all | Ulysses attention |

The rule behind the backward column: the forward's output gradient is partial (a sum over ranks is owed) exactly
where the forward made a replicated value from shards, and complete where the forward kept a replica. A group of
size 1 makes every function the identity. All of them go through :class:`hetero.comm.Comm`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Function

from hetero.comm import Comm


def _all_reduce(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    out = x.detach().clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out)
    return out


def _check_seq(x: torch.Tensor, comm: Comm, dim: int) -> None:
    n = x.shape[dim]
    if n % comm.size:
        raise ValueError(
            f"sequence parallelism splits dimension {dim} of shape {tuple(x.shape)} over {comm.size} tensor ranks: "
            f"its length {n} must divide by {comm.size} (pad the sequence)"
        )


def _keep_part(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    _check_seq(x, comm, dim)
    return x.detach().chunk(comm.size, dim)[comm.rank].contiguous()


class _CopyToRegion(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.comm), None


class _ReduceFromRegion(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _along(name: str, forward: Callable, backward: Callable) -> type[Function]:
    """An autograd function along one dimension: `forward(x, comm, dim)` and its conjugate `backward(grad, comm,
    dim)`, the table's two columns."""

    def fwd(ctx: Any, x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return forward(x, comm, dim)

    def bwd(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return backward(grad, ctx.comm, ctx.dim), None, None

    return type(name, (Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


def _gather(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    return comm.all_gather_dim(x, dim)


def _reduce_scatter(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    _check_seq(x, comm, dim)
    return comm.reduce_scatter_dim(x, dim)


_GatherSeq = _along("_GatherSeq", _gather, _reduce_scatter)
_ReduceScatterSeq = _along("_ReduceScatterSeq", _reduce_scatter, _gather)
_ScatterSeq = _along("_ScatterSeq", _keep_part, _gather)
_GatherSeqExact = _along("_GatherSeqExact", _gather, _keep_part)


class _AllToAll(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.comm, ctx.dims = comm, (scatter_dim, gather_dim)
        return comm.all_to_all_dim(x, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return ctx.comm.all_to_all_dim(grad, gather_dim, scatter_dim), None, None, None


def copy_to_region(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """f: identity forward; backward all-reduces the input gradient (each rank's shard contributes a part)."""
    return x if comm.size == 1 else _CopyToRegion.apply(x, comm)


def reduce_from_region(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """g: all-reduce forward (sum the ranks' partial outputs); backward passes the complete gradient through."""
    return x if comm.size == 1 else _ReduceFromRegion.apply(x, comm)


def gather_seq(x: torch.Tensor, comm: Comm, dim: int = 1) -> torch.Tensor:
    """All-gather along the sequence; backward reduce-scatters, since the consumer's input gradient is partial."""
    return x if comm.size == 1 else _GatherSeq.apply(x, comm, dim)


def reduce_scatter_seq(x: torch.Tensor, comm: Comm, dim: int = 1) -> torch.Tensor:
    """Sum the ranks' partial outputs and keep this rank's part of the sequence; backward all-gathers."""
    return x if comm.size == 1 else _ReduceScatterSeq.apply(x, comm, dim)


def scatter_seq(x: torch.Tensor, comm: Comm, dim: int = 1) -> torch.Tensor:
    """Keep this rank's part of a replicated sequence; backward all-gathers the parts' gradients."""
    return x if comm.size == 1 else _ScatterSeq.apply(x, comm, dim)


def gather_seq_exact(x: torch.Tensor, comm: Comm, dim: int = 1) -> torch.Tensor:
    """All-gather along the sequence into a replica; backward keeps this rank's part of the (complete) gradient."""
    return x if comm.size == 1 else _GatherSeqExact.apply(x, comm, dim)


def all_to_all(x: torch.Tensor, comm: Comm, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Re-partition ``x``: split ``scatter_dim`` over the ranks, concatenate ``gather_dim``; backward reverses it."""
    return x if comm.size == 1 else _AllToAll.apply(x, comm, scatter_dim, gather_dim)
