"""Parallelism beyond data parallelism: the mesh of process groups, tensor (1D, and 2D / 2.5D / 3D grids in
`grid/`), sequence (Megatron-SP, Ulysses, ring) and pipeline parallelism, one file per concern."""

from hetero.parallel.grid import BlockShard, Grid, apply_grid_parallel
from hetero.parallel.mesh import Mesh
from hetero.parallel.plans import BUILTIN_PLANS, STYLES, resolve_plan
from hetero.parallel.ring import apply_ring, ring_attention
from hetero.parallel.tensor import apply_tensor_parallel
from hetero.parallel.tp_shard import TPShard, unshard
from hetero.parallel.ulysses import apply_ulysses
from hetero.parallel.vocab import vocab_parallel_cross_entropy

__all__ = [
    "BUILTIN_PLANS",
    "STYLES",
    "BlockShard",
    "Grid",
    "Mesh",
    "TPShard",
    "apply_grid_parallel",
    "apply_ring",
    "apply_tensor_parallel",
    "apply_ulysses",
    "ring_attention",
    "resolve_plan",
    "unshard",
    "vocab_parallel_cross_entropy",
]
