"""How the engine meets the mesh: build the groups and cut the model at initialize, run `train_batch` (micro-batches,
with or without a pipeline) and see the global gradient norm across tensor and pipeline ranks.

The order at initialize follows torchtitan's: pipeline split first (so other stages' layers are dropped before
anything else touches them), then tensor parallelism on what is left, then ZeRO over the data-parallel group (the
engine's own construction, on `mesh.dp`).

[Note: one reduction per batch]
`train_batch` runs all of a batch's micro-batches, in whatever order the schedule interleaves their forwards and
backwards, inside one trace step. Stages 2-3 switch their chunks to `accumulate_full`: each micro-batch's gradient is
added into the chunk's full-size gradient buffer, and the reduce-scatter runs once, after the last backward, instead
of once per micro-batch. Stages 0-1 accumulate locally and reduce at the update anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hetero.comm import Comm
from hetero.config import ParallelConfig
from hetero.device import Device
from hetero.errors import ConfigError
from hetero.parallel.mesh import Mesh
from hetero.parallel.pipeline.balance import unit_costs
from hetero.parallel.pipeline.chimera import replica_group
from hetero.parallel.pipeline.runtime import PipelineRuntime
from hetero.parallel.pipeline.split import StageChunk, keep_stages, units_of
from hetero.zero.protocol import BATCH_REDUCE

if TYPE_CHECKING:
    from hetero.engine import Engine

log = logging.getLogger("hetero.parallel")


def setup_parallel(
    model: nn.Module, optimizer: torch.optim.Optimizer, cfg: ParallelConfig, world: Comm, device: Device
) -> tuple[Mesh, list[StageChunk] | None, Comm]:
    """The mesh over `world`, this rank's pipeline chunks (None without a pipeline) and the group ZeRO shards over
    (the data-parallel group; with Chimera, that of both replicas of this rank's stages); the model is cut and
    tensor-sharded in place, and the optimizer's groups keep only the parameters this rank still has."""
    split = cfg.split_sequence  # Ulysses / ring: the `tensor` ranks split the sequence, inside ZeRO's group
    mesh = Mesh.build(
        world,
        tensor=1 if split else cfg.tensor,
        pipeline=cfg.pipeline,
        sequence=cfg.tensor if split else 1,
        tensor_mode=cfg.tensor_mode,
        tensor_depth=cfg.tensor_depth,
    )
    chimera = cfg.schedule == "chimera" and cfg.pipeline > 1
    zero = replica_group(mesh, world) if chimera else mesh.dp
    chunks = None
    plan: Any = cfg.tensor_plan
    if cfg.tensor > 1:
        from hetero.parallel.plans import resolve_plan

        # Resolved on the whole model: a pattern must match somewhere in it, not on every stage.
        plan = resolve_plan(model, plan)
    if cfg.pipeline > 1:
        costs = None
        if cfg.pipeline_split == "auto":
            costs, basis = unit_costs(model, units_of(model), given=cfg.pipeline_costs, world=world, device=device)
            log.info("pipeline stages balanced by %s%s", basis, f": {[f'{c:.3g}' for c in costs]}" if costs else "")
        chunks = keep_stages(
            model,
            rank=mesh.pp_rank,
            ranks=cfg.pipeline,
            virtual=cfg.virtual_stages,
            split=cfg.pipeline_split,
            costs=costs,
            bidirectional=chimera,
        )
        kept = {id(p) for p in model.parameters()}
        for group in optimizer.param_groups:  # groups stay (possibly empty): their indices name hyperparameters
            group["params"] = [p for p in group["params"] if id(p) in kept]
    if split:
        from hetero.parallel.ring import apply_ring
        from hetero.parallel.ulysses import apply_ulysses

        apply = apply_ring if cfg.sequence == "ring" else apply_ulysses
        # ZeRO's data-parallel group holds the sequence group: its mean completes the parts' sum (seq_split.py).
        apply(model, mesh.sp, plan=plan, reduce_grads=False)
    elif cfg.tensor > 1:
        present = {n for n, _ in model.named_modules()}
        plan = {n: st for n, st in plan.items() if n in present}
        if mesh.grid is not None:
            from hetero.parallel.grid import apply_grid_parallel

            apply_grid_parallel(model, plan, mesh.grid)
            return mesh, chunks, zero
        from hetero.parallel.tensor import apply_tensor_parallel
        from hetero.parallel.vocab import AlignedLMLoss

        apply_tensor_parallel(model, plan, mesh.tp, sequence=cfg.sequence == "megatron")
        for m in model.modules():
            # A pipelined GPT computes its loss in its last unit: give it the vocabulary-parallel loss too.
            head = getattr(m, "lm_head", None)
            if m is not model and hasattr(m, "loss_function") and hasattr(getattr(head, "weight", None), "_hetero_tp"):
                m.loss_function = AlignedLMLoss(mesh.tp)
    return mesh, chunks, zero


def split_batch(batch: Any, parts: int) -> list[Any]:
    """`parts` micro-batches of equal size along dim 0 of every tensor (in nested tuples, lists and dicts)."""
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] % parts:
            raise ConfigError(
                f"parallel.microbatches = {parts} must divide the batch: got a batch of shape {tuple(batch.shape)}"
            )
        return list(batch.chunk(parts))
    if isinstance(batch, (list, tuple)):
        cols = [split_batch(v, parts) for v in batch]
        return [type(batch)(c[i] for c in cols) for i in range(parts)]
    if isinstance(batch, dict):
        cols = {k: split_batch(v, parts) for k, v in batch.items()}
        return [{k: c[i] for k, c in cols.items()} for i in range(parts)]
    if batch is None:
        return [None] * parts
    raise ConfigError(f"train_batch: cannot split a {type(batch).__name__} into micro-batches; pass tensors")


