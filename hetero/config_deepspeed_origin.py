"""What a `Config.from_deepspeed` config remembers of its DeepSpeed JSON: the settings a Trainer fills or checks.

[Note: a config's DeepSpeed origin]
Hugging Face's DeepSpeed integration fills a JSON's "auto" values from TrainingArguments and refuses a JSON whose
given values disagree with them (gradient_accumulation_steps, gradient_clipping, train_micro_batch_size_per_gpu,
train_batch_size, fp16/bf16.enabled). The translated Config holds only hetero's fields, so it lost both which values
were "auto" and the batch sizes (hetero loads no data). `DeepSpeedOrigin` keeps them beside the Config, by identity:
- outside a Trainer, `hetero.initialize` warns once, naming each "auto" nothing filled and what it became (clipping
  off, fp32, no accumulation: a run that silently differs from the one under the Trainer);
- HeteroTrainer checks the given values against its TrainingArguments as Hugging Face's integration does, and
  builds its engine from `dataclasses.replace(...)` of the config, a new object without an origin, so the warning
  never fires there (the Trainer filled every "auto").
A Config built any other way (a dict, `dataclasses.replace`) has no origin: nothing to warn about or check.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any

from hetero.errors import ConfigError

log = logging.getLogger("hetero.config")

# id(config) -> its origin; an entry leaves with its config (weakref.finalize), so an id is never reused stale.
_ORIGINS: dict[int, DeepSpeedOrigin] = {}


@dataclasses.dataclass
class DeepSpeedOrigin:
    auto: dict[str, str]  # DeepSpeed key left "auto" -> what hetero made of it
    given: dict[str, Any]  # DeepSpeed key the Trainer also sets -> the JSON's value (not "auto")
    warned: bool = False  # the "auto" warning is given once per config

    def attach(self, config: Any) -> Any:
        """Remember this origin for `config` (a Config); returns it."""
        _ORIGINS[id(config)] = self
        weakref.finalize(config, _ORIGINS.pop, id(config), None)
        return config


def deepspeed_origin(config: Any) -> DeepSpeedOrigin | None:
    """The DeepSpeed origin of a Config made by `Config.from_deepspeed` (None for any other)."""
    return _ORIGINS.get(id(config))


def warn_unfilled_auto(config: Any) -> None:
    """Outside a Trainer: warn once that the config's "auto" values were filled by nothing, and what each became."""
    origin = deepspeed_origin(config)
    if origin is None or not origin.auto or origin.warned:
        return
    origin.warned = True
    lines = "".join(f'\n  {key}: "auto" became {became}' for key, became in origin.auto.items())
    log.warning(
        'hetero.initialize: the DeepSpeed config gives "auto" for settings that Hugging Face\'s Trainer (or '
        "HeteroTrainer) fills from TrainingArguments; outside a Trainer nothing fills them:%s\nSet each in the JSON "
        '(e.g. "gradient_clipping": 1.0, "bf16": {"enabled": true}, "gradient_accumulation_steps": 4), or train '
        "under HeteroTrainer, which fills them",
        lines,
    )


# DeepSpeed key -> (TrainingArguments' attribute, how to read the JSON's value for the comparison)
_TRAINER_KEYS = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
}


def check_trainer_args(config: Any, args: Any) -> None:
    """Refuse a DeepSpeed JSON whose given values disagree with the TrainingArguments, as Hugging Face's DeepSpeed
    integration does: the Trainer drives them, and a silent override trained at another batch size or precision."""
    origin = deepspeed_origin(config)
    if origin is None:
        return
    wrong = []
    for key, value in origin.given.items():
        if key == "train_batch_size":
            theirs = args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps
            name = "world size x per_device_train_batch_size x gradient_accumulation_steps"
        else:
            name = _TRAINER_KEYS[key]
            theirs = getattr(args, name)
        if key == "gradient_clipping":  # both: clipping only at a norm > 0
            same = (value if value > 0 else 0) == (theirs if theirs and theirs > 0 else 0)
        else:
            same = value == theirs
        if not same:
            wrong.append(f"{key} is {value!r} in the DeepSpeed config but {theirs!r} in TrainingArguments ({name})")
    if wrong:
        raise ConfigError(
            "HeteroTrainer: the DeepSpeed config disagrees with the TrainingArguments, which drive these under the "
            "Trainer (Hugging Face's DeepSpeed integration refuses this too):\n  "
            + "\n  ".join(wrong)
            + '\nSet each of these keys to "auto" in the DeepSpeed JSON (the Trainer then fills it), or make the '
            "two agree"
        )


def given_keys(ds_config: Any) -> dict[str, Any]:
    """The DeepSpeed settings a Trainer also sets, where the JSON gives them (not "auto")."""
    given: dict[str, Any] = {}
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps"):
        if isinstance(ds_config.get(key), int) and not isinstance(ds_config.get(key), bool):
            given[key] = ds_config[key]
    clip = ds_config.get("gradient_clipping")
    if isinstance(clip, (int, float)) and not isinstance(clip, bool):
        given["gradient_clipping"] = float(clip)
    return given
