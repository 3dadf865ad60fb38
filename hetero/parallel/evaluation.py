"""`engine.eval_batch`: a forward only, through whatever layout the engine has (pipeline stages, tensor shards,
data-parallel ranks), for evaluation and generation.

[Note: evaluation through the stages]
With a pipeline, each rank runs every micro-batch's forward through its chunks in stage order (`forward_only`; with
Chimera the second half of the micro-batches takes the reverse pipeline, ordered as in training so that the two
replicas of a stage meet in ZeRO's collectives in the same order), passing activations with
the training runtime's exchanges; the programs are replayed free of deadlock like the training schedules'. Nothing
is saved for a backward (no_grad), so micro-batches are not limited by activation memory. With labels the last stage
computes each micro-batch's loss (the model's `.loss`, or `loss_fn`), and the result is the mean over micro-batches
and data-parallel ranks, like `train_batch`'s. Without labels the last stage's outputs are concatenated over the
micro-batches and broadcast from the rank holding each micro-batch's last stage to every pipeline rank. Logits a
head left cut over the tensor ranks are gathered whole by a hook on the head, before the model's code after it
sees them: a 1D vocabulary-parallel head's over the tensor group; a grid head's (2D, 2.5D, 3D: [b/B, s, V/q], cut by
batch rows and vocabulary) over its layout's groups (`grid.layers.whole_logits`). Under Ulysses and ring nothing
is cut there: the plan's `sequence_gather` (before the head, on the final norm) has joined the sequence, zig-zag
undone. So every rank holds the full outputs of its data-parallel rank's batch (what greedy generation needs).

A forward that raises on one stage (a hook, a loss_fn, a shape error) stops its rank computing as in training
([Note: a stage that raises] in pipeline/runtime.py): its messages go marked and stop the stages after it. Marks
only travel forward here, so the stages before the one that raised would not hear of it: before the outputs are
shared or the loss summed, the pipeline ranks agree on which of them raised (one small all-reduce, carrying the
loss sum with it), and then every rank raises, its own error or a PipelineError naming the rank. Before, the
others waited in their sends, the broadcast or the loss's all-reduce until comm_timeout (600 s by default), and
the engine's transfers were broken for good after it. The data-parallel replicas of a stage share nothing inside an
evaluation below zero_stage 3: with labels the loss's average over them carries which replicas stopped, and every
rank raises (a PipelineError naming them on the replicas that did not), all in step for the next batch; without
labels nothing waits for the replica that raised. Before, the other replicas waited in that average until
comm_timeout. At zero_stage 3 they gather inside the batch: a stopped replica stops the job, as in training
([Note: a batch that raises on some data-parallel ranks] in batches.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hetero.errors import CommError
from hetero.parallel.pipeline.runtime import (
    DTYPES,
    HEADER,
    MAX_DIMS,
    Halt,
    PipelineError,
    PipelineRuntime,
    check_loss,
    loss_of,
    settle,
)
from hetero.parallel.pipeline.schedule import Exchange, Item, forward_only, program, split_until_free, stage

if TYPE_CHECKING:
    from hetero.engine import Engine
    from hetero.parallel.mesh import Mesh


def eval_batch(engine: Engine, inputs: Any, labels: Any = None, loss_fn: Callable | None = None) -> Any:
    """See `Engine.eval_batch`."""
    from hetero.parallel.batches import call_model, mean_over_ranks, replicas_stop, split_batch, to_device_tree

    cfg = engine.config.parallel
    m = cfg.microbatches
    mesh = engine.mesh
    # The vocabulary-parallel and grid losses take cut logits: whole ones only when they are what is returned.
    with torch.no_grad(), _full_logits(engine.module, mesh if labels is None else None):
        if engine.stages is None:
            if labels is None:
                return call_model(engine, engine.to_device(inputs))  # one forward: the model's own outputs
            total = torch.zeros((), dtype=torch.float32)
            for x, y in zip(split_batch(inputs, m), split_batch(labels, m)):
                y = to_device_tree(y, engine.device)
                out = call_model(engine, x, labels=y) if loss_fn is None else call_model(engine, x)
                loss = loss_of(out) if loss_fn is None else loss_fn(out, y)
                total += engine.device.to_host(loss.detach(), torch.float32, copy=True)
            mean = (total / m).to(torch.float32)
            # A forward that raised was agreed as engine(...)'s are; one rank's waits in a check that the loss's
            # all-reduce would meet ([Note: a batch that raises on some data-parallel ranks] in batches.py).
            mean_over_ranks(engine, mean, mesh.dp, engine.check.seq)
            return mean
        xs = [engine.to_device(x) for x in split_batch(inputs, m)]
        ys = [to_device_tree(y, engine.device) for y in split_batch(labels, m)]
        replicas = mesh.dp_size > 1 and mesh.tp_size == 1
        stop = replicas_stop(engine) if replicas and engine.stage == 3 else contextlib.nullcontext()
        try:
            with stop:
                total, outputs = _run(engine, xs, ys if labels is not None else None, loss_fn)
        except Exception as e:
            if replicas and labels is not None and engine.stage < 3 and not isinstance(e, CommError):
                _replicas_mean(mesh, total=None, failed=e)  # the other replicas wait in the loss's average
            raise
        if labels is None:
            with engine.device.compute_context():  # headers and buffers are device memory (NCCL's rule)
                return _share(outputs, engine.pipeline_runtime(), m)
    mean = (total / m).to(torch.float32)  # through the stages, already summed over the pipeline group
    return _replicas_mean(mesh, total=mean, failed=None)


@functools.lru_cache(maxsize=32)
def forward_programs(p: int, m: int, v: int, bidirectional: bool) -> tuple[tuple[Item, ...], ...]:
    """Every pipeline rank's forward-only program, replayed free of deadlock ([Note: split exchanges])."""
    if bidirectional:
        from hetero.parallel.pipeline.chimera import chimera_programs

        progs = chimera_programs(p, m, forward=True)
    else:
        progs = [program([(a,) for a in forward_only(p, m, r, v)], p, r, v) for r in range(p)]
    return tuple(tuple(prog) for prog in split_until_free("forward", progs, p, m, v))


