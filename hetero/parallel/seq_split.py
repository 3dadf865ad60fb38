"""What Ulysses and ring sequence parallelism share: the region where the sequence is split, the attention hook
points, and the gradients of the parameters inside the region.

The region is Megatron-SP's (``sequence.py``, [Note: the sequence-parallel region]), bounded by the plan's
``sequence_scatter`` and ``sequence_gather`` modules; weights stay whole. Which positions a rank holds is a
``SeqLayout``: contiguous parts (Ulysses: the all-to-all regroups them by heads), or ring attention's zig-zag, where
the sequence is cut in 2p chunks and rank r holds chunks r and 2p-1-r, so that under a causal mask every rank has
the same share of the triangle to compute (``ring.py``).

Attention is reached through its hook points: hetero GPT's ``attend`` (q, k, v [b, heads, seq, d] in, the same out),
and for transformers' attention modules an attention function registered once with transformers, to which only the
wrapped modules dispatch (the model's config keeps its own choice for everything else), with rotary tables sliced
to the rank's positions before the module uses them.

[Note: gradients inside the split region]
A parameter used inside the region sees only this rank's positions, so its gradient is a part of the whole. Applied
by hand (``reduce_grads=True``) a hook all-reduces it over the group, as under Megatron-SP, and every rank ends with
the complete gradient. Through ``hetero.initialize`` the sequence group is part of ZeRO's data-parallel group (the
ranks of a sequence group hold different tokens of the same samples: for ZeRO they are data-parallel ranks), whose
reduction is a mean over its ranks; the hook then multiplies the part by the group size p instead, so that the
mean over the p ranks is their sum, and no collective is added. Parameters outside the region (embeddings, the
LM head after the gather) see every position on every rank: their gradients are already complete and equal.

[Note: the sequence split across pipeline stages]
With a pipeline, each stage splits the sequence over the same group: the sequence ranks of a data-parallel group
are the same positions of the pipeline on every stage (`Mesh.build` lays sp out inside dp, and pp links equal dp
coordinates), so rank s of the group on stage i sends its positions to rank s on stage i + 1, and the activations
that cross a stage boundary inside the region are that rank's part of the sequence (the pipeline's headers carry
their shapes). The scatter is on the stage holding the plan's `sequence_scatter` module, the gather on the one
holding `sequence_gather`; a middle stage has neither, and its attention and layers take the parts as they come.
So the plan is resolved and its regions checked on the whole model, before the cut (`check_regions`), and each
stage applies the part of it that it holds (`whole_model=False`). Every rank of a sequence group runs the same
schedule, so their ring or all-to-all exchanges come in the same order; ZeRO's group on each stage is that stage's
data-parallel group, which holds the sequence group as without a pipeline.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd import Function

from hetero.comm import Comm
from hetero.errors import ConfigError
from hetero.parallel.plans import COLUMN, resolve_plan
from hetero.parallel.sequence import SEQ_DIM, add_output_map, all_reduce_grads, mark_region, replace_first_input
from hetero.parallel.tensor import check_untouched
from hetero.parallel.tp_ops import gather_seq_exact, scatter_seq
from hetero.parallel.tp_rng import RegionRng

_HF_NAME = "hetero_seq_split"  # the attention implementation registered with transformers
_INSIDE = (*COLUMN, "rowwise", "norm", "head_norm", "heads", "parallel_input")  # in the region


@dataclass(frozen=True)
class SeqLayout:
    """Which positions of a sequence of length n each rank of a group of `size` holds."""

    kind: str  # "contiguous" | "zigzag"
    size: int

    def index(self, rank: int, n: int, device: torch.device | None = None) -> torch.Tensor:
        parts = 2 * self.size if self.kind == "zigzag" else self.size
        if n % parts:
            raise ValueError(
                f"{self.kind} sequence parallelism over {self.size} ranks cuts the sequence into {parts} equal parts: "
                f"its length {n} must divide by {parts} (pad the sequence)"
            )
        c = n // parts
        chunks = (rank, parts - 1 - rank) if self.kind == "zigzag" else (rank,)
        return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in chunks])

    def order(self, n: int, device: torch.device | None = None) -> torch.Tensor:
        """The positions of every rank's part, concatenated in rank order (what an all-gather returns)."""
        return torch.cat([self.index(r, n, device) for r in range(self.size)])


