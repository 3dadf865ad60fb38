"""Coming from DeepSpeed: `hetero.Config.from_deepspeed(ds_config)`, and hints in config errors.

[Note: translating a DeepSpeed config]
DeepSpeed's JSON mixes what hetero configures (ZeRO stage, where optimizer states and parameters live, precision
and fp16's loss scale, gradient accumulation and clipping, a metrics sink) with what a hetero user writes in Python
(the optimizer and the LR scheduler are objects given to `hetero.initialize`, DeepSpeed's own scheduler classes
included; batch sizes belong to the data loader, though the accumulation DeepSpeed derives from them is hetero's and
translated) and with tuning knobs hetero decides itself (bucket sizes, prefetch sizes, swap buffers: hetero sizes
chunks, prefetches along the recorded access trace and streams NVMe through its host tier). The aio section's queue
depth and block size become the NVMe tier's own ([Note: DeepSpeed's aio section on hetero's NVMe tier] in
hetero/config_deepspeed_aio.py). `from_deepspeed` translates the
first kind and names every key of the other two with what to do instead, as a warning (or, with strict=True, as one
ConfigError). A value of "auto" (Hugging Face's DeepSpeed integration fills those from TrainingArguments) is left to
hetero's default, and HeteroTrainer fills the same fields from TrainingArguments (outside it, `hetero.initialize`
names each "auto" nothing filled: [Note: a config's DeepSpeed origin] in hetero/config_deepspeed_origin.py). A section
switched off ("amp": {"enabled": false}, "sparse_gradients": false) asks for nothing and is not named. fp16's
loss-scale settings beside
an "auto" fp16 are translated all the same, for when TrainingArguments choose fp16. The fp16 section becomes the
loss_scale section with DeepSpeed's defaults where it gives none (hysteresis 2, a window of 1000), so a translated
config scales the loss and skips steps as DeepSpeed does ([Note: the fp16 loss scale] in hetero/zero/precision.py).
A config without gradient_clipping clips at 1.0, DeepSpeed's default since its 0.19.3 (and its documented one; the
versions before did not clip), with a warning saying so; DeepSpeed clips only at a value > 0, so 0 or less is none.
zero_optimization is read as DeepSpeed's own pydantic model reads it (hetero/config_deepspeed_zero.py,
[Note: DeepSpeed's ZeRO section as its own model reads it]).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetero.comm.launchers import LAUNCHERS
from hetero.config_deepspeed_aio import translate_aio
from hetero.config_deepspeed_origin import DeepSpeedOrigin, given_keys
from hetero.config_deepspeed_zero import ZERO_TUNING, translate_zero
from hetero.errors import ConfigError

log = logging.getLogger("hetero.config")

# Keys hetero does not translate, and what to do instead.
_HANDLED_ELSEWHERE = {
    "optimizer": "build the torch optimizer yourself (e.g. torch.optim.AdamW(model.parameters(), lr=..., "
    "betas=..., eps=..., weight_decay=...)) and pass it to hetero.initialize",
    "scheduler": "build the scheduler on that optimizer and pass lr_scheduler= to hetero.initialize: DeepSpeed's own "
    "classes run unchanged (deepspeed.runtime.lr_schedules.WarmupLR(optimizer, ...), WarmupDecayLR, WarmupCosineLR), "
    "stepped once per update and not after a skipped fp16 update, as DeepSpeed steps them",
    "train_batch_size": "hetero does not load data: your loader's micro-batches make it up (with "
    "train_micro_batch_size_per_gpu, gradient_accumulation_steps is derived from it and checked as DeepSpeed does)",
    "train_micro_batch_size_per_gpu": "hetero does not load data: feed micro-batches of this size per rank",
    "steps_per_print": "log engine.metrics() at the interval you want",
    "wall_clock_breakdown": "see engine.metrics()['update_seconds'] and hetero.profile",
    "activation_checkpointing": "set activation_checkpointing (true, or module names) and activation_offload",
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


def from_deepspeed(ds_config: Mapping[str, Any] | str | os.PathLike, *, strict: bool = False) -> dict[str, Any]:
    """The hetero config dict equivalent to a DeepSpeed config (a dict or a .json path); see the note above."""
    return translate_deepspeed(ds_config, strict=strict)[0]


def translate_deepspeed(
    ds_config: Mapping[str, Any] | str | os.PathLike, *, strict: bool = False
) -> tuple[dict[str, Any], DeepSpeedOrigin]:
    """`from_deepspeed`'s dict, and what a Trainer fills or checks of the JSON ([Note: a config's DeepSpeed
    origin] in hetero/config_deepspeed_origin.py)."""
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
            translate_zero(value, out, notes)
        elif key == "aio":
            translate_aio(value, out, notes)
        elif key in ("fp16", "bf16", "bfloat16"):
            _precision(key, value, out, notes)
        elif key == "gradient_accumulation_steps":
            if value != "auto":
                out["grad_accumulation_steps"] = value
        elif key == "gradient_clipping":
            if value != "auto":  # "auto": HeteroTrainer fills it from TrainingArguments' max_grad_norm
                out["grad_clip_norm"] = _clip(value)
        elif key == "tensorboard":
            if _enabled(key, value):
                out.setdefault("log", {})["tensorboard"] = os.path.join(
                    value.get("output_path", "runs"), value.get("job_name", "")
                ).rstrip(os.sep)
        elif key == "wandb":
            if _enabled(key, value):
                out.setdefault("log", {})["wandb"] = value.get("project", "deepspeed")
        elif key in ("optimizer", "scheduler") and isinstance(value, Mapping):
            notes.append(f"{key}: {_built_yourself(key, value)}{_UNDER_TRAINER}")
        elif _disabled(key, value):
            pass  # "amp": {"enabled": false}, "sparse_gradients": false: a section switched off asks for nothing
        elif key in _HANDLED_ELSEWHERE:
            notes.append(f"{key}: {_HANDLED_ELSEWHERE[key]}")
        else:
            notes.append(f"{key}: no hetero equivalent")
    _batch_sizes(ds_config, out)
    if "gradient_clipping" not in ds_config:
        out["grad_clip_norm"] = _DS_CLIP
        log.warning(
            "from_deepspeed: gradient_clipping is not set, and DeepSpeed clips the gradient norm at %s by default "
            "(since 0.19.3; earlier versions did not clip): grad_clip_norm is %s. Set gradient_clipping to choose (0: "
            'no clipping; "auto": TrainingArguments\' max_grad_norm under HeteroTrainer)',
            _DS_CLIP,
            _DS_CLIP,
        )
    if "precision" in out and isinstance(out["precision"], list):
        raise ConfigError("DeepSpeed config enables both fp16 and bf16: enable one")
    if notes:
        text = "".join(f"\n  {note}" for note in notes)  # one key a line: a realistic config names dozens
        if strict:
            raise ConfigError(f"from_deepspeed: these DeepSpeed settings were not translated:{text}")
        log.warning("from_deepspeed: not translated (what to do instead):%s", text)
    return out, _origin(ds_config, out)


def _disabled(key: str, value: Any) -> bool:
    """A section or flag DeepSpeed reads as off: false, or a section whose "enabled" is false."""
    if isinstance(value, Mapping):
        return "enabled" in value and _enabled(key, value) is False
    return value is False or (isinstance(value, str) and value.strip().lower() in _FALSE)


def _origin(ds_config: Mapping[str, Any], out: dict[str, Any]) -> DeepSpeedOrigin:
    """Which of the settings a Trainer fills were "auto" (and what they became), and which were given."""
    auto: dict[str, str] = {}
    given = given_keys(ds_config)
    precision = out.get("precision", "fp32")
    for key in ("fp16", "bf16", "bfloat16"):
        section = ds_config.get(key)
        if isinstance(section, Mapping) and "enabled" in section:
            name = f"{'fp16' if key == 'fp16' else 'bf16'}.enabled"
            enabled = _enabled(key, section)
            if enabled == "auto":
                auto[f"{key}.enabled"] = f"precision {precision!r}"
            else:
                given[name] = enabled
    if ds_config.get("gradient_accumulation_steps") == "auto" and "grad_accumulation_steps" not in out:
        auto["gradient_accumulation_steps"] = "grad_accumulation_steps 1 (an update every micro-batch)"
    if ds_config.get("gradient_clipping") == "auto":
        auto["gradient_clipping"] = "grad_clip_norm None (no clipping)"
    return DeepSpeedOrigin(auto=auto, given=given)


# [Note: a DeepSpeed flag]
# DeepSpeed reads its sections through pydantic, whose booleans take the strings and numbers below too: a config
# with "enabled": "false" is off under DeepSpeed. It turned fp16 on here (bool("false") is True), and a section that
# is no mapping ("fp16": true, which DeepSpeed refuses) was skipped without a word.
_TRUE = ("true", "t", "yes", "y", "on", "1")
_FALSE = ("false", "f", "no", "n", "off", "0")
_DS_CLIP = 1.0  # DeepSpeed's gradient_clipping where the config gives none (0.0 before its 0.19.3)


def _enabled(key: str, section: Any) -> bool | str:
    """A section's "enabled", read as DeepSpeed reads it ([Note: a DeepSpeed flag]); "auto" as it is."""
    if not isinstance(section, Mapping):
        raise ConfigError(f'{key}: expected a section such as {{"enabled": true}}, got {section!r}')
    value = section.get("enabled", False)
    if value == "auto" or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f'{key}.enabled: expected true or false (or "auto"), got {value!r}')


