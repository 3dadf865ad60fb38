"""Ulysses sequence parallelism (Jacobs et al., 2023): every rank of the group holds all the weights and 1/p of the
sequence; attention alone needs every position, so an all-to-all trades the sequence split for a head split
around it and back.

    q, k, v [b, H, s/p, d] --all-to-all--> [b, H/p, s, d] --attention--> [b, H/p, s, d] --all-to-all--> [b, H, s/p, d]

Each all-to-all moves 1/p of a tensor per rank, so the traffic per rank falls as p grows, where Megatron-SP's
all-gathers stay constant; the price is a head count (and key/value head count) that divides by p, and weights
replicated over the group (ZeRO over the same ranks shards them).

The region of the sequence split is the same as Megatron-SP's and comes from the same plans (``sequence_scatter``
and ``sequence_gather``; ``heads`` marks the attention modules). Every parameter inside the region sees 1/p of the
positions, so its gradient is all-reduced over the group in a hook; parameters outside (embeddings, the LM head)
see every position on every rank and need nothing. The loss is computed whole on every rank.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hetero.comm import Comm
from hetero.errors import ConfigError
from hetero.parallel.plans import resolve_plan
from hetero.parallel.sequence import SEQ_DIM, add_sequence_gather, add_sequence_scatter, all_reduce_grads
from hetero.parallel.tensor import _heads, check_untouched
from hetero.parallel.tp_ops import all_to_all

_HF_NAME = "hetero_ulysses"  # the attention implementation registered with transformers
_INSIDE = ("colwise", "colwise_qkv", "rowwise", "norm", "heads", "parallel_input")  # styles of modules in the region


class _Attend:
    """hetero GPT's ``attend`` hook ([b, heads, seq, d] in and out) between the two all-to-alls."""

    def __init__(self, comm: Comm, inner: Callable[..., torch.Tensor]) -> None:
        self.comm, self.inner = comm, inner

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (all_to_all(t, self.comm, 1, 2) for t in (q, k, v))
        return all_to_all(self.inner(q, k, v), self.comm, 2, 1)


def _hf_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q, k, v [b, heads, seq, d] in, [b, seq, heads, d] out."""
    comm, inner = module._hetero_ulysses
    q, k, v = (all_to_all(t, comm, 1, 2) for t in (query, key, value))
    out, _ = inner(module, q, k, v, mask, **kwargs)
    return all_to_all(out, comm, 1, 2), None  # per-rank attention weights would be a fraction: none returned


def _wrap_hf(module: nn.Module, name: str, comm: Comm) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    impl = module.config._attn_implementation
    if impl in (None, "eager"):
        inner = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    else:
        inner = ALL_ATTENTION_FUNCTIONS.get(impl)
    if inner is None:
        raise ConfigError(f"{name}: no attention function for implementation {impl!r} to wrap in Ulysses all-to-alls")
    if _HF_NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(_HF_NAME, _hf_attention)
    # This module alone dispatches to the wrapper: the model's config (masks are built from it) keeps its choice.
    module.config = copy.copy(module.config)
    module.config._attn_implementation = _HF_NAME
    module._hetero_ulysses = (comm, inner)

    def slice_rotary(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # Rotary tables come computed for the whole sequence; q and k here hold this rank's part of it.
        pe = kwargs.get("position_embeddings")
        if pe is not None:
            kwargs = {**kwargs, "position_embeddings": tuple(t.chunk(comm.size, SEQ_DIM)[comm.rank] for t in pe)}
        return args, kwargs

    module.register_forward_pre_hook(slice_rotary, with_kwargs=True)


def apply_ulysses(model: nn.Module, comm: Comm, *, plan: Mapping[str, str] | str = "auto") -> None:
    """Ulysses sequence parallelism over ``comm``, in place; weights stay whole, names unchanged.

    ``plan`` is a tensor-parallel plan (``"auto"`` for the built-in families): its ``sequence_scatter`` and
    ``sequence_gather`` modules bound the region, its ``heads`` modules are the attention modules (hetero's GPT or
    transformers' attention), and the parameters of its modules with layer styles are inside the region. Other
    styles are ignored. Head counts must divide by the group size; checked before anything changes.
    """
    check_untouched(model)
    resolved = resolve_plan(model, plan)
    modules = dict(model.named_modules())
    parts = {name: style.split("+") for name, style in resolved.items()}
    attention = [name for name, styles in parts.items() if "heads" in styles]
    for role in ("sequence_scatter", "sequence_gather", "heads"):
        if not any(role in styles for styles in parts.values()):
            raise ConfigError(f"Ulysses needs a plan with a {role!r} module; this plan has none")
    for name in attention:
        module = modules[name]
        _heads(module, name, comm.size)
        if not (hasattr(module, "attend") or hasattr(getattr(module, "config", None), "_attn_implementation")):
            raise ConfigError(
                f"{name} ({type(module).__name__}) is neither hetero's GPT attention nor a transformers attention "
                "module: Ulysses has nowhere to put its all-to-alls"
            )
    inside: dict[int, nn.Parameter] = {}  # by id: a module and its parent may both be planned
    for name, styles in parts.items():
        if any(s in _INSIDE for s in styles):
            inside.update((id(p), p) for p in modules[name].parameters())
    for name in attention:
        module = modules[name]
        if hasattr(module, "attend"):
            module.attend = _Attend(comm, module.attend)
        else:
            _wrap_hf(module, name, comm)
    for name, styles in parts.items():
        if "sequence_scatter" in styles:
            add_sequence_scatter(modules[name], name, comm)
        if "sequence_gather" in styles:
            add_sequence_gather(modules[name], name, comm)
    all_reduce_grads(list(inside.values()), comm)
