"""What one rank holds under a tensor x pipeline x data layout, computed on the meta device, for the estimator.

[Note: a layout's bytes per rank]
The engine cuts the model into pipeline stages, shards the planned layers over the tensor ranks, then builds ZeRO's
chunks over the data-parallel ranks (`parallel/engine_glue.py`). The estimate does the same on a meta copy of the
model: 1D tensor parallelism is applied for real (`apply_tensor_parallel` with `MetaComm`, a stand-in group that
only produces the shapes a collective would), so the shards, the plan and the vocabulary-parallel loss are the
engine's own; each pipeline rank's stages are chosen by the engine's own `boundaries` (pipeline_split "auto" balances
the units' FLOPs counted on meta, where a real run times them); and the chunk layout of the rank's parameters is
`build_layout` over the data-parallel degree (twice that under Chimera, whose two replicas of a stage are one ZeRO
group). Activations: each unit's saved bytes for one micro-batch, counted on meta through the sharded model; a
rank's peak is found by walking its schedule's actions, each forward adding what its stage keeps (its units' inputs
only for checkpointed blocks, plus one block's activations for the recomputation), each backward releasing it.

Models whose top-level children are not a chain of units (a Hugging Face causal LM: the blocks sit inside
`model.layers`) are cut the way a pipelined transformer is: the embeddings join the first stage, the blocks are the
units, the final norm and head join the last stage, and the activations outside the blocks (logits, loss) are the
last stage's.

The other tensor modes and sequence forms are modelled from their papers (`tensor_modes.py`): their parameters are
the 1D shards of a degree that gives the same share, their activations the unsharded ones times their share.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from hetero.errors import ConfigError
from hetero.parallel.pipeline import schedule as S
from hetero.parallel.pipeline.split import _balanced, units_of
from hetero.profiler.activations import SavedBytes, _FusedAttention, _meta_like, repeated_blocks, storage_key
from hetero.profiler.tensor_modes import SEQUENCE_FORMS, TENSOR_MODES


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    tensor_mode: str = "1d"
    sequence: str | None = None  # None | "megatron" | "ulysses" | "ring"
    pipeline: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    microbatches: int = 1
    split: Any = "auto"  # parallel.pipeline_split
    plan: Any = "auto"  # parallel.tensor_plan

    def check(self, world: int) -> int:
        """The data-parallel degree; a ConfigError for a layout that cannot exist."""
        if self.tensor_mode not in TENSOR_MODES:
            raise ConfigError(f"tensor_mode {self.tensor_mode!r}: choose one of {', '.join(TENSOR_MODES)}")
        if self.sequence is not None and self.sequence not in SEQUENCE_FORMS:
            raise ConfigError(f"sequence {self.sequence!r}: choose none or one of {', '.join(SEQUENCE_FORMS)}")
        if self.tensor > 1 and (why := TENSOR_MODES[self.tensor_mode].check(self.tensor)):
            raise ConfigError(f"tensor_mode: {why}")
        if self.sequence is not None and self.tensor == 1:
            raise ConfigError("sequence parallelism runs inside the tensor group: set tensor > 1")
        if self.sequence == "megatron" and self.tensor_mode != "1d":
            raise ConfigError("Megatron sequence parallelism goes with the 1d tensor mode")
        if world % (self.tensor * self.pipeline):
            raise ConfigError(
                f"tensor ({self.tensor}) x pipeline ({self.pipeline}) must divide the world size ({world})"
            )
        return world // (self.tensor * self.pipeline)

    @property
    def chimera(self) -> bool:
        return self.schedule == "chimera" and self.pipeline > 1

    @property
    def stages(self) -> int:
        return self.pipeline if self.chimera else self.pipeline * self.virtual

    def stages_of(self, rank: int) -> list[int]:
        if self.chimera:
            return [rank, self.pipeline - 1 - rank]
        return [rank + c * self.pipeline for c in range(self.virtual)]


def layout_from(
    cfg: Any,
    tensor: int | None,
    tensor_mode: str,
    pipeline: int | None,
    microbatches: int | None,
    sequence: bool | str | None,
) -> Layout | None:
    """The layout the arguments (over the config's "parallel" section) describe; None for plain data parallelism."""
    par = cfg.parallel
    seq = sequence if sequence is not None else par.sequence
    form = "megatron" if seq is True else None if seq in (False, None, "none") else str(seq)
    layout = Layout(
        tensor=tensor if tensor is not None else par.tensor,
        tensor_mode=tensor_mode,
        sequence=form,
        pipeline=pipeline if pipeline is not None else par.pipeline,
        schedule=par.schedule,
        virtual=par.virtual_stages or 1,
        microbatches=microbatches if microbatches is not None else par.microbatches,
        split=par.pipeline_split,
        plan=par.tensor_plan,
    )
    for name in ("tensor", "pipeline", "microbatches"):
        v = getattr(layout, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}: expected an integer >= 1, got {v!r}")
    trivial = layout.tensor == 1 and layout.pipeline == 1 and form is None and tensor_mode == "1d"
    return None if trivial else layout


def describe_ranks(est: Any, layout: Layout, ranks: list, placed: list[tuple[dict, dict]], world: int) -> None:
    """Fill an Estimate's layout, per_pipeline_rank and busiest-rank figures from each rank's (resident, transient)
    bytes."""
    import dataclasses

    est.layout = {**dataclasses.asdict(layout), "data": layout.check(world)}
    est.layout.pop("plan")
    for (part, _), (res, tra) in zip(ranks, placed):
        states = ("parameters", "gradients", "master_weights", "optimizer_states")
        est.per_pipeline_rank.append(
            {
                "pipeline_rank": part.pipeline_rank,
                "units": part.units,
                "model_state": {t: sum(res[t][k] for k in states) for t in res},
                "activations": part.activations,
                "device": sum(res["device"].values()) + sum(tra["device"].values()),
            }
        )
    worst = max(est.per_pipeline_rank, key=lambda r: r["device"])
    busiest = ranks[worst["pipeline_rank"]][1]
    est.n_chunks, est.chunk_elements = len(busiest), sum(sp.capacity for sp in busiest)
    est.chunk_params = sum(info.numel for sp in busiest for info in sp.params)
    note = f"pipeline rank {worst['pipeline_rank']}"
    est.activations = dataclasses.replace(est.activations, bytes=worst["activations"], note=note)


def describe(layout: dict[str, Any], per_rank: list[dict[str, Any]]) -> list[str]:
    """Lines of the estimate's table about the layout and each pipeline rank."""
    from hetero.config import format_size

    lines = [
        f"layout: tensor {layout['tensor']} ({layout['tensor_mode']}, sequence {layout['sequence']}) x pipeline "
        f"{layout['pipeline']} ({layout['schedule']}, {layout['microbatches']} micro-batches) x data {layout['data']}; "
        "the table shows the busiest pipeline rank"
    ]
    for r in per_rank:
        states = sum(r["model_state"].values())
        lines.append(
            f"  pipeline rank {r['pipeline_rank']}: model states {format_size(states)}, activations "
            f"{format_size(r['activations'])}, device {format_size(r['device'])} ({', '.join(r['units'][:4])}"
            + (", ...)" if len(r["units"]) > 4 else ")")
        )
    return lines


class MetaComm:
    """A tensor group of `size` ranks seen from rank `rank`, for meta tensors: collectives give the shapes they would
    give and move nothing ([Note: a layout's bytes per rank])."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        return None

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        return None

    def all_gather_dim(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        shape = list(t.shape)
        shape[dim] *= self.size
        return t.new_empty(shape)

    def reduce_scatter_dim(self, t: torch.Tensor, dim: int, op: str = "sum") -> torch.Tensor:
        shape = list(t.shape)
        shape[dim] //= self.size
        return t.new_empty(shape)

    def all_to_all_dim(self, t: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        shape = list(t.shape)
        shape[scatter_dim] //= self.size
        shape[gather_dim] *= self.size
        return t.new_empty(shape)


@dataclass
class Unit:
    name: str
    params: list[tuple[str, nn.Parameter]]  # (qualified name, parameter), in model order
    block: bool  # a repeated block (what activation checkpointing wraps)
    saved: int = 0  # bytes one micro-batch's forward saves for backward
    input: int = 0  # bytes of its input (what a checkpointed block keeps instead)
    flops: float = 1.0


@dataclass
class RankPart:
    """What one pipeline rank (tensor rank 0) holds: its parameters, in model order, and its activation peak."""

    pipeline_rank: int
    params: list[tuple[str, nn.Parameter]]
    activations: int
    units: list[str]
    model: nn.Module  # the sharded meta copy the parameters belong to


def shard(model: nn.Module, layout: Layout) -> nn.Module:
    """A meta copy of the model with the layout's tensor parallelism applied as tensor rank 0."""
    model = copy.deepcopy(model)
    if layout.tensor == 1 or layout.sequence in ("ulysses", "ring"):
        return model
    from hetero.parallel.plans import resolve_plan
    from hetero.parallel.tensor import apply_tensor_parallel

    degree = TENSOR_MODES[layout.tensor_mode].param_degree(layout.tensor)
    plan = resolve_plan(model, layout.plan)
    sequence = layout.sequence == "megatron"
    apply_tensor_parallel(model, plan, MetaComm(degree), sequence=sequence)  # type: ignore[arg-type]
    return model


def pipeline_units(model: nn.Module) -> tuple[list[Unit], bool]:
    """The model's pipeline units and whether they run as a chain (the engine's own `units_of`), else the cut of a
    transformer whose blocks sit deeper (see the note)."""
    blocks = repeated_blocks(model)
    top = units_of(model)
    if not blocks or any(m is blocks[0] for _, m in top):
        named = {id(p): n for n, p in model.named_parameters()}
        units = [
            Unit(name, [(named[id(p)], p) for p in m.parameters() if id(p) in named], _is_block(m, blocks))
            for name, m in top
        ]
        return _dedupe(units), True
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    embeds = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    first, last = Unit("embeddings", [], False), Unit("head", [], False)
    for name, p in model.named_parameters():
        if id(p) not in in_blocks:
            (first if id(p) in embeds else last).params.append((name, p))
    names = {id(m): n for n, m in model.named_modules()}
    named = {id(p): n for n, p in model.named_parameters()}
    middle = [Unit(names[id(b)], [(named[id(p)], p) for p in b.parameters()], True) for b in blocks]
    return _dedupe([first, *middle, last]), False


def _is_block(m: nn.Module, blocks: list[nn.Module]) -> bool:
    return any(m is b for b in blocks)


def _dedupe(units: list[Unit]) -> list[Unit]:
    seen: set[int] = set()  # a tied parameter belongs to the first unit that holds it
    for u in units:
        mine = [(n, p) for n, p in u.params if id(p) not in seen]
        seen.update(id(p) for _, p in mine)
        u.params = mine
    return units


def measure_units(
    model: nn.Module, units: list[Unit], inputs: dict[str, Any], dtype: torch.dtype, share: float
) -> None:
    """Fill each unit's saved and input bytes for one micro-batch (a meta forward; see the note), times `share`."""
    params = {n: _meta_like(p, dtype) for n, p in model.named_parameters()}
    buffers = {n: _meta_like(b, dtype) for n, b in model.named_buffers()}
    meter = SavedBytes(exclude={storage_key(t) for t in params.values()})
    modules = dict(model.named_modules())
    handles = []
    firsts: dict[str, int] = {}
    for u in units:
        m = modules.get(u.name)
        if m is None:
            continue

        def pre(mod: nn.Module, args: tuple, kwargs: dict, label: str = u.name) -> None:
            meter.owner = label
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if first is not None:
                firsts[label] = first.untyped_storage().nbytes()

        def post(mod: nn.Module, args: tuple, out: Any) -> None:
            meter.owner = ""

        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post))
    try:
        with torch.device("meta"), _FusedAttention(), meter.active():
            torch.func.functional_call(model, {**params, **buffers}, args=(), kwargs=inputs, tie_weights=True)
    finally:
        for h in handles:
            h.remove()
    for u in units:
        u.saved = int(meter.by_owner.get(u.name, 0) * share)
        u.input = int(firsts.get(u.name, 0) * share)
    units[-1].saved += int(meter.by_owner.get("", 0) * share)  # outside every unit: the loss, the logits' tail


