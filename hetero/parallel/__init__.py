"""Parallelism beyond data parallelism: the mesh of process groups, tensor (with sequence) and pipeline
parallelism, one file per concern."""

from hetero.parallel.mesh import Mesh
from hetero.parallel.plans import BUILTIN_PLANS, STYLES, resolve_plan
from hetero.parallel.tensor import TPShard, apply_tensor_parallel, unshard
from hetero.parallel.ulysses import apply_ulysses
from hetero.parallel.vocab import vocab_parallel_cross_entropy

__all__ = [
    "BUILTIN_PLANS",
    "STYLES",
    "Mesh",
    "TPShard",
    "apply_tensor_parallel",
    "apply_ulysses",
    "resolve_plan",
    "unshard",
    "vocab_parallel_cross_entropy",
]
