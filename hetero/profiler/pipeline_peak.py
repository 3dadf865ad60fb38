"""A pipeline rank's activation peak: its schedule run on meta, as the pipeline runtime runs it.

[Note: a pipeline rank's step on meta]
What a pipeline rank holds at once is not one micro-batch's step (step_peak.py) but its schedule's: 1F1B keeps up to
`pipeline` micro-batches forwarded and not yet backwarded on stage 0, GPipe all of them, and the runtime
(parallel/pipeline/runtime.py) holds more than the graphs: each micro-batch's received input and its output until
its backward, the gradient received for the output, and everything it sends (outputs forward, input gradients
back, with their headers) until its next exchange waits for them. So the rank's own program (the runtime's
`programs`, exchanges included) is run on meta, action by action, through the engine's own cut of the model
(`units_of`, `StageChunk`), with the parameters as meta tensors of the compute dtype, each parameter's gradient
dropped once accumulated (a model state, counted apart), blocks checkpointed (and their inputs offloaded) as the
engine does it (step_peak.py), and every storage counted from creation until freed (`LiveBytes`). Received tensors
are allocated at the exchange before the step that uses them, as the runtime allocates them, with the shapes a
forward of one micro-batch through every stage gives. The batch (every micro-batch's ids and labels: each rank is
given the whole batch) is counted as held throughout. Not counted: the runtime's loss sums, host scalars on a GPU.

[Note: micro-batches past the warm-up]
Run action by action, the program costs a forward and a backward on meta per micro-batch: an estimate of 64
micro-batches took seconds per rank, and the planner asks many. Past its warm-up a schedule repeats, and each further
micro-batch (each further p, where the schedule takes them in multiples of the pipeline) adds the same bytes to the
peak: its ids and labels, held throughout; what is in flight stays the same, and so does what it sends, held to
the next exchange. So `schedule_peak` runs the program for three counts past the warm-up, (virtual + 1) x pipeline
and one and two steps more, and where the two steps add the same bytes (on the device and on the host) extends that
line to the batch's count; where they do not, or the batch is not much longer, it runs the whole batch.
tests/test_estimator_pipeline_speed.py finds the line equal to the whole run, byte for byte, for every schedule.

[Note: the cut an estimate is for]
A pipeline rank's bytes are those of the units its stages hold, so an estimate holds for one cut, which its
`layout["pipeline_split"]` names as `parallel.pipeline_split` takes it: the FQNs where stages 1.. begin, under the
engine's unit names (None where the engine names this model's units otherwise). With "auto" the estimate balances the
units' FLOPs on meta, while a run times them on the device ([Note: balancing stages by time] in balance.py) and may
cut elsewhere: on a loaded machine a tiny Llama's head, timed slow, was cut off alone, and pipeline rank 0 held both
decoder layers, 236496 bytes against an estimate of 130888 (tests/test_estimator_pipeline_timing.py). A bound over
every cut a timing could pick is no plan (it is the costliest stage's), so the table names the cut and the setting
that runs it; a run given that list cuts there whatever the timing, as a plan's pasted config does ([Note: the cut a
plan pastes] in planner.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from hetero.activation import choose_blocks
from hetero.kv_cache import cache_off_when_recomputing
from hetero.parallel.pipeline import schedule as S
from hetero.parallel.pipeline.runtime import HEADER, loss_of
from hetero.parallel.pipeline.split import StageChunk, units_of
from hetero.profiler.activations import autocast_off_on_meta, meta_like
from hetero.profiler.step_peak import Offload, checkpointed, on_meta, step_bytes


def stage_outputs(
    model: nn.Module, stage_units: list[list[str]], ids: torch.Tensor, dtype: torch.dtype
) -> list[tuple[torch.Size, torch.dtype]]:
    """Each stage's output for one micro-batch of `ids` (what it sends on, and the gradient it receives), on meta,
    once for every rank. A cut of its own: a Hugging Face decoder's units share a cache of masks and rotary tables,
    which a rank's step makes (and holds) as the engine's first forward does."""
    chunks = _chunks(model, stage_units)
    out: list[tuple[torch.Size, torch.dtype]] = []

    def run() -> None:
        x = ids
        with torch.no_grad():
            for s in range(len(stage_units) - 1):
                x = chunks[s](x, None, batch=ids)
                out.append((x.shape, x.dtype))

    params = {f"model.{n}": meta_like(q, dtype) for n, q in model.named_parameters()}
    buffers = {f"model.{n}": meta_like(b, dtype) for n, b in model.named_buffers()}
    with autocast_off_on_meta(), on_meta():
        torch.func.functional_call(_Program(model, run), {**params, **buffers}, args=(), tie_weights=True)
    return out


class _Program(nn.Module):
    """The rank's program as one call, so that every action runs on the replaced parameters."""

    def __init__(self, model: nn.Module, run: Any) -> None:
        super().__init__()
        self.model = model
        self.run = run

    def forward(self) -> None:
        self.run()