def rank_parts(
    model: nn.Module,
    layout: Layout,
    *,
    inputs: dict[str, Any],
    dtype: torch.dtype,
    checkpointing: bool,
) -> list[RankPart]:
    """What each pipeline rank holds under `layout` ([Note: a layout's bytes per rank])."""
    sharded = shard(model, layout)
    units, _ = pipeline_units(sharded)
    share = (
        SEQUENCE_FORMS[layout.sequence][1](layout.tensor)
        if layout.sequence in ("ulysses", "ring")
        else TENSOR_MODES[layout.tensor_mode].activation_share(layout.tensor)
        if layout.tensor_mode != "1d"
        else 1.0
    )
    measure_units(sharded, units, inputs, dtype, share)
    if len(units) < layout.stages:
        raise ConfigError(
            f"pipeline: {layout.stages} stages need at least {layout.stages} units, the model has {len(units)}"
        )
    starts = _starts(units, layout, inputs) + [len(units)]
    stage_units = [units[starts[s] : starts[s + 1]] for s in range(layout.stages)]
    parts = []
    for k in range(layout.pipeline):
        mine = layout.stages_of(k)
        held = {id(p) for s in mine for u in stage_units[s] for _, p in u.params}
        params = [(n, p) for n, p in sharded.named_parameters() if id(p) in held]

        def kept(s: int) -> int:
            return sum(u.input if checkpointing and u.block else u.saved for u in stage_units[s])

        if layout.pipeline == 1:
            peak = max(sum(kept(s) for s in mine), 0)
        else:
            alive = peak = 0
            for a in S.build(layout.schedule, layout.pipeline, layout.microbatches, k, layout.virtual):
                alive += kept(S.stage(a, layout.pipeline, k)) * (1 if a.kind == "F" else -1)
                peak = max(peak, alive)
        if checkpointing:
            peak += max((u.saved for s in mine for u in stage_units[s] if u.block), default=0)
        names = [u.name for s in mine for u in stage_units[s]]
        parts.append(RankPart(k, params, peak, names, sharded))
    return parts


