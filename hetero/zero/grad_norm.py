"""The whole gradient's sum of squares at an update: over data-parallel shards, tensor ranks and pipeline stages,
read on the host (`grad_stats`) or left on the device (`sq_on_device`).

[Note: the norm on the device, agreed]
The two ways issue different collectives: `sq_on_device` all-reduces a device scalar on the data group, `grad_stats`
a host scalar on the control group (and fp16's check on the device adds its own). The device's way needs every chunk
to step on the device, which follows from the optimizer's placement, and that is each rank's own (`offload` is a
per-rank key: [Note: one config for every rank] in hetero/config_ranks.py). Decided by each rank from its own
placement, two ranks (optimizer states on the host on one, on the device on the other) each waited at the first
clipped update in an all-reduce the other never issued, until comm_timeout (ten minutes by default): measured under
the stand-in, which takes a GPU's path here ([Note: the CPU stand-in] in hetero/standin.py). So the ranks agree
once, as the engine starts (`norm_on_device`): the device's way only where it suits every rank.
tests/test_placements_apart.py.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from hetero.memory import Tier
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


def norm_on_device(chunks: list[ZeroChunk], *, mesh: Mesh, comm: Comm, device: Device) -> bool:
    """Whether the update's norm (and fp16's overflow check) may stay on the device: on every rank of `comm`, every
    chunk steps on a device with memory of its own, and the norm needs no group but the data-parallel one. One
    all-reduce where the ranks could differ ([Note: the norm on the device, agreed])."""
    if mesh.tp_size > 1 or mesh.pp_size > 1 or comm.size != mesh.dp_size or not device.separate_memory:
        return False  # the config and the device kind: the same on every rank
    mine = torch.tensor([int(all(zc.placement.compute is Tier.DEVICE for zc in chunks))], dtype=torch.int64)
    if comm.size > 1:
        comm.control.all_reduce(mine, op="min")
    return bool(int(mine))


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
