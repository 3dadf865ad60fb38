"""The whole gradient's sum of squares at an update: over data-parallel shards, tensor ranks and pipeline stages,
read on the host (`grad_stats`) or left on the device (`sq_on_device`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from hetero.parallel.pipeline.tied import counts_in_norm
from hetero.zero.host_grads import chunk_sum_of_squares
from hetero.zero.norms import SquareSum, sum_of_squares

if TYPE_CHECKING:
    from hetero.comm import Comm
    from hetero.device import Device
    from hetero.parallel.mesh import Mesh
    from hetero.zero.zero_chunk import ZeroChunk


def zc_sharded(chunks: list[ZeroChunk]) -> bool:
    """Whether ranks hold disjoint shards of the reduced gradient (stages 1-3): their squares add up."""
    return bool(chunks) and chunks[0].stage >= 1


def grad_stats(chunks: list[ZeroChunk], *, mesh: Mesh, comm: Comm, device: Device) -> tuple[float, bool]:
    """Sum of squares of the global (scaled) gradient, and whether it is finite: over data-parallel shards (`comm`),
    pipeline stages and tensor ranks, read back to the host. A tensor-sharded parameter's pieces add up (a block that
    `replicas` tensor ranks hold alike counts 1 / replicas on each); a replicated one (no `_hetero_tp`) has the same
    gradient on every tensor rank, so each rank counts 1 / degree of it."""
    tp = mesh.tp_size
    sums = SquareSum()
    for zc in chunks:
        g = zc.grad_view()
        if tp == 1 and all(counts_in_norm(info.param) for info in zc.spec.params):
            sums.add(chunk_sum_of_squares(zc, g))
            continue
        lo, _ = zc.kept_range()
        for info, a, b in zc.spec.overlaps(lo, lo + g.numel()):
            if not counts_in_norm(info.param):  # a tied copy another pipeline rank counts (pipeline/tied.py)
                continue
            cut = getattr(info.param, "_hetero_tp", None)  # a 2.5D block is held by `replicas` tensor ranks
            weight = 1.0 / (cut.replicas if cut is not None else tp)
            sums.add(weight * zc.device.to_host(sum_of_squares(g[a - lo : b - lo])))
    sq = sums.total(device)
    if zc_sharded(chunks):  # disjoint shards; at stage 0 every data-parallel rank holds the whole gradient
        comm.control.all_reduce(sq, op="sum")
    mesh.tp.control.all_reduce(sq, op="sum")
    mesh.pp.control.all_reduce(sq, op="sum")
    if comm.size > mesh.dp_size:
        sq /= 2  # Chimera: pipeline ranks r and p - 1 - r hold the same stages, each counted twice over pp
    value = float(sq)
    return value, math.isfinite(value)


def sq_on_device(chunks: list[ZeroChunk], *, comm: Comm, device: Device) -> torch.Tensor:
    """The same sum where only the data-parallel group holds parts of the gradient, as a float64 device scalar
    all-reduced there: nothing read back ([Note: the norm read when asked] in update.py)."""
    sums = SquareSum()
    for zc in chunks:
        sums.add(chunk_sum_of_squares(zc, zc.grad_view()))
    sq = sums.on_device(device)
    if zc_sharded(chunks):
        comm.all_reduce(sq, op="sum")
    return sq


def clip_coef(clip_max: float, norm: float) -> float:
    """min(1, clip / (norm + 1e-6)) as torch's clip_grad_norm_ clamps it: NaN where the norm is NaN, so a NaN gradient
    makes every parameter NaN, as torch's loop and the coefficient on the device (`clip_coef_on_device`) do. Python's
    min(1.0, nan) is 1.0: the chunks stepped on the host left all but the NaN parameters finite, the same run on a
    GPU none."""
    coef = clip_max / (norm + 1e-6)
    return coef if coef < 1.0 or math.isnan(coef) else 1.0


def clip_coef_on_device(sq: torch.Tensor, clip_max: float, inv_scale: float = 1.0) -> torch.Tensor:
    """min(1, clip / (norm + 1e-6)) * inv_scale from the (scaled) sum of squares on the device, norm = sqrt(sq) *
    inv_scale: in float64, one rounding per operation in the host's order (`Updater.prepare`), so the same bits (a
    float divided by a tensor is a reciprocal and a product in torch: two roundings, hence `new_full`)."""
    norm = sq.sqrt() if inv_scale == 1.0 else sq.sqrt() * inv_scale
    denom = norm + 1e-6
    coef = torch.clamp(denom.new_full((), clip_max) / denom, max=1.0)
    return coef if inv_scale == 1.0 else coef * inv_scale