def _clip(value: Any) -> float | None:
    """grad_clip_norm for DeepSpeed's gradient_clipping: DeepSpeed clips only at a value > 0."""
    if isinstance(value, str):  # "1.0": a number written as text, taken as before
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ConfigError(f'gradient_clipping: expected a number (0: no clipping) or "auto", got {value!r}')
    return float(value) if value > 0 else None


# DeepSpeed's fp16 settings and their defaults (its DeepSpeedFP16Config), translated exactly into hetero's loss_scale
# section by `_loss_scale` ([Note: the fp16 loss scale] in hetero/zero/precision.py).
_DS_FP16 = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
            "consecutive_hysteresis": False, "min_loss_scale": 1}  # fmt: skip
_FP16_UNTRANSLATED = {
    "auto_cast": "hetero computes in fp16 throughout (parameters and floating inputs cast), without torch.autocast",
    "fp16_master_weights_and_grads": "hetero keeps fp32 master weights, and accumulates gradients in fp32",
}


def _precision(key: str, value: Any, out: dict[str, Any], notes: list[str]) -> None:
    enabled = _enabled(key, value)
    if not enabled:
        return
    name = "fp16" if key == "fp16" else "bf16"
    # "auto": the Trainer's TrainingArguments choose the precision (HeteroTrainer); fp16's scale is still translated,
    # for when they choose fp16 (it is read only then).
    auto = enabled == "auto"
    if auto and name == "bf16":
        return
    if not auto and out.get("precision") not in (None, name):
        out["precision"] = [out["precision"], name]  # both: reported by the caller
        return
    if not auto:
        out["precision"] = name
    if name == "bf16":
        extra = [k for k, v in value.items() if k != "enabled" and v]
        if extra:
            notes.append(
                f"{key}.{'/'.join(extra)}: no hetero equivalent (hetero keeps fp32 master weights and optimizer "
                "states, and accumulates gradients in fp32)"
            )
        return
    # DeepSpeed's scaler with this config's settings, its defaults where they are absent or "auto".
    out["loss_scale"] = _loss_scale(
        {k: d if value.get(k, d) == "auto" else value.get(k, d) for k, d in _DS_FP16.items()}
    )
    notes += [f"fp16.{k}: {why}" for k, why in _FP16_UNTRANSLATED.items() if value.get(k)]


