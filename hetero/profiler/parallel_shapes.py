"""The model as one rank of a tensor or sequence layout holds it, for `hetero.estimate`: a meta copy of the model
cut by the layout (1D, 2D, 2.5D, 3D tensor parallelism; Ulysses or ring sequence parallelism), and the size of the
group ZeRO shards over.

The layout is applied for real, by the same functions the engine calls, with `ShapeComm` groups in place of process
groups: the parameters get the shapes tensor rank 0 would hold, and a forward on the meta device runs the layout's
layers (gathers included), so the activations the estimator counts are this rank's: a key/value head that several
tensor ranks hold whole (fewer key/value heads than ranks) counts whole on each, as the engine holds it
([Note: key/value heads replicated over tensor ranks]). Nothing of the user's model is copied or changed: its
parameters are replaced by meta tensors in the copy.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from hetero.config import Config
from hetero.errors import ConfigError


def _meta_copy(model: nn.Module) -> tuple[nn.Module, dict[int, nn.Parameter]]:
    """A deep copy whose parameters and buffers are meta tensors (no data copied); original param id -> copy."""
    memo: dict[int, object] = {}
    params: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        if id(p) not in memo:
            meta = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            memo[id(p)] = params[id(p)] = meta
    for b in model.buffers():
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    return copy.deepcopy(model, memo), params


def per_rank_model(
    model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config, world_size: int
) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """(the model as tensor rank 0 holds it, an optimizer over its parameters, ZeRO's group size). Without tensor
    or sequence parallelism: the model itself and the whole world."""
    par = cfg.parallel
    if par.tensor == 1:
        return model, optimizer, world_size
    split = par.split_sequence
    model_parallel = (1 if split else par.tensor) * par.pipeline
    if world_size % (par.tensor * par.pipeline):
        raise ConfigError(
            f"world_size = {world_size}: tensor ({par.tensor}) x pipeline ({par.pipeline}) must divide it"
        )
    meta, params = _meta_copy(model)
    groups = [{**g, "params": [params[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    opt = type(optimizer)(groups)
    from hetero.parallel.shape_comm import ShapeComm

    plan = par.tensor_plan
    if split:
        from hetero.parallel.ring import apply_ring
        from hetero.parallel.ulysses import apply_ulysses

        apply = apply_ring if par.sequence == "ring" else apply_ulysses
        apply(meta, ShapeComm(0, par.tensor), plan=plan, reduce_grads=False)
    elif par.tensor_mode == "1d":
        from hetero.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(meta, plan, ShapeComm(0, par.tensor), sequence=par.sequence == "megatron")
    else:
        from hetero.parallel.grid import Grid, apply_grid_parallel

        apply_grid_parallel(meta, plan, Grid.shape_only(par.tensor_mode, par.tensor, par.tensor_depth, 0))
    return meta, opt, world_size // model_parallel
