"""`hetero.plan`: the layouts that fit a machine, ranked by the step time a stated cost model predicts.

Every layout of the world (tensor degree and mode, sequence form, pipeline degree and schedule, micro-batches, ZeRO
stage, offload placement) is checked against the machine with the estimator's arithmetic for every pipeline rank
([Note: a layout's bytes per rank]); the sharded model, its units and each pipeline rank's chunk layout are built
once per tensor layout and pipeline degree and reused by the options that share them. The step time comes from the
cost model of `cost_model.py` ([Note: the planner's cost model]); `benchmarks/planner_ranking.py` measures a
handful of layouts on a machine and reports the rank correlation of predicted against measured step times.

[Note: the planner's activation figure]
What decides whether a layout fits is the estimator's activation figure: the step's peak on meta, temporaries of
forward and backward, the logits and, with a pipeline, every micro-batch in flight and every tensor sent or received
(`estimator.step_activations`, `parallel_layout.rank_peak`); the planner calls those same functions, so an option
so checked has `hetero.estimate`'s activations for its config, byte for byte. What forward saves, walked over the
schedule (`parallel_layout.walk`), costs a meta forward per tensor layout and rows; the step's peak costs a meta
step per tensor layout and rows without a pipeline (the placements and micro-batch counts share it) and each
pipeline rank's program per pipeline layout ([Note: micro-batches past the warm-up]): some 20 times the walk's time
over a whole grid. So by default (`figure="confirm"`) the walk ranks every layout and the layouts of the first
`confirm` fitting options are checked again with the step's peak, until those all have been: the walk is below the
peak without checkpointing (a layout it passes may not fit), and with it may be above (a layout it refuses may fit:
then missed, never wrongly passed). `figure="step"` checks every layout with the peak; `"saved"` with the walk only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hetero.config import Config
from hetero.config_values import check_int
from hetero.errors import ConfigError
from hetero.parallel.pipeline.split import boundaries, units_of
from hetero.profiler import estimator as E
from hetero.profiler.cost_model import Shape, idle_fraction, shape_of, step_cost
from hetero.profiler.machine import Machine
from hetero.profiler.meta_models import as_model, as_optimizer, default_seq_len
from hetero.profiler.parallel_layout import (
    Layout,
    ParamView,
    as_chain,
    measure_units,
    optimizer_view,
    pipeline_units,
    rank_peak,
    stage_starts,
    walk,
)
from hetero.profiler.parallel_shapes import per_rank_model
from hetero.profiler.placement import TIERS, place
from hetero.profiler.plan_config import option_config
from hetero.profiler.plan_result import FIGURES, Option, Plan
from hetero.profiler.rates import Rates
from hetero.profiler.tensor_modes import SEQUENCE_FORMS, TENSOR_MODES, q_and_depth
from hetero.progress import bar as make_bar
from hetero.zero.layout import build_layout
from hetero.zero.optim import algorithm_of
from hetero.zero.precision import COMPUTE_DTYPES

log = logging.getLogger("hetero.profiler")

SCHEDULES = ("1f1b", "interleaved_1f1b", "chimera", "gpipe")


def plan(
    model_or_config: nn.Module | int | float | str | os.PathLike,
    world_size: int,
    *,
    machine: Machine | None = None,
    rates: Rates | None = None,
    global_batch: int | None = None,
    seq_len: int | None = None,
    precision: str = "bf16",
    optimizer: torch.optim.Optimizer | str = "adamw",
    checkpointing: bool = True,
    tensor_modes: tuple[str, ...] | None = None,
    schedules: tuple[str, ...] = SCHEDULES,
    max_tensor: int | None = None,
    chunk_size: int | str = "auto",
    nvme_dir: str | None = None,
    tensor_plan: Any = "auto",
    figure: str = "confirm",
    confirm: int = 15,
    pipeline_split: str | Sequence[str] | None = None,
) -> Plan:
    """Every layout of `world_size` ranks, checked against `machine` and ranked by `rates` (see the note).

    model_or_config: as `hetero.estimate` (a model, a Hugging Face config.json, a parameter count). machine:
    default this machine; rates: default measured here (`Rates.measure`). global_batch: sequences per step
    (default 2 per rank); the micro-batch rows follow from it. checkpointing: activation checkpointing of the blocks.
    max_tensor: the largest tensor degree tried (default the node's GPUs, or the world). tensor_modes: the modes
    tried (default: those this hetero's config accepts, `available_modes()`; others are ranked from their papers'
    figures, and their config is for the keys of hetero's tensor-mode work). nvme_dir: written into the configs
    that offload to NVMe (default a placeholder to replace). tensor_plan: as parallel.tensor_plan (default "auto":
    the known model families'); a layout the plan cannot shard is left out. figure: the activation figure each
    layout is checked with: "step", the estimator's; "saved", cheaper and lower; "confirm" (default): "saved" for
    all, then the estimator's for the layouts of the first `confirm` fitting options, until those all have it
    ([Note: the planner's activation figure]). pipeline_split: what a pipeline option's config says
    ([Note: the cut a plan pastes]): None (default), the FQNs where the stages of the cut its figures were computed
    for begin, balanced by parameter counts; a list of FQNs (as parallel.pipeline_split), that cut, planned and
    pasted, for the layouts of its stage count only; "auto" or "params", kept in the configs as asked (a run then
    cuts as the engine does, possibly elsewhere than the figures' cut, which each option's layout still names).
    """
    tensor_modes = tensor_modes if tensor_modes is not None else available_modes()
    tensor_modes = (tensor_modes,) if isinstance(tensor_modes, str) else tuple(tensor_modes)  # "2d": one mode
    unknown = [m for m in tensor_modes if m not in TENSOR_MODES]
    if unknown:
        raise ConfigError(
            f"tensor_modes: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(map(repr, TENSOR_MODES))}"
        )
    if figure not in FIGURES:
        raise ConfigError(f"figure: unknown {figure!r}; choose from {', '.join(map(repr, FIGURES))}")
    check_int("confirm", confirm, minimum=1, hint="(fitting options confirmed with the estimator's figure)")
    check_int("world_size", world_size, minimum=1, hint="(ranks in all)")
    split = _check_split(pipeline_split)
    if global_batch is not None:
        check_int("global_batch", global_batch, minimum=1, hint="(sequences per step, over every rank)")
    if seq_len is not None:
        check_int("seq_len", seq_len, minimum=1, hint="(tokens per sequence)")
    if precision not in COMPUTE_DTYPES:
        raise ConfigError(f"precision: unknown {precision!r}; choose from {', '.join(map(repr, COMPUTE_DTYPES))}")
    model = as_model(model_or_config)
    opt = as_optimizer(optimizer, model)
    if split is not None and not isinstance(split, str):  # the engine's own checks, on the whole model
        boundaries(units_of(as_chain(model)), len(split) + 1, split)
    machine = machine if machine is not None else Machine.detect()
    rates = rates if rates is not None else Rates.measure()
    seq = seq_len if seq_len is not None else default_seq_len(model)
    batch = global_batch if global_batch is not None else 2 * world_size
    dtype = COMPUTE_DTYPES[precision]
    gpus = machine.gpus or world_size
    ranks_per_node = min(world_size, gpus)
    n_states = len(algorithm_of(opt).state_names)
    chunk_numel = None if chunk_size == "auto" else Config.from_dict({"chunk_size": chunk_size}).chunk_size
    shape = shape_of(model)
    prefetch = Config().prefetch_depth
    buffers = sum(b.numel() * (dtype.itemsize if b.is_floating_point() else b.element_size()) for b in model.buffers())
    out = Plan(world_size, batch, seq, machine, rates, figure=figure, confirm=confirm)
    if split is not None:  # [Note: the cut a plan pastes]
        out.notes.append(
            f"pipeline_split {split!r} kept in the configs as asked: a run cuts as the engine does, maybe elsewhere "
            "than the cut each option's figures are for (its layout's pipeline_split; plan without pipeline_split to "
            "paste that cut)"
            if isinstance(split, str)
            else f"pipeline_split {list(split)}: only pipeline layouts of {len(split) + 1} stages are planned"
        )
    started = time.perf_counter()
    ckpt_cfg = Config.from_dict({"activation_checkpointing": checkpointing})

    @functools.cache
    def sharded_for(t: int, mode: str, sequence: str | None) -> tuple[nn.Module, Any, int]:
        """The model as tensor rank 0 of this tensor layout holds it (the engine's own cut, on meta), the optimizer
        over it, and the ranks its ZeRO group spans without a pipeline."""
        lay = Layout(tensor=t, tensor_mode=mode, tensor_depth=_depth_of(mode, t), sequence=sequence, plan=tensor_plan)
        return per_rank_model(model, opt, lay.config(), world_size)

    @functools.cache
    def noted(why: str) -> None:  # a forward that failed on meta counts no activation: the plan must say so
        why = why and f"activations {why}; the device figures leave them out (see hetero.estimate for this model)"
        if why and why not in out.notes:
            out.notes.append(why)
            log.warning("hetero.plan: %s", why)

    @functools.cache  # one meta forward per tensor layout and rows, shared by its pipelines and placements
    def units_for(t: int, mode: str, sequence: str | None, rows: int | None = None) -> tuple[Any, list]:
        sharded = as_chain(sharded_for(t, mode, sequence)[0])  # cut as the estimator cuts it
        rows = rows if rows is not None else _batch_parts(mode, t)
        units, _ = pipeline_units(sharded)
        noted(measure_units(sharded, units, E.lm_inputs(rows, seq), dtype))  # the estimator's inputs
        return sharded, units

    @functools.cache
    def ranks_for(t: int, mode: str, sequence: str | None, p: int, chimera: bool, virtual: int) -> tuple | None:
        """Each pipeline rank's part (k, its stages, every stage's units, chunk specs, gathered bytes, ZeRO's group
        size), and the FQNs where stages 1.. begin (None for p = 1, or where the engine names the units otherwise)."""
        sharded, units = units_for(t, mode, sequence)
        _, opt_t, zero_t = sharded_for(t, mode, sequence)
        lay = Layout(tensor=t, tensor_mode=mode, sequence=sequence, pipeline=p, virtual=virtual,
                     schedule="chimera" if chimera else "1f1b", split="params")  # fmt: skip
        if len(units) < lay.stages or (isinstance(split, tuple) and p > 1 and len(split) != lay.stages - 1):
            return None  # a given split names the cut of one stage count
        engine = [n for n, _ in units_of(sharded)] if p > 1 else []
        if len(engine) != len(units):  # the engine cuts this model elsewhere: its FQNs cannot name the cut
            engine = []
        if isinstance(split, tuple) and p > 1:  # the user's cut, by the engine's own function where it can
            given = dataclasses.replace(lay, split=split)
            starts = boundaries(units_of(sharded), lay.stages, split) if engine else stage_starts(units, given, {})
        else:
            starts = stage_starts(units, lay, {})
        starts = [*starts, len(units)]
        stage_units = [units[starts[s] : starts[s + 1]] for s in range(lay.stages)]
        zero_world = zero_t // p * (2 if chimera else 1)
        result = []
        for k in range(p):
            mine = lay.stages_of(k)
            held = {id(q) for s in mine for u in stage_units[s] for _, q in u.params}
            params = [(n, q) for n, q in sharded.named_parameters() if id(q) in held]
            specs = build_layout(ParamView(params, sharded), optimizer_view(opt_t, params),  # type: ignore[arg-type]
                                 chunk_numel=chunk_numel, world=zero_world)  # fmt: skip
            result.append((k, mine, stage_units, specs, E.gathered_bytes(sharded, specs, dtype, None), zero_world))
        given_cut = split if isinstance(split, tuple) and p > 1 else None
        return result, (tuple(engine[i] for i in starts[1:-1]) if engine else given_cut)

    def rank_layout(t: int, mode: str, sequence: str | None, p: int, sched: str, m: int, fig: str) -> None:
        """Every placement of one layout: its bytes checked against the machine (activations by `fig`), its step
        time predicted."""
        data = world_size // (t * p)
        if batch % (data * m):
            return
        rows = batch // (data * m)
        if rows % _batch_parts(mode, t):
            return  # a grid mode cuts each micro-batch's rows over its batch groups
        chimera = sched == "chimera" and p > 1
        virtual = 2 if sched == "interleaved_1f1b" and p > 1 else 1
        try:
            found = ranks_for(t, mode, sequence, p, chimera, virtual)
        except (ConfigError, ValueError):
            return  # a degree the model's shapes do not divide by
        if found is None:
            return
        ranks, cut = found
        acts = rank_activations(t, mode, sequence, p, sched, m, virtual, rows, ranks, fig)
        idle = idle_fraction(sched, p, m, virtual)
        lay = {"tensor": t, "tensor_mode": mode, "tensor_depth": _depth_of(mode, t), "sequence": sequence,
               "pipeline": p, "schedule": sched if p > 1 else "1f1b", "microbatches": m, "data": data, "rows": rows,
               "virtual_stages": virtual, "pipeline_split": list(cut) if cut is not None else None}  # fmt: skip
        zero_world = ranks[0][5]
        for stage, params_at, optim_at in E.CANDIDATES:
            if "nvme" in (params_at, optim_at) and machine.nvme_bytes == 0:
                continue
            out.considered += 1
            # The busiest pipeline rank, as the estimator reports it: per rank on the device, per node elsewhere.
            needed = {tier: -1 for tier in TIERS}
            psi = max(sum(sp.capacity for sp in rk[3]) for rk in ranks)
            n_chunks = max(len(rk[3]) for rk in ranks)
            busiest = 0
            for (_, _, _, specs, gathered, _), act in zip(ranks, acts):
                resident, transient = place(specs, gathered=gathered, stage=stage, world=zero_world, dtype=dtype,
                                            n_states=n_states, params=params_at, optim=optim_at,
                                            prefetch_depth=prefetch)  # fmt: skip
                resident["device"]["buffers"] += buffers
                transient["device"]["activations"] += act
                per = {tier: sum(resident[tier].values()) + sum(transient[tier].values()) for tier in TIERS}
                if per["device"] > needed["device"]:
                    busiest = act
                    needed = {tier: per[tier] * (1 if tier == "device" else ranks_per_node) for tier in TIERS}
            fits = all(needed[tier] <= int(_cap(machine, tier) * E.USABLE[tier]) for tier in TIERS)
            terms = step_cost(shape, lay, stage, params_at, optim_at, (psi, n_chunks), zero_world, idle, rates, dtype,
                          gpus, ranks_per_node, seq, batch, world_size, checkpointing)  # fmt: skip
            config = option_config(lay, stage, params_at, optim_at, precision, checkpointing, nvme_dir)
            if p > 1:  # [Note: the cut a plan pastes]
                config["parallel"]["pipeline_split"] = _pasted(split, cut, out.notes)
            out.options.append(Option(lay, stage, {"params": params_at, "optimizer": optim_at}, needed, fits,
                                      sum(terms.values()), terms, config, busiest, fig))  # fmt: skip

    @functools.cache
    def step_peak(t: int, mode: str, sequence: str | None, rows: int) -> int:
        """Without a pipeline: the estimator's own figure for one micro-batch of `rows` (every placement and
        micro-batch count of this tensor layout shares it)."""
        model_t = sharded_for(t, mode, sequence)[0]
        act, _ = E.step_activations(model_t, None, batch_size=rows, seq_len=seq, dtype=dtype, cfg=ckpt_cfg)
        noted(act.note if act.note.startswith("not counted") else "")
        return act.bytes

    sent_for: dict[tuple, Any] = {}  # the stages' outputs by cut and rows, found by a layout's first rank

    def rank_activations(
        t: int,
        mode: str,
        sequence: str | None,
        p: int,
        sched: str,
        m: int,
        virtual: int,
        rows: int,
        ranks: list,
        fig: str,
    ) -> list[int]:
        """Each pipeline rank's activation bytes by `fig` ([Note: the planner's activation figure])."""
        if fig == "step" and p == 1:
            return [step_peak(t, mode, sequence, rows)]
        sharded, units_rows = units_for(t, mode, sequence, rows)  # the units' activations at this micro-batch's rows
        by_name = {u.name: u for u in units_rows}
        if fig == "saved":
            return [_activations(rk, p, sched, m, virtual, checkpointing, by_name) for rk in ranks]
        stage_units = [[by_name[u.name] for u in su] for su in ranks[0][2]]
        lay = Layout(tensor=t, tensor_mode=mode, sequence=sequence, pipeline=p, schedule=sched, microbatches=m,
                     virtual=virtual)  # fmt: skip
        key = (t, mode, sequence, p, sched == "chimera", virtual, rows)
        inputs, acts = E.lm_inputs(rows, seq), []
        for k in range(p):  # as the estimator's `rank_parts` asks it
            peak, _, _, sent_for[key] = rank_peak(sharded, units_rows, stage_units, lay, k, inputs, dtype,
                                                  checkpointing, False, sent_for.get(key))  # fmt: skip
            acts.append(peak)
        return acts

    # A 70B model's layouts take a minute or more to rank: a bar where someone watches (hetero/progress.py).
    grid = list(_grid(shape, world_size, gpus, max_tensor, tensor_modes, schedules))
    # Under torchrun every rank may plan alike (nothing here is collective): the launcher's RANK shows one bar.
    progress = make_bar(len(grid), "hetero: ranking layouts", unit="layout", rank=int(os.environ.get("RANK", "0")))
    try:
        for cell in grid:
            rank_layout(*cell, "saved" if figure == "confirm" else figure)
            progress.update()
    finally:
        progress.close()
    out.options.sort(key=_order)
    while figure == "confirm":  # each pass confirms layouts for good: it ends
        cells = {_cell(o) for o in out.options[:confirm] if o.fits and o.figure == "saved"}
        if not cells:
            break
        out.options = [o for o in out.options if _cell(o) not in cells]
        for cell in cells:
            rank_layout(*cell, "step")
        out.considered = len(out.options)
        out.options.sort(key=_order)
    out.seconds = time.perf_counter() - started
    return out


def _check_split(split: str | Sequence[str] | None) -> str | tuple[str, ...] | None:
    """plan()'s pipeline_split, checked as the config checks it (a list: its FQNs against the model, later)."""
    if split is None:
        return None
    if isinstance(split, str):
        return Config.from_dict({"parallel": {"pipeline_split": split}}).parallel.pipeline_split  # type: ignore
    if not split or not all(isinstance(s, str) for s in split):
        raise ConfigError(
            f'pipeline_split: expected None, "auto", "params" or a non-empty list of the FQNs where stages 1.. '
            f"begin, got {split!r}"
        )
    return tuple(split)


# [Note: the cut a plan pastes]
# A pipeline rank's bytes depend on which units its stages hold (with checkpointing, which stage keeps which saved
# inputs), so an option's figures hold for one cut: the planner's, balanced by parameter counts on the meta copy. A
# pasted pipeline_split "auto" let the run time its units instead and cut elsewhere (a large head is slow, an
# embedding fast: on meta, the engine's FLOP count put a 4-block GPT's head alone on the last stage, where the plan
# had counted it with two blocks), with other bytes per rank than the plan promised. So by default the config names
# the cut itself, as the FQNs where stages 1.. begin under the engine's own unit names (`units_of`), which a run
# takes as given. A user who passes pipeline_split "auto" (or "params") to plan() asks for that in the config: it
# is kept, a note says the figures may not be the run's, and each option's layout still names the cut they are
# for. A list is planned as given, by the engine's `boundaries`, for the layouts of its stage count.
def _pasted(split: str | tuple[str, ...] | None, cut: tuple[str, ...] | None, notes: list[str]) -> str | list[str]:
    """A pipeline option's parallel.pipeline_split ([Note: the cut a plan pastes])."""
    if isinstance(split, str):
        return split
    if isinstance(split, tuple):
        return list(split)
    if cut is not None:
        return list(cut)
    why = (
        'pipeline options paste pipeline_split "auto": the engine cuts this model into other units than the '
        "planner's, whose FQNs cannot name the cut the figures are for (a run may cut elsewhere)"
    )
    if why not in notes:
        notes.append(why)
    return "auto"


def _order(o: Option) -> tuple:  # equal times: less device memory first (room for a larger batch)
    return not o.fits, round(o.seconds, 9), o.needed["device"]


def _cell(o: Option) -> tuple:
    """The grid cell (`_grid`) an option's layout came from."""
    lay = o.layout
    return lay["tensor"], lay["tensor_mode"], lay["sequence"], lay["pipeline"], lay["schedule"], lay["microbatches"]


def _batch_parts(mode: str, t: int) -> int:
    """The parts a grid mode cuts a micro-batch's rows into (1 for 1D)."""
    if mode == "1d" or t == 1:
        return 1
    from hetero.parallel.grid.mesh import Grid

    return Grid.shape_only(mode, t, _depth_of(mode, t)).batch_parts


def _depth_of(mode: str, t: int) -> int | None:
    """2.5D's depth at degree t: the smallest that fits (`tensor_modes.q_and_depth`); None for the other modes."""
    qd = q_and_depth(t) if mode == "2.5d" else None
    return qd[1] if qd else None


def available_modes() -> tuple[str, ...]:
    """The tensor modes `hetero.initialize` can run: 1D, and the others once the config has `tensor_mode`."""
    from hetero.config import ParallelConfig

    has = "tensor_mode" in {f.name for f in dataclasses.fields(ParallelConfig)}
    return tuple(TENSOR_MODES) if has else ("1d",)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _grid(
    shape: Shape,
    world: int,
    gpus: int,
    max_tensor: int | None,
    modes: tuple[str, ...],
    schedules: tuple[str, ...],
) -> Any:
    top = max_tensor if max_tensor is not None else min(world, gpus)
    for t in _divisors(world):
        if t > top:
            continue
        for mode in modes if t > 1 else ("1d",):
            if t > 1 and TENSOR_MODES[mode].check(t):
                continue
            forms: tuple[str | None, ...] = (None, *SEQUENCE_FORMS) if t > 1 and mode == "1d" else (None,)
            for sequence in forms:
                for p in _divisors(world // t):
                    if p > shape.layers:
                        continue
                    for sched in schedules if p > 1 else ("1f1b",):
                        if sched == "chimera" and p % 2:
                            continue
                        for m in sorted({p, 2 * p, 4 * p}) if p > 1 else (1, 2):
                            yield t, mode, sequence, p, sched, m


def _activations(
    rank: tuple, p: int, sched: str, m: int, virtual: int, checkpointing: bool, units: dict[str, Any]
) -> int:
    """Peak activation bytes the rank keeps (`parallel_layout.walk`); `units`: by name, measured at the
    micro-batch's rows."""
    k, mine, stage_units = rank[:3]
    stage_units = [[units[u.name] for u in su] for su in stage_units]
    lay = Layout(pipeline=p, schedule=sched if p > 1 else "1f1b", microbatches=m, virtual=virtual)
    return walk(stage_units, mine, lay, k, checkpointing)


def _cap(machine: Machine, tier: str) -> int:
    return {"device": machine.device_bytes, "host": machine.host_bytes, "nvme": machine.nvme_bytes}[tier]
