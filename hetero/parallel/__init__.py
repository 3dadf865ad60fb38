"""Parallelism beyond data parallelism: tensor (with sequence) parallelism, one file per concern."""

from hetero.parallel.plans import BUILTIN_PLANS, STYLES, resolve_plan
from hetero.parallel.tensor import TPShard, apply_tensor_parallel, unshard
from hetero.parallel.ulysses import apply_ulysses
from hetero.parallel.vocab import vocab_parallel_cross_entropy

__all__ = [
    "BUILTIN_PLANS",
    "STYLES",
    "TPShard",
    "apply_tensor_parallel",
    "apply_ulysses",
    "resolve_plan",
    "unshard",
    "vocab_parallel_cross_entropy",
]
