"""Typed configuration, validated once at the edge.

A user hands `hetero.initialize` a dict, a path to a .json/.yaml file, or a `Config`. Everything is turned into
keyword-only frozen dataclasses here; nothing downstream reads raw dicts. Unknown keys are errors that name the key
and the closest valid one; sizes accept ints of bytes or strings such as "2GiB", "512MB", "1.5e9".
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hetero.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, *, key: str = "size") -> int:
    """Bytes from an int, a float, or a string like "2GiB" / "512 MB" / "1e9"."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size in bytes or a string like '2GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(f"{key}: a size in bytes must be whole, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"{key}: cannot read {value!r} as a size; write bytes (e.g. 1073741824) or a number with a unit "
                f"from {sorted(u for u in _SIZE_UNITS if u)} (e.g. '2GiB', '512MB')"
            )
        n = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ConfigError(f"{key}: expected a size in bytes or a string like '2GiB', got {type(value).__name__}")
    if n < 0:
        raise ConfigError(f"{key}: a size cannot be negative, got {value!r}")
    return n


def format_size(n: int | float) -> str:
    """Human-readable bytes, binary units."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


Placement = Literal["device", "host", "nvme", "auto"]
_PLACEMENTS = ("device", "host", "nvme", "auto")


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    device_budget: int | None = None
    """Bytes hetero may hold on the compute device; None: all the device has (the CPU's RAM share without CUDA)."""
    host_budget: int | None = None
    """Bytes of (pinned) host memory hetero may hold; None: a share of the machine's available RAM."""
    nvme_dir: str | None = None
    """Directory for swap files; required when anything is placed on NVMe. A private subdirectory is made in it."""
    nvme_budget: int | None = None
    """Bytes of swap hetero may write; None: the free space of nvme_dir's file system."""

    def __post_init__(self) -> None:
        for name in ("device_budget", "host_budget", "nvme_budget"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, parse_size(v, key=f"memory.{name}"))
        if self.nvme_dir is not None and not isinstance(self.nvme_dir, (str, os.PathLike)):
            raise ConfigError(f"memory.nvme_dir: expected a directory path, got {type(self.nvme_dir).__name__}")
        if self.nvme_dir is not None:
            object.__setattr__(self, "nvme_dir", os.fspath(self.nvme_dir))


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    params: Placement = "device"
    """Where parameter chunks live between uses ("nvme" needs zero_stage 3 in the engine)."""
    optimizer: Placement = "device"
    """Where optimizer states and fp32 master weights live."""

    def __post_init__(self) -> None:
        for name in ("params", "optimizer"):
            _check_choice(f"offload.{name}", getattr(self, name), _PLACEMENTS)


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
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
    """FQNs where a new stage begins (pipeline * virtual_stages - 1 of them), or "auto": balanced by parameters."""
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    """Pipeline schedule."""
    microbatches: int = 1
    """Micro-batches train_batch splits each batch into (gradient accumulation within the batch)."""
    virtual_stages: int | None = None
    """Model chunks per pipeline rank; only for "interleaved_1f1b" (default 2 there, 1 otherwise)."""

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "microbatches"):
            _check_int(f"parallel.{name}", getattr(self, name), minimum=1)
        self._check_modes()
        if isinstance(self.tensor_plan, str):
            if self.tensor_plan != "auto":
                raise ConfigError(f'parallel.tensor_plan: expected "auto" or a mapping, got {self.tensor_plan!r}')
        elif not isinstance(self.tensor_plan, Mapping):
            raise ConfigError(f'parallel.tensor_plan: expected a mapping or "auto", got {self.tensor_plan!r}')
        if isinstance(self.pipeline_split, str):
            if self.pipeline_split != "auto":
                raise ConfigError(
                    f'parallel.pipeline_split: expected "auto" or a list of FQNs, got {self.pipeline_split!r}'
                )
        else:
            if not all(isinstance(s, str) for s in self.pipeline_split):
                raise ConfigError(f"parallel.pipeline_split: expected a list of FQNs, got {self.pipeline_split!r}")
            object.__setattr__(self, "pipeline_split", tuple(self.pipeline_split))
        if self.schedule not in SCHEDULES:
            close = difflib.get_close_matches(str(self.schedule), SCHEDULES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"parallel.schedule: {self.schedule!r} is not a schedule{hint} Choose one of {', '.join(SCHEDULES)}"
            )
        interleaved = self.schedule == "interleaved_1f1b"
        if self.virtual_stages is None:
            object.__setattr__(self, "virtual_stages", 2 if interleaved else 1)
        _check_int("parallel.virtual_stages", self.virtual_stages, minimum=1)
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
        if self.sequence in ("ulysses", "ring") and self.pipeline > 1:
            raise ConfigError(
                f"parallel.sequence = {self.sequence!r} with pipeline > 1 is not supported; use 'megatron' with a "
                "pipeline, or no pipeline"
            )

    @property
    def split_sequence(self) -> bool:
        """Ulysses or ring: the `tensor` ranks split the sequence and hold whole layers."""
        return self.sequence in ("ulysses", "ring")

    @property
    def stages(self) -> int:
        """Model chunks in all: pipeline ranks x virtual stages per rank."""
        return self.pipeline * self.virtual_stages  # type: ignore[operator]


