"""The collectives of grid layouts as autograd functions, and the grid matrix product.

| function | forward | backward |
| --- | --- | --- |
| ``gather`` (tp_ops.gather_seq) | all-gather along a dim | reduce-scatter along it |
| ``scatter_sum`` (tp_ops.reduce_scatter_seq) | reduce-scatter along a dim | all-gather along it |
| ``sum_shared`` | all-reduce | all-reduce |
| ``grid_linear`` | gather x and W, multiply, reduce-scatter y | see below |

``sum_shared`` is the statistic of a norm: each rank adds its hidden part, every rank uses the total for its own
part, so the total's gradient on a rank covers only that rank's part: the parts are summed again in backward. (The
1D ``reduce_from_region`` passes gradients through unchanged because there every rank computes the same replicated
values after it.)

[Note: the grid product]
``grid_linear(x, w, gx, gw, gy)`` computes y = x w^T (w stored [out, in], as ``nn.Linear``) where x, w and y are
blocks: ``gx`` = (group, dim) along which x's blocks are gathered first (None: x is used as it is), ``gw`` the same
for w, ``gy`` the group and dim along which the partial products are summed and cut (None: they are complete).

    forward:  X = AG_gx(x), W = AG_gw(w), y = RS_gy(X W^T)
    backward: dY = AG_gy(dy), dx = RS_gx(dY W), dw = RS_gw(dY^T X)

In 2D (gx = row along hidden, gw = column along in, gy = None) this is SUMMA: the q broadcasts of X blocks along a
row that SUMMA makes, summed over its q steps, are what an all-gather moves (each rank sends its block once and
receives the q - 1 others, the ring cost of either), and the transposed products of its backward (Optimus' ABT and
ATB) reduce their partial sums to the block's owner: a reduce-scatter. Only the local blocks x and w are kept for
backward (the papers' memory: a rank never holds more than a block between forward and backward); they are gathered
again there, so backward moves twice what forward does (Optimus: 2 collectives forward, 4 backward per product).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

from hetero.parallel.tp_ops import gather_seq as gather
from hetero.parallel.tp_ops import reduce_scatter_seq as scatter_sum

Spec = tuple[Any, int] | None  # (group, dim) or None

__all__ = ["gather", "grid_linear", "scatter_sum", "sum_shared"]


def _ag(t: torch.Tensor, spec: Spec) -> torch.Tensor:
    if spec is None or spec[0].size == 1:
        return t
    comm, dim = spec
    return comm.all_gather_dim(t, dim)


def _rs(t: torch.Tensor, spec: Spec) -> torch.Tensor:
    if spec is None or spec[0].size == 1:
        return t
    comm, dim = spec
    return comm.reduce_scatter_dim(t, dim)


class _SumShared(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any) -> torch.Tensor:
        ctx.comm = comm
        out = x.detach().clone(memory_format=torch.contiguous_format)
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone(memory_format=torch.contiguous_format)
        ctx.comm.all_reduce(out)
        return out, None


def sum_shared(x: torch.Tensor, comm: Any) -> torch.Tensor:
    """All-reduce (sum) forward and backward: a total every rank uses for its own part (see the module table)."""
    return x if comm.size == 1 else _SumShared.apply(x, comm)


class _GridLinear(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, gx: Spec, gw: Spec, gy: Spec) -> torch.Tensor:
        ctx.specs = (gx, gw, gy)
        ctx.save_for_backward(x, w)  # the local blocks only: gathered again in backward ([Note: the grid product])
        big_x, big_w = _ag(x.detach(), gx), _ag(w.detach(), gw)
        return _rs(torch.matmul(big_x, big_w.t()), gy)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        x, w = ctx.saved_tensors
        gx, gw, gy = ctx.specs
        big_dy = _ag(dy.contiguous(), gy)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _rs(torch.matmul(big_dy, _ag(w.detach(), gw)), gx)
        if ctx.needs_input_grad[1]:
            big_x = _ag(x.detach(), gx)
            dw = _rs(big_dy.reshape(-1, big_dy.shape[-1]).t() @ big_x.reshape(-1, big_x.shape[-1]), gw)
        return dx, dw, None, None, None


def grid_linear(x: torch.Tensor, w: torch.Tensor, gx: Spec, gw: Spec, gy: Spec) -> torch.Tensor:
    """y = x w^T over grid blocks ([Note: the grid product]); w is [out, in] (a Conv1D passes its weight's .t())."""
    return _GridLinear.apply(x, w, gx, gw, gy)