class _Keep(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, layout: SeqLayout) -> torch.Tensor:
        ctx.comm, ctx.layout = comm, layout
        return x.index_select(SEQ_DIM, layout.index(comm.rank, x.shape[SEQ_DIM], x.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _unpermute(ctx.comm.all_gather_dim(grad, SEQ_DIM), ctx.layout), None, None


class _Join(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, layout: SeqLayout) -> torch.Tensor:
        ctx.comm, ctx.layout = comm, layout
        return _unpermute(comm.all_gather_dim(x, SEQ_DIM), layout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # The consumers after the region are replicated: the gradient is complete, keep this rank's positions.
        return grad.index_select(SEQ_DIM, ctx.layout.index(ctx.comm.rank, grad.shape[SEQ_DIM], grad.device)), None, None


def _unpermute(gathered: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
    order = layout.order(gathered.shape[SEQ_DIM], gathered.device)
    out = torch.empty_like(gathered)
    out.index_copy_(SEQ_DIM, order, gathered)
    return out


def keep_positions(x: torch.Tensor, comm: Comm, layout: SeqLayout) -> torch.Tensor:
    """This rank's positions of a replicated sequence; backward all-gathers the parts' gradients."""
    if comm.size == 1:
        return x
    return scatter_seq(x, comm, SEQ_DIM) if layout.kind == "contiguous" else _Keep.apply(x, comm, layout)


def join_positions(x: torch.Tensor, comm: Comm, layout: SeqLayout) -> torch.Tensor:
    """Every rank's positions gathered back into the sequence's order; backward keeps this rank's part."""
    if comm.size == 1:
        return x
    return gather_seq_exact(x, comm, SEQ_DIM) if layout.kind == "contiguous" else _Join.apply(x, comm, layout)


def scale_grads(params: list[nn.Parameter], factor: float) -> None:
    """Multiply these parameters' gradients by `factor` as autograd computes them ([Note: gradients inside the split
    region])."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * factor

    for p in params:
        if p.requires_grad and not getattr(p, "_hetero_sp_reduced", False):
            p.register_hook(hook)
            p._hetero_sp_reduced = True
            p._hetero_grad_factor = factor  # a tiled weight's tiles bypass the hook ([Note: hooks on tiled gradients])


def _hf_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q, k, v [b, heads, seq, d] in, [b, seq, heads, d] out."""
    return module._hetero_seq_attention(module, query, key, value, mask, **kwargs), None


def hf_inner(module: nn.Module, name: str) -> Callable[..., Any]:
    """The attention function a transformers module would call (its config's implementation, or eager)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = module.config._attn_implementation
    if impl in (None, "eager", _HF_NAME):
        inner = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    else:
        inner = ALL_ATTENTION_FUNCTIONS.get(impl)
    if inner is None:
        raise ConfigError(f"{name}: no attention function for implementation {impl!r} to wrap")
    return inner


def _wrap_hf(module: nn.Module, comm: Comm, layout: SeqLayout, attention: Callable[..., torch.Tensor]) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if _HF_NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(_HF_NAME, _hf_attention)
    # This module alone dispatches to the wrapper: the model's config (masks are built from it) keeps its choice.
    module.config = copy.copy(module.config)
    module.config._attn_implementation = _HF_NAME
    module._hetero_seq_attention = attention

    def slice_rotary(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # Rotary tables come computed for the whole sequence; q and k here hold this rank's positions of it.
        pe = kwargs.get("position_embeddings")
        if pe is not None:
            idx = layout.index(comm.rank, pe[0].shape[SEQ_DIM], pe[0].device)
            kwargs = {**kwargs, "position_embeddings": tuple(t.index_select(SEQ_DIM, idx) for t in pe)}
        return args, kwargs

    module.register_forward_pre_hook(slice_rotary, with_kwargs=True)


def check_regions(resolved: Mapping[str, str]) -> None:
    """A resolved plan (of the whole model) bounds a split region and names its attention modules."""
    parts = [style.split("+") for style in resolved.values()]
    for role in ("sequence_scatter", "sequence_gather", "heads"):
        if not any(role in styles for styles in parts):
            raise ConfigError(f"sequence parallelism needs a plan with a {role!r} module; this plan has none")


def apply_sequence_split(
    model: nn.Module,
    comm: Comm,
    *,
    plan: Mapping[str, str] | str,
    layout: SeqLayout,
    gpt_attend: Callable[[nn.Module], Callable[..., torch.Tensor]],
    hf_attention: Callable[[nn.Module, str], Callable[..., torch.Tensor]],
    check_attention: Callable[[nn.Module, str], None],
    reduce_grads: bool,
    whole_model: bool = True,
) -> RegionRng:
    """Split the sequence over ``comm`` inside the plan's region, in place (see the module docstring); returns the
    group's random streams: dropout inside the region draws each rank's own ([Note: dropout under tensor
    parallelism]), for its own positions; a pipeline stage brackets its units with them (setup.py).
    ``whole_model`` False: ``model`` is one pipeline stage ([Note: the sequence split across pipeline stages]).
    ``gpt_attend(module)`` makes the new ``attend`` of a hetero GPT attention module (q, k, v [b, heads, s, d] in and
    out, causal), ``hf_attention(module, name)`` the attention function of a transformers module;
    ``check_attention`` raises before anything changes if a module cannot take part."""
    check_untouched(model)
    resolved = resolve_plan(model, plan, strict=whole_model)
    if whole_model:
        check_regions(resolved)
    modules = dict(model.named_modules())
    parts = {name: style.split("+") for name, style in resolved.items()}
    attention = [name for name, styles in parts.items() if "heads" in styles]
    for name in attention:
        module = modules[name]
        check_attention(module, name)
        if not (hasattr(module, "attend") or hasattr(getattr(module, "config", None), "_attn_implementation")):
            raise ConfigError(
                f"{name} ({type(module).__name__}) is neither hetero's GPT attention nor a transformers attention "
                "module: sequence parallelism has no hook point there"
            )
    inside: dict[int, nn.Parameter] = {}  # by id: a module and its parent may both be planned
    for name, styles in parts.items():
        if any(s in _INSIDE for s in styles):
            inside.update((id(p), p) for p in modules[name].parameters())
    wrapped = {name: hf_attention(modules[name], name) for name in attention if not hasattr(modules[name], "attend")}
    for name in attention:  # nothing changed above this line
        module = modules[name]
        if hasattr(module, "attend"):
            module.attend = gpt_attend(module)
        else:
            _wrap_hf(module, comm, layout, wrapped[name])
    rng = RegionRng(comm)
    for name, styles in parts.items():
        module = modules[name]
        if "sequence_scatter" in styles:

            def pre_hook(_: nn.Module, args: tuple, kwargs: dict, name: str = name) -> tuple[tuple, dict]:
                return replace_first_input(name, args, kwargs, lambda x: rng.enter_at(keep_positions(x, comm, layout)))

            module.register_forward_pre_hook(pre_hook, with_kwargs=True)
            mark_region(module, "scatter", comm.size)  # each rank keeps 1/size of the positions (ring: 2 chunks)
        if "sequence_gather" in styles:
            mark_region(module, "gather", comm.size)
            add_output_map(module, name, lambda x: join_positions(x, comm, layout))
            module.register_forward_hook(rng.leave, always_call=True)
    model.register_forward_pre_hook(rng.leave)  # a forward that raised inside the region left its stream on
    if reduce_grads:
        all_reduce_grads(list(inside.values()), comm)
    else:
        scale_grads(list(inside.values()), float(comm.size))
    return rng