def schedule_peak(
    model: nn.Module,
    stage_units: list[list[str]],
    rank: int,
    layout: Any,
    inputs: dict[str, Any],
    **kwargs: Any,
) -> tuple[int, int]:
    """`rank_step_peak` for `layout`'s micro-batches, run for at most three counts past the warm-up and extended
    ([Note: micro-batches past the warm-up]); keyword arguments as `rank_step_peak`'s."""
    m, p = layout.microbatches, layout.pipeline
    step = p if layout.schedule in ("chimera", "interleaved_1f1b") and p > 1 else 1  # the counts it takes
    first = -(-(layout.virtual + 1) * p // step) * step  # past the warm-up, a count the schedule takes
    if m <= 3 * (first + step):  # running the batch costs no more than the three
        return rank_step_peak(model, stage_units, rank, layout, inputs, **kwargs)
    a, b, c = (
        rank_step_peak(model, stage_units, rank, dataclasses.replace(layout, microbatches=k), inputs, **kwargs)
        for k in (first, first + step, first + 2 * step)
    )
    if any(y - x != z - y for x, y, z in zip(a, b, c)):  # not on a line yet: the whole batch
        return rank_step_peak(model, stage_units, rank, layout, inputs, **kwargs)
    n = (m - first) // step
    return a[0] + n * (b[0] - a[0]), a[1] + n * (b[1] - a[1])


def rank_step_peak(
    model: nn.Module,
    stage_units: list[list[str]],
    rank: int,
    layout: Any,
    inputs: dict[str, Any],
    *,
    dtype: torch.dtype,
    checkpointing: bool | list[str] | tuple = False,
    offload: bool = False,
    sent: list[tuple[torch.Size, torch.dtype]],
) -> tuple[int, int]:
    """The most activation bytes pipeline rank `rank` of `layout` (a `parallel_layout.Layout`) holds at once on the
    device, and on the host (activation offload's copies); `stage_units`: each stage's unit names; `sent`: each
    stage's output (`stage_outputs`) ([Note: a pipeline rank's step on meta]). Raises what the meta run raised."""
    chunks = _chunks(model, stage_units)
    ids = inputs.get("input_ids", next(v for v in inputs.values() if isinstance(v, torch.Tensor)))
    labels = inputs.get("labels")
    m, p = layout.microbatches, layout.pipeline
    xs = [torch.empty_like(ids, device="meta") for _ in range(m)]
    ys = [None if labels is None else torch.empty_like(labels, device="meta") for _ in range(m)]
    program = S.programs(layout.schedule, p, m, layout.virtual)[rank]
    last = layout.stages - 1
    chosen = choose_blocks(model, checkpointing, strict=False) if checkpointing else []
    host = Offload() if offload and chosen else None
    live = step_bytes()

    def run() -> None:
        saved: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        inbox: dict[Any, torch.Tensor] = {}
        outbox: dict[Any, torch.Tensor] = {}
        sending: list[torch.Tensor] = []  # the sends' payloads and headers, held to the next exchange
        with live:
            live.current = live.peak = sum(t.untyped_storage().nbytes() for t in [*xs, *ys] if t is not None)
            for item in program:
                if isinstance(item, S.Exchange):
                    sending.clear()  # the earlier exchanges' sends, waited ([Note: sends waited at the next exchange])
                    for _ in item.sends:
                        sending.append(torch.zeros(HEADER, dtype=torch.int64))
                    sending += [outbox.pop(msg).contiguous() for _, msg in item.sends]
                    headers = [torch.empty(HEADER, dtype=torch.int64) for _ in item.recvs]
                    for _, (kind, mb, s) in item.recvs:
                        shape, dt = sent[s - 1] if kind == 0 else sent[s]
                        inbox[(kind, mb, s)] = torch.empty(shape, dtype=dt)
                    del headers
                    continue
                s, mb = S.stage(item, p, rank), item.microbatch
                if item.kind == "F":
                    x = xs[mb] if s == 0 else inbox.pop((0, mb, s))
                    if x.is_floating_point() and s > 0:
                        x.requires_grad_(True)
                    y = chunks[s](x, ys[mb] if s == last else None, batch=xs[mb])
                    if s == last:
                        y = loss_of(y)
                    else:
                        outbox[(0, mb, s + 1)] = y.detach()
                    saved[(s, mb)] = (x, y)
                else:
                    x, y = saved.pop((s, mb))
                    if s == last:
                        torch.autograd.backward(y * 1.0)  # the runtime's loss scale
                    else:
                        grad = inbox.pop((1, mb, s))
                        if y.requires_grad:
                            torch.autograd.backward(y, grad)
                        del grad
                    if s > 0:
                        outbox[(1, mb, s - 1)] = x.grad if x.grad is not None else torch.zeros_like(x)
                    del x, y
            sending.clear()

    params = {f"model.{n}": meta_like(q, dtype) for n, q in model.named_parameters()}
    buffers = {f"model.{n}": meta_like(b, dtype) for n, b in model.named_buffers()}
    handles = [q.register_post_accumulate_grad_hook(_drop_grad) for q in params.values() if q.requires_grad]
    cache_on = cache_off_when_recomputing(model, [n for n, _ in chosen]) if chosen else None
    try:
        with checkpointed([b for _, b in chosen], host), autocast_off_on_meta(), on_meta():
            torch.func.functional_call(_Program(model, run), {**params, **buffers}, args=(), tie_weights=True)
    finally:
        for h in handles:
            h.remove()
        if cache_on is not None:
            cache_on()
    return live.peak, 0 if host is None else host.host_peak


def cut_named(model: nn.Module, names: list[str], starts: list[int]) -> list[str] | None:
    """The FQNs where stages 1.. begin (`starts`: where each stage begins among the units `names`), a
    parallel.pipeline_split that runs this cut; None where the engine names `model`'s units otherwise ([Note: the cut
    an estimate is for])."""
    return [names[i] for i in starts[1:]] if names == [n for n, _ in units_of(model)] else None


def cut_lines(layout: dict[str, Any]) -> list[str]:
    """The estimate's table line naming its cut, and what to set where a run would time the units itself."""
    cut = layout.get("pipeline_split")
    if not cut:
        return []
    line = f"  stages begin at {', '.join(cut)}"
    if layout.get("split") == "auto":
        line += (
            ' (units balanced by FLOPs on meta; a run\'s "auto" times them and may cut elsewhere, with other bytes per '
            f"rank: set parallel.pipeline_split to {cut} to run this cut)"
        )
    return [line]


def _chunks(model: nn.Module, stage_units: list[list[str]]) -> list[StageChunk]:
    """Every stage as the engine's cut runs it."""
    units = dict(units_of(model))
    return [StageChunk(s, len(stage_units), [(n, units[n]) for n in names]) for s, names in enumerate(stage_units)]


def _drop_grad(q: torch.Tensor) -> None:
    q.grad = None
