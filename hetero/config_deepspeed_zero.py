"""DeepSpeed's zero_optimization section, read as DeepSpeed 0.19.8 reads it (for `hetero.config_deepspeed`).

[Note: DeepSpeed's ZeRO section as its own model reads it]
DeepSpeed reads zero_optimization through pydantic models (DeepSpeedZeroConfig and its two offload models) that
forbid unknown keys, take the stage3_ keys under their short names too, drop every "auto" value (Hugging Face's) for
the field's default, and read numbers leniently: a stage of "3", " 3.0 ", 3.0 or true (1) is a stage, 3.5 or "three"
is refused. They also still translate the deprecated cpu_offload / cpu_offload_param (true: that offload section
with device "cpu", refused beside the section itself). hetero read only a few of these: "stage": "3" was refused
by hetero's own check, cpu_offload was named with a hint but not translated, keys DeepSpeed forbids (typos such as
cpu_offload_params) were a warning at most, and offload keys it did not know were dropped without a word. This
module reads the section with the same rules, refuses what DeepSpeed refuses with the closest key it accepts, and
names each accepted key hetero does not translate. offload_param.max_in_cpu counts parameter elements: it becomes
offload.params_host_elements, which the Config turns into bytes of the precision the parameters end up with (fixing
the bytes here took fp32's 4 where fp16/bf16 was "auto" and HeteroTrainer then chose 2-byte parameters). Every other
offload setting is checked as those models check it (integers >= 0, booleans, fractions from 0 to 1; they were not
checked at all) and named with what hetero does instead only where hetero does otherwise: pin_memory true, ratio 1,
pipelined NVMe states are what hetero does, and a warning about them said nothing a user could act on.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

from hetero.errors import ConfigError

_DEVICES = {"cpu": "host", "nvme": "nvme", "none": "device"}
DS_MAX_IN_CPU = 10**9  # DeepSpeed's default offload_param.max_in_cpu, in parameter elements

# What DeepSpeed's zero_optimization accepts and hetero does not translate, and what to do instead (the stage3_ keys'
# short names are looked up under their stage3_ name).
ZERO_TUNING = {
    "overlap_comm": "hetero overlaps gradient reduce-scatters with backward by itself",
    "contiguous_gradients": "gradients are contiguous in chunks already",
    "reduce_bucket_size": "the chunk is the bucket: chunk_size",
    "allgather_bucket_size": "the chunk is the bucket: chunk_size",
    "reduce_scatter": "stages 2-3 reduce-scatter per chunk",
    "allgather_partitions": "stages 1-2 all-gather per chunk",
    "use_multi_rank_bucket_allreduce": "stages 2-3 reduce-scatter per chunk",
    "round_robin_gradients": "not needed: shards are equal by construction",
    "sub_group_size": "the optimizer steps chunk by chunk already",
    "compute_grad_norm": "hetero computes the gradient norm at every update (engine.get_global_grad_norm())",
    "stage3_prefetch_bucket_size": "prefetch_depth (in chunks, along the recorded access trace)",
    "stage3_param_persistence_threshold": "not needed: small parameters share chunks",
    "stage3_model_persistence_threshold": "not needed: small parameters share chunks",
    "stage3_max_live_parameters": "memory.device_budget bounds what stays gathered",
    "stage3_max_reuse_distance": "memory.device_budget and the access trace decide what stays gathered",
    "stage3_module_granularity_threshold": "gather_ahead gathers a block's chunks as a unit",
    "stage3_use_all_reduce_for_fetch_params": "stage 3 all-gathers per chunk",
    "stage3_allgather_sequential": "stage 3 all-gathers per chunk",
    "stage3_gather_16bit_weights_on_model_save": "engine.full_state_dict() or python -m hetero.checkpoint consolidate",
    "stage3_gather_fp16_weights_on_model_save": "engine.full_state_dict() or python -m hetero.checkpoint consolidate",
    "elastic_checkpoint": "hetero checkpoints load into any data-parallel size",
    "ignore_unused_parameters": "unused parameters are handled (they keep their state)",
    "load_from_fp32_weights": "hetero checkpoints hold the fp32 master weights",
    "pipeline_loading_checkpoint": "hetero checkpoints load into any layout",
    "memory_efficient_linear": "not needed",
    "override_module_apply": "not needed: hetero gathers what module.apply touches",
    "legacy_stage1": "not available",
    "parameter_alignment": "not needed: chunks align their parameters",
    "cpu_offload_use_pin_memory": "deprecated, and DeepSpeed reads nothing from it: hetero pins host memory itself",
    "zero_hpz_partition_size": "not available (hetero shards over the whole data-parallel group)",
    "zero_quantized_weights": "not available (hetero gathers parameters unquantized)",
    "zero_quantized_nontrainable_weights": "not available (hetero keeps frozen parameters unquantized)",
    "zero_quantized_gradients": "not available (hetero reduces gradients unquantized, in fp32)",
    "zenflow": "not available: hetero updates every parameter at every update",
    "leaf_module": "not needed: hetero gathers per chunk, not per module",
    "save_muon_momentum_buffer_in_memory": "the optimizer's states live where offload.optimizer puts them",
    "log_trace_cache_warnings": "not available",
    "enable_sanity_checks": "not available",
}
_ALIASED = ("prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
            "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
            "use_all_reduce_for_fetch_params", "allgather_sequential")  # fmt: skip
# Every key DeepSpeed 0.19.8's DeepSpeedZeroConfig accepts; it refuses any other.
ZERO_KEYS = frozenset(ZERO_TUNING) | {"stage", "offload_param", "offload_optimizer", "cpu_offload", "cpu_offload_param",
                                     *_ALIASED}  # fmt: skip
# The offload sections' keys (DeepSpeedZeroOffloadParamConfig, ...OptimizerConfig) past device and nvme_path.
_OFFLOAD_KEYS = {
    "offload_param": {"buffer_count", "buffer_size", "max_in_cpu", "pin_memory"},
    "offload_optimizer": {"buffer_count", "pin_memory", "pipeline_read", "pipeline_write", "fast_init", "ratio",
                          "super_offload", "cpuadam_cores_perc"},
}  # fmt: skip
# Their types and ranges as DeepSpeed's pydantic models check them (ge=0 ints, bools, floats in [0, 1]).
_OFFLOAD_INTS = ("buffer_count", "buffer_size", "max_in_cpu")
_OFFLOAD_FLOATS = ("ratio", "cpuadam_cores_perc")
# What hetero does instead of each, said where it does something else than the value asks (None: nothing to say).
_POOL = "it has no swap-buffer pool to size, so bound that tier with memory.host_budget instead"
_OFFLOAD_NOTES = {
    ("offload_param", "buffer_count"): "hetero reads parameter chunks from NVMe into its host tier, prefetch_depth "
    f"chunks ahead along the recorded access trace: {_POOL}",
    ("offload_param", "buffer_size"): "hetero reads parameter chunks from NVMe into its host tier, whole chunks at a "
    f"time (chunk_size): {_POOL}",
    ("offload_optimizer", "buffer_count"): "hetero streams the optimizer-state chunks from NVMe through its host tier "
    f"as the update reaches them: {_POOL}",
}
_DEPRECATED = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def _offload_note(key: str, k: str, v: Any, value: Mapping[str, Any]) -> str | None:
    """What hetero does instead of offload section `key`'s setting `k`=`v` (checked), or None where it does that."""
    if (key, k) in _OFFLOAD_NOTES:
        return _OFFLOAD_NOTES[key, k]
    nvme = value.get("device") == "nvme"
    if k == "pin_memory" and not v:
        return (
            "hetero pins its host buffers whenever CUDA is present (pageable ones would make every copy between "
            "host and device wait); to bound the pinned memory under a tight memlock limit (ulimit -l), set "
            "memory.host_budget"
        )
    if k in ("pipeline_read", "pipeline_write") and not v and nvme:
        return (
            "hetero always streams the optimizer states: the next chunks' NVMe reads and the last ones' writes "
            "overlap the update's math (no switch turns that off)"
        )
    if k == "fast_init" and v:
        return (
            "DeepSpeed's fast_init batches how its own swapper builds the fp32 master from parameters on NVMe at "
            "initialization; hetero builds its master chunks its own way, with no slower path to skip"
        )
    if k == "ratio" and v < 1:
        return "hetero offloads every optimizer state (DeepSpeed's ratio < 1 keeps the rest on the device)"
    if k == "super_offload" and v:
        return "hetero's host optimizer runs torch's fused kernels on its own threads"
    if k == "cpuadam_cores_perc" and ds_bool("", value.get("super_offload", False)):  # read only with super_offload
        return "hetero's host optimizer runs torch's fused kernels on its own threads"
    return None


