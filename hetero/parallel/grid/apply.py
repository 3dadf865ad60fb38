"""Apply a tensor-parallel plan in a grid mode (2D, 2.5D, 3D), in place: the plan's styles mapped onto grid layers.

The plans are the 1D ones (`plans.py`); in a grid every layer is cut two ways, so a style names a role, not a cut:

| style | grid layer |
| --- | --- |
| ``colwise`` (``_qkv``, ``_gate_up``) | grid product, input in `main`, output in `alt` (3D; 2D/2.5D: `main`) |
| ``rowwise`` | grid product, input in `alt`, output in `main` |
| ``vocab`` | vocabulary embedding: lookup on the block, reduce-scatter over main.batch |
| ``vocab_head`` | logits [b/B, s, V/q]; the model's loss becomes the grid cross entropy |
| ``embedding`` | position embedding: columns gathered for this rank's hidden part (1D: left whole) |
| ``norm`` | layer/RMS norm: statistics summed over the hidden group |
| ``heads`` | head counts divided by q (each rank holds q-th of the heads of its batch part) |
| ``head_norm`` | a norm of each head (Qwen3's, Gemma 3's q/k norms): whole, its gradient summed over the grid |
| ``parallel_input``, ``sequence_*`` | nothing (each product gathers its own input) |

Every module holding parameters must have one of the partitioning styles: a grid cuts the batch, so a module left
whole would see a part of the batch and of the hidden dimension and compute nonsense. The one exception is a norm
of each head inside an attention module (``head_norm``): it normalises over a head's own dimension, which no grid
cuts, so it stays whole; every rank feeds it its part of the batch and of the heads, and the tensor group's ranks
hold each (batch part, head part) pair once, so the sum of their gradients over it is the whole gradient, as 1D's
sum over its ranks' heads. All checks (styles, module types, divisibility by the grid, and the 1D plan's:
[Note: plan mistakes under a grid]) run before anything changes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping

import torch
from torch import nn

from hetero.errors import ConfigError
from hetero.parallel.grid.layers import MIXINS, GridRole, norm_kind, rms_offset
from hetero.parallel.grid.loss import grid_cross_entropy
from hetero.parallel.grid.mesh import Grid, Orient, Place
from hetero.parallel.grid.plan_roles import check_plan_roles, is_norm
from hetero.parallel.grid.rows import cut_row_inputs
from hetero.parallel.grid.shard import BlockShard
from hetero.parallel.plan_shapes import pattern
from hetero.parallel.plans import COLUMN, FUSED_PARTS, resolve_plan
from hetero.parallel.replicas import check_replicas
from hetero.parallel.sequence import all_reduce_grads
from hetero.parallel.tensor import check_untouched, generate_with_whole_logits, head_counts, linear_dims
from hetero.parallel.tp_rng import RegionRng, bracket
from hetero.parallel.vocab import AlignedLMLoss, CausalLMLoss, local_padding_idx

log = logging.getLogger("hetero.parallel")

PARTITIONING = ("colwise", "colwise_qkv", "colwise_gate_up", "rowwise", "vocab", "vocab_head", "norm", "embedding")
WHOLE = ("head_norm",)  # styles whose parameters the grid leaves whole (see the module docstring)
_SUBCLASSES: dict[tuple[type, type], type] = {}


def _linear(grid: Grid, part: str) -> tuple[GridRole, Callable[[Place], int], int, Callable[[Place], int]]:
    """A linear layer's role, and its weight's blocks: (role, out index, in parts, in index) per place."""
    q, fused = grid.q, FUSED_PARTS.get(part, 1)  # a fused q/k/v's thirds, a fused gate/up's halves
    if grid.mode != "3d":
        # SUMMA: X gathered over the row (hidden), W over the column (its input rows); the output has X's layout.
        role = GridRole(grid=grid, orient=grid.main, gx=(grid.main.hidden, -1), gw=(grid.wgroup, 1), fused=fused)
        return role, lambda p: p.main_h, q, lambda p: p.main_b
    if part == "rowwise":  # alt -> main: X gathered over the b-line (batch), partial sums cut over the c-line
        role = GridRole(
            grid=grid, orient=grid.main, gx=(grid.main.hidden, 0), gw=(grid.wgroup, 1), gy=(grid.alt.hidden, 0)
        )
        return role, lambda p: p.main_h, q * q, lambda p: p.alt_h * q + p.w
    role = GridRole(
        grid=grid, orient=grid.alt, gx=(grid.alt.hidden, 0), gw=(grid.wgroup, 1), gy=(grid.main.hidden, 0), fused=fused
    )
    return role, lambda p: p.alt_h, q * q, lambda p: p.main_h * q + p.w


def _vector_cut(grid: Grid, orient: Orient, shape: tuple[int, ...], dim: int, fused: int = 1) -> BlockShard:
    """A hidden-dimension vector cut q x |batch| ways (see layers.py); `orient` names the layout it serves."""
    m = orient.batch.size
    alt = orient is grid.alt and grid.alt is not grid.main
    index = [(p.alt_h if alt else p.main_h) * m + (p.alt_b if alt else p.main_b) for p in grid.places()]
    return BlockShard(
        full_shape=shape,
        dims=(dim,),
        parts=(grid.q * m,),
        indices=tuple((i,) for i in index),
        rank=grid.rank,
        fused=fused,
        fused_dim=dim,
    )


def _cuts(part: str, module: nn.Module, name: str, grid: Grid) -> tuple[GridRole | None, dict[str, BlockShard]]:
    """The module's role and its parameters' cuts (raising ConfigError when a style does not fit the module)."""
    places = grid.places()
    if part in (*COLUMN, "rowwise"):
        out_dim, in_dim = linear_dims(module, name, part)
        role, out_ix, in_parts, in_ix = _linear(grid, part)
        shape = tuple(module.weight.shape)
        cuts = {
            "weight": BlockShard(
                full_shape=shape,
                dims=(out_dim, in_dim),
                parts=(grid.q, in_parts),
                indices=tuple((out_ix(p), in_ix(p)) for p in places),
                rank=grid.rank,
                fused=role.fused,
                fused_dim=out_dim,
            )
        }
        if getattr(module, "bias", None) is not None:
            cuts["bias"] = _vector_cut(grid, role.orient, tuple(module.bias.shape), 0, role.fused)
        return role, cuts
    if part in ("vocab", "vocab_head"):
        kind = nn.Embedding if part == "vocab" else nn.Linear
        if not isinstance(module, kind):
            raise ConfigError(f"{name} is a {type(module).__name__}: style {part!r} needs an {kind.__name__}")
        m = grid.main
        role = GridRole(grid=grid, orient=m, gw=(m.batch, 0), gy=(m.hidden, -1))
        cut = BlockShard(
            full_shape=tuple(module.weight.shape),
            dims=(0, 1),
            parts=(m.batch.size, grid.q),
            indices=tuple((p.main_b, p.main_h) for p in places),
            rank=grid.rank,
        )
        cuts = {"weight": cut}
        if part == "vocab_head" and module.bias is not None:
            cuts["bias"] = _vector_cut(grid, grid.main, tuple(module.bias.shape), 0)
        return role, cuts
    if part == "embedding":
        if not isinstance(module, nn.Embedding):
            raise ConfigError(f"{name} is a {type(module).__name__}: style 'embedding' needs an nn.Embedding")
        return GridRole(grid=grid, orient=grid.main), {
            "weight": _vector_cut(grid, grid.main, tuple(module.weight.shape), 1)
        }
    if part == "norm":
        if norm_kind(module) is None:
            raise ConfigError(
                f"{name} is a {type(module).__name__}: tensor_mode {grid.mode!r} knows nn.LayerNorm and RMS norms "
                "(nn.RMSNorm, transformers' *RMSNorm); give this module a norm hetero knows or use tensor_mode '1d'"
            )
        shape = getattr(module, "normalized_shape", None)
        size = int(shape[-1]) if shape else int(module.weight.shape[-1])
        own = {n: p for n, p in module.named_parameters(recurse=False)}
        offset = 0.0 if isinstance(module, nn.LayerNorm) else rms_offset(module)
        if offset is None:
            raise ConfigError(
                f"{name} is a {type(module).__name__} whose output is neither x / rms(x) * weight (Llama's) nor "
                f"x / rms(x) * (1 + weight) (Gemma's): tensor_mode {grid.mode!r} would compute another norm; give "
                "the model a norm hetero knows, or use tensor_mode '1d'"
            )
        return GridRole(grid=grid, orient=grid.main, size=size, offset=offset), {
            n: _vector_cut(grid, grid.main, tuple(p.shape), 0) for n, p in own.items()
        }
    return None, {}


def _check_head_norm(name: str, parts: Mapping[str, list[str]], grid: Grid) -> None:
    """A head norm is left whole because it normalises within a head: a module outside every attention module
    (style 'heads') would see this rank's part of the hidden dimension instead and compute another norm."""
    if not any("heads" in styles and name.startswith(f"{outer}.") for outer, styles in parts.items()):
        raise ConfigError(
            f"{name}: style 'head_norm' is a norm of each head inside an attention module, but no module above it "
            f"has style 'heads'; there tensor_mode {grid.mode!r} cuts the hidden dimension: give a norm of the "
            "residual stream 'norm', or the attention module holding it 'heads'"
        )