def _loss_scale(ds: dict[str, Any]) -> dict[str, Any]:
    """hetero's loss_scale section for DeepSpeed's fp16 settings (all given): the same scales, the same skips."""
    static = ds["loss_scale"]
    if isinstance(static, bool) or not isinstance(static, (int, float)) or not 0 <= static < math.inf:
        raise ConfigError(f"fp16.loss_scale: expected a number >= 0 (0: a dynamic scale), got {static!r}")
    if static > 0:  # DeepSpeed reads none of the dynamic settings then
        return {"static": static}
    power = ds["initial_scale_power"]
    if isinstance(power, bool) or not isinstance(power, int):
        raise ConfigError(
            f"fp16.initial_scale_power: expected an integer (the scale starts at 2**power), got {power!r}"
        )
    return {
        "initial_scale": 2.0**power,
        "growth_interval": ds["loss_scale_window"],
        "deepspeed_window": True,  # DeepSpeed's window grows one overflow-free step later than hetero's
        "hysteresis": ds["hysteresis"],
        "consecutive_hysteresis": ds["consecutive_hysteresis"],
        "min_scale": _floor(ds["min_loss_scale"]),
    }


def _floor(min_loss_scale: Any) -> Any:
    """min_scale for DeepSpeed's min_loss_scale. At 0 or less DeepSpeed halves the scale without a floor (configs
    in the wild give 0.0); hetero's floor must be > 0 (it was a ConfigError naming loss_scale.min_scale, a key the
    DeepSpeed config does not have), so the least positive float: the same scales until DeepSpeed's reach 0."""
    number = isinstance(min_loss_scale, (int, float)) and not isinstance(min_loss_scale, bool)
    return math.ulp(0.0) if number and min_loss_scale <= 0 else min_loss_scale


