"""How the engine meets the mesh at initialize: build the groups and cut the model in place.

The order follows torchtitan's: pipeline split first (so other stages' layers are dropped before anything else
touches them), then tensor parallelism on what is left, then ZeRO over the data-parallel group (the engine's own
construction, on the group returned here).

[Note: checks before the cut]
A layout's checks (a width or head count the tensor degree does not divide, a plan that does not fit a module, a
model that differs between the tensor ranks) would run on each pipeline stage's part of the model after the cut,
and a stage whose layers pass would go on to initialize and wait until comm_timeout for one that raised. So they run
on the whole model, before the cut, where every rank sees the same layers: the plan against the model
(`check_tensor_plan`, `check_grid_plan`, `check_regions`) and the copies against each other (`check_replicas`,
whose verdict every rank of the job shares: [Note: one verdict for every rank]). What still runs on a stage's part
after the cut (the sequence split's attention checks, for one) is agreed over every rank (`_agreed`): each rank
tells the others whether its part raised, and every rank raises the first rank's ConfigError. Every rank issues
that exchange, whatever its part did, so none is left waiting.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hetero.comm import Comm
from hetero.config import ParallelConfig
from hetero.device import Device
from hetero.errors import ConfigError
from hetero.parallel.mesh import Mesh
from hetero.parallel.pipeline.balance import choose_cut
from hetero.parallel.pipeline.chimera import replica_group
from hetero.parallel.pipeline.hf import owned, split_sequence
from hetero.parallel.pipeline.split import StageChunk, cut_stages, units_of
from hetero.parallel.pipeline.tied import Ties, tie_groups

log = logging.getLogger("hetero.parallel")


def setup_parallel(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    cfg: ParallelConfig,
    world: Comm,
    device: Device,
    saved_cut: dict[str, Any] | None = None,
) -> tuple[Mesh, list[StageChunk] | None, Comm, tuple[Ties, dict] | None]:
    """The mesh over `world`, this rank's pipeline chunks (None without a pipeline), the group ZeRO shards over
    (the data-parallel group; with Chimera, that of both replicas of this rank's stages) and the parameters tied
    across pipeline ranks with their groups (None when there are none: pipeline/tied.py); the model is cut and
    tensor-sharded in place, and the optimizer's groups keep only the parameters this rank still has. saved_cut: the
    pipeline cut a checkpoint records (`checkpoint.describe.read_cut`), which "auto" follows."""
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
        else:  # [Note: checks before the cut]
            from hetero.parallel.replicas import check_replicas

            if mesh.grid is not None:
                from hetero.parallel.grid import check_grid_plan

                check_grid_plan(model, plan, mesh.grid)
            else:
                from hetero.parallel.tensor import check_tensor_plan

                check_tensor_plan(model, plan, mesh.tp.size, sequence=cfg.sequence == "megatron")
            check_replicas(model, mesh.tp, every=world)
    whole_plan, units = plan, []  # the whole model's plan, and its pipeline units: where each stage sits in it
    if cfg.pipeline > 1:
        _check_chain(model)
        units = [(n, owned(n, u)) for n, u in units_of(model)]
        split_at, costs, basis, source = choose_cut(
            model,
            units_of(model),
            split=cfg.pipeline_split,
            given=cfg.pipeline_costs,
            stages=cfg.pipeline * cfg.virtual_stages,
            world=world,
            device=device,
            saved=saved_cut,
        )
        chunks, ties = cut_stages(
            model,
            rank=mesh.pp_rank,
            ranks=cfg.pipeline,
            virtual=cfg.virtual_stages,
            split=split_at,
            costs=costs,
            bidirectional=chimera,
            basis=basis,
            source=source,
        )
        if chunks[0].cut is not None:  # which cut, and why: timed, saved or given
            log.info("pipeline cut: %s", chunks[0].cut.describe())
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
        cut = functools.partial(apply, model, mesh.sp, plan=plan, reduce_grads=False, whole_model=chunks is None)
    elif cfg.tensor > 1:
        present = {n for n, _ in model.named_modules()}
        plan = {n: st for n, st in plan.items() if n in present}
        if mesh.grid is not None:
            from hetero.parallel.grid import apply_grid_parallel

            cut = functools.partial(apply_grid_parallel, model, plan, mesh.grid, replicas_checked=True)
        else:
            from hetero.parallel.tensor import apply_tensor_parallel

            sequence = cfg.sequence == "megatron"
            # A stage's part of the plan need not bound the sequence region: the whole model's did, above.
            whole = chunks is None
            cut = functools.partial(
                apply_tensor_parallel, model, plan, mesh.tp, sequence=sequence, strict=whole, replicas_checked=True
            )
    else:
        return mesh, chunks, zero, tied
    if chunks is None:
        cut()  # the whole model on every rank: each rank's checks are every rank's
        return mesh, chunks, zero, tied
    made = _agreed(cut, world)
    from hetero.parallel.sequence import region_at
    from hetero.parallel.tp_rng import RegionRng, bracket

    # A stage runs its units, never the model's hooks ([Note: dropout under tensor parallelism], [Note: dropout under
    # a grid]): a grid's stage runs inside its region; a 1D or sequence-split stage enters it where its input is inside.
    rng = RegionRng(mesh.grid.tp) if mesh.grid is not None else made
    at = {n: i for i, (n, _) in enumerate(units)}
    fqns = [parts for _, parts in units]
    for chunk in chunks:
        (first, unit), (_, last) = chunk.units[0], chunk.units[-1]
        inside = mesh.grid is not None or (bool(cfg.sequence) and region_at(fqns, whole_plan, at[first]))
        bracket(unit, last, rng, enter=inside)
        for name, u in chunk.units if cfg.sequence else ():  # [Note: a split sequence through the stages]
            split_sequence(u, cfg.tensor if region_at(fqns, whole_plan, at[name]) else 1)
    return mesh, chunks, zero, tied


def by_hand_tensor_parallel(model: nn.Module) -> bool:
    """Whether `apply_tensor_parallel` already cut some parameter of the model (by hand, before initialize)."""
    return any(getattr(p, "_hetero_tp", None) is not None for p in model.parameters())


def _check_chain(model: nn.Module) -> None:
    """hetero's own GPT is no chain of children (its forward adds the position embedding beside the token one, which
    a cut fed the token embedding's output: initialize failed in the balancer, or with a split given, in the first
    batch): refused, naming its pipelineable twin. The estimator still cuts it by its children (the parameter-count
    model: only where its bytes sit matters there)."""
    from hetero.models.gpt import GPT

    if isinstance(model, GPT):
        raise ConfigError(
            "parallel.pipeline: hetero.models.GPT's forward adds its position embedding to its token embedding, so "
            "its children do not run one after the other and a pipeline cannot cut it between them; build "
            "hetero.models.gpt_pipe.GPTPipe from the same GPTConfig (the same model, its children in order)"
        )


def _agreed(cut: Callable[[], Any], world: Comm) -> Any:
    """Run ``cut``, this rank's stage's part of a tensor or sequence layout, and stop every rank of ``world`` with the
    same ConfigError if any rank's raised one ([Note: checks before the cut])."""
    error: ConfigError | None = None
    made = None
    try:
        made = cut()
    except ConfigError as err:  # the layouts raise before they change anything or issue a collective
        error = err
    said = world.all_gather_object(None if error is None else str(error))
    failed = [(world.global_rank(r), m) for r, m in enumerate(said) if m is not None]
    if failed:
        ranks = [r for r, _ in failed]
        raise ConfigError(
            f"{failed[0][1]} [global ranks {ranks} found this on their pipeline stage's layers; every rank stops]"
        ) from error
    return made