def _norm_fix(name: str, module: nn.Module, parts: Mapping[str, list[str]]) -> str:
    """The plan line a norm left out needs: 'head_norm' inside an attention styled 'heads', else 'norm'."""
    if not is_norm(module):
        return ""
    inside = any("heads" in styles and name.startswith(f"{outer}.") for outer, styles in parts.items())
    return f": add {pattern(name)!r}: {'head_norm' if inside else 'norm'!r} to the plan"


def _check_divides(cut: BlockShard, name: str, grid: Grid) -> None:
    for d, p in zip(cut.dims, cut.parts):
        fused = cut.fused if d == cut.fused_dim else 1  # a fused q/k/v dimension is cut alike in each of its thirds
        if cut.full_shape[d] % (fused * p):
            split = f"{fused} parts x {p} blocks" if fused > 1 else f"{p} blocks"
            raise ConfigError(
                f"{name}: dimension {d} of shape {cut.full_shape} does not divide into {split}, as tensor_mode "
                f"{grid.mode!r} with q = {grid.q} (tensor = {grid.tp.size}) cuts it; a grid cuts every layer (none "
                f"can be left whole), so choose a tensor degree whose q divides the model's widths, pad this layer "
                f"to a multiple of {fused * p}, or use tensor_mode '1d'"
            )


