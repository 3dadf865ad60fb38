"""`engine.train_batch` for micro-batches and pipelines: split a batch, run every micro-batch's forward and backward
(through the pipeline stages when there are any), reduce the gradients once, step.

[Note: one reduction per batch]
`train_batch` runs all of a batch's micro-batches, in whatever order the schedule interleaves their forwards and
backwards, inside one trace step. Stages 2-3 switch their chunks to `accumulate_full`: each micro-batch's gradient is
added into the chunk's full-size gradient buffer, and the reduce-scatter runs once, after the last backward, instead
of once per micro-batch. Stages 0-1 accumulate locally and reduce at the update anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hetero.device import Device
from hetero.errors import CommError, ConfigError
from hetero.zero.protocol import BATCH_REDUCE

if TYPE_CHECKING:
    from hetero.engine import Engine


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
    xs = [engine.to_device(x) for x in split_batch(inputs, m)]
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
            if engine.stages is None:  # a schedule interleaving micro-batches keeps every module's backward hook
                gathers.learn(engine.comm)  # [Note: one backward hook per unit]
        engine.events.emit("backward_end")

    accumulate = [zc for zc in engine.chunks if zc.spec.trainable and zc.grad_full is not None]
    # One trace step per batch, whatever the schedule's order; with grad_accumulation_steps 1 it runs on through the
    # update (`engine.step()` below ends it), so that prefetch and eviction see the update coming.
    with engine.trace_step(update_follows=True):
        for zc in accumulate:
            zc.accumulate_full = True
        engine.events.emit("forward_begin")
        try:
            with engine.device.compute_context(), engine.backward_open():
                try:
                    total = _run_micro_batches(engine, xs, ys, loss_fn, loss_scale, after_forward, after_backward)
                except Exception as e:
                    # Every stage stops with the one that raised ([Note: a stage that raises]): the gradients the
                    # batch added are dropped, as engine.backward drops a failed backward's ([Note: a backward that
                    # fails]), or the next update would step on part of this batch's. A CommError passes at once.
                    if not isinstance(e, CommError):
                        engine.drop_accumulation(e)
                    raise
            if engine.tied is not None:  # before any data-parallel reduction ([Note: parameters tied across stages])
                engine.tied.sum_grads(update_follows=engine.is_gradient_accumulation_boundary())
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
    if engine.stages is not None:
        rt = engine.pipeline_runtime()
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


def to_device_tree(obj: Any, device: Device) -> Any:
    if isinstance(obj, torch.Tensor):
        return device.to_device(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device_tree(v, device) for v in obj)
    if isinstance(obj, dict):
        return {k: to_device_tree(v, device) for k, v in obj.items()}
    return obj
