"""`hetero.estimate`: the bytes a configuration needs on each tier, before running it.

[Note: the engine's own arithmetic]
The estimate is not a rule of thumb: it builds the chunk layout the engine would build (`build_layout` on the
model's parameter shapes, with the same optimizer param groups, chunk size and world size) and then, per chunk, the
buffers each ZeRO stage keeps (`hetero/zero/zero_chunk.py`, [Note: what each stage keeps]) on the tier the offload
config puts them. These *resident* model states are what the engine's tier ledgers hold between steps, byte for
byte. On top come *transient* buffers that exist only during a step: stage-3 chunks gathered for use (the one in use
plus `prefetch_depth` arriving and one being released), per-micro-batch gradient buffers and the reduce-scatters in
flight (stages 2-3), optimizer states read back from NVMe for the update (the chunk stepping and the next one), and
parameter shards read back from NVMe for a gather (`placement.py` places both). Activations are counted on the
meta device (see `activations.py`). A configuration fits when each tier's resident + transient bytes (per node for
the shared host and NVMe tiers) stay within the usable share of what the machine has.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hetero.config import Config, format_size
from hetero.config_values import check_int
from hetero.errors import ConfigError
from hetero.parallel.mesh import check_degrees
from hetero.profiler.activations import ActivationEstimate, meta_activation_bytes
from hetero.profiler.auto_chunks import cap_for, tiled_counts
from hetero.profiler.estimate_args import check_sizes, config_for
from hetero.profiler.gathered import gathered_bytes
from hetero.profiler.machine import Machine
from hetero.profiler.meta_models import as_model, as_optimizer, default_seq_len
from hetero.profiler.parallel_layout import describe, describe_ranks, layout_from, layout_ranks, with_layout
from hetero.profiler.parallel_shapes import per_rank_model
from hetero.profiler.placement import KINDS, MODEL_STATE_KINDS, TIERS, place, zeros
from hetero.profiler.step_peak import Offload, meta_step_peak
from hetero.zero.layout import build_layout
from hetero.zero.optim import algorithm_of
from hetero.zero.precision import COMPUTE_DTYPES

USABLE = {"device": 0.9, "host": 0.9, "nvme": 1.0}  # share of a tier's capacity a run can count on
# (zero_stage, offload.params, offload.optimizer), fastest first: everything on the device at the lowest stage, then
# optimizer states on the host, then on NVMe, parameters leaving the device last.
CANDIDATES = (
    (0, "device", "device"), (1, "device", "device"), (2, "device", "device"), (3, "device", "device"),
    (1, "device", "host"), (2, "device", "host"), (3, "device", "host"), (3, "host", "host"),
    (2, "device", "nvme"), (3, "device", "nvme"), (3, "host", "nvme"), (3, "nvme", "nvme"),
)  # fmt: skip


@dataclass(frozen=True)
class Candidate:
    zero_stage: int
    params: str  # offload.params
    optimizer: str  # offload.optimizer
    needed: dict[str, int]  # tier -> bytes per rank
    fits: bool | None  # None: no machine to check against
    short: tuple[str, ...] = ()  # tiers that do not fit

    def label(self) -> str:
        return f"zero_stage={self.zero_stage} offload.params={self.params} offload.optimizer={self.optimizer}"


@dataclass
class Estimate:
    """Bytes per rank on each tier, by kind; `resident` is what stays between steps (what the engine's ledgers
    hold after an update), `transient` what a step adds at its peak."""

    n_params: int
    n_chunks: int
    chunk_elements: int  # the chunks' total capacity: parameters plus padding (of the busiest rank, with a layout)
    chunk_numel: int  # the chunk size the layout chose (trimmed chunks and tiles are smaller)
    world_size: int
    ranks_per_node: int
    zero_stage: int
    precision: str
    offload_params: str
    offload_optimizer: str
    optimizer: str
    batch_size: int
    seq_len: int
    resident: dict[str, dict[str, int]] = field(default_factory=zeros)
    transient: dict[str, dict[str, int]] = field(default_factory=zeros)
    activations: ActivationEstimate | None = None
    machine: Machine | None = None
    candidates: list[Candidate] = field(default_factory=list)
    chunk_params: int = 0  # parameters in this rank's chunks (n_params without a layout)
    layout: dict[str, Any] = field(default_factory=dict)  # tensor, tensor_mode, sequence, pipeline, ... , data
    per_pipeline_rank: list[dict[str, Any]] = field(default_factory=list)  # each pipeline rank's bytes (layouts)
    parallel: dict[str, Any] = field(default_factory=dict)  # the tensor / sequence layout (empty without one)
    tiled: dict[str, int] = field(default_factory=dict)  # weights split into tiles -> their tiles ([Note: tiles])

    # ---- figures ------------------------------------------------------------------------------------------
    def bytes(self, tier: str, kind: str | None = None) -> int:
        """Peak bytes per rank on a tier (resident + transient), of one kind or all."""
        kinds = KINDS if kind is None else (kind,)
        return sum(self.resident[tier][k] + self.transient[tier][k] for k in kinds)

    def model_state(self, tier: str) -> int:
        """Parameters, gradients, master weights and optimizer states resident on the tier between steps."""
        return sum(self.resident[tier][k] for k in MODEL_STATE_KINDS)

    def needed(self, tier: str) -> int:
        """Bytes the tier must offer: per rank for the device, per node (all its ranks) for host and NVMe."""
        per_rank = self.bytes(tier)
        return per_rank if tier == "device" else per_rank * self.ranks_per_node

    @property
    def fits(self) -> bool | None:
        return None if self.machine is None else not self.short

    @property
    def short(self) -> tuple[str, ...]:
        if self.machine is None:
            return ()
        return tuple(t for t in TIERS if self.needed(t) > _capacity(self.machine, t))

    @property
    def recommendation(self) -> Candidate | None:
        return next((c for c in self.candidates if c.fits), None)

    @property
    def advice(self) -> str | None:
        """Where nothing fits: what the placement that needs the least device memory still needs on the tiers it is
        short on; whether activations are most of the device's need (no placement moves them, only
        checkpointing or a smaller micro-batch does); and whether NVMe offload was left untried (no NVMe space)."""
        if self.machine is None or not self.candidates or self.recommendation is not None:
            return None
        lean = min(self.candidates, key=lambda c: c.needed["device"])
        short = ", ".join(
            f"{t} {format_size(lean.needed[t])}{'' if t == 'device' else ' per node'} of "
            f"{format_size(_capacity(self.machine, t))} usable"
            for t in lean.short
        )
        parts = [f"the placement that needs the least on the device ({lean.label()}) needs {short}"]
        acts = self.bytes("device", "activations")
        if "device" in lean.short and 2 * acts > lean.needed["device"]:
            ckpt = self.activations is not None and self.activations.checkpointed
            fix = "" if ckpt else "set activation_checkpointing (true, or the blocks to checkpoint), or "
            parts.append(
                f"activations are {format_size(acts)} of the {format_size(lean.needed['device'])} needed on the device"
                f" there, and no placement moves them; {fix}lower batch_size or seq_len"
            )
        if self.machine.nvme_bytes == 0:
            parts.append(
                "NVMe offload was not tried: the machine has no NVMe space (give memory.nvme_dir, --nvme-dir, for "
                "this machine; nvme_bytes, --nvme-space, for a described one)"
            )
        return "; ".join(parts)

    # ---- renderings ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        rec = self.recommendation
        return {
            "n_params": self.n_params,
            "n_chunks": self.n_chunks,
            "chunk_elements": self.chunk_elements,
            "chunk_numel": self.chunk_numel,
            "tiled": dict(self.tiled),
            "world_size": self.world_size,
            "ranks_per_node": self.ranks_per_node,
            "config": {
                "zero_stage": self.zero_stage,
                "precision": self.precision,
                "offload": {"params": self.offload_params, "optimizer": self.offload_optimizer},
            },
            "optimizer": self.optimizer,
            "parallel": dict(self.parallel),
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "per_rank": {t: {k: self.bytes(t, k) for k in KINDS} | {"total": self.bytes(t)} for t in TIERS},
            "resident": {t: dict(self.resident[t]) for t in TIERS},
            "transient": {t: dict(self.transient[t]) for t in TIERS},
            "needed": {t: self.needed(t) for t in TIERS},
            "activations": None if self.activations is None else dataclasses.asdict(self.activations),
            "machine": None if self.machine is None else dataclasses.asdict(self.machine),
            "fits": self.fits,
            "short": list(self.short),
            "candidates": [dataclasses.asdict(c) for c in self.candidates],
            "recommendation": None if rec is None else dataclasses.asdict(rec),
            "advice": self.advice,
            "layout": self.layout,
            "per_pipeline_rank": self.per_pipeline_rank,
        }

    def table(self) -> str:
        head = (
            f"hetero estimate: {self.n_params / 1e6:,.1f}M parameters, {self.n_chunks} chunks per rank "
            f"({100 * (self.chunk_elements / max(1, self.chunk_params) - 1):.1f}% padding), world {self.world_size}"
            f" ({self.ranks_per_node} per node), ZeRO-{self.zero_stage}, {self.precision}, {self.optimizer}, offload"
            f" params={self.offload_params} optimizer={self.offload_optimizer}"
        )
        if self.parallel:
            p = self.parallel
            head += (
                f"; per tensor rank of tensor {p['tensor']} ({p['tensor_mode']}, sequence {p['sequence']}), ZeRO over"
                f" {p['zero_world']} ranks"
            )
        act = self.activations
        sub = f"micro-batch {self.batch_size} x {self.seq_len} tokens per rank"
        if act is not None:
            sub += f"; activations {format_size(act.bytes)}" + (" (checkpointed)" if act.checkpointed else "")
            if act.note.startswith("not counted"):
                sub += f" ({act.note}; pass inputs= as meta tensors)"
        cols = ("params", "grads", "master", "optim st.", "activ.", "buffers", "per rank", "needed")
        lines = [head, sub]
        if self.layout:
            lines += describe(self.layout, self.per_pipeline_rank)
        lines += ["", f"{'bytes':<8}" + "".join(f"{c:>12}" for c in cols) + f"{'usable':>12}  fits"]
        for t in TIERS:
            cells = [format_size(self.bytes(t, k)) for k in KINDS]
            cells += [format_size(self.bytes(t)), format_size(self.needed(t))]
            if self.machine is not None:
                cap = _capacity(self.machine, t)
                tail = f"{format_size(cap):>12}  {'yes' if self.needed(t) <= cap else 'NO'}"
            else:
                tail = f"{'-':>12}  -"
            lines.append(f"{t:<8}" + "".join(f"{c:>12}" for c in cells) + tail)
        lines.append("(needed: per rank on the device; per node, all ranks together, on host and NVMe)")
        if self.machine is not None:
            lines += ["", f"machine: {self.machine.describe()}"]
            verdict = "fits" if self.fits else f"does NOT fit (short on {', '.join(self.short)})"
            lines.append(f"this configuration {verdict}")
            lines.append("candidates, fastest first:")
            for c in self.candidates:
                need = "  ".join(f"{t} {format_size(c.needed[t]):>10}" for t in TIERS)
                mark = "fits" if c.fits else f"short: {', '.join(c.short)}"
                lines.append(f"  {c.label():<62} {need}   {mark}")
            rec = self.recommendation
            advice = f"; {self.advice}" if self.advice else ""
            lines.append(f"recommended: {rec.label()}" if rec else f"recommended: nothing fits this machine{advice}")
        return "\n".join(lines)


def _capacity(machine: Machine, tier: str) -> int:
    raw = {"device": machine.device_bytes, "host": machine.host_bytes, "nvme": machine.nvme_bytes}[tier]
    return int(raw * USABLE[tier])


# ---- the estimate ---------------------------------------------------------------------------------------------
def estimate(
    model_or_param_count: nn.Module | int | float | str | os.PathLike,
    config: Config | dict[str, Any] | str | os.PathLike | None = None,
    *,
    world_size: int = 1,
    batch_size: int = 1,
    seq_len: int | None = None,
    optimizer: torch.optim.Optimizer | str = "adamw",
    inputs: dict[str, Any] | None = None,
    machine: Machine | None | bool = True,
    ranks_per_node: int | None = None,
    tensor: int | None = None,
    tensor_mode: str | None = None,
    pipeline: int | None = None,
    microbatches: int | None = None,
    sequence: bool | str | None = None,
) -> Estimate:
    """Bytes per tier and kind a training run of this model under `config` needs, and whether it fits.

    model_or_param_count: a model (on the meta device or real; never run for real), a path to a Hugging Face
    config.json, or a parameter count (a GPT-3-shaped model is assumed, see `layouts.gpt_for_params`).
    optimizer: the optimizer instance you will train with (its param groups shape the layout), or "adamw" / "adam"
    / "sgd" for one param group. inputs: forward keyword arguments as meta tensors, for models that do not take
    `input_ids` (default: input_ids and labels of [batch_size, seq_len]). machine: True reads this machine (NVMe
    offload then needs memory.nvme_dir: its free space is the tier), a `Machine` describes another, False/None checks
    nothing (neither needs a directory: `estimate_args.py`). ranks_per_node: ranks sharing a node's host RAM and
    NVMe (default: the world size, at most the node's GPU count when it has GPUs).

    tensor, tensor_mode, pipeline, microbatches, sequence: the layout (over the config's "parallel" section);
    world_size counts every rank. With a pipeline the bytes are the busiest pipeline rank's, every rank's in
    `per_pipeline_rank` ([Note: a layout's bytes per rank]); batch_size is the rows of one micro-batch.
    """
    check_sizes(world_size=world_size, batch_size=batch_size, seq_len=seq_len)
    cfg = config_for(config, machine)  # NVMe offload for a described machine needs no directory here
    cfg = with_layout(cfg, tensor=tensor, tensor_mode=tensor_mode, pipeline=pipeline, microbatches=microbatches,
                      sequence=sequence)  # fmt: skip
    check_degrees(world_size, tensor=cfg.parallel.tensor, pipeline=cfg.parallel.pipeline)  # the engine's own check
    for key, value in (("offload.params", cfg.offload.params), ("offload.optimizer", cfg.offload.optimizer)):
        if value == "auto":
            raise ConfigError(f'{key}: "auto" has no fixed placement to estimate; the candidates list shows each one')
    model = as_model(model_or_param_count)
    opt = as_optimizer(optimizer, model)
    n_params = sum(p.numel() for p in model.parameters())  # the whole model's
    algo = algorithm_of(opt)
    if machine is True:
        machine = Machine.detect(nvme_dir=cfg.memory.nvme_dir)
    elif machine is False:
        machine = None
    if ranks_per_node is not None:
        check_int("ranks_per_node", ranks_per_node, minimum=1, hint="(ranks sharing a node's host memory and NVMe)")
    else:
        gpus = machine.gpus if machine is not None else 0
        ranks_per_node = min(world_size, gpus) if gpus else world_size
    chunk_numel = None if cfg.chunk_size == "auto" else cfg.chunk_size
    cap_of = cap_for(cfg, machine, ranks_per_node, len(algo.state_names))  # the engine's automatic chunk size
    dtype = COMPUTE_DTYPES[cfg.precision]
    seq = seq_len if seq_len is not None else default_seq_len(model)
    layout, ranks = layout_from(cfg), []
    if layout is None:
        # Tensor / sequence layouts: the model as tensor rank 0 holds it, ZeRO over the data-parallel group.
        model, opt, zero_world = per_rank_model(model, opt, cfg, world_size)
        specs = build_layout(
            model, opt, chunk_numel=chunk_numel, world=zero_world, max_chunk_numel=cap_of(zero_world), tiling=cfg.tiling
        )
        act, host_acts = step_activations(model, inputs, batch_size=batch_size, seq_len=seq, dtype=dtype, cfg=cfg)
    else:  # with a pipeline: each pipeline rank of the layout ([Note: a layout's bytes per rank])
        ckpt = getattr(cfg, "activation_checkpointing", False)  # true, or the blocks' names, as the engine's
        offload = bool(ckpt) and bool(getattr(cfg, "activation_offload", False))
        ranks, zero_world = layout_ranks(model, opt, layout, world=world_size, chunk_numel=chunk_numel, dtype=dtype,
                                         inputs=inputs or lm_inputs(batch_size, seq), checkpointing=ckpt,
                                         offload=offload, cap=cap_of, tiling=cfg.tiling)  # fmt: skip
        ckpt = bool(ckpt)
        host_acts = ranks[0][0].host_activations
        specs = ranks[0][1]
        act = ActivationEstimate(bytes=ranks[0][0].activations, saved=0, checkpointed=ckpt, note="")  # describe_ranks
    buffers = sum(b.numel() * (dtype.itemsize if b.is_floating_point() else b.element_size()) for b in model.buffers())

    # Stage 3 gathers by unit ([Note: units]): the engine's own units and release rules give the gathered peak.
    budget = cfg.memory.device_budget
    rules = dict(ahead=cfg.gather_ahead, host_budget=cfg.memory.host_budget, world=zero_world)
    rules["shards_via_host"] = cfg.offload.params != "device"
    per_rank = [
        (sp, p.activations, p.host_activations, gathered_bytes(p.model, sp, dtype, budget, **rules)) for p, sp in ranks
    ]
    per_rank = per_rank or [(specs, act.bytes, host_acts, gathered_bytes(model, specs, dtype, budget, **rules))]

    def placed_rank(
        stage: int, params: str, optim: str, rank_specs: list, acts: int, host_acts: int, gathered: int
    ) -> tuple:
        resident, transient = place(
            rank_specs,
            gathered=gathered,
            stage=stage,
            world=zero_world,
            dtype=dtype,
            n_states=len(algo.state_names),
            params=params,
            optim=optim,
            prefetch_depth=cfg.prefetch_depth,
            params_host_bytes=cfg.offload.params_host_bytes,  # used only where params are on NVMe (shard_homes)
        )
        resident["device"]["buffers"] += buffers
        transient["device"]["activations"] += acts
        transient["host"]["activations"] += host_acts  # activation offload's copies of block inputs
        return resident, transient

    def placed(stage: int, params: str, optim: str) -> tuple[dict, dict]:  # the busiest pipeline rank's bytes
        options = [placed_rank(stage, params, optim, *args) for args in per_rank]
        return max(options, key=lambda rt: sum(rt[0]["device"].values()) + sum(rt[1]["device"].values()))

    est = Estimate(
        n_params=n_params,
        n_chunks=len(specs),
        chunk_elements=sum(s.capacity for s in specs),
        chunk_numel=specs[0].chunk_numel,
        chunk_params=sum(p.numel for s in specs for p in s.params),  # tiles hold their share each
        tiled=tiled_counts(specs),
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        zero_stage=cfg.zero_stage,
        precision=cfg.precision,
        offload_params=cfg.offload.params,
        offload_optimizer=cfg.offload.optimizer,
        optimizer=algo.name,
        batch_size=batch_size,
        seq_len=seq,
        activations=act,
        machine=machine,
    )
    if cfg.parallel.tensor > 1:
        p = cfg.parallel
        est.parallel = {
            "tensor": p.tensor,
            "tensor_mode": p.tensor_mode,
            "tensor_depth": p.tensor_depth,
            "sequence": p.sequence,
            "zero_world": zero_world,
        }
    est.resident, est.transient = placed(cfg.zero_stage, cfg.offload.params, cfg.offload.optimizer)
    if layout is not None:
        rows = [placed_rank(est.zero_stage, est.offload_params, est.offload_optimizer, *args) for args in per_rank]
        describe_ranks(est, layout, ranks, rows, world_size)
    if machine is not None:
        for stage, params, optim in CANDIDATES:
            if "nvme" in (params, optim) and machine.nvme_bytes == 0:
                continue
            probe = dataclasses.replace(est)
            probe.resident, probe.transient = placed(stage, params, optim)
            needed = {t: probe.needed(t) for t in TIERS}
            est.candidates.append(Candidate(stage, params, optim, needed, not probe.short, probe.short))
    return est


def lm_inputs(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    # Two tensors, not one: the embedding saves input_ids and the loss its targets, and a model that does not shift
    # its labels itself is given labels of their own (a shifted copy), so one shared tensor undercounted them. (A
    # Hugging Face model called with labels=input_ids holds batch x seq x 8 bytes fewer than this counts.)
    return {k: torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta") for k in ("input_ids", "labels")}


def step_activations(
    model: nn.Module, inputs: dict[str, Any] | None, *, batch_size: int, seq_len: int, dtype: torch.dtype, cfg: Config
) -> tuple[ActivationEstimate, int]:
    """The step's activations on the device, and the bytes activation offload holds on the host (the planner's
    figure too: `planner.py`)."""
    checkpointing = getattr(cfg, "activation_checkpointing", False)  # true, or the blocks' names, as the engine's
    inputs = inputs if inputs is not None else lm_inputs(batch_size, seq_len)
    try:
        act = meta_activation_bytes(model, inputs, dtype=dtype, checkpointing=checkpointing)
    except Exception as e:  # a forward that cannot run on meta tensors: say so, count nothing
        return ActivationEstimate(
            bytes=0, saved=0, checkpointed=bool(checkpointing), note=f"not counted: forward on meta failed: {e}"
        ), 0
    offload = Offload() if checkpointing and getattr(cfg, "activation_offload", False) else None
    try:  # the whole step: gradients, the logits held, recomputations ([Note: a step's activation peak])
        peak = meta_step_peak(model, inputs, dtype=dtype, checkpointing=checkpointing, offload=offload)
    except Exception as e:
        note = f"{act.note}; saved bytes only: backward on meta failed: {e}".lstrip("; ")
        if offload is not None:
            note += "; activation_offload not counted: an upper bound for the device"
        return dataclasses.replace(act, note=note), 0
    if offload is None:
        return dataclasses.replace(act, bytes=max(peak, act.saved_peak)), 0
    # What forward saves counts the blocks' inputs on the device; offloaded, they are not ([Note: offloaded inputs
    # on meta]): the step's peak is the figure, and the inputs' host copies are the host's.
    note = f"{act.note}; block inputs offloaded: {format_size(offload.host_peak)} on the host".lstrip("; ")
    return dataclasses.replace(act, bytes=peak, note=note), offload.host_peak