_DEPRECATED = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
_FLOAT_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)  # "0.5", "1e-1", not "nan"
_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:\.0+)?", re.ASCII)  # pydantic's integer text: "3", "+3", "3.00", not "3."
_TRUE = ("true", "t", "yes", "y", "on", "1")
_FALSE = ("false", "f", "no", "n", "off", "0")


def ds_int(key: str, value: Any, *, allowed: str) -> int:
    """An integer as DeepSpeed's pydantic fields read one ([Note: DeepSpeed's ZeRO section as its own model reads
    it]): an int, a bool, a whole float, or integer text; anything else is refused, naming `allowed`."""
    if isinstance(value, (bool, int)):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
        return int(value.strip().split(".")[0])
    raise ConfigError(f"{key}: expected {allowed}, got {value!r}; DeepSpeed refuses this value too")


def ds_fraction(key: str, value: Any) -> float:
    """A float in [0, 1] as DeepSpeed's pydantic fields read one: a number or number text, not NaN or infinite."""
    if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
        value = float(value)
    if not isinstance(value, (bool, int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"{key}: expected a fraction from 0 to 1, got {value!r}; DeepSpeed refuses this value too")
    return float(value)


def ds_bool(key: str, value: Any) -> bool:
    """A boolean as pydantic reads one ([Note: a DeepSpeed flag] in hetero/config_deepspeed.py)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{key}: expected true or false, got {value!r}; DeepSpeed refuses this value too")


def _refuse_unknown(where: str, key: str, known: set[str] | frozenset[str]) -> None:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    top = " (aio is a top-level DeepSpeed section, beside zero_optimization)" if key == "aio" else ""
    listed = f" Its keys: {', '.join(sorted(known))}" if len(known) < 15 else ""
    raise ConfigError(
        f"{where}.{key}: not a DeepSpeed 0.19.8 key{hint}{top}; DeepSpeed refuses this config too (its {where} "
        f"forbids unknown keys).{listed}"
    )


def translate_zero(zero: Any, out: dict[str, Any], notes: list[str]) -> None:
    """zero_optimization into `out` (zero_stage, offload, memory.nvme_dir); what is not translated into `notes`."""
    if isinstance(zero, bool):
        # DeepSpeed's older form, still in its getting-started ds_config.json: true is stage 1, false stage 0.
        out["zero_stage"] = 1 if zero else 0
        return
    if not isinstance(zero, Mapping):
        raise ConfigError(
            f"zero_optimization: expected a mapping ({{'stage': 0-3, ...}}) or true/false, got {type(zero).__name__}"
        )
    zero = {k: v for k, v in zero.items() if not (isinstance(v, str) and v == "auto")}  # DeepSpeed's default then
    for key in zero:
        if key not in ZERO_KEYS:
            _refuse_unknown("zero_optimization", key, ZERO_KEYS)
    for old, new in _DEPRECATED.items():
        if old in zero:
            if new in zero:
                raise ConfigError(
                    f"zero_optimization: {old} (deprecated) and {new} given together; DeepSpeed refuses this too. "
                    f"Keep {new} only"
                )
            on = zero.pop(old)  # None: unset, as DeepSpeed's Optional field
            zero[new] = {"device": "cpu"} if on is not None and ds_bool(f"zero_optimization.{old}", on) else None
    for key, value in zero.items():
        if key == "stage":
            out["zero_stage"] = _stage(value)
        elif key in _OFFLOAD_KEYS:
            if value is not None:  # DeepSpeed's "no offload" too
                _offload(key, value, out, notes)
        else:
            notes.append(f"zero_optimization.{key}: {ZERO_TUNING.get(key) or ZERO_TUNING['stage3_' + key]}")
    offload = out.get("offload", {})
    if offload.get("params", "device") != "device" and out.get("zero_stage", 0) != 3:
        # DeepSpeed reads offload_param at stage 3 only (the stages below keep whole parameters on the device) and
        # trains without it; hetero's check would refuse offload.params, a key this config does not have.
        offload.pop("params_host_elements", None)
        device = {"host": "cpu", "nvme": "nvme"}[offload.pop("params")]
        notes.append(
            f"zero_optimization.offload_param: device {device!r} not translated: DeepSpeed offloads parameters at "
            f"stage 3 only and ignores it at stage {out.get('zero_stage', 0)}; set stage 3 to offload them"
        )


def _stage(value: Any) -> int:
    stage = ds_int("zero_optimization.stage", value, allowed="a ZeRO stage: 0, 1, 2 or 3")
    if stage not in range(4):
        raise ConfigError(f"zero_optimization.stage: expected 0, 1, 2 or 3, got {value!r}; DeepSpeed refuses it too")
    return stage


def _offload(key: str, value: Any, out: dict[str, Any], notes: list[str]) -> None:
    if not isinstance(value, Mapping):  # was skipped without a word ("cpu": no offload); DeepSpeed refuses it
        raise ConfigError(f'zero_optimization.{key}: expected a section such as {{"device": "cpu"}}, got {value!r}')
    value = {k: v for k, v in value.items() if not (isinstance(v, str) and v == "auto")}
    known = _OFFLOAD_KEYS[key] | {"device", "nvme_path"}
    for k in value:
        if k not in known:
            _refuse_unknown(f"zero_optimization.{key}", k, known)
    device = value.get("device", "none")
    if not isinstance(device, str) or device not in _DEVICES:
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
    # Every setting checked as DeepSpeed's model checks it, whatever the device (it validates them all).
    checked = {}
    for k, v in value.items():
        name = f"zero_optimization.{key}.{k}"
        if k in _OFFLOAD_INTS:
            allowed = "a number of parameter elements (>= 0)" if k == "max_in_cpu" else "an integer >= 0"
            checked[k] = ds_int(name, v, allowed=allowed)
            if checked[k] < 0:
                raise ConfigError(f"{name}: expected {allowed}, got {v!r}; DeepSpeed refuses this value too")
        elif k in _OFFLOAD_FLOATS:
            checked[k] = ds_fraction(name, v)
        elif k not in ("device", "nvme_path"):
            checked[k] = ds_bool(name, v)
    if key == "offload_param" and device == "nvme":
        # DeepSpeed keeps up to max_in_cpu parameter elements (1e9 unless set) on the host: so does hetero, counted
        # in elements of whatever precision the parameters end up with ([Note: parameter shards kept on the host]).
        out["offload"]["params_host_elements"] = checked.pop("max_in_cpu", DS_MAX_IN_CPU)
    checked.pop("max_in_cpu", None)  # read only with device "nvme", by DeepSpeed too
    for k, v in checked.items():
        why = _offload_note(key, k, v, value)
        if why is not None:
            notes.append(f"zero_optimization.{key}.{k}: {why}")
