"""The autograd functions of tiled layers: forward and backward over a weight's tiles, one resident at a time
([Note: computing on tiles] in `hetero/zero/tiling.py`, which swaps them into the layers' forwards). A tile's gradient
is computed only where the backward is the training one ([Note: backwards that are not the training one], ibid.).

[Note: tiles summed in fp32]
Where a layer's weight is split into tiles along its input features (Conv1D's forward, Linear's input gradient),
the layer's result is a sum of one product per tile. Summed in fp16 each partial sum was rounded to fp16 again:
under fp16 a tiled Llama's v_proj moved 0.0062 from the float64 run in five steps where plain PyTorch's fp16 moved
0.00053 (the untiled engine the same as plain). One matmul rounds its output once; so the tiles' products are summed
in fp32 and rounded once at the end, which brought it back to 0.00053.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hetero.zero.tile_rows import embedding_grad_rows, embedding_rows

if TYPE_CHECKING:
    from hetero.zero.tiling import Tiled, TileRunner
    from hetero.zero.units import Entry


def tile_grad(r: TileRunner, e: Entry, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, a tile's weight gradient, computed where `TileRunner.grad_out` says."""
    return torch.mm(a, b, out=r.grad_out(e, b))


def _add(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """total + a @ b, summed over a layer's tiles in fp32 where a and b are 16-bit ([Note: tiles summed in fp32])."""
    if a.dtype in (torch.float16, torch.bfloat16):
        a, b = a.float(), b.float()  # 16-bit products summed in fp32 still moved 0.0060
    return a @ b if total is None else total.addmm_(a, b)


def _begin_forward(ctx: Any, x: torch.Tensor, r: TileRunner, t: Tiled, counted: bool, layer: str) -> None:
    """A tiled linear or Conv1D layer's forward starts: what its backward needs, and its turn to gather."""
    ctx.r, ctx.t, ctx.counted, ctx.layer = r, t, counted, layer
    ctx.save_for_backward(x)
    r.take_turn(layer, backward=False)


def _begin_backward(ctx: Any) -> tuple[torch.Tensor, TileRunner, Tiled, bool]:
    """Its backward starts: the input, the runner, the weight, whether the tiles' gradients are wanted; its turn."""
    (x,) = ctx.saved_tensors
    grads = ctx.r.wants_grads(ctx.t)
    ctx.r.take_turn(ctx.layer, backward=True)
    return x, ctx.r, ctx.t, grads


class TiledLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, anchor: torch.Tensor, r: TileRunner, t: Tiled, counted: bool, layer: str
    ) -> Any:
        _begin_forward(ctx, x, r, t, counted, layer)
        parts = []
        for e in t.tiles:
            w = r.open(e)
            try:
                parts.append(F.linear(x, w))
            finally:
                r.close(e)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, r, t, grads = _begin_backward(ctx)
        dx = None
        x2 = x.reshape(-1, x.shape[-1])
        dy2 = dy.reshape(-1, dy.shape[-1])
        lo = 0
        for e in t.tiles:
            w = r.open(e)
            try:
                rows = w.shape[0]
                g = dy2[:, lo : lo + rows]
                if ctx.needs_input_grad[0]:
                    dx = _add(dx, g, w)
                if grads:
                    r.deliver(t, e, tile_grad(r, e, g.t(), x2), ctx.counted)
                lo += rows
            finally:
                r.close(e)
        r.end_backward(t, ctx.counted)
        return (None if dx is None else dx.to(x.dtype).view(x.shape)), None, None, None, None, None


class TiledConv1D(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, anchor: torch.Tensor, r: TileRunner, t: Tiled, counted: bool, layer: str
    ) -> Any:
        _begin_forward(ctx, x, r, t, counted, layer)
        out = None
        lo = 0
        for e in t.tiles:
            w = r.open(e)
            try:
                rows = w.shape[0]
                part = x[:, lo : lo + rows]
                out = _add(out, part, w)
                lo += rows
            finally:
                r.close(e)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, r, t, grads = _begin_backward(ctx)
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        lo = 0
        for e in t.tiles:
            w = r.open(e)
            try:
                rows = w.shape[0]
                if dx is not None:
                    dx[:, lo : lo + rows] = dy @ w.t()
                if grads:
                    r.deliver(t, e, tile_grad(r, e, x[:, lo : lo + rows].t(), dy), ctx.counted)
                lo += rows
            finally:
                r.close(e)
        r.end_backward(t, ctx.counted)
        return dx, None, None, None, None, None


class TiledEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        ids: torch.Tensor,
        anchor: torch.Tensor,
        r: TileRunner,
        t: Tiled,
        counted: bool,
        padding_idx: int | None,
    ) -> Any:
        ctx.r, ctx.t, ctx.counted, ctx.padding_idx = r, t, counted, padding_idx
        ctx.save_for_backward(ids)
        flat = ids.reshape(-1)
        out = None
        lo = 0
        for e in t.tiles:
            w = r.open(e)
            try:
                if out is None:
                    out = torch.zeros(flat.numel(), w.shape[1], dtype=w.dtype, device=w.device)
                out = embedding_rows(out, w, flat, lo, sync_free=e.chunk.device.separate_memory)
                lo += w.shape[0]
            finally:
                r.close(e)
        return out.view(*ids.shape, -1)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        (ids,) = ctx.saved_tensors
        r, t = ctx.r, ctx.t
        grads = r.wants_grads(t)
        flat = ids.reshape(-1)
        dy2 = dy.reshape(flat.numel(), -1)
        lo = 0
        for e in t.tiles:
            rows, dim = e.info.shape
            if grads:
                # The gradient needs no values of the tile: it is not gathered (nothing to read, no collective).
                g = r.grad_out(e, dy).zero_()
                g = embedding_grad_rows(g, dy2, flat, lo, sync_free=e.chunk.device.separate_memory)
                pad = ctx.padding_idx
                if pad is not None and lo <= pad < lo + rows:
                    g[pad - lo].zero_()
                r.deliver(t, e, g, ctx.counted)
            lo += rows
        r.end_backward(t, ctx.counted)
        return None, None, None, None, None, None
