"""The layers of grid layouts (2D, 2.5D, 3D), swapped in per instance as 1D tensor parallelism does: a subclass of
the module's own class whose forward adds the grid's communication; names, hooks and state_dict keys unchanged.

Each layer reads its `GridRole` (`module._hetero_grid`): the grid, and for a linear layer the three gathers of its
product ([Note: the grid product]) and the layout its output leaves in. Shapes on a rank (b, s, h: the model's batch,
sequence and hidden sizes; B: grid.batch_parts; q: the hidden split):

| layer | input | weight held | output |
| --- | --- | --- | --- |
| linear (colwise, rowwise) | [b/B, s, in/q] | [out/q, in/q] (3D: [out/q, in/q^2]) | [b/B, s, out/q] |
| vocab embedding | ids [b, s], whole | [V/|main.batch|, h/q] | [b/B, s, h/q] |
| vocab head | [b/B, s, h/q] | the embedding's block | logits [b/B, s, V/q] |
| position embedding | positions, whole | [P, h/(q |main.batch|)] | [.., s, h/q] |
| layer norm, RMS norm | [b/B, s, h/q] | [h/(q |main.batch|)] | [b/B, s, h/q] |

A vector along the hidden dimension (a bias, a norm's weight, a position embedding's rows) is cut q |batch| ways
so that no two ranks hold the same values; it is all-gathered over the batch group of its layout before use (whose
ranks need the same hidden part) and its gradient reduce-scattered back, which also sums the batch parts.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetero.errors import ConfigError
from hetero.parallel.grid.mesh import Grid, Orient
from hetero.parallel.grid.ops import Spec, gather, grid_linear, scatter_sum, sum_shared
from hetero.parallel.tensor import LogitsHead


@dataclass(frozen=True, eq=False)
class GridRole:
    grid: Grid
    orient: Orient  # the layout of the module's output (a linear's) or of its input and output
    gx: Spec = None  # a linear's gathers ([Note: the grid product])
    gw: Spec = None
    gy: Spec = None
    fused: int = 1  # a fused q/k/v projection's bias is cut per third
    size: int = 0  # a norm's full normalized size
    offset: float = 0.0  # an RMS norm's scale is (offset + weight): 1 in Gemma's, 0 in Llama's


def hidden_vector(p: torch.Tensor, orient: Orient, dim: int = 0, fused: int = 1) -> torch.Tensor:
    """A hidden-dimension vector's part for this rank's layout: its sub-parts gathered over the layout's batch group
    (reduce-scattered in backward: every batch part adds its share of the gradient)."""
    g = gather(p, orient.batch, dim)
    if fused > 1 and orient.batch.size > 1:
        # A fused q/k/v bias (1-D): gathered as [ranks, thirds, n], the product's output holds [thirds, ranks, n].
        g = g.view(orient.batch.size, fused, -1).transpose(0, 1).reshape(-1)
    return g


def _conv1d(module: nn.Module) -> bool:
    return hasattr(module, "nf") and hasattr(module, "nx") and not isinstance(module, nn.Linear)


def weight_as_linear(module: nn.Module) -> torch.Tensor:
    """The weight as [out, in] (a Conv1D stores [in, out])."""
    return module.weight.t() if _conv1d(module) else module.weight


class _Linear:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        role = self._hetero_grid
        y = grid_linear(x, weight_as_linear(self), role.gx, role.gw, role.gy)
        if self.bias is None:
            return y
        return y + hidden_vector(self.bias, role.orient, 0, role.fused)


class _Head(LogitsHead):
    """The vocabulary head: logits cut by batch (rows) and vocabulary (the layout's hidden group)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        role = self._hetero_grid
        y = grid_linear(x, self.weight, role.gx, role.gw, role.gy)
        return y if self.bias is None else y + hidden_vector(self.bias, role.orient, 0)

    def whole_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[b/B, s, V/q] gathered whole, [b, s, V], on every tensor rank (generate picks its tokens from them)."""
        return whole_logits(logits, self._hetero_grid.grid)


def check_rows(t: torch.Tensor, grid: Grid, what: str) -> None:
    parts = grid.batch_parts
    if t.shape[0] % parts:
        raise ConfigError(
            f"tensor_mode {grid.mode!r} (tensor = {grid.tp.size}) cuts the batch into {parts} parts, {what}: "
            f"{t.shape[0]} rows; give each data-parallel rank a multiple of {parts} rows per micro-batch (its batch "
            f"divided by parallel.microbatches), or pad the batch with rows whose labels are -100"
        )


def own_rows(t: torch.Tensor, grid: Grid, what: str) -> torch.Tensor:
    """This rank's part of a whole batch ([b, ...] -> [b/B, ...]): depth layer first, then main.batch."""
    check_rows(t, grid, what)
    return t.chunk(grid.batch_parts, 0)[grid.batch_index]


def is_grid_head(module: nn.Module) -> bool:
    """Whether `module` is a grid layout's vocabulary head (its logits cut by batch rows and vocabulary)."""
    return isinstance(module, _Head)


def whole_logits(logits: torch.Tensor, grid: Grid) -> torch.Tensor:
    """A grid head's logits [b/B, s, V/q] gathered whole, [b, s, V], on every rank of the tensor group: the
    vocabulary over the hidden group of the head's layout, then the rows in `own_rows`' order (main.batch within a
    depth layer, then the depth layers). Forward only: for evaluation and generation, not for a backward."""
    whole = grid.main.hidden.all_gather_dim(logits, logits.dim() - 1)
    return grid.outer.all_gather_dim(grid.main.batch.all_gather_dim(whole, 0), 0)


# The grid whose model's forward in progress cut its ids to this rank's rows ([Note: row inputs under a grid]).
IDS_CUT: ContextVar[Grid | None] = ContextVar("hetero_grid_ids_cut", default=None)
# 3D: the grid whose model's forward in progress cut its mask and positions to alt's rows, and the rows per rank.
ROWS_ON_ALT: ContextVar[tuple[Grid, int] | None] = ContextVar("hetero_grid_rows_on_alt", default=None)


def main_rows(ids: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Positions cut to alt's rows for attention (3D, `ROWS_ON_ALT`), moved to main's: rank (a, b, c) holds rows
    a q + b; the b-line holds a q + 0 .. a q + q - 1 in order, of which a q + c is main's. Others as they are."""
    cut = ROWS_ON_ALT.get()
    if cut is None or cut[0] is not grid or ids.dim() == 0 or ids.shape[0] != cut[1]:
        return ids  # whole-batch rows not cut, or one row broadcast to all
    return grid.main.hidden.all_gather_dim(ids, 0).chunk(grid.q, 0)[grid.alt.hidden.rank]


class _VocabEmbedding:
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        grid = self._hetero_grid.grid
        batch = grid.main.batch
        if IDS_CUT.get() is grid:  # this rank's rows: whole again, in own_rows' order (integers, no gradient)
            ids = grid.outer.all_gather_dim(batch.all_gather_dim(ids, 0), 0)
        check_rows(ids, grid, "the input ids")
        ids = ids.chunk(grid.outer.size, 0)[grid.outer.rank]  # 2.5D: this depth layer's slab
        n_local = self.weight.shape[0]
        local = ids - batch.rank * n_local
        outside = (local < 0) | (local >= n_local)
        # The class's own lookup on this rank's block (Gemma's scales its rows by sqrt(hidden)); its padding_idx was
        # made a row of the block, or None, when the block was cut.
        out = super().forward(local.masked_fill(outside, 0))
        # Rows of other vocabulary parts read 0 here: the sum over the batch group completes every row, and the
        # reduce-scatter keeps this rank's part of the batch (backward: all-gather, then the lookup's scatter-add).
        return scatter_sum(out.masked_fill(outside.unsqueeze(-1), 0.0), batch, 0)


class _Embedding:
    """A position (or any non-vocabulary) embedding: rows whole, columns in the layout's hidden part."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        role = self._hetero_grid
        ids = main_rows(ids, role.grid)  # 3D: positions cut for attention, moved to the rows this output joins
        weight = hidden_vector(self.weight, role.orient, 1)
        return F.embedding(ids, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq)


class _LayerNorm:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        role = self._hetero_grid
        comm = role.orient.hidden
        xf = x.to(torch.float32)  # statistics in fp32, as torch's layer_norm computes them for bf16/fp16 inputs
        mean = sum_shared(xf.sum(-1, keepdim=True), comm) / role.size
        centred = xf - mean
        var = sum_shared(centred.square().sum(-1, keepdim=True), comm) / role.size
        y = (centred * torch.rsqrt(var + self.eps)).to(x.dtype)
        if self.weight is not None:
            y = y * hidden_vector(self.weight, role.orient)
        if getattr(self, "bias", None) is not None:
            y = y + hidden_vector(self.bias, role.orient)
        return y


class _RMSNorm:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        role = self._hetero_grid
        dtype = x.dtype
        xf = x.to(torch.float32)  # as Llama's RMSNorm: the statistic in fp32
        var = sum_shared(xf.square().sum(-1, keepdim=True), role.orient.hidden) / role.size
        eps = getattr(self, "variance_epsilon", None)
        if eps is None:
            eps = getattr(self, "eps", None)
        if eps is None:
            eps = torch.finfo(xf.dtype).eps
        y = xf * torch.rsqrt(var + eps)
        if self.weight is None:
            return y.to(dtype)
        if role.offset:  # Gemma's: (x_normed * (1 + w)) in fp32, then cast
            return (y * (role.offset + hidden_vector(self.weight, role.orient).float())).to(dtype)
        return hidden_vector(self.weight, role.orient) * y.to(dtype)  # Llama's: the cast first, then w


def rms_offset(module: nn.Module) -> float | None:
    """An RMS norm's weight offset (its scale is offset + weight): 0 as Llama's, 1 as Gemma's; None when its output
    is neither. Told by running the module on a probe (the weights whole, before any cut); a module on the meta
    device has no values to run, and is told by its name."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return 0.0
    if weight.is_meta:
        return 1.0 if "Gemma" in type(module).__name__ else 0.0
    with torch.no_grad():
        w = weight.detach().float().cpu()
        x = torch.linspace(-2.0, 3.0, w.numel(), dtype=torch.float32).reshape(1, -1)
        eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None) or torch.finfo(x.dtype).eps
        normed = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
        got = module(x.to(weight.dtype).to(weight.device)).float().cpu()
        tol = max(16 * torch.finfo(weight.dtype).eps, 1e-5)  # a few roundings in the weight's precision (bf16 too)
        for offset in (0.0, 1.0):
            want = normed * (offset + w)
            if torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
                return offset
    return None


def norm_kind(module: nn.Module) -> type | None:
    """The grid forward for a norm module, or None when it is not a norm hetero knows."""
    if isinstance(module, nn.LayerNorm):
        return _LayerNorm
    if isinstance(module, getattr(nn, "RMSNorm", ())) or (
        type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight")
    ):
        return _RMSNorm
    return None


MIXINS: dict[str, Any] = {
    "linear": _Linear,
    "vocab": _VocabEmbedding,
    "vocab_head": _Head,
    "embedding": _Embedding,
}
