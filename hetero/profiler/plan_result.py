"""What `hetero.plan` returns: the options it checked and the plan that ranks them (planner.py builds them)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from hetero.config import format_size
from hetero.profiler.durations import format_seconds
from hetero.profiler.machine import Machine
from hetero.profiler.rates import Rates

# The activation figures an option can be checked with ([Note: the planner's activation figure]).
FIGURES = {
    "step": "the estimator's step peak on meta (hetero.estimate's figure), every layout",
    "saved": "the saved bytes walked over the schedule, every layout (cheaper; hetero.estimate's figure decides)",
    "confirm": "ranked with the saved bytes walked over the schedule, the first {confirm} fitting layouts confirmed "
    "with the estimator's step peak (hetero.estimate's figure)",
}


@dataclass(frozen=True)
class Option:
    # tensor, tensor_mode, sequence, pipeline, schedule, microbatches, data, rows, virtual_stages, and pipeline_split:
    # the FQNs where the stages of the cut its figures are for begin (None without a pipeline)
    layout: dict[str, Any]
    zero_stage: int
    offload: dict[str, str]
    needed: dict[str, int]  # per tier: device per rank, host and NVMe per node (the busiest pipeline rank)
    fits: bool
    seconds: float  # predicted step time
    terms: dict[str, float]  # the cost model's terms ([Note: the planner's cost model])
    config: dict[str, Any]  # hetero.initialize's config for this option
    activations: int = 0  # the busiest pipeline rank's activation bytes on the device, by `figure`
    figure: str = "step"  # where `activations` comes from: "step" (the estimator's) or "saved"

    def label(self) -> str:
        lay = self.layout
        seq = f"+{lay['sequence']}" if lay["sequence"] else ""
        cut = _cut(lay.get("pipeline_split"))
        pipe = f"pp{lay['pipeline']} {lay['schedule']}{cut}" if lay["pipeline"] > 1 else "pp1"
        return (
            f"tp{lay['tensor']} {lay['tensor_mode']}{seq} x {pipe} x dp{lay['data']}, m={lay['microbatches']} "
            f"x {lay['rows']} rows, ZeRO-{self.zero_stage} params={self.offload['params']} "
            f"optimizer={self.offload['optimizer']}"
        )


def _cut(split: list[str] | None, room: int = 40) -> str:
    """Where the stages begin (" cut at layers.2,layers.4"), if it is short enough for a table's line."""
    text = ",".join(split or [])
    return f" cut at {text}" if text and len(text) <= room else ""


@dataclass
class Plan:
    world_size: int
    global_batch: int
    seq_len: int
    machine: Machine
    rates: Rates
    options: list[Option] = field(default_factory=list)  # fitting ones first, fastest first
    considered: int = 0
    figure: str = "confirm"  # how the options' activations were counted (FIGURES)
    confirm: int = 15  # under "confirm": the fitting options checked with the estimator's figure
    seconds: float = 0.0  # how long planning took
    notes: list[str] = field(default_factory=list)  # what the figures could not count (a forward failing on meta)

    @property
    def best(self) -> Option | None:
        return next((o for o in self.options if o.fits), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "machine": dataclasses.asdict(self.machine),
            "rates": self.rates.to_dict(),
            "considered": self.considered,
            "activations": self.figure,
            "planning_seconds": self.seconds,
            "notes": list(self.notes),
            "options": [dataclasses.asdict(o) for o in self.options],
            "best": None if self.best is None else dataclasses.asdict(self.best),
        }

    def table(self, top: int = 15) -> str:
        lines = [
            f"hetero plan: world {self.world_size}, global batch {self.global_batch} x {self.seq_len} tokens; "
            f"{self.considered} layouts considered, {sum(o.fits for o in self.options)} fit",
            f"machine: {self.machine.describe()}",
            f"rates: {self.rates.describe()}",
            f"activations: {FIGURES[self.figure].format(confirm=self.confirm)}",
            *(f"note: {n}" for n in self.notes),
            "cost model: compute / (1 - bubble) + tensor + pipeline + data + offload communication (hetero/profiler/"
            "cost_model.py, [Note: the planner's cost model])",
            "",
        ]
        fitting = [o for o in self.options if o.fits][:top]
        for i, o in enumerate(fitting, 1):
            terms = " ".join(f"{k} {format_seconds(v)}" for k, v in o.terms.items() if v)
            lines.append(f"{i:>3}. {format_seconds(o.seconds):>9}  {o.label()}")
            need = ", ".join(f"{t} {format_size(o.needed[t])}" for t in ("device", "host", "nvme"))
            need += f" (activations {format_size(o.activations)}, {o.figure} figure)"
            lines.append(f"       {need}; {terms}")
        if not fitting:
            lines.append("nothing fits this machine: more ranks, more host memory or NVMe space")
        if self.best is not None:
            lines += ["", "config to paste (hetero.initialize):", json.dumps(self.best.config, indent=2)]
        return "\n".join(lines)
