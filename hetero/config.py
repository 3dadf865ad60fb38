"""Typed configuration, validated once at the edge.

A user hands `hetero.initialize` a dict, a path to a .json/.yaml file, or a `Config`. Everything is turned into
keyword-only frozen dataclasses here; nothing downstream reads raw dicts. Unknown keys are errors that name the key
and the closest valid one; sizes accept ints of bytes or strings such as "2GiB", "512MB", "1.5e9".
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hetero.config_deepspeed import key_hint, translate_deepspeed

# Re-exported: users and the rest of hetero import every config name from hetero.config.
from hetero.config_parallel import TENSOR_MODES as TENSOR_MODES
from hetero.config_parallel import ParallelConfig as ParallelConfig
from hetero.config_parallel import grid_shape as grid_shape
from hetero.config_values import check_choice, check_chunk_size, check_int, check_zero_stage, not_a_mapping
from hetero.config_values import format_size as format_size
from hetero.config_values import parse_size as parse_size
from hetero.errors import ConfigError

_PLACEMENTS = ("device", "host", "nvme", "auto")
_DEFAULT_WARMUP = 40  # delayed_param_update_warmup: the ZeRO-Offload paper's 40 exact iterations
Placement = Literal["device", "host", "nvme", "auto"]


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
    nvme_io_threads: int | None = None
    """NVMe requests in flight, one I/O thread each; None: 8. DeepSpeed's aio queue_depth x intra_op_parallelism."""
    nvme_block_bytes: int | None = None
    """Bytes of each NVMe request, a multiple of 4096 (O_DIRECT's alignment); None: 8 MiB. DeepSpeed's block_size."""

    def __post_init__(self) -> None:
        for name in ("device_budget", "host_budget", "nvme_budget", "nvme_block_bytes"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, parse_size(v, key=f"memory.{name}"))
        for name, least in (("nvme_io_threads", 1), ("nvme_block_bytes", 4096)):
            if (v := getattr(self, name)) is not None and (check_int(f"memory.{name}", v, minimum=least) or v % least):
                raise ConfigError(f"memory.{name}: expected a multiple of {least} (O_DIRECT's alignment), got {v}")
        if self.nvme_dir is not None and not isinstance(self.nvme_dir, (str, os.PathLike)):
            raise ConfigError(f"memory.nvme_dir: expected a directory path, got {type(self.nvme_dir).__name__}")
        if self.nvme_dir is not None:
            # "~/swap" as a shell would read it (DeepSpeed's nvme_path too): else "folder does not exist"
            object.__setattr__(self, "nvme_dir", os.path.expanduser(os.fspath(self.nvme_dir)))


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    params: Placement = "device"
    """Where parameter chunks live between uses ("nvme" needs zero_stage 3 in the engine)."""
    optimizer: Placement = "device"
    """Where optimizer states and fp32 master weights live."""
    params_host_bytes: int = 0
    """With params on "nvme": bytes of each rank's parameter shards that live on the host instead, never written to
    NVMe (in layout order, the order forward gathers them, each chunk whose shard still fits). DeepSpeed's
    offload_param.max_in_cpu, in bytes; 0: every shard on NVMe. [Note: parameter shards kept on the host] in
    hetero/zero/stages.py."""
    params_host_elements: int | None = None
    """The same in parameter elements, as DeepSpeed counts max_in_cpu: where set, params_host_bytes is this many
    elements of the parameters' precision, derived again whenever the precision changes (HeteroTrainer takes it
    from the TrainingArguments after the translation)."""

    def __post_init__(self) -> None:
        for name in ("params", "optimizer"):
            check_choice(f"offload.{name}", getattr(self, name), _PLACEMENTS)
        n = parse_size(self.params_host_bytes, key="offload.params_host_bytes")
        object.__setattr__(self, "params_host_bytes", n)
        if self.params_host_elements is not None:
            check_int("offload.params_host_elements", self.params_host_elements, minimum=0)
            n = n or self.params_host_elements
        if n and self.params != "nvme":
            raise ConfigError(
                f"offload.params_host_bytes: keeps part of the parameter shards on the host when offload.params is "
                f"'nvme'; offload.params is {self.params!r}. Set offload.params to 'nvme', or leave "
                "params_host_bytes at 0"
            )


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Where `engine.metrics()` also goes after every `every`-th update (rank 0 only); see hetero/metrics.py."""

    tensorboard: str | None = None
    """A directory for torch.utils.tensorboard event files (needs the tensorboard package)."""
    wandb: str | None = None
    """A Weights & Biases project name (needs the wandb package); an active wandb run is used as it is."""
    every: int = 1
    """Updates between two writes."""

    def __post_init__(self) -> None:
        for name in ("tensorboard", "wandb"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise ConfigError(f"log.{name}: expected a string, got {type(v).__name__}")
            if v is not None:
                object.__setattr__(self, name, os.fspath(v))
        check_int("log.every", self.every, minimum=1)


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """fp16's loss scale, read only with precision "fp16": dynamic by default, or static ([Note: the fp16 loss scale]
    in hetero/zero/precision.py). `Config.from_deepspeed` translates DeepSpeed's fp16 settings into it exactly."""

    initial_scale: float = 2.0**16
    """The scale the first steps' loss is multiplied by (DeepSpeed's 2**initial_scale_power)."""
    growth_interval: int = 2000
    """The scale doubles after this many overflow-free steps since the last overflow, and again every as many."""
    hysteresis: int = 1
    """Overflows it takes to halve the scale: 1 halves at every one; 2 (DeepSpeed's default) lets one pass (its step
    is skipped all the same). The count refills when the scale grows."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis count at every overflow-free step, so that only overflows in a row add up."""
    min_scale: float = 1.0
    """The scale never halves below this."""
    deepspeed_window: bool = False
    """Count growth_interval as DeepSpeed's loss_scale_window: the scale doubles at the step after growth_interval
    overflow-free ones, one step later than torch.amp.GradScaler and hetero by default (then every growth_interval)."""
    static: float | None = None
    """A fixed scale instead of the dynamic one (DeepSpeed's loss_scale > 0): it never changes, and a step whose
    gradients overflow is still skipped, as DeepSpeed skips it. None: dynamic."""

    def __post_init__(self) -> None:
        for name in ("initial_scale", "min_scale"):
            object.__setattr__(self, name, _positive(f"loss_scale.{name}", getattr(self, name)))
        check_int("loss_scale.growth_interval", self.growth_interval, minimum=1, hint="(overflow-free steps)")
        check_int("loss_scale.hysteresis", self.hysteresis, minimum=1, hint="(1 halves at every overflow)")
        for name in ("consecutive_hysteresis", "deepspeed_window"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"loss_scale.{name}: expected true or false, got {getattr(self, name)!r}")
        if self.min_scale > self.initial_scale:
            raise ConfigError(
                f"loss_scale.min_scale: {self.min_scale!r} is above initial_scale {self.initial_scale!r}; the scale "
                "starts at initial_scale and never halves below min_scale: give min_scale <= initial_scale"
            )
        if self.static is None:
            return
        object.__setattr__(self, "static", _positive("loss_scale.static", self.static, hint=" (or None: dynamic)"))
        dynamic = [
            f.name for f in dataclasses.fields(self) if f.name != "static" and getattr(self, f.name) != f.default
        ]
        if dynamic:
            raise ConfigError(
                f"loss_scale.{'/'.join(dynamic)}: a static scale never changes, so these dynamic settings have no "
                "effect; remove them, or set static to None for a dynamic scale"
            )


