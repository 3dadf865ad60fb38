"""The `parallel` section of the config: tensor (1D, 2D, 2.5D, 3D; sequence forms), pipeline (schedules, splits)
and data parallel degrees, validated against each other."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from hetero.config_values import check_int
from hetero.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "chimera")
SPLITS = ("auto", "params")
TENSOR_MODES = ("1d", "2d", "2.5d", "3d")
SEQUENCE_MODES = ("megatron", "ulysses", "ring")


def grid_shape(mode: str, tensor: int, depth: int | None) -> tuple[int, int]:
    """(q, d) of a tensor mode at this degree: 1d -> (tensor, 1), 2d -> tensor = q^2, 2.5d -> q^2 d, 3d -> q^3."""
    if mode not in TENSOR_MODES:
        close = difflib.get_close_matches(str(mode).lower(), TENSOR_MODES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"parallel.tensor_mode: {mode!r} is not a mode{hint}; choose one of {', '.join(TENSOR_MODES)}"
        )
    if mode != "2.5d" and depth not in (None, 1):
        raise ConfigError(f"parallel.tensor_depth = {depth!r} applies to tensor_mode '2.5d' only (mode is {mode!r})")
    if mode == "1d":
        return tensor, 1
    d = 1
    if mode == "2.5d":
        if depth is None or isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"parallel.tensor_depth: tensor_mode '2.5d' needs an integer depth >= 1, got {depth!r}")
        d = depth
    power = 3 if mode == "3d" else 2
    q = round((tensor / d) ** (1 / power)) if tensor % d == 0 else 0
    if q < 2 or q**power * d != tensor:
        shape = {"2d": "q^2 (4, 9, 16, ...)", "3d": "q^3 (8, 27, 64, ...)", "2.5d": f"q^2 x tensor_depth {d}, q >= 2"}
        raise ConfigError(f"parallel.tensor = {tensor} does not fit tensor_mode {mode!r}: it must be {shape[mode]}")
    return q, d


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Tensor x pipeline x data parallelism; the data-parallel degree is what is left of the world size."""

    tensor: int = 1
    """Tensor-parallel degree: the ranks that cut the layers named by tensor_plan (with "ulysses" or "ring"
    sequence parallelism: the ranks that split the sequence, layers whole)."""
    tensor_mode: Literal["1d", "2d", "2.5d", "3d"] = "1d"
    """How layers are cut: "1d" (Megatron), "2d" (SUMMA on a q x q grid, tensor = q^2), "2.5d" (Tesseract,
    tensor = q^2 x tensor_depth), "3d" (a q x q x q cube, tensor = q^3)."""
    tensor_depth: int | None = None
    """The depth d of "2.5d"."""
    tensor_plan: Mapping[str, str] | str = "auto"
    """FQN patterns -> style ("colwise", "rowwise", "vocab", ...), or "auto" for known model families."""
    sequence: bool | Literal["megatron", "ulysses", "ring"] = False
    """Sequence parallelism: true or "megatron" (inside the 1d tensor group), "ulysses" (all-to-all around
    attention) or "ring" (ring self-attention) over the `tensor` ranks, whose layers then stay whole."""
    pipeline: int = 1
    """Pipeline stages."""
    pipeline_split: tuple[str, ...] | str = "auto"
    """FQNs where a new stage begins (pipeline * virtual_stages - 1 of them); "auto": stages balanced by each unit's
    time, measured in a short warm-up (or `pipeline_costs`); "params": balanced by parameter count."""
    pipeline_costs: Mapping[str, float] | tuple[float, ...] | None = None
    """With pipeline_split "auto": each unit's cost instead of timing it, one number per unit in model order, or
    unit-name patterns ("layers.*") -> cost (unmatched units cost 1)."""
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "chimera"] = "1f1b"
    """Pipeline schedule; "chimera" runs two pipelines in opposite directions (an even number of stages, micro-batches
    a multiple of it)."""
    microbatches: int = 1
    """Micro-batches train_batch splits each batch into (gradient accumulation within the batch)."""
    virtual_stages: int | None = None
    """Model chunks per pipeline rank; only for "interleaved_1f1b" (default 2 there, 1 otherwise)."""

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "microbatches"):
            check_int(f"parallel.{name}", getattr(self, name), minimum=1)
        self._check_modes()
        if isinstance(self.tensor_plan, str):
            if self.tensor_plan != "auto":
                raise ConfigError(f'parallel.tensor_plan: expected "auto" or a mapping, got {self.tensor_plan!r}')
        elif not isinstance(self.tensor_plan, Mapping):
            raise ConfigError(f'parallel.tensor_plan: expected a mapping or "auto", got {self.tensor_plan!r}')
        if isinstance(self.pipeline_split, str):
            if self.pipeline_split not in SPLITS:
                raise ConfigError(
                    f'parallel.pipeline_split: expected "auto", "params" or a list of FQNs, got {self.pipeline_split!r}'
                )
        else:
            if not all(isinstance(s, str) for s in self.pipeline_split):
                raise ConfigError(f"parallel.pipeline_split: expected a list of FQNs, got {self.pipeline_split!r}")
            object.__setattr__(self, "pipeline_split", tuple(self.pipeline_split))
        if isinstance(self.schedule, str) and self.schedule.lower() in SCHEDULES:
            object.__setattr__(self, "schedule", self.schedule.lower())  # "1F1B", "GPipe": the papers' spellings
        if self.schedule not in SCHEDULES:
            close = difflib.get_close_matches(str(self.schedule).lower(), SCHEDULES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"parallel.schedule: {self.schedule!r} is not a schedule{hint}. Choose one of {', '.join(SCHEDULES)}"
            )
        self._check_costs()
        interleaved = self.schedule == "interleaved_1f1b"
        uneven = self.pipeline % 2 or self.microbatches % self.pipeline
        if self.schedule == "chimera" and self.pipeline > 1 and uneven:
            raise ConfigError(
                f"parallel.schedule 'chimera' needs an even parallel.pipeline (got {self.pipeline}) and "
                f"parallel.microbatches a multiple of it (got {self.microbatches}): half of the micro-batches run "
                "each direction, in basic units of pipeline / 2"
            )
        if self.virtual_stages is None:
            object.__setattr__(self, "virtual_stages", 2 if interleaved else 1)
        check_int("parallel.virtual_stages", self.virtual_stages, minimum=1)
        if self.virtual_stages > 1 and not interleaved:
            raise ConfigError(
                f"parallel.virtual_stages = {self.virtual_stages} needs schedule 'interleaved_1f1b' "
                f"(schedule is {self.schedule!r})"
            )
        if interleaved and self.pipeline > 1 and self.microbatches % self.pipeline:
            raise ConfigError(
                f"parallel.microbatches = {self.microbatches}: the interleaved schedule needs a multiple of "
                f"parallel.pipeline = {self.pipeline}"
            )
        if not isinstance(self.pipeline_split, str) and len(self.pipeline_split) != self.stages - 1:
            raise ConfigError(
                f"parallel.pipeline_split names {len(self.pipeline_split)} FQNs; {self.stages} stages "
                f"(pipeline {self.pipeline} x virtual_stages {self.virtual_stages}) begin at {self.stages - 1}"
            )

    def _check_costs(self) -> None:
        costs = self.pipeline_costs
        if costs is None:
            return
        if self.pipeline_split != "auto":
            raise ConfigError(
                f'parallel.pipeline_costs balances pipeline_split "auto"; pipeline_split is {self.pipeline_split!r}'
            )
        values = list(costs.values()) if isinstance(costs, Mapping) else costs
        if isinstance(costs, (str, bytes)) or not isinstance(values, (list, tuple)):
            raise ConfigError(f"parallel.pipeline_costs: expected a list of numbers or a mapping, got {costs!r}")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"parallel.pipeline_costs: every cost must be a number > 0, got {v!r}")
        if not isinstance(costs, Mapping):
            object.__setattr__(self, "pipeline_costs", tuple(float(v) for v in costs))

    def _check_modes(self) -> None:
        if self.sequence is True:
            object.__setattr__(self, "sequence", "megatron")
        if self.sequence is not False and self.sequence not in SEQUENCE_MODES:
            close = difflib.get_close_matches(str(self.sequence), SEQUENCE_MODES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"parallel.sequence: {self.sequence!r} is not a sequence mode{hint}; choose false, true, "
                f"{', '.join(map(repr, SEQUENCE_MODES))}"
            )
        grid_shape(self.tensor_mode, self.tensor, self.tensor_depth)
        if self.sequence and self.tensor == 1:
            raise ConfigError(
                f"parallel.sequence = {self.sequence!r} splits the sequence over the `tensor` ranks; set tensor > 1"
            )
        if self.sequence and self.tensor_mode != "1d":
            raise ConfigError(
                f"parallel.sequence = {self.sequence!r} with tensor_mode {self.tensor_mode!r}: grid modes cut the "
                "batch, not the sequence; sequence parallelism runs with tensor_mode '1d'"
            )

    @property
    def split_sequence(self) -> bool:
        """Ulysses or ring: the `tensor` ranks split the sequence and hold whole layers."""
        return self.sequence in ("ulysses", "ring")

    @property
    def stages(self) -> int:
        """Model chunks in all: pipeline ranks x virtual stages per rank."""
        return self.pipeline * self.virtual_stages  # type: ignore[operator]