def _run(engine: Engine, xs: list[Any], ys: list[Any] | None, loss_fn: Callable | None) -> tuple[torch.Tensor, dict]:
    """This rank's forwards; returns the losses' sum over the pipeline group (with labels: the micro-batches whose
    last stage each rank holds) and this rank's outputs (without labels). Raises on every pipeline rank when one
    raised ([Note: evaluation through the stages])."""
    rt = engine.pipeline_runtime()
    bidirectional = engine.config.parallel.schedule == "chimera"
    prog = forward_programs(rt.p, rt.m, rt.v, bidirectional)[rt.pp.rank]
    inbox: dict = {}
    outbox: dict = {}
    sends: list = []
    total = torch.zeros((), dtype=torch.float32)
    outputs: dict[int, torch.Tensor] = {}
    gathers = engine.gathers
    halt = Halt()
    side = rt.side_digests(xs)  # what each stage reads from its own copy of a micro-batch (a padded batch's mask)
    # The exchanges run in the device's compute too: headers and received buffers are device memory (NCCL's rule).
    with engine.trace_step(), engine.device.compute_context():
        try:
            for item in prog:
                if isinstance(item, Exchange):
                    try:
                        settle(sends)  # [Note: sends waited at the next exchange]
                        sends += rt.exchange(item, outbox, inbox, halt, side)
                    except Exception:
                        halt.raise_if_stopped(rt.pp)  # the error that stopped this rank is the one to see
                        raise
                    continue
                if halt.origin is not None:
                    continue  # stopped: the exchanges go on, marked
                try:
                    total += _forward(engine, rt, item, xs, ys, loss_fn, inbox, outbox, outputs)
                except Exception as e:
                    halt.fail(e, rt.pp.rank)
            settle(sends)
        finally:
            if gathers is not None:
                if halt.error is not None:
                    gathers.abort_forward()  # a unit stopped in its forward: no hook of it ends it now
                if not isinstance(halt.error, CommError):  # after one, a gather in flight would never complete
                    gathers.release_all()
        return _agree(rt, halt, total), outputs


def _forward(
    engine: Engine,
    rt: PipelineRuntime,
    item: Any,
    xs: list[Any],
    ys: list[Any] | None,
    loss_fn: Callable | None,
    inbox: dict,
    outbox: dict,
    outputs: dict[int, torch.Tensor],
) -> torch.Tensor:
    """One forward of the program; returns its loss on a last stage with labels, else 0."""
    s = stage(item, rt.p, rt.pp.rank)
    mb = item.microbatch
    x = xs[mb] if s == 0 else inbox.pop((0, mb, s))
    last = s == rt.last_stage
    with_labels = last and ys is not None and loss_fn is None
    y = rt.chunks[item.chunk](x, ys[mb] if with_labels else None, batch=xs[mb])
    loss = torch.zeros((), dtype=torch.float32)
    if last and ys is not None:
        value = loss_of(y) if loss_fn is None else loss_fn(y, ys[mb])
        check_loss(value, "loss_fn" if loss_fn is not None else "the last stage's .loss")
        loss = engine.device.to_host(value.detach(), torch.float32, copy=True)
    elif last:
        outputs[mb] = _tensor_of(y)
    elif not isinstance(y, torch.Tensor):
        raise PipelineError(
            f"virtual stage {s} returned {type(y).__name__}; a stage must return one tensor to pass to the next "
            "(split the model where a single tensor flows between units)"
        )
    else:
        outbox[(0, mb, s + 1)] = y
    if engine.gathers is not None:
        engine.gathers.end_forward(training=False)  # stage 3: nothing will need the chunks gathered for it
    return loss