def train_batch(engine: Engine, inputs: Any, labels: Any, loss_fn: Callable | None) -> torch.Tensor:
    """One batch: forward and backward of every micro-batch (through the pipeline when there is one), one gradient
    reduction, then `engine.step()`. Returns the mean loss over the global batch, on every rank."""
    cfg = engine.config.parallel
    m = cfg.microbatches
    xs = [engine._to_device(x) for x in split_batch(inputs, m)]
    ys = [to_device_tree(y, engine.device) for y in split_batch(labels, m)]
    scale = engine.scaler.scale if engine.scaler is not None else 1.0
    loss_scale = scale / (m * engine.config.grad_accumulation_steps)  # the mean over micro-batches and steps
    if engine.comm.size > engine.mesh.dp_size:
        # Chimera: each stage's gradient is split between its two replicas, which ZeRO averages as if they were
        # data-parallel ranks; doubling makes that average their sum ([Note: Chimera's layout]).
        loss_scale *= 2
    gathers = engine.gathers

    def after_forward() -> None:
        if gathers is not None:
            gathers.end_forward(training=True)
        engine.events.emit("forward_end")

    def after_backward() -> None:
        if gathers is not None:
            gathers.release_all()
        engine.events.emit("backward_end")

    engine.manager.step_begin()  # one trace step per batch, whatever the schedule's order
    engine._in_step = True
    accumulate = [zc for zc in engine._trainable if zc.grad_full is not None]
    for zc in accumulate:
        zc.accumulate_full = True
    engine.events.emit("forward_begin")
    try:
        with engine.device.compute_context():
            total = _run_micro_batches(engine, xs, ys, loss_fn, loss_scale, after_forward, after_backward)
        for zc in accumulate:
            engine.check(BATCH_REDUCE, chunk=zc.spec.index)
            zc.reduce_batch()  # layout order: the same on every data-parallel rank
    finally:
        for zc in accumulate:
            zc.accumulate_full = False
        if gathers is not None:
            gathers.release_all()
        if engine.activations is not None:
            engine.activations.step_end()  # offloaded inputs of blocks whose recomputation never ran
        engine.manager.step_end()
        engine._in_step = False
    engine.step()
    mean = (total / m).to(torch.float32)
    mesh = engine.mesh
    if mesh.pp_size > 1:
        mesh.pp.control.all_reduce(mean, op="sum")  # only the last stage's is not zero
    engine.comm.control.all_reduce(mean, op="avg")
    return mean


def _run_micro_batches(
    engine: Engine,
    xs: list[Any],
    ys: list[Any],
    loss_fn: Callable | None,
    loss_scale: float,
    after_forward: Callable[[], None],
    after_backward: Callable[[], None],
) -> torch.Tensor:
    """Forward and backward of every micro-batch, through the pipeline when there is one; the summed loss (host)."""
    if engine._stages is not None:
        rt = engine._pipeline_runtime()
        return rt.run(
            xs, ys, loss_fn=loss_fn, loss_scale=loss_scale, after_forward=after_forward, after_backward=after_backward
        )
    total = torch.zeros((), dtype=torch.float32)
    for x, y in zip(xs, ys):
        if loss_fn is None:
            out = engine.module(x, labels=y)
            loss = out.loss if hasattr(out, "loss") else out["loss"]
        else:
            loss = loss_fn(engine.module(x), y)
        after_forward()
        (loss * loss_scale).backward()
        total += engine.device.to_host(loss.detach(), torch.float32, copy=True)
        del loss
        after_backward()
    return total


def make_runtime(engine: Engine) -> PipelineRuntime:
    cfg = engine.config.parallel
    return PipelineRuntime(
        engine._stages,
        engine.mesh.pp,
        schedule=cfg.schedule,
        microbatches=cfg.microbatches,
        virtual=cfg.virtual_stages,
        device=engine.device.torch_device,
    )


def to_device_tree(obj: Any, device: Device) -> Any:
    if isinstance(obj, torch.Tensor):
        return device.to_device(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device_tree(v, device) for v in obj)
    if isinstance(obj, dict):
        return {k: to_device_tree(v, device) for k, v in obj.items()}
    return obj
