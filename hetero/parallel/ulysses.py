"""Ulysses sequence parallelism (Jacobs et al., 2023): every rank of the group holds all the weights and 1/p of the
sequence; attention alone needs every position, so an all-to-all trades the sequence split for a head split
around it and back.

    q, k, v [b, H, s/p, d] --all-to-all--> [b, H/p, s, d] --attention--> [b, H/p, s, d] --all-to-all--> [b, H, s/p, d]

Each all-to-all moves 1/p of a tensor per rank, so the traffic per rank falls as p grows, where Megatron-SP's
all-gathers stay constant; the price is a head count (and key/value head count) that divides by p, and weights
replicated over the group (through ``hetero.initialize`` ZeRO shards them over the same ranks).

The region of the sequence split, the hook points and the gradients are shared with ring attention
(``seq_split.py``); this file is the all-to-all around the model's own attention.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hetero.comm import Comm
from hetero.parallel.seq_split import SeqLayout, apply_sequence_split, hf_inner
from hetero.parallel.tensor import head_counts
from hetero.parallel.tp_ops import all_to_all
from hetero.parallel.tp_rng import RegionRng


class _Attend:
    """hetero GPT's ``attend`` ([b, heads, seq, d] in and out) between the two all-to-alls."""

    def __init__(self, comm: Comm, inner: Callable[..., torch.Tensor]) -> None:
        self.comm, self.inner = comm, inner

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (all_to_all(t, self.comm, 1, 2) for t in (q, k, v))
        return all_to_all(self.inner(q, k, v), self.comm, 2, 1)


class _HFAttention:
    """transformers' attention interface around the module's own attention function."""

    def __init__(self, comm: Comm, inner: Callable[..., Any]) -> None:
        self.comm, self.inner = comm, inner

    def __call__(
        self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any
    ) -> torch.Tensor:
        q, k, v = (all_to_all(t, self.comm, 1, 2) for t in (query, key, value))
        out, _ = self.inner(module, q, k, v, mask, **kwargs)  # [b, s, heads/p, d]
        return all_to_all(out, self.comm, 1, 2)  # per-rank attention weights would be a fraction: none returned


def _check_heads(module: nn.Module, name: str, size: int) -> None:
    head_counts(module, name, size)  # raises unless heads and key/value heads divide by the group size


def apply_ulysses(
    model: nn.Module,
    comm: Comm,
    *,
    plan: Mapping[str, str] | str = "auto",
    reduce_grads: bool = True,
    whole_model: bool = True,
) -> RegionRng:
    """Ulysses sequence parallelism over ``comm``, in place; weights stay whole, names unchanged.

    ``plan`` is a tensor-parallel plan (``"auto"`` for the built-in families): its ``sequence_scatter`` and
    ``sequence_gather`` modules bound the region, its ``heads`` modules are the attention modules (hetero's GPT or
    transformers' attention), and the parameters of its modules with layer styles are inside the region. Other
    styles are ignored. Head counts must divide by the group size; checked before anything changes.
    ``reduce_grads``: see [Note: gradients inside the split region] (False when ZeRO's group holds ``comm``).
    """
    return apply_sequence_split(
        model,
        comm,
        plan=plan,
        layout=SeqLayout("contiguous", comm.size),
        gpt_attend=lambda module: _Attend(comm, module.attend),
        hf_attention=lambda module, name: _HFAttention(comm, hf_inner(module, name)),
        check_attention=lambda module, name: _check_heads(module, name, comm.size),
        reduce_grads=reduce_grads,
        whole_model=whole_model,
    )
