"""What one rank holds under a tensor x pipeline x data layout, computed on the meta device, for the estimator.

[Note: a layout's bytes per rank]
The engine cuts the model into pipeline stages, applies the tensor or sequence layout to what is left, then builds
ZeRO's chunks (`parallel/engine_glue.py`). The estimate does the same on a meta copy: the layout is applied by the
engine's own functions with `ShapeComm` groups (`parallel_shapes.per_rank_model`: 1D, 2D, 2.5D, 3D, Ulysses, ring),
so the shards and the layers are the engine's; each pipeline rank's stages come from the engine's own boundaries
(`pipeline_split` "auto" balances the units' FLOPs on meta, where a real run times them: the estimate names its cut,
[Note: the cut an estimate is for] in pipeline_peak.py); and each rank's parameters are laid out by `build_layout`
over ZeRO's group (twice the data-parallel degree under Chimera, whose two replicas of a stage are one group).
Activations: each unit's saved bytes for one micro-batch, counted on meta through the laid-out model; a rank's peak
is its own program run on meta as the runtime runs it, every micro-batch in flight, received tensors and sends held
included (pipeline_peak.py, [Note: a pipeline rank's step on meta]), and where that cannot run, its schedule walked
over the saved bytes (`walk`, which the planner uses).

Models whose top-level children are not a chain of units (a Hugging Face causal LM: the blocks sit inside
`model.layers`) are cut the way a pipelined transformer is: the embeddings join the first stage, the blocks are the
units, the final norm and head join the last stage, and the activations outside the blocks (logits, loss) are the
last stage's. hetero's own GPT (the parameter-count model) is no chain either (its forward adds the position
embedding beside the token one; initialize refuses to pipeline it): it is cut as `GPTPipe`, its pipelineable twin
built of the same modules, which a pipelined run of it is; cut by its children, the program failed on meta.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from hetero.config import Config
from hetero.errors import ConfigError
from hetero.models.gpt import GPT
from hetero.models.gpt_pipe import GPTPipe
from hetero.parallel.pipeline import schedule as S
from hetero.parallel.pipeline.split import balanced, units_of
from hetero.profiler.activations import meter_modules, repeated_blocks
from hetero.profiler.parallel_shapes import per_rank_model
from hetero.profiler.pipeline_peak import cut_lines, cut_named
from hetero.profiler.tensor_modes import q_and_depth


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    tensor_mode: str = "1d"
    tensor_depth: int | None = None  # 2.5D's d
    sequence: str | None = None  # None | "megatron" | "ulysses" | "ring"
    pipeline: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    microbatches: int = 1
    split: Any = "auto"  # parallel.pipeline_split
    plan: Any = "auto"  # parallel.tensor_plan

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

    def config(self) -> Config:
        """The "parallel" section of this layout, validated (the config's own errors for layouts that cannot be)."""
        return Config.from_dict(
            {
                "parallel": {
                    "tensor": self.tensor,
                    "tensor_mode": self.tensor_mode,
                    "tensor_depth": self.tensor_depth,
                    "sequence": self.sequence or False,
                    "tensor_plan": self.plan,
                    "pipeline": self.pipeline,
                    "schedule": self.schedule,
                    "microbatches": self.microbatches,
                    "pipeline_split": self.split,
                    **({"virtual_stages": self.virtual} if self.schedule == "interleaved_1f1b" else {}),
                }
            }
        )


def with_layout(
    cfg: Config,
    *,
    tensor: int | None = None,
    tensor_mode: str | None = None,
    pipeline: int | None = None,
    microbatches: int | None = None,
    sequence: bool | str | None = None,
) -> Config:
    """The config with these layout arguments (None: the config's own) in its "parallel" section, validated. A 2.5D
    tensor mode without a depth gets the smallest that fits the degree."""
    if all(v is None for v in (tensor, tensor_mode, pipeline, microbatches, sequence)):
        return cfg
    d = cfg.to_dict()
    par = dict(d.get("parallel", {}))
    for key, value in (("tensor", tensor), ("tensor_mode", tensor_mode), ("pipeline", pipeline),
                       ("microbatches", microbatches)):  # fmt: skip
        if value is not None:
            par[key] = value
    if sequence is not None:
        par["sequence"] = False if sequence in ("none", None) else sequence
    qd = q_and_depth(par.get("tensor", 1))
    if par.get("tensor_mode") == "2.5d" and par.get("tensor_depth") is None and qd is not None:
        par["tensor_depth"] = qd[1]
    d["parallel"] = par
    return Config.from_dict(d)


def layout_from(cfg: Config) -> Layout | None:
    """The config's pipeline layout, or None without a pipeline (the estimator's tensor-only path then applies)."""
    par = cfg.parallel
    if par.pipeline == 1:
        return None
    seq = par.sequence
    return Layout(
        tensor=par.tensor,
        tensor_mode=par.tensor_mode,
        tensor_depth=par.tensor_depth,
        sequence="megatron" if seq is True else (seq or None),
        pipeline=par.pipeline,
        schedule=par.schedule,
        virtual=par.virtual_stages or 1,
        microbatches=par.microbatches,
        split=par.pipeline_split,
        plan=par.tensor_plan,
    )


def describe_ranks(est: Any, layout: Layout, ranks: list, placed: list[tuple[dict, dict]], world: int) -> None:
    """Fill an Estimate's layout, per_pipeline_rank and busiest-rank figures from each rank's (resident, transient)
    bytes."""
    import dataclasses

    est.layout = {**dataclasses.asdict(layout), "data": world // (layout.tensor * layout.pipeline)}
    est.layout["pipeline_split"] = ranks[0][0].cut  # [Note: the cut an estimate is for] in pipeline_peak.py
    est.layout.pop("plan")
    for (part, _), (res, tra) in zip(ranks, placed):
        states = ("parameters", "gradients", "master_weights", "optimizer_states")
        est.per_pipeline_rank.append(
            {
                "pipeline_rank": part.pipeline_rank,
                "units": part.units,
                "model_state": {t: sum(res[t][k] for k in states) for t in res},
                "activations": part.activations,
                "host_activations": part.host_activations,  # activation offload's, at most at once
                "device": sum(res["device"].values()) + sum(tra["device"].values()),
            }
        )
    worst = max(est.per_pipeline_rank, key=lambda r: r["device"])
    busiest = ranks[worst["pipeline_rank"]][1]
    est.n_chunks, est.chunk_elements = len(busiest), sum(sp.capacity for sp in busiest)
    est.chunk_params = sum(info.numel for sp in busiest for info in sp.params)
    note = f"pipeline rank {worst['pipeline_rank']}"
    if ranks[0][0].note:  # no activations counted (`measure_units`): say why, as the whole-model estimate does
        note = f"{ranks[0][0].note}; {note}"
    est.activations = dataclasses.replace(est.activations, bytes=worst["activations"], note=note)


def describe(layout: dict[str, Any], per_rank: list[dict[str, Any]]) -> list[str]:
    """Lines of the estimate's table about the layout and each pipeline rank."""
    from hetero.config import format_size

    lines = [
        f"layout: tensor {layout['tensor']} ({layout['tensor_mode']}, sequence {layout['sequence']}) x pipeline "
        f"{layout['pipeline']} ({layout['schedule']}, {layout['microbatches']} micro-batches) x data {layout['data']}; "
        "the table shows the busiest pipeline rank",
        *cut_lines(layout),
    ]
    for r in per_rank:
        states = sum(r["model_state"].values())
        lines.append(
            f"  pipeline rank {r['pipeline_rank']}: model states {format_size(states)}, activations "
            f"{format_size(r['activations'])}, device {format_size(r['device'])} ({', '.join(r['units'][:4])}"
            + (", ...)" if len(r["units"]) > 4 else ")")
        )
    return lines


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
    note: str = ""  # why no activations were counted, if none were
    host_activations: int = 0  # activation offload's copies of block inputs on the host, at most at once
    cut: list[str] | None = None  # the pipeline_split running this cut (`cut_named`), the same on every rank


def as_chain(model: nn.Module) -> nn.Module:
    """The model as a pipeline cuts it: hetero's GPT, no chain of children, as `GPTPipe`, its twin that is (see the
    module's docstring); any other model as it is. The planner and the estimator cut through this one function, so
    that their bytes agree."""
    return GPTPipe(gpt=model) if isinstance(model, GPT) else model


def pipeline_units(model: nn.Module) -> tuple[list[Unit], bool]:
    """The model's pipeline units and whether they run as a chain (the engine's own `units_of`), else the cut of a
    transformer whose blocks sit deeper (see the note)."""
    blocks = repeated_blocks(model)
    top = units_of(model)
    if not blocks or any(m is blocks[0] for _, m in top):
        units = [Unit(name, _own(name, m), _is_block(m, blocks)) for name, m in top]
        return units, True
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    embeds = {id(m) for m in model.modules() if isinstance(m, nn.Embedding)}
    first, last = Unit("embeddings", [], False), Unit("head", [], False)
    for mname, m in model.named_modules():
        for pname, p in m.named_parameters(prefix=mname, recurse=False):
            if id(p) not in in_blocks:  # an embedding tied to the head belongs to both (the engine keeps both)
                unit = first if id(m) in embeds else last
                if all(q is not p for _, q in unit.params):
                    unit.params.append((pname, p))
    names = {id(m): n for n, m in model.named_modules()}
    middle = [Unit(names[id(b)], _own(names[id(b)], b), True) for b in blocks]
    return [first, *middle, last], False


def _own(name: str, m: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """A unit's parameters under its own names (a parameter tied to another unit's is held by both, as the
    engine's cut keeps it: pipeline/tied.py)."""
    out: list[tuple[str, nn.Parameter]] = []
    for pname, p in m.named_parameters(prefix=name, remove_duplicate=False):
        if all(q is not p for _, q in out):
            out.append((pname, p))
    return out


def _is_block(m: nn.Module, blocks: list[nn.Module]) -> bool:
    return any(m is b for b in blocks)


def measure_units(model: nn.Module, units: list[Unit], inputs: dict[str, Any], dtype: torch.dtype) -> str:
    """Fill each unit's saved and input bytes for one micro-batch (a meta forward; see the note). A forward that
    cannot run on meta tensors (one that enables autocast, which the meta device does not take) leaves them 0:
    returns why, for the estimate's note (`describe_ranks`); "" when counted."""
    modules = dict(model.named_modules())
    try:
        meter, firsts = meter_modules(
            model, inputs, {u.name: modules[u.name] for u in units if u.name in modules}, dtype=dtype
        )
    except Exception as e:  # the whole-model estimate says the same (estimator.step_activations)
        return f"not counted: forward on meta failed: {e}"
    for u in units:
        u.saved = meter.by_owner.get(u.name, 0)
        u.input = firsts.get(u.name, 0)
    units[-1].saved += meter.by_owner.get("", 0)  # outside every unit: the loss, the logits' tail
    return ""


def rank_parts(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: Layout,
    *,
    world: int,
    inputs: dict[str, Any],
    dtype: torch.dtype,
    checkpointing: bool | list[str] | tuple,
    offload: bool = False,
) -> tuple[list[RankPart], torch.optim.Optimizer, int]:
    """What each pipeline rank holds under `layout` ([Note: a layout's bytes per rank]), the optimizer over the
    sharded copy's parameters, and the size of ZeRO's group. checkpointing: true or the blocks' names, as the
    config's; offload: activation_offload."""
    sharded, opt, _ = per_rank_model(model, optimizer, layout.config(), world)
    sharded = as_chain(sharded)
    split = layout.sequence in ("ulysses", "ring")  # the sequence ranks are inside ZeRO's group
    zero_world = world // ((1 if split else layout.tensor) * layout.pipeline)
    units, _ = pipeline_units(sharded)
    note = measure_units(sharded, units, inputs, dtype)
    if len(units) < layout.stages:
        raise ConfigError(
            f"pipeline: {layout.stages} stages need at least {layout.stages} units, the model has {len(units)}"
        )
    starts = stage_starts(units, layout, inputs) + [len(units)]
    stage_units = [units[starts[s] : starts[s + 1]] for s in range(layout.stages)]
    cut = cut_named(sharded, [u.name for u in units], starts[:-1])
    parts, sent = [], None
    for k in range(layout.pipeline):
        mine = layout.stages_of(k)
        # The engine's names and order: the cut model's named_parameters, a tied parameter under this rank's name
        held = {n for s in mine for u in stage_units[s] for n, _ in u.params}
        params, seen = [], set()
        for n, p in sharded.named_parameters(remove_duplicate=False):
            if n in held and id(p) not in seen:
                seen.add(id(p))
                params.append((n, p))
        peak, host, why, sent = rank_peak(
            sharded, units, stage_units, layout, k, inputs, dtype, checkpointing, offload, sent
        )
        names = [u.name for s in mine for u in stage_units[s]]
        parts.append(RankPart(k, params, peak, names, sharded, note or why, host, cut))
    return parts, opt, zero_world * (2 if layout.chimera else 1)


def rank_peak(
    model: nn.Module,
    units: list[Unit],
    stage_units: list[list[Unit]],
    layout: Layout,
    rank: int,
    inputs: dict[str, Any],
    dtype: torch.dtype,
    checkpointing: bool | list[str] | tuple,
    offload: bool,
    sent: list | None,
) -> tuple[int, int, str, list | None]:
    """(device peak, host peak, note, the stages' outputs) of a pipeline rank: its program on meta, else its
    schedule walked over the saved bytes (the note says why). `sent`: the stages' outputs, found by the first rank."""
    from hetero.profiler.pipeline_peak import schedule_peak, stage_outputs

    engine_units = [n for n, _ in units_of(model)]
    if len(engine_units) == len(units):  # the engine's cut names the units its own way (a Hugging Face decoder)
        at = {id(u): i for i, u in enumerate(units)}
        names = [[engine_units[at[id(u)]] for u in stage] for stage in stage_units]
        try:
            if sent is None:
                ids = inputs.get("input_ids", next(v for v in inputs.values() if isinstance(v, torch.Tensor)))
                sent = stage_outputs(model, names, ids, dtype)
            peak, host = schedule_peak(model, names, rank, layout, inputs, dtype=dtype, checkpointing=checkpointing,
                                       offload=offload, sent=sent)  # fmt: skip
            return peak, host, "", sent
        except Exception as e:  # counted as before: what the schedule keeps saved
            why = f"saved bytes only: the schedule on meta failed: {e}"
    else:
        why = "saved bytes only: the engine's units differ from the estimate's"
    mine = layout.stages_of(rank)
    return walk(stage_units, mine, layout, rank, bool(checkpointing)), 0, why, sent


def walk(stage_units: list[list[Unit]], mine: list[int], layout: Layout, rank: int, checkpointing: bool) -> int:
    """Peak activation bytes of a pipeline rank: its schedule's actions in order, each forward adding what its stage
    keeps for one micro-batch (checkpointed blocks: their inputs), each backward releasing it; with checkpointing,
    plus the largest block's activations (its recomputation)."""

    def kept(s: int) -> int:
        return sum(u.input if checkpointing and u.block else u.saved for u in stage_units[s])

    alive = peak = 0
    p = layout.pipeline
    for a in S.build(layout.schedule, p, layout.microbatches, rank, layout.virtual):
        alive += kept(S.stage(a, p, rank)) * (1 if a.kind == "F" else -1)
        peak = max(peak, alive)
    if checkpointing:
        peak += max((u.saved for s in mine for u in stage_units[s] if u.block), default=0)
    return peak


def stage_starts(units: list[Unit], layout: Layout, inputs: dict[str, Any]) -> list[int]:
    if not isinstance(layout.split, str):
        names = [u.name for u in units]
        missing = [n for n in layout.split if n not in names]
        if missing:
            raise ConfigError(f"pipeline_split: {missing} are not units of this model ({', '.join(names)})")
        return [0] + [names.index(n) for n in layout.split]
    empty = [
        not any(p.numel() for _, p in u.params) for u in units
    ]  # as the engine's cut ([Note: stages hold parameters])
    if layout.split == "auto":
        # The engine times the units; on meta their FLOPs stand in: 6 x parameters x tokens for the matrices.
        tokens = next((v.numel() for v in inputs.values() if isinstance(v, torch.Tensor)), 1)
        flops = [max(1.0, 6.0 * tokens * sum(p.numel() for _, p in u.params)) for u in units]
        return balanced(flops, layout.stages, empty=empty)
    return balanced([float(sum(p.numel() for _, p in u.params)) for u in units], layout.stages, empty=empty)


class ParamView:
    """A model's parameters restricted to one rank's, for `build_layout` (it reads named_parameters, and the modules
    holding them to tell which may be split into tiles)."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], model: nn.Module | None = None) -> None:
        self._params = params
        self._model = model

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self._params)

    def modules(self) -> Iterator[nn.Module]:
        return self._model.modules() if self._model is not None else iter(())


def optimizer_view(optimizer: torch.optim.Optimizer, params: list[tuple[str, nn.Parameter]]) -> SimpleNamespace:
    """The optimizer's param groups restricted to these parameters (what a pipeline rank keeps of them)."""
    mine = {id(p) for _, p in params}
    groups = [{"params": [p for p in g["params"] if id(p) in mine]} for g in optimizer.param_groups]
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
    checkpointing: bool | list[str] | tuple,
    offload: bool = False,
    cap: Callable[[int], int | None] | None = None,
    tiling: bool = True,
) -> tuple[list[tuple[RankPart, list]], int]:
    """Per pipeline rank: what it holds and the chunk layout ZeRO builds of it; and the size of ZeRO's group.
    cap: the automatic chunk size's ceiling for ZeRO's group size (`chunk_size.budget_cap`); tiling: as the config's."""
    from hetero.zero.layout import build_layout

    parts, opt, zero_world = rank_parts(
        model, optimizer, layout, world=world, inputs=inputs, dtype=dtype, checkpointing=checkpointing, offload=offload
    )
    out = []
    for part in parts:
        view = optimizer_view(opt, part.params)
        specs = build_layout(
            ParamView(part.params, model),  # type: ignore[arg-type]
            view,
            chunk_numel=chunk_numel,
            world=zero_world,
            max_chunk_numel=cap(zero_world) if cap is not None else None,
            tiling=tiling,
        )
        out.append((part, specs))
    return out, zero_world