@dataclass(frozen=True, kw_only=True)
class Config:
    zero_stage: int = 0
    """0: data parallel; 1: shard optimizer states; 2: also gradients; 3: also parameters."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision; bf16/fp16 keep fp32 master weights. fp16 uses dynamic loss scaling."""
    grad_accumulation_steps: int = 1
    """Micro-batches per optimizer update; backward divides the loss by this."""
    grad_clip_norm: float | None = None
    """Clip the global gradient norm to this before the update; None: no clipping."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    chunk_size: int | Literal["auto"] = "auto"
    """Chunk capacity in elements, or "auto": the largest that the device and host budgets hold with room to spare
    (prefetched chunks included) and that keeps padding low."""
    tiling: bool = True
    """Split a weight larger than a chunk into tiles of whole rows, each a chunk, and compute its Linear, Embedding
    or Conv1D layer tile by tile (ZeRO-Infinity's memory-centric tiling); false: such a weight gets a chunk of its
    own, and its layer runs whole."""
    prefetch_depth: int = 2
    """How many chunks ahead of use to start moving along the recorded access trace."""
    activation_checkpointing: bool | list[str] = False
    """Recompute blocks in backward: true picks the children of the model's ModuleLists; or a list of module class
    names / qualified-name patterns (fnmatch, e.g. "layers.*")."""
    activation_offload: bool = False
    """Keep the checkpointed blocks' inputs in host memory between forward and backward (needs checkpointing)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor, pipeline and data parallelism (see ParallelConfig)."""
    comm_timeout: float = 600.0
    """Seconds a collective or transfer may wait for the other ranks; then the step fails with an error naming the
    operation and the ranks that did not arrive (dead, hung, or on another path) instead of hanging."""
    check_collectives: bool = True
    """Before each collective of the chunk protocol the ranks compare what they are about to run (a few bytes on a
    host-side group), so a rank that took another path fails at once with an error naming the module."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3) or isinstance(self.zero_stage, bool):
            raise ConfigError(f"zero_stage: must be one of 0, 1, 2, 3, got {self.zero_stage!r}")
        _check_choice("precision", self.precision, ("fp32", "bf16", "fp16"))
        _check_int("grad_accumulation_steps", self.grad_accumulation_steps, minimum=1)
        if self.grad_clip_norm is not None:
            if isinstance(self.grad_clip_norm, bool) or not isinstance(self.grad_clip_norm, (int, float)):
                raise ConfigError(f"grad_clip_norm: expected None or a positive number, got {self.grad_clip_norm!r}")
            if not self.grad_clip_norm > 0:
                raise ConfigError(f"grad_clip_norm: must be > 0 (or None to disable), got {self.grad_clip_norm!r}")
        if self.chunk_size != "auto":
            _check_int("chunk_size", self.chunk_size, minimum=1, hint='or "auto"')
        _check_int("prefetch_depth", self.prefetch_depth, minimum=0)
        _check_activation(self.activation_checkpointing, self.activation_offload)
        if isinstance(self.comm_timeout, bool) or not isinstance(self.comm_timeout, (int, float)):
            raise ConfigError(f"comm_timeout: expected a number of seconds, got {self.comm_timeout!r}")
        if not self.comm_timeout > 0:
            raise ConfigError(f"comm_timeout: must be > 0 seconds, got {self.comm_timeout!r}")
        if not isinstance(self.tiling, bool):
            raise ConfigError(f"tiling: expected true or false, got {self.tiling!r}")
        if not isinstance(self.check_collectives, bool):
            raise ConfigError(f"check_collectives: expected true or false, got {self.check_collectives!r}")
        if self.offload.params in ("host", "nvme") and self.zero_stage != 3:
            raise ConfigError(
                f"offload.params: {self.offload.params!r} needs zero_stage 3 (parameters are sharded and gathered "
                f"for use only at stage 3); got zero_stage {self.zero_stage}"
            )
        uses_nvme = "nvme" in (self.offload.params, self.offload.optimizer)
        if uses_nvme and self.memory.nvme_dir is None:
            raise ConfigError(
                "memory.nvme_dir: offload to 'nvme' needs a directory for swap files; "
                "set memory.nvme_dir to a path on a fast local disk"
            )

    @classmethod
    def from_any(cls, value: Config | Mapping[str, Any] | str | os.PathLike | None) -> Config:
        """A Config from a Config, a dict, or a path to a .json / .yaml file."""
        if value is None:
            return cls()
        if isinstance(value, Config):
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls.from_dict(_load_file(Path(value)))
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise ConfigError(f"config: expected a dict, a .json/.yaml path or hetero.Config, got {type(value).__name__}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Config:
        return _build(cls, d, prefix="")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Nested dataclass fields and their types; kept explicit because `from __future__ import annotations` makes
# field types strings.
_NESTED: dict[tuple[type, str], type] = {
    (Config, "offload"): OffloadConfig,
    (Config, "memory"): MemoryConfig,
    (Config, "parallel"): ParallelConfig,
}


def _build(cls: type, d: Mapping[str, Any], *, prefix: str) -> Any:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, got {type(d).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint} Valid keys here: {', '.join(names)}")
        sub = _NESTED.get((cls, key))
        if sub is not None and not isinstance(value, sub):
            value = _build(sub, value, prefix=f"{prefix}{key}.")
        kwargs[key] = value
    return cls(**kwargs)


def _check_choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: {value!r} is not valid; choose one of {', '.join(map(repr, choices))}")


def _check_activation(checkpointing: object, offload: object) -> None:
    ok = isinstance(checkpointing, bool) or (
        isinstance(checkpointing, (list, tuple)) and all(isinstance(x, str) and x for x in checkpointing)
    )
    if not ok:
        raise ConfigError(
            "activation_checkpointing: expected true/false or a list of module class names or name patterns "
            f"(e.g. ['Block'] or ['layers.*']), got {checkpointing!r}"
        )
    if not isinstance(offload, bool):
        raise ConfigError(f"activation_offload: expected true or false, got {offload!r}")
    if offload and not checkpointing:
        raise ConfigError(
            "activation_offload: offloads the inputs of checkpointed blocks; set activation_checkpointing too "
            "(true, or the blocks to checkpoint)"
        )


def _check_int(key: str, value: object, *, minimum: int, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = f" {hint}" if hint else ""
        raise ConfigError(f"{key}: expected an integer >= {minimum}{extra}, got {value!r}")


def _load_file(path: Path) -> Mapping[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid JSON: {e}") from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml  # optional: only needed for YAML configs
        except ImportError:
            raise ConfigError(f"config file {str(path)!r} is YAML; install PyYAML (pip install pyyaml)") from None
        return yaml.safe_load(text) or {}
    raise ConfigError(f"config file {str(path)!r}: expected a .json, .yaml or .yml file")