def _shard(param: nn.Parameter, cut: BlockShard, name: str) -> None:
    done = getattr(param, "_hetero_tp", None)
    if done is not None:  # a tied parameter, met a second time
        if done != cut:
            first = getattr(param, "_hetero_tp_name", "another module's parameter")
            raise ConfigError(
                f"{name} is the same parameter as {first} (tied), and the plan cuts them differently: {first} into "
                f"{_blocks(done)}, {name} into {_blocks(cut)}. A tied parameter has one block per rank: give both "
                "modules' plan lines the same style (an input embedding tied to the LM head: 'vocab' with "
                "'vocab_head'), or untie them"
            )
        return
    with torch.no_grad():
        param.data = cut.shard_of(param.data)
    param.grad = None
    param._hetero_tp = cut
    param._hetero_tp_name = name  # a tied module met later names it in its refusal


def _blocks(cut: BlockShard) -> str:
    """A grid cut in words for a refusal: blocks along which dimensions."""
    return ", ".join(f"{p} blocks along dimension {d}" for d, p in zip(cut.dims, cut.parts))


def _swap(module: nn.Module, mixin: type, role: GridRole) -> None:
    key = (mixin, type(module))
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(
            f"Grid{mixin.__name__.strip('_')}{type(module).__name__}", key, {"__module__": __name__}
        )
    module.__class__ = _SUBCLASSES[key]
    module._hetero_grid = role


def _install_loss(model: nn.Module, grid: Grid) -> None:
    """Every module whose `lm_head` is the grid's vocabulary head takes its masks and positions for the whole batch
    (`rows.py`) and computes its loss on grid logits: transformers' models (a settable `loss_function` property, per
    instance), hetero's GPT and its pipelined head (a method)."""
    for m in model.modules():
        head = getattr(m, "lm_head", None)
        if not isinstance(getattr(head, "_hetero_grid", None), GridRole):
            continue
        cut_row_inputs(m, grid)  # its masks and positions meet the rows the head's logits hold
        if not hasattr(m, "loss_function"):
            continue
        causal = isinstance(getattr(type(m), "loss_function", None), property)
        entropy = functools.partial(grid_cross_entropy, grid=grid)
        loss = CausalLMLoss if causal else AlignedLMLoss
        m.loss_function = loss(grid.main.hidden, entropy=entropy)  # the vocabulary is cut over the hidden group


_Work = list[tuple[str, nn.Module, str, GridRole | None, dict[str, BlockShard]]]