# HeteroTrainer builds both from TrainingArguments, so there the advice to pass objects to hetero.initialize misleads.
_UNDER_TRAINER = (
    " (under HeteroTrainer: set TrainingArguments' optim, learning_rate, weight_decay, adam_beta1/adam_beta2, "
    "lr_scheduler_type and warmup_steps instead)"
)
_DS_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")  # run under hetero by tests/test_deepspeed_compat.py
_TORCH_OPTIMIZERS = {"adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad"}  # DeepSpeed reads the type in any case


def _built_yourself(key: str, section: Mapping[str, Any]) -> str:
    """What to build for DeepSpeed's optimizer or scheduler section, with its type and settings ("auto": yours)."""
    kind = str(section.get("type"))
    params = section.get("params") or {}
    auto = [k for k, v in params.items() if v == "auto"]
    fill = f' (and fill {", ".join(auto)}, which Hugging Face fills for "auto")' if auto else ""
    if key == "scheduler":
        if kind not in _DS_SCHEDULERS:
            return f"DeepSpeed's {kind!r} scheduler: {_HANDLED_ELSEWHERE[key]}"
        args = "".join(f", {k}={v!r}" for k, v in params.items() if v != "auto")
        return (
            f"pass lr_scheduler=deepspeed.runtime.lr_schedules.{kind}(optimizer{args}){fill} to hetero.initialize: "
            "DeepSpeed's classes run unchanged, stepped once per update and not after a skipped fp16 update, as "
            "DeepSpeed steps them"
        )
    # DeepSpeed's "Adam" decouples weight decay (AdamW) unless adam_w_mode is false; its own flags are not torch's.
    adam = kind.lower() == "adam"
    torch_name = (
        ("AdamW" if params.get("adam_w_mode", True) else "Adam") if adam else _TORCH_OPTIMIZERS.get(kind.lower())
    )
    if torch_name is None:
        return f"DeepSpeed's {kind!r} optimizer: {_HANDLED_ELSEWHERE[key]}"
    if "max_grad_norm" in params:
        raise ConfigError(
            "optimizer.params.max_grad_norm: DeepSpeed refuses it too; clip with gradient_clipping (hetero's "
            "grad_clip_norm)"
        )
    own = ("adam_w_mode", "torch_adam", "bias_correction", "fp32_optimizer_states")
    args = "".join(f", {k}={v!r}" for k, v in params.items() if v != "auto" and k not in own)
    if torch_name == "AdamW" and not params.get("torch_adam") and "weight_decay" not in params:
        args += (
            ", weight_decay=0.0"  # DeepSpeed's own Adams (FusedAdam, DeepSpeedCPUAdam) default to 0, torch's AdamW 0.01
        )
    decoupled = " (DeepSpeed's 'Adam' decouples weight decay: torch's AdamW)" if adam and torch_name == "AdamW" else ""
    text = f"build torch.optim.{torch_name}(model.parameters(){args}){decoupled}{fill} and pass it to hetero.initialize"
    if torch_name in ("Adam", "AdamW") and params.get("bias_correction", True) is False:
        text += "; bias_correction false has no torch equivalent (torch's Adam always corrects the moments' bias)"
    return text


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _batch_sizes(ds_config: Mapping[str, Any], out: dict[str, Any]) -> None:
    """DeepSpeed derives gradient_accumulation_steps from the two batch sizes where it is not given, and refuses
    sizes that do not multiply out: the accumulation is hetero's, so it is derived and checked here alike."""
    given = {k: ds_config[k] for k in _BATCH_KEYS if ds_config.get(k) not in (None, "auto")}
    if "train_batch_size" not in given or "train_micro_batch_size_per_gpu" not in given:
        return  # DeepSpeed's other cases leave the accumulation as given (1 when absent, hetero's default too)
    for k, v in given.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{k}: expected a positive integer, got {v!r}")
    batch, micro = given["train_batch_size"], given["train_micro_batch_size_per_gpu"]
    world = _world_size()
    accum = given.get("gradient_accumulation_steps", batch // micro // world)
    if accum <= 0 or batch != micro * accum * world:
        shown = accum if "gradient_accumulation_steps" in given else f"{accum}, derived"
        raise ConfigError(
            f"train_batch_size {batch} is not train_micro_batch_size_per_gpu x gradient_accumulation_steps x world "
            f"size ({micro} x {shown} x {world}, the world from the launcher's environment); DeepSpeed refuses "
            "this config too. Give sizes that multiply out, or only gradient_accumulation_steps (with tensor or "
            "pipeline parallelism, the world here is every rank)"
        )
    out["grad_accumulation_steps"] = accum


def _world_size() -> int:
    # from_deepspeed runs before hetero joins the world: its size comes from the launcher, as hetero's join reads it.
    for var in ("WORLD_SIZE", *(size for _, size, _ in LAUNCHERS.values())):
        raw = os.environ.get(var, "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return 1


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
    "cpu_offload": "hetero's key is offload.optimizer: 'host'",
    "cpu_offload_param": "hetero's key is offload.params: 'host'",
    "max_in_cpu": "hetero's key is offload.params_host_elements (or params_host_bytes)",
    "aio": "hetero's keys are memory.nvme_io_threads (queue_depth x intra_op_parallelism) and memory.nvme_block_bytes",
    "tensorboard": "hetero's key is log.tensorboard (a directory)",
    "wandb": "hetero's key is log.wandb (a project name)",
}
_VALUE_HINTS = {"cpu": "host", "none": "device"}


def key_hint(key: str) -> str:
    """A hint for an unknown config key that is DeepSpeed's ("" if it is not)."""
    if key in _KEY_HINTS or key in _HANDLED_ELSEWHERE or key in ZERO_TUNING:
        what = _KEY_HINTS.get(key) or _HANDLED_ELSEWHERE.get(key) or ZERO_TUNING[key]
        return (
            f" '{key}' is a DeepSpeed key: {what}. To translate a whole DeepSpeed config, use "
            "hetero.Config.from_deepspeed(ds_config)."
        )
    return ""


def value_hint(value: object) -> str:
    """A hint for an invalid placement that is DeepSpeed's name for one ("" if it is not)."""
    if isinstance(value, str) and value.lower() in _VALUE_HINTS:
        return f" ({value!r} is DeepSpeed's name: hetero calls it {_VALUE_HINTS[value.lower()]!r})"
    return ""
