"""`engine.train_batch` for micro-batches and pipelines: split a batch, run every micro-batch's forward and backward
(through the pipeline stages when there are any), reduce the gradients once, step.

[Note: one reduction per batch]
`train_batch` runs all of a batch's micro-batches, in whatever order the schedule interleaves their forwards and
backwards, inside one trace step. Stages 2-3 switch their chunks to `accumulate_full`: each micro-batch's gradient is
added into the chunk's full-size gradient buffer, and the reduce-scatter runs once, after the last backward, instead
of once per micro-batch. Stages 0-1 accumulate locally and reduce at the update anyway.

[Note: a batch that raises on some data-parallel ranks]
A micro-batch whose forward raises on one data-parallel rank (a bad batch, an out-of-memory error on one device) left
its peers waiting: at stage 3 in the next gather, else in the gradient reduction or the loss's all-reduce, until
comm_timeout (ten minutes by default); a loop that skipped the batch paired its next batch's collectives with the
others' current ones, silently a batch apart under the collective schedule's checks. So each micro-batch (forward, loss
and backward: a micro-batch's backward reduces nothing, the batch's end does) is agreed as a forward of `engine(...)` is
([Note: a forward that fails] in hetero/engine.py): ranks that all raised at the same point go on together, each having
dropped the batch; a rank that raised alone stops every rank within about a second, with an error naming it
(CollectiveMismatchError with the checks on, RankFailedError with them off). Through the pipeline stages the unit of
agreement is the replica's whole batch: a stage that raises stops its pipeline ([Note: a stage that raises] in
pipeline/runtime.py), then every rank of the replica agrees with its data-parallel peers, the other replicas' ranks of
its stage, in the same way (at stages 0-2 nothing crosses the replicas inside a batch, so replicas whose pipelines all
stopped meet at the same point). At stage 3 the replicas gather inside the batch: with the checks on, replicas whose
stages all raised at the same point stop at the same point of every stage's program (a stage stops where the marks
reach it, a fixed action of its program) and skip the batch together; where one replica raised alone, the healthy
replica's next gather meets the stopped one's check, both raise CollectiveMismatchError, and their pipelines stop
marked "broken" (PipelineCommError on the other stages: a failed collective, so they agree with nobody and post their
failure for good, which stops their own peers waiting in the agreement within a second). Before, every stopped
replica posted for good, so a batch that raised on every replica at once stopped the job. With the checks off the
replicas cannot tell where the others stopped (a pipeline peer waiting for a rank in its agreement sees that rank's
post and stops): each rank of a stopped replica posts its failure for good, which stops every rank of the job within a
second, naming it (and the engine refuses further batches, as under tensor parallelism).
A batch that raised and was agreed leaves nothing in the gradients: its earlier micro-batches' gradients were added
already, and they are dropped with those of the accumulation's earlier batches (grad_accumulation_steps > 1), as a
backward that raises drops them ([Note: a backward that fails] in engine.py); the accumulation starts again, the same on
every rank. Where the ranks stop, gradients do not matter: resume from a checkpoint. The loss's all-reduce at a batch's
end is preceded by a check, with the checks on, when none was posted since the micro-batches (`mean_over_ranks`): a rank
that raised waits in its FORWARD_FAILED check, which the all-reduce would meet instead (both hung).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from hetero.comm.watch import post_failure
from hetero.device import Device
from hetero.errors import CommError, ConfigError, add_note
from hetero.parallel.pipeline.runtime import PipelineCommError
from hetero.zero.protocol import ALL_REDUCE, BATCH_REDUCE

if TYPE_CHECKING:
    from hetero.comm import Comm
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
    if isinstance(batch, Mapping):  # a tokenizer's BatchEncoding too (a UserDict): plain dicts come out
        cols = {k: split_batch(v, parts) for k, v in batch.items()}
        return [{k: c[i] for k, c in cols.items()} for i in range(parts)]
    if batch is None:
        return [None] * parts
    raise ConfigError(f"train_batch: cannot split a {type(batch).__name__} into micro-batches; pass tensors")


def call_model(model: Callable[..., Any], inputs: Any, **kwargs: Any) -> Any:
    """The model on a micro-batch: a mapping (a tokenizer's `input_ids` and `attention_mask`) as keyword arguments,
    as `model(**batch)` takes it; anything else as the one positional input (it was passed whole, positionally, and a
    dict failed inside the embedding)."""
    return model(**inputs, **kwargs) if isinstance(inputs, Mapping) else model(inputs, **kwargs)


def train_batch(
    engine: Engine,
    inputs: Any,
    labels: Any,
    loss_fn: Callable | None,
    *,
    before_update: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One batch: forward and backward of every micro-batch (through the pipeline when there is one), one gradient
    reduction, `before_update` (train_batch's on_grads: [Note: gradients read inside train_batch] in
    hetero/zero/grad_views.py), then `engine.step()`. Returns the mean loss over the global batch, on every rank."""
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
    trainable = engine.trainable

    def after_forward() -> None:
        if gathers is not None:
            gathers.end_forward(training=True)
        engine.events.emit("forward_end")

    def after_backward() -> None:
        # As engine.backward ends each backward: a stage 0-1 chunk's gradients summed on the device go down now, those
        # of parameters this micro-batch did not use included, and the next micro-batch counts its own arrivals
        # ([Note: a micro-batch's sum on the device goes down at its end] in hetero/zero/host_grads.py).
        for zc in trainable:
            zc.host_sum.flush()
            zc.grads_seen.clear()
        if gathers is not None:
            gathers.release_all()
            if engine.stages is None:  # a schedule interleaving micro-batches keeps every module's backward hook
                gathers.learn(engine.comm)  # [Note: one backward hook per unit]
        engine.events.emit("backward_end")

    accumulate = [zc for zc in trainable if zc.grad_full is not None]
    # One trace step per batch, whatever the schedule's order; with grad_accumulation_steps 1 it runs on through the
    # update (`engine.step()` below ends it), so that prefetch and eviction see the update coming.
    broken = False  # a collective failed: one still in flight (a gather issued ahead) would never complete
    with engine.trace_step(update_follows=True):
        for zc in accumulate:
            zc.accumulate_full = True
        engine.events.emit("forward_begin")
        try:
            with engine.device.compute_context(), engine.backward_open():
                try:
                    total = _run_micro_batches(engine, xs, ys, loss_fn, loss_scale, after_forward, after_backward)
                except Exception as e:
                    # Every stage stops with the one that raised ([Note: a stage that raises]), every data-parallel
                    # rank with it ([Note: a batch that raises on some data-parallel ranks]): the gradients the
                    # batch added are dropped, as engine.backward drops a failed backward's ([Note: a backward that
                    # fails]), or the next update would step on part of this batch's. A CommError passes at once.
                    if gathers is not None:
                        gathers.abort_forward()  # a unit stopped in its forward (local): no hook of it ends it now
                    broken = isinstance(e, CommError)
                    if not broken:
                        engine.drop_accumulation(e)
                    raise
            forwards_done = engine.check.seq
            if engine.tied is not None:  # before any data-parallel reduction ([Note: parameters tied across stages])
                engine.tied.sum_grads(update_follows=engine.is_gradient_accumulation_boundary())
            for zc in accumulate:
                engine.check(BATCH_REDUCE, chunk=zc.spec.index)
                zc.reduce_batch()  # layout order: the same on every data-parallel rank
        finally:
            for zc in accumulate:
                zc.accumulate_full = False
            if gathers is not None and not broken:
                gathers.release_all()
            if engine.activations is not None:
                engine.activations.step_end()  # offloaded inputs of blocks whose recomputation never ran
    if before_update is not None:  # the gradients are final: tied copies summed, stages 2-3 reduced
        before_update()
    engine.step()
    mean = (total / m).to(torch.float32)
    mesh = engine.mesh
    if mesh.pp_size > 1:
        mesh.pp.control.all_reduce(mean, op="sum")  # only the last stage's is not zero
    mean_over_ranks(engine, mean, engine.comm, forwards_done)
    return mean


def mean_over_ranks(engine: Engine, mean: torch.Tensor, comm: Comm, forwards_done: int) -> None:
    """Average a batch's loss over `comm`, the data-parallel group, in place. forwards_done: the collective schedule's
    count when the batch's forwards ended; with the checks on and none posted since, one goes first ([Note: a batch
    that raises on some data-parallel ranks])."""
    if engine.check.enabled and engine.check.seq == forwards_done:
        engine.check(ALL_REDUCE)
    comm.control.all_reduce(mean, op="avg")


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
        with replicas_agree(engine):
            return rt.run(
                xs,
                ys,
                loss_fn=loss_fn,
                loss_scale=loss_scale,
                after_forward=after_forward,
                after_backward=after_backward,
            )
    total = torch.zeros((), dtype=torch.float32)
    for x, y in zip(xs, ys):
        # Agreed as engine(...)'s forwards are, its backward with it ([Note: a batch that raises on some data-parallel
        # ranks]).
        with engine.forward_agreed():
            if loss_fn is None:
                out = call_model(engine.module, x, labels=y)
                loss = out.loss if hasattr(out, "loss") else out["loss"]
            else:
                loss = loss_fn(call_model(engine.module, x), y)
            after_forward()
            (loss * loss_scale).backward()
        total += engine.device.to_host(loss.detach(), torch.float32, copy=True)
        del loss
        after_backward()
    return total


@contextlib.contextmanager
def replicas_agree(engine: Engine) -> Iterator[None]:
    """Around a batch through the pipeline stages: where it raises, this rank's data-parallel peers, the other
    replicas of its stage, learn of it ([Note: a batch that raises on some data-parallel ranks])."""
    mesh = engine.mesh
    if mesh.dp_size == 1 or mesh.tp_size > 1:
        # Every rank of engine.comm is a rank of this pipeline (Chimera's two replicas of a stage too), which stopped
        # as one; a tensor-parallel rank stops the job (engine.train_batch).
        yield
        return
    if engine.stage == 3 and not engine.check.enabled:
        with replicas_stop(engine):
            yield
        return
    try:
        with engine.forward_agreed():
            yield
    except PipelineCommError as e:
        # Its stage's data-parallel peers may be waiting in the agreement of a pipeline that stopped on its own error.
        post_failure(e, why="its pipeline stopped in a failed collective")
        raise


@contextlib.contextmanager
def replicas_stop(engine: Engine) -> Iterator[None]:
    """Around a batch through the pipeline stages at zero_stage 3 with data-parallel replicas: where it raises, every
    rank of the job is told to stop ([Note: a batch that raises on some data-parallel ranks])."""
    try:
        yield
    except Exception as e:
        if not isinstance(e, CommError):
            why = f"in a batch through the pipeline stages, which its replicas {engine.comm.global_ranks} gather in"
            post_failure(e, why=why)
            add_note(
                e,
                f"hetero: at zero_stage 3 this stage's data-parallel peers (global ranks {engine.comm.global_ranks}) "
                "gather inside the batch, and where the others stopped is not known, so no replica can skip a batch "
                "that raised: every rank of the job was told to stop, and this engine runs no further batch. Find "
                "the cause (above, or on the rank named), then resume from the last checkpoint",
            )
        raise


def to_device_tree(obj: Any, device: Device) -> Any:
    if isinstance(obj, torch.Tensor):
        return device.to_device(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device_tree(v, device) for v in obj)
    if isinstance(obj, dict):
        return {k: to_device_tree(v, device) for k, v in obj.items()}
    return obj
