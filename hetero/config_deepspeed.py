"""Coming from DeepSpeed: `hetero.Config.from_deepspeed(ds_config)`, and hints in config errors.

[Note: translating a DeepSpeed config]
DeepSpeed's JSON mixes what hetero configures (ZeRO stage, where optimizer states and parameters live, precision,
gradient accumulation and clipping, a metrics sink) with what a hetero user writes in Python (the optimizer and the
LR scheduler are torch objects given to `hetero.initialize`; batch sizes belong to the data loader) and with tuning
knobs hetero decides itself (bucket sizes, prefetch sizes, AIO queue depths: hetero sizes chunks, prefetches along
the recorded access trace and sizes its NVMe I/O by itself). `from_deepspeed` translates the first kind and names
every key of the other two with what to do instead, as a warning (or, with strict=True, as one ConfigError). A value
of "auto" (Hugging Face's DeepSpeed integration fills those from TrainingArguments) is left to hetero's default,
and HeteroTrainer fills the same fields from TrainingArguments.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetero.errors import ConfigError

log = logging.getLogger("hetero.config")

_DEVICES = {"cpu": "host", "nvme": "nvme", "none": "device", None: "device"}

# Keys hetero does not translate, and what to do instead.
_HANDLED_ELSEWHERE = {
    "optimizer": "build the torch optimizer yourself (e.g. torch.optim.AdamW(model.parameters(), lr=..., "
    "betas=..., eps=..., weight_decay=...)) and pass it to hetero.initialize",
    "scheduler": "build a torch LR scheduler on that optimizer and pass lr_scheduler= to hetero.initialize "
    "(WarmupLR / WarmupDecayLR: torch.optim.lr_scheduler.LambdaLR or transformers.get_scheduler)",
    "train_batch_size": "hetero does not load data: batch size x data-parallel size x accumulation is your loader's",
    "train_micro_batch_size_per_gpu": "hetero does not load data: feed micro-batches of this size per rank",
    "steps_per_print": "log engine.metrics() at the interval you want",
    "wall_clock_breakdown": "see engine.metrics()['update_seconds'] and hetero.profile",
    "activation_checkpointing": "set activation_checkpointing (true, or module names) and activation_offload",
    "aio": "hetero sizes its NVMe I/O itself (O_DIRECT, its own thread pool)",
    "flops_profiler": "use hetero.profile",
    "comms_logger": "not available",
    "zero_allow_untested_optimizer": "any elementwise torch optimizer is accepted",
    "zero_force_ds_cpu_optimizer": "hetero runs torch's own fused optimizer kernels on the host",
    "communication_data_type": "gradients are reduced in fp32",
    "prescale_gradients": "gradients are averaged over ranks in fp32",
    "gradient_predivide_factor": "gradients are averaged over ranks in fp32",
    "amp": "use precision 'bf16' or 'fp16'",
    "data_types": "gradients are accumulated in fp32",
}
_ZERO_TUNING = {
    "overlap_comm": "hetero overlaps gradient reduce-scatters with backward by itself",
    "contiguous_gradients": "gradients are contiguous in chunks already",
    "reduce_bucket_size": "the chunk is the bucket: chunk_size",
    "allgather_bucket_size": "the chunk is the bucket: chunk_size",
    "reduce_scatter": "stages 2-3 reduce-scatter per chunk",
    "allgather_partitions": "stages 1-2 all-gather per chunk",
    "round_robin_gradients": "not needed: shards are equal by construction",
    "sub_group_size": "the optimizer steps chunk by chunk already",
    "stage3_prefetch_bucket_size": "prefetch_depth (in chunks, along the recorded access trace)",
    "stage3_param_persistence_threshold": "not needed: small parameters share chunks",
    "stage3_max_live_parameters": "memory.device_budget bounds what stays gathered",
    "stage3_max_reuse_distance": "memory.device_budget and the access trace decide what stays gathered",
    "stage3_gather_16bit_weights_on_model_save": "engine.full_state_dict() or python -m hetero.checkpoint consolidate",
    "stage3_gather_fp16_weights_on_model_save": "engine.full_state_dict() or python -m hetero.checkpoint consolidate",
    "elastic_checkpoint": "hetero checkpoints load into any data-parallel size",
    "ignore_unused_parameters": "unused parameters are handled (they keep their state)",
    "load_from_fp32_weights": "hetero checkpoints hold the fp32 master weights",
    "memory_efficient_linear": "not needed",
    "cpu_offload": "offload.optimizer = 'host'",
    "cpu_offload_params": "offload.params = 'host'",
    "zero_hpz_partition_size": "not available",
    "zero_quantized_weights": "not available",
    "zero_quantized_gradients": "not available",
    "mics_shard_size": "not available",
    "aio": "hetero sizes its NVMe I/O itself (O_DIRECT, its own thread pool)",
}
_DS_MAX_IN_CPU = 10**9  # DeepSpeed's default offload_param.max_in_cpu, in parameter elements
_OFFLOAD_TUNING = ("pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "fast_init", "pipeline_read",
                   "pipeline_write", "ratio")  # fmt: skip
_FP16_TUNING = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
                "consecutive_hysteresis", "auto_cast", "fp16_master_weights_and_grads")  # fmt: skip


def from_deepspeed(ds_config: Mapping[str, Any] | str | os.PathLike, *, strict: bool = False) -> dict[str, Any]:
    """The hetero config dict equivalent to a DeepSpeed config (a dict or a .json path); see the note above."""
    if isinstance(ds_config, (str, os.PathLike)):
        path = Path(ds_config)
        if not path.is_file():
            raise ConfigError(f"DeepSpeed config {str(path)!r} does not exist")
        try:
            ds_config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"DeepSpeed config {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(ds_config, Mapping):
        raise ConfigError(f"from_deepspeed: expected a dict or a .json path, got {type(ds_config).__name__}")
    out: dict[str, Any] = {}
    notes: list[str] = []  # "key: what to do instead"
    for key, value in ds_config.items():
        if key == "zero_optimization":
            _zero(value, out, notes)
        elif key in ("fp16", "bf16", "bfloat16"):
            _precision(key, value, out, notes)
        elif key == "gradient_accumulation_steps":
            if value != "auto":
                out["grad_accumulation_steps"] = value
        elif key == "gradient_clipping":
            if value != "auto" and value:
                out["grad_clip_norm"] = float(value)
        elif key == "tensorboard":
            if _enabled(value):
                out.setdefault("log", {})["tensorboard"] = os.path.join(
                    value.get("output_path", "runs"), value.get("job_name", "")
                ).rstrip(os.sep)
        elif key == "wandb":
            if _enabled(value):
                out.setdefault("log", {})["wandb"] = value.get("project", "deepspeed")
        elif key in _HANDLED_ELSEWHERE:
            notes.append(f"{key}: {_HANDLED_ELSEWHERE[key]}")
        else:
            notes.append(f"{key}: no hetero equivalent")
    if "precision" in out and isinstance(out["precision"], list):
        raise ConfigError("DeepSpeed config enables both fp16 and bf16: enable one")
    if "params_host_bytes" in out.get("offload", {}):  # DeepSpeed counts 16-bit elements (fp32 without fp16/bf16)
        itemsize = 2 if out.get("precision") in ("fp16", "bf16") else 4
        out["offload"]["params_host_bytes"] *= itemsize
    if notes:
        text = "; ".join(notes)
        if strict:
            raise ConfigError(f"from_deepspeed: these DeepSpeed settings were not translated: {text}")
        log.warning("from_deepspeed: not translated (what to do instead): %s", text)
    return out


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def _precision(key: str, value: Any, out: dict[str, Any], notes: list[str]) -> None:
    if not _enabled(value) or value.get("enabled") == "auto":
        return
    name = "fp16" if key == "fp16" else "bf16"
    if out.get("precision") not in (None, name):
        out["precision"] = [out["precision"], name]  # both: reported by the caller
        return
    out["precision"] = name
    extra = [k for k in value if k != "enabled"]
    if extra:
        notes.append(
            f"{key}.{'/'.join(extra)}: hetero's fp16 loss scale is dynamic (starts at 2**16, halves on overflow, "
            "doubles after 2000 clean steps)"
        )


def _zero(zero: Any, out: dict[str, Any], notes: list[str]) -> None:
    if isinstance(zero, bool):
        # DeepSpeed's older form, still in its getting-started ds_config.json: true is stage 1, false stage 0.
        out["zero_stage"] = 1 if zero else 0
        return
    if not isinstance(zero, Mapping):
        raise ConfigError(
            f"zero_optimization: expected a mapping ({{'stage': 0-3, ...}}) or true/false, got {type(zero).__name__}"
        )
    for key, value in zero.items():
        if key == "stage":
            out["zero_stage"] = value
        elif key in ("offload_optimizer", "offload_param"):
            if not isinstance(value, Mapping):
                continue
            device = value.get("device")
            if device not in _DEVICES:
                raise ConfigError(
                    f"zero_optimization.{key}.device: {device!r} is not a DeepSpeed offload device (cpu, nvme, none)"
                )
            target = "optimizer" if key == "offload_optimizer" else "params"
            out.setdefault("offload", {})[target] = _DEVICES[device]
            if device == "nvme":
                nvme = value.get("nvme_path")
                if nvme is None:
                    raise ConfigError(f"zero_optimization.{key}: device 'nvme' needs nvme_path")
                have = out.setdefault("memory", {}).get("nvme_dir")
                if have is not None and have != nvme:
                    notes.append(f"zero_optimization.{key}.nvme_path: hetero uses one nvme_dir ({have!r}) for both")
                else:
                    out["memory"]["nvme_dir"] = nvme
            translated = ()
            if key == "offload_param" and device == "nvme":
                # DeepSpeed keeps up to max_in_cpu parameter elements (1e9 unless set) on the host: so does hetero,
                # in bytes once the precision is known ([Note: parameter shards kept on the host]).
                elements = value.get("max_in_cpu", _DS_MAX_IN_CPU)
                if isinstance(elements, bool) or not isinstance(elements, (int, float)) or elements < 0:
                    raise ConfigError(
                        f"zero_optimization.offload_param.max_in_cpu: expected a number of parameter elements "
                        f"(>= 0), got {elements!r}"
                    )
                out["offload"]["params_host_bytes"] = int(elements)  # elements here: scaled in from_deepspeed
                translated = ("max_in_cpu",)
            tuning = [k for k in value if k in _OFFLOAD_TUNING and k not in translated]
            if tuning:
                notes.append(f"zero_optimization.{key}.{'/'.join(tuning)}: hetero pins, buffers and pipelines itself")
        elif key in _ZERO_TUNING:
            notes.append(f"zero_optimization.{key}: {_ZERO_TUNING[key]}")
        else:
            notes.append(f"zero_optimization.{key}: no hetero equivalent")


# ---- hints for config errors ---------------------------------------------------------------------------------
_KEY_HINTS = {
    "zero_optimization": "hetero's keys are zero_stage, offload and memory",
    "fp16": "hetero's key is precision: 'fp16'",
    "bf16": "hetero's key is precision: 'bf16'",
    "bfloat16": "hetero's key is precision: 'bf16'",
    "gradient_accumulation_steps": "hetero's key is grad_accumulation_steps",
    "gradient_clipping": "hetero's key is grad_clip_norm",
    "offload_optimizer": "hetero's key is offload.optimizer ('host' or 'nvme'), with memory.nvme_dir",
    "offload_param": "hetero's key is offload.params ('host' or 'nvme'), with memory.nvme_dir",
    "stage": "hetero's key is zero_stage",
    "nvme_path": "hetero's key is memory.nvme_dir",
    "device": "hetero's keys are offload.params and offload.optimizer",
    "tensorboard": "hetero's key is log.tensorboard (a directory)",
    "wandb": "hetero's key is log.wandb (a project name)",
}
_VALUE_HINTS = {"cpu": "host", "none": "device"}


def key_hint(key: str) -> str:
    """A hint for an unknown config key that is DeepSpeed's ("" if it is not)."""
    if key in _KEY_HINTS or key in _HANDLED_ELSEWHERE or key in _ZERO_TUNING:
        what = _KEY_HINTS.get(key) or _HANDLED_ELSEWHERE.get(key) or _ZERO_TUNING[key]
        return (
            f"; '{key}' is a DeepSpeed key: {what}. To translate a whole DeepSpeed config, use "
            "hetero.Config.from_deepspeed(ds_config)."
        )
    return ""


def value_hint(value: object) -> str:
    """A hint for an invalid placement that is DeepSpeed's name for one ("" if it is not)."""
    if isinstance(value, str) and value.lower() in _VALUE_HINTS:
        return f" ({value!r} is DeepSpeed's name: hetero calls it {_VALUE_HINTS[value.lower()]!r})"
    return ""