def _starts(units: list[Unit], layout: Layout, inputs: dict[str, Any]) -> list[int]:
    if not isinstance(layout.split, str):
        names = [u.name for u in units]
        missing = [n for n in layout.split if n not in names]
        if missing:
            raise ConfigError(f"pipeline_split: {missing} are not units of this model ({', '.join(names)})")
        return [0] + [names.index(n) for n in layout.split]
    if layout.split == "auto":
        # The engine times the units; on meta their FLOPs stand in: 6 x parameters x tokens for the matrices.
        tokens = next((v.numel() for v in inputs.values() if isinstance(v, torch.Tensor)), 1)
        return _balanced([max(1.0, 6.0 * tokens * sum(p.numel() for _, p in u.params)) for u in units], layout.stages)
    return _balanced([float(sum(p.numel() for _, p in u.params)) for u in units], layout.stages)


class ParamView:
    """A model's parameters restricted to one rank's, for `build_layout` (it reads named_parameters only)."""

    def __init__(self, params: list[tuple[str, nn.Parameter]]) -> None:
        self._params = params

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self._params)


def optimizer_view(
    optimizer: torch.optim.Optimizer, original: nn.Module, params: list[tuple[str, nn.Parameter]]
) -> SimpleNamespace:
    """The optimizer's param groups (by the original model's names), holding this rank's parameters."""
    name_of = {id(p): n for n, p in original.named_parameters()}
    mine = dict(params)
    groups = [
        {"params": [mine[name_of[id(p)]] for p in g["params"] if name_of.get(id(p)) in mine]}
        for g in optimizer.param_groups
    ]
    return SimpleNamespace(param_groups=groups)


def layout_ranks(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: Layout,
    *,
    world: int,
    chunk_numel: int | None,
    inputs: dict[str, Any],
    dtype: torch.dtype,
    checkpointing: bool,
) -> list[tuple[RankPart, list]]:
    """Per pipeline rank: what it holds and the chunk layout ZeRO builds of it over the data-parallel degree."""
    from hetero.zero.layout import build_layout

    data = layout.check(world)
    zero_world = 2 * data if layout.chimera else data
    out = []
    for part in rank_parts(model, layout, inputs=inputs, dtype=dtype, checkpointing=checkpointing):
        view = optimizer_view(optimizer, model, part.params)
        specs = build_layout(ParamView(part.params), view, chunk_numel=chunk_numel, world=zero_world)  # type: ignore[arg-type]
        out.append((part, specs))
    return out