def _agree(rt: PipelineRuntime, halt: Halt, total: torch.Tensor) -> torch.Tensor:
    """The losses' sum over the pipeline group, and which pipeline ranks raised, in one all-reduce; raise on every
    rank if any did: a stage's marks reach only the stages after it ([Note: evaluation through the stages])."""
    both = torch.zeros(1 + rt.p, dtype=torch.float64)
    both[0] = total.double()
    if halt.error is not None:
        both[1 + rt.pp.rank] = 1
    rt.pp.control.all_reduce(both, op="sum")
    raised = [r for r in range(rt.p) if both[1 + r] > 0]
    if raised:
        halt.heard(raised[0])
        halt.raise_if_stopped(rt.pp)
    return both[0].to(torch.float32)


def _replicas_mean(mesh: Mesh, *, total: torch.Tensor | None, failed: Exception | None) -> torch.Tensor:
    """The loss's mean over the data-parallel group, which carries whether each replica's pipeline stopped in this
    batch (`failed`: this one's error, raised after); a PipelineError naming the replicas that did on every other
    rank ([Note: evaluation through the stages])."""
    dp = mesh.dp
    both = torch.zeros(1 + dp.size, dtype=torch.float32)
    if total is not None:
        both[0] = total
    if failed is not None:
        both[1 + dp.rank] = 1
    dp.control.all_reduce(both, op="sum")
    if failed is not None:
        raise failed
    stopped = [dp.global_rank(r) for r in range(dp.size) if both[1 + r] > 0]
    if stopped:
        raise PipelineError(
            f"eval_batch: the pipeline of global rank(s) {', '.join(map(str, stopped))} (data-parallel group "
            f"{dp.global_ranks}) stopped in this batch: one of its stages raised (its error, on those ranks or their "
            "pipeline peers, says which). No rank returns a loss for the batch; every rank may go on with the next"
        )
    return both[0] / dp.size


def _share(outputs: dict[int, torch.Tensor], rt: PipelineRuntime, m: int) -> torch.Tensor:
    """The outputs of all m micro-batches, concatenated, on every pipeline rank: each micro-batch's broadcast from
    the rank that computed it (a header first: the others do not know its shape)."""
    parts = []
    for mb in range(m):
        owner = _last_stage_rank(rt, mb)
        header = torch.zeros(HEADER, dtype=torch.int64)
        if rt.pp.rank == owner:
            t = outputs[mb].contiguous()
            if t.dtype not in DTYPES or t.dim() > MAX_DIMS:
                raise PipelineError(f"eval_batch cannot pass a {t.dtype} output of {t.dim()} dims between stages")
            header[:2] = torch.tensor([DTYPES.index(t.dtype), t.dim()])
            header[2 : 2 + t.dim()] = torch.tensor(t.shape)
        header = header.to(rt.device)
        rt.pp.broadcast(header, src=owner)
        code, ndim, *shape = header.tolist()
        buf = t if rt.pp.rank == owner else torch.empty(shape[:ndim], dtype=DTYPES[code], device=rt.device)
        rt.pp.broadcast(buf, src=owner)
        parts.append(buf)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _last_stage_rank(rt: PipelineRuntime, mb: int) -> int:
    """The pipeline rank holding micro-batch mb's last stage (Chimera's reverse pipeline ends on rank 0)."""
    if rt.schedule == "chimera" and mb >= rt.m // 2:
        return 0
    return rt.last_stage % rt.p


class _full_logits:
    """While active, the logits of vocabulary-parallel heads (1D: cut by vocabulary over the tensor group) and of
    grid heads (cut by batch rows and vocabulary over the grid's groups) are gathered whole on every tensor rank."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh | None) -> None:
        self.model, self.mesh, self.handles = model, mesh, []

    def __enter__(self) -> None:
        if self.mesh is None or self.mesh.tp.size == 1:
            return
        from hetero.parallel.grid.layers import is_grid_head
        from hetero.parallel.tensor import is_vocab_head

        for module in self.model.modules():
            if is_vocab_head(module) or is_grid_head(module):
                self.handles.append(module.register_forward_hook(self._gather))

    def _gather(self, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        grid = self.mesh.grid
        if grid is not None:
            from hetero.parallel.grid.layers import whole_logits

            return whole_logits(out, grid)
        return self.mesh.tp.all_gather_dim(out, out.dim() - 1)

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _tensor_of(y: Any) -> torch.Tensor:
    if isinstance(y, torch.Tensor):
        return y
    logits = getattr(y, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise PipelineError(f"eval_batch: the last stage returned {type(y).__name__}; expected a tensor or .logits")