@dataclass(frozen=True, kw_only=True)
class Config:
    zero_stage: int = 0
    """0: data parallel; 1: shard optimizer states; 2: also gradients; 3: also parameters."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision; bf16/fp16 keep fp32 master weights. fp16 scales the loss (loss_scale: dynamic by default)."""
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
    own, and its layer runs whole. With chunk_size "auto", only weights larger than the largest chunk the budgets
    hold are split ([Note: tiling only what the budgets need])."""
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
    checkpoint_patience: float | None = None
    """Seconds a rank that finished writing (or reading) its part of a checkpoint waits, at most, for ranks still at
    theirs; None: as long as their heartbeats advance, however long ([Note: patient meetings]). A rank blocked for
    good in a system call (an NFS server that never answers) looks alive: this bounds the wait for it, and then every
    rank raises RankTimeoutError naming it, nothing committed."""
    check_collectives: bool = True
    """Before each collective of the chunk protocol the ranks compare what they are about to run (posted beside it on a
    host-side group: 0.2-0.8 ms a check on two loaded gloo CPU ranks), so a rank on another path raises
    CollectiveMismatchError naming the module. Off, ranks on other paths issue other collectives: gloo ends the
    process natively (SIGABRT) where their sizes differ, else data mixes silently; NCCL hangs or mixes data."""
    gather_ahead: bool = True
    """Stage 3: as a unit (a block) starts, issue the gathers of the next one (forward: the next in module order;
    backward: the one before), so they overlap this unit's compute; where every rank's device budget holds one more
    unit gathered ([Note: gathering ahead] in hetero/zero/gathers.py)."""
    delayed_param_update: bool = False
    """ZeRO-Offload's delayed parameter update: the host/NVMe optimizer step of update t runs while the forward and
    backward of the next micro-batch run, which therefore use the parameters of update t-1 (one step stale; see
    [Note: the delayed parameter update]), after delayed_param_update_warmup exact updates. Needs offload.optimizer
    "host" or "nvme"."""
    delayed_param_update_warmup: int = _DEFAULT_WARMUP
    """With delayed_param_update: how many updates are exact before the delay starts. Early training moves the
    weights fast, and a gradient taken one update stale hurts most there; the ZeRO-Offload paper delays only after
    the first 40 iterations, hence the default ([Note: warming up before delaying]). 0 delays from the first update."""
    delayed_param_update_prediction: bool = False
    """With delayed_param_update: run each forward and backward on a prediction of the weights the pending update
    is about to give (its momentum and the fresh gradient, one step of Adam or SGD with a per-tensor scale) instead of
    the weights one update old. The delay takes Adam out of its stability range at learning rates where the exact
    update is stable; the prediction brings the loss back to the exact update's ([Note: predicting past the delay]
    in hetero/zero/predict.py). Costs: the master weights kept apart from the parameters (with states on NVMe, 4
    more bytes a parameter each way), an axpy over the shard at each update's boundary."""
    update_in_backward: bool = False
    """Step each chunk's optimizer during the backward before an update, as soon as its reduced gradient is final,
    instead of after backward (PyTorch's optimizer-in-backward). The same arithmetic as the update after backward;
    with states on the host or NVMe their I/O then overlaps backward, and gradients are consumed as they are made
    (never written to NVMe). Exact only where no update needs the whole gradient first: not with grad_clip_norm,
    fp16 loss scaling or delayed_param_update. The hyperparameters (lr, ...) are read when that backward starts, not
    at engine.step(), and the parameters hold their new values once backward returns ([Note: the update in
    backward])."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """With precision "fp16": the loss scale, dynamic (hetero's defaults, or DeepSpeed's hysteresis and window) or
    static (see LossScaleConfig)."""
    log: LogConfig = field(default_factory=LogConfig)
    """An optional metrics sink: tensorboard directory, wandb project (see LogConfig)."""
    progress: bool = True
    """Progress bars for long work (initialisation, weight streaming, checkpoints) on a terminal, rank 0 only; the
    environment variable HETERO_PROGRESS=0 turns them off too (hetero/progress.py)."""

    def __post_init__(self) -> None:
        check_zero_stage(self.zero_stage)
        check_choice("precision", self.precision, ("fp32", "bf16", "fp16"))
        if self.offload.params_host_elements is not None:  # DeepSpeed's count: elements of the parameters' dtype
            nbytes = self.offload.params_host_elements * (4 if self.precision == "fp32" else 2)
            object.__setattr__(self, "offload", dataclasses.replace(self.offload, params_host_bytes=nbytes))
        check_int("grad_accumulation_steps", self.grad_accumulation_steps, minimum=1)
        if self.grad_clip_norm is not None:
            if isinstance(self.grad_clip_norm, bool) or not isinstance(self.grad_clip_norm, (int, float)):
                raise ConfigError(f"grad_clip_norm: expected None or a positive number, got {self.grad_clip_norm!r}")
            if not self.grad_clip_norm > 0:
                raise ConfigError(f"grad_clip_norm: must be > 0 (or None to disable), got {self.grad_clip_norm!r}")
        check_chunk_size(self.chunk_size)
        check_int("prefetch_depth", self.prefetch_depth, minimum=0)
        _check_activation(self.activation_checkpointing, self.activation_offload)
        if isinstance(self.comm_timeout, bool) or not isinstance(self.comm_timeout, (int, float)):
            raise ConfigError(f"comm_timeout: expected a number of seconds, got {self.comm_timeout!r}")
        if not 0 < self.comm_timeout < math.inf:  # inf: an OverflowError from torch.distributed's join, nan: no bound
            raise ConfigError(
                f"comm_timeout: must be a finite number of seconds > 0, got {self.comm_timeout!r}; for a long bound "
                "give a long one (86400: a day)"
            )
        if self.checkpoint_patience is not None and (
            isinstance(self.checkpoint_patience, bool)
            or not isinstance(self.checkpoint_patience, (int, float))
            or not self.checkpoint_patience > 0
        ):
            raise ConfigError(
                f"checkpoint_patience: expected None (wait while the ranks are alive) or a positive number of seconds, "
                f"got {self.checkpoint_patience!r}"
            )
        if not isinstance(self.tiling, bool):
            raise ConfigError(f"tiling: expected true or false, got {self.tiling!r}")
        if not isinstance(self.check_collectives, bool):
            raise ConfigError(f"check_collectives: expected true or false, got {self.check_collectives!r}")
        if not isinstance(self.gather_ahead, bool):
            raise ConfigError(f"gather_ahead: expected true or false, got {self.gather_ahead!r}")
        if not isinstance(self.delayed_param_update, bool):
            raise ConfigError(f"delayed_param_update: expected true or false, got {self.delayed_param_update!r}")
        if self.delayed_param_update and self.offload.optimizer not in ("host", "nvme"):
            raise ConfigError(
                "delayed_param_update: overlaps the optimizer step on the host with the device's next forward and "
                f"backward, so it needs offload.optimizer 'host' or 'nvme' (got {self.offload.optimizer!r}); set "
                "offload.optimizer, or leave delayed_param_update false"
            )
        check_int(
            "delayed_param_update_warmup",
            self.delayed_param_update_warmup,
            minimum=0,
            hint="(exact updates before the delay starts; 0 delays from the first)",
        )
        if not self.delayed_param_update and self.delayed_param_update_warmup != _DEFAULT_WARMUP:
            raise ConfigError(
                f"delayed_param_update_warmup: {self.delayed_param_update_warmup!r} has no effect unless "
                "delayed_param_update is true; set delayed_param_update true, or remove delayed_param_update_warmup"
            )
        if not isinstance(self.delayed_param_update_prediction, bool):
            raise ConfigError(
                f"delayed_param_update_prediction: expected true or false, got {self.delayed_param_update_prediction!r}"
            )
        if self.delayed_param_update_prediction and not self.delayed_param_update:
            raise ConfigError(
                "delayed_param_update_prediction: has no effect unless delayed_param_update is true; set "
                "delayed_param_update true, or remove delayed_param_update_prediction"
            )
        if not isinstance(self.update_in_backward, bool):
            raise ConfigError(f"update_in_backward: expected true or false, got {self.update_in_backward!r}")
        if self.update_in_backward:
            needs_all = [
                what
                for what, on in (
                    (f"grad_clip_norm {self.grad_clip_norm!r}", self.grad_clip_norm is not None),
                    ("precision 'fp16' (its overflow check)", self.precision == "fp16"),
                    ("delayed_param_update", self.delayed_param_update),
                )
                if on
            ]
            # Checked here, before the model is cut and its chunks allocated, rather than once the mesh exists.
            if self.parallel.pipeline > 1 or (self.parallel.tensor > 1 and not self.parallel.split_sequence):
                needs_all.append(f"parallel.tensor {self.parallel.tensor} / pipeline {self.parallel.pipeline} (the "
                                 "gradient norm is summed over their ranks first; set both to 1)")  # fmt: skip
            if needs_all:
                raise ConfigError(
                    "update_in_backward: steps each chunk as soon as its gradient is final, but "
                    f"{' and '.join(needs_all)} {('needs', 'need')[len(needs_all) > 1]} the whole gradient before "
                    f"any chunk steps; turn {('it', 'them')[len(needs_all) > 1]} off, or leave update_in_backward false"
                )
        if self.offload.params in ("host", "nvme") and self.zero_stage != 3:
            raise ConfigError(
                f"offload.params: {self.offload.params!r} needs zero_stage 3 (parameters are sharded and gathered "
                f"for use only at stage 3); got zero_stage {self.zero_stage}"
            )
        if not isinstance(self.progress, bool):
            raise ConfigError(f"progress: expected true or false, got {self.progress!r}")
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

    @classmethod
    def from_deepspeed(cls, ds_config: Mapping[str, Any] | str | os.PathLike, *, strict: bool = False) -> Config:
        """Translate a DeepSpeed config (a dict or a .json path): ZeRO stage, offload devices and nvme_path,
        fp16/bf16 and fp16's loss scale, gradient accumulation and clipping, tensorboard/wandb. What has no
        translation (the optimizer, the scheduler, batch sizes, tuning knobs) is named in a warning with what to do
        instead; strict=True makes that a ConfigError. See [Note: translating a DeepSpeed config] in
        hetero/config_deepspeed.py."""
        translated, origin = translate_deepspeed(ds_config, strict=strict)
        return origin.attach(cls.from_dict(translated))  # [Note: a config's DeepSpeed origin]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Nested dataclass fields and their types; kept explicit because `from __future__ import annotations` makes
# field types strings.
_NESTED: dict[tuple[type, str], type] = {
    (Config, "offload"): OffloadConfig,
    (Config, "memory"): MemoryConfig,
    (Config, "parallel"): ParallelConfig,
    (Config, "log"): LogConfig,
    (Config, "loss_scale"): LossScaleConfig,
}


def _build(cls: type, d: Mapping[str, Any], *, prefix: str) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(d, Mapping):
        raise not_a_mapping(prefix.rstrip(".") or "config", d, names)
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else "."
            raise ConfigError(
                f"unknown config key '{prefix}{key}'{hint}{key_hint(str(key))} Valid keys here: {', '.join(names)}"
            )
        sub = _NESTED.get((cls, key))
        if sub is not None and not isinstance(value, sub):
            value = _build(sub, value, prefix=f"{prefix}{key}.")
        kwargs[key] = value
    return cls(**kwargs)


def _positive(key: str, value: object, *, hint: str = "") -> float:
    """A positive, finite number as a float (a loss scale)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{key}: expected a positive number{hint}, got {value!r}")
    return float(value)


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