def _planned(
    model: nn.Module, plan: Mapping[str, str] | str, grid: Grid, strict: bool
) -> tuple[dict[str, str], dict[str, list[str]], _Work]:
    """Every check of the plan against the model and the grid, changing nothing: the resolved plan, each module's
    styles, and each partitioned module's role and cuts."""
    resolved = resolve_plan(model, plan, strict=strict)
    modules = dict(model.named_modules())
    check_plan_roles(resolved, modules, grid)  # the 1D plan checks: [Note: plan mistakes under a grid]
    parts = {name: style.split("+") for name, style in resolved.items()}
    styled = set(PARTITIONING + WHOLE)
    for name, module in modules.items():
        if any(True for _ in module.parameters(recurse=False)) and not set(parts.get(name, ())) & styled:
            raise ConfigError(
                f"{name or type(model).__name__} ({type(module).__name__}) holds parameters but no tensor_plan style "
                f"partitions them; tensor_mode {grid.mode!r} cuts the batch and the hidden dimension, so every such "
                f"module needs one of {', '.join(PARTITIONING)} (or 'head_norm' for a norm of each head inside an "
                f"attention module){_norm_fix(name, module, parts)}, or use tensor_mode '1d'"
            )
    work: _Work = []
    for name, styles in parts.items():
        module = modules[name]
        if "heads" in styles:
            head_counts(module, name, grid.q)  # checks only
        layer = [s for s in styles if s in styled]
        if len(layer) > 1:
            raise ConfigError(f"{name}: styles {layer} both cut its parameters; give it one of them")
        if "head_norm" in layer:
            _check_head_norm(name, parts, grid)
            continue
        for part in layer:
            role, cuts = _cuts(part, module, name, grid)
            for pname, cut in cuts.items():
                _check_divides(cut, f"{name}.{pname}", grid)
            work.append((name, module, part, role, cuts))
    return resolved, parts, work


def check_grid_plan(model: nn.Module, plan: Mapping[str, str] | str, grid: Grid) -> None:
    """Raise the ConfigError `apply_grid_parallel` would raise on ``model``, changing nothing. Run on the whole
    model before a pipeline cuts it: each stage would otherwise check only its own layers, and a stage whose layers
    pass would go on to wait for one that raised."""
    _planned(model, plan, grid, strict=True)


def apply_grid_parallel(
    model: nn.Module,
    plan: Mapping[str, str] | str,
    grid: Grid,
    *,
    strict: bool = True,
    replicas_checked: bool = False,
) -> dict[str, str]:
    """Cut ``model`` in place over ``grid`` following ``plan`` (patterns -> styles, or "auto"); returns the resolved
    plan. The model must be complete (or this pipeline stage's part of it) and identical on every rank of the grid
    (checked over the grid's tensor group, unless ``replicas_checked``: setup.py checks the whole model before a
    pipeline cuts it). A ConfigError leaves the model as it was.
    """
    check_untouched(model)
    resolved, parts, work = _planned(model, plan, grid, strict)
    if not replicas_checked:
        check_replicas(model, grid.tp)  # every rank keeps its blocks of its own copy: they must be one model's
    modules = dict(model.named_modules())
    for name, styles in parts.items():  # nothing changed above this line
        if "heads" in styles:
            for attr, value in head_counts(modules[name], name, grid.q).items():
                setattr(modules[name], attr, value)
        if "head_norm" in styles:  # fed this rank's rows and heads: the sum over the grid is the whole gradient
            all_reduce_grads(list(modules[name].parameters()), grid.tp)
    for name, module, part, role, cuts in work:
        for pname, cut in cuts.items():
            _shard(getattr(module, pname), cut, f"{name}.{pname}")
        if part == "vocab":  # the class's own lookup runs on this rank's block: its padding row is one of the block's
            module._hetero_padding_idx = module.padding_idx  # the whole table's, for lazy_init's replay
            module.padding_idx = local_padding_idx(module.padding_idx, module.weight.shape[0], grid.main.batch.rank)
        if part == "norm":
            _swap(module, norm_kind(module), role)
        else:
            _swap(module, MIXINS["linear" if part.startswith(("colwise", "rowwise")) else part], role)
    if grid.outer.size > 1:
        # 2.5D: every depth layer holds the same weights and computes their gradient on its own slice of the batch.
        all_reduce_grads([p for p in model.parameters() if hasattr(p, "_hetero_tp")], grid.outer)
    _install_loss(model, grid)
    bracket(model, model, RegionRng(grid.tp))  # every activation is cut: [Note: dropout under a grid]
    if any("vocab_head" in styles for styles in parts.values()):
        generate_with_whole_logits(model)  # generate picks each token from the whole batch's whole vocabulary
    log.info("tensor mode %s: %d modules planned over %s", grid.mode, len(resolved), grid)
    return resolved
