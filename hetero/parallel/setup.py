"""How the engine meets the mesh at initialize: build the groups and cut the model in place.

The order follows torchtitan's: pipeline split first (so other stages' layers are dropped before anything else
touches them), then tensor parallelism on what is left, then ZeRO over the data-parallel group (the engine's own
construction, on the group returned here).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from hetero.comm import Comm
from hetero.config import ParallelConfig
from hetero.device import Device
from hetero.errors import ConfigError
from hetero.parallel.mesh import Mesh
from hetero.parallel.pipeline.balance import unit_costs
from hetero.parallel.pipeline.chimera import replica_group
from hetero.parallel.pipeline.split import StageChunk, cut_stages, units_of
from hetero.parallel.pipeline.tied import Ties, tie_groups

log = logging.getLogger("hetero.parallel")


def setup_parallel(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, cfg: ParallelConfig, world: Comm, device: Device
) -> tuple[Mesh, list[StageChunk] | None, Comm, tuple[Ties, dict] | None]:
    """The mesh over `world`, this rank's pipeline chunks (None without a pipeline), the group ZeRO shards over
    (the data-parallel group; with Chimera, that of both replicas of this rank's stages) and the parameters tied
    across pipeline ranks with their groups (None when there are none: pipeline/tied.py); the model is cut and
    tensor-sharded in place, and the optimizer's groups keep only the parameters this rank still has."""
    split = cfg.split_sequence  # Ulysses / ring: the `tensor` ranks split the sequence, inside ZeRO's group
    mesh = Mesh.build(
        world,
        tensor=1 if split else cfg.tensor,
        pipeline=cfg.pipeline,
        sequence=cfg.tensor if split else 1,
        tensor_mode=cfg.tensor_mode,
        tensor_depth=cfg.tensor_depth,
        sequence_parts=(2 if cfg.sequence == "ring" else 1) * cfg.tensor if cfg.sequence else 1,  # ring: zig-zag
    )
    chimera = cfg.schedule == "chimera" and cfg.pipeline > 1
    zero = replica_group(mesh, world) if chimera else mesh.dp
    chunks, tied = None, None
    plan: Any = cfg.tensor_plan
    if cfg.tensor > 1:
        from hetero.parallel.plans import resolve_plan

        # Resolved on the whole model: a pattern must match somewhere in it, not on every stage.
        plan = resolve_plan(model, plan)
        if split:
            from hetero.parallel.seq_split import check_regions

            check_regions(plan)  # before the cut: [Note: the sequence split across pipeline stages]
        elif mesh.grid is not None and cfg.pipeline > 1:
            from hetero.parallel.grid import check_grid_plan

            # On the whole model: a stage checking only its own layers would pass and wait for one that raised.
            check_grid_plan(model, plan, mesh.grid)
    if cfg.pipeline > 1:
        costs = None
        if cfg.pipeline_split == "auto":
            costs, basis = unit_costs(model, units_of(model), given=cfg.pipeline_costs, world=world, device=device)
            log.info("pipeline stages balanced by %s%s", basis, f": {[f'{c:.3g}' for c in costs]}" if costs else "")
        if split or cfg.sequence == "megatron":
            from hetero.parallel.pipeline.hf import is_hf_decoder

            if is_hf_decoder(model):  # its layers' masks and rotary tables are made for the whole sequence
                raise ConfigError(
                    f"parallel: sequence {cfg.sequence!r} with a pipeline of a Hugging Face model is not supported; "
                    "use the pipeline with tensor parallelism (any tensor_mode) and data parallelism, or sequence "
                    "parallelism without a pipeline"
                )
        chunks, ties = cut_stages(
            model,
            rank=mesh.pp_rank,
            ranks=cfg.pipeline,
            virtual=cfg.virtual_stages,
            split=cfg.pipeline_split,
            costs=costs,
            bidirectional=chimera,
        )
        if ties.sets:  # every rank makes every tie group, also those it is not in
            tied = ties, tie_groups(ties, mesh, world)
        kept = {id(p) for p in model.parameters()}
        # Groups stay (possibly empty): their indices name hyperparameters.
        for group in optimizer.param_groups if optimizer is not None else []:
            group["params"] = [p for p in group["params"] if id(p) in kept]
    if split:
        from hetero.parallel.ring import apply_ring
        from hetero.parallel.ulysses import apply_ulysses

        apply = apply_ring if cfg.sequence == "ring" else apply_ulysses
        # ZeRO's data-parallel group holds the sequence group: its mean completes the parts' sum (seq_split.py).
        apply(model, mesh.sp, plan=plan, reduce_grads=False, whole_model=chunks is None)
    elif cfg.tensor > 1:
        present = {n for n, _ in model.named_modules()}
        plan = {n: st for n, st in plan.items() if n in present}
        if mesh.grid is not None:
            from hetero.parallel.grid import apply_grid_parallel

            apply_grid_parallel(model, plan, mesh.grid)
            return mesh, chunks, zero, tied
        from hetero.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, plan, mesh.tp, sequence=cfg.sequence == "megatron")
    return mesh, chunks, zero, tied
