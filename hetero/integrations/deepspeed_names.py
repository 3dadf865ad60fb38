"""The names a training loop written for DeepSpeed's engine calls, answered by hetero's engine.

A loop ported from DeepSpeed logs `engine.get_lr()` and `engine.get_global_grad_norm()`, checks
`engine.was_step_applied()` after an fp16 step, asks `engine.gradient_accumulation_steps()` or
`engine.zero_optimization_stage()`, and saves with `engine.save_16bit_model(dir)`; with these it runs unchanged (its
`initialize` call and config aside: `hetero.Config.from_deepspeed`, and `check_initialize_args` below names
deepspeed.initialize's calling style). Each is hetero's own figure under DeepSpeed's name and meaning.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from hetero.errors import HeteroError


class DeepSpeedNames:
    """Mixed into `hetero.Engine`."""

    optimizer: Any
    config: Any
    stage: int
    last_grad_norm: float | None
    last_update_skipped: bool
    global_steps: int
    mesh: Any
    comm: Any

    full_state_dict: Callable[[], dict[str, torch.Tensor]]

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (LOCAL_RANK, set by torchrun and DeepSpeed's launcher; 0 unset)."""
        return int(os.environ.get("LOCAL_RANK", "0") or 0)

    def save_16bit_model(
        self,
        save_dir: str | os.PathLike,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's: the whole model's state_dict in the compute dtype (the training precision), written by global
        rank 0 with torch.save to save_dir/save_filename, under any layout; every rank calls it (it gathers). Returns
        True."""
        if exclude_frozen_parameters:
            raise TypeError(
                "save_16bit_model: exclude_frozen_parameters=True is not available (hetero saves every parameter); "
                "drop the frozen ones from engine.full_state_dict() and torch.save the rest"
            )
        state = self.full_state_dict(rank0_only=True)  # the whole model, tensor and pipeline parts joined
        if self.mesh.world.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(os.fspath(save_dir), save_filename))
        return True

    def get_lr(self) -> list[float]:
        """Each param group's learning rate, as the next update uses it."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The last update's gradient norm over every rank, before clipping (None before the first)."""
        return self.last_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last update was applied: False before the first one (as DeepSpeed's) and when it was skipped
        (fp16 overflow)."""
        return self.global_steps > 0 and not self.last_update_skipped

    def gradient_accumulation_steps(self) -> int:
        return int(self.config.grad_accumulation_steps)

    def zero_optimization_stage(self) -> int:
        return self.stage

    def zero_optimization(self) -> bool:
        return self.stage > 0

    def gradient_clipping(self) -> float:
        """The clipping norm (0.0: none, DeepSpeed's value for no clipping)."""
        return float(self.config.grad_clip_norm or 0.0)

    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    def get_mom(self) -> list[Any]:
        """Each param group's momentum term: Adam's betas, SGD's and RMSprop's momentum (0.0 where it has none)."""
        key = "betas" if all("betas" in g for g in self.optimizer.param_groups) else "momentum"
        return [g.get(key, 0.0) for g in self.optimizer.param_groups]

    # hetero never sees the batches (the loop's loader makes them), so it has no batch size to answer with: say so,
    # where the engine would otherwise report that its model lacks the attribute.
    def train_batch_size(self) -> int:
        raise HeteroError(_NO_BATCH_SIZE.format("train_batch_size"))

    def train_micro_batch_size_per_gpu(self) -> int:
        raise HeteroError(_NO_BATCH_SIZE.format("train_micro_batch_size_per_gpu"))


_NO_BATCH_SIZE = (
    "engine.{}(): hetero does not load data, so it holds no batch size; use your data loader's (the value in your "
    "DeepSpeed config), feeding each rank micro-batches of train_micro_batch_size_per_gpu and calling engine.step() "
    "after each, as with DeepSpeed; the engine updates every engine.gradient_accumulation_steps() of them"
)


# DeepSpeed's keyword arguments of its checkpoint calls, with what hetero does instead: named, rather than met by
# Python's bare "unexpected keyword argument" in a script ported from DeepSpeed.
_LOAD_ONLY_PART = (
    "hetero restores the weights, optimizer states and LR scheduler together (and returns client_state alone, where "
    "DeepSpeed returns (load_path, client_state)); to start from the weights only, write them out with "
    "hetero.checkpoint.consolidate(dir, 'weights.safetensors') and load them into the model before hetero.initialize"
)
_DEEPSPEED_KWARGS = {
    "load_checkpoint": {
        "load_module_strict": "hetero checks every saved tensor against the model, always strictly",
        "load_optimizer_states": _LOAD_ONLY_PART,
        "load_lr_scheduler_states": _LOAD_ONLY_PART,
        "load_module_only": _LOAD_ONLY_PART,
        "custom_load_fn": "hetero loads its own sharded format; convert other checkpoints to a state_dict first",
    },
    "save_checkpoint": {
        "save_latest": "hetero always moves the root's `latest` to the checkpoint it commits",
        "exclude_frozen_parameters": "hetero saves every parameter, so that a resume is bit-exact",
    },
}


# Their DeepSpeed defaults, which are what hetero does: a script that spells them out is taken as it is.
_DEEPSPEED_DEFAULTS = {
    "load_module_strict": True,
    "load_optimizer_states": True,
    "load_lr_scheduler_states": True,
    "load_module_only": False,
    "custom_load_fn": None,
    "save_latest": True,
    "exclude_frozen_parameters": False,
}


def refuse_deepspeed_kwargs(method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """kwargs less DeepSpeed's keywords of `method` given at their defaults (hetero's behaviour); a TypeError naming
    each one given otherwise, with hetero's way instead."""
    known = _DEEPSPEED_KWARGS[method]
    found = [k for k in kwargs if k in known and kwargs[k] is not _DEEPSPEED_DEFAULTS[k]]
    if found:
        raise TypeError(
            f"{method}: "
            + "; ".join(f"{k}={kwargs[k]!r} (DeepSpeed's keyword) is not available: {known[k]}" for k in found)
            + ". Leave it out, or give DeepSpeed's default, which is what hetero does ("
            + ", ".join(f"{k}={_DEEPSPEED_DEFAULTS[k]!r}" for k in found)
            + ")"
        )
    return {k: v for k, v in kwargs.items() if k not in known}


# ---- DeepSpeed's deepspeed.initialize calling style ---------------------------------------------------------
MISSING: Any = object()  # hetero.initialize's optimizer when none was given (None is an inference engine)
ENGINE_ALONE = (
    "hetero.initialize returns the engine alone (DeepSpeed's returns engine, optimizer, dataloader, lr_scheduler): "
    "write engine = hetero.initialize(model, optimizer, config, lr_scheduler) and keep your own optimizer, loader "
    "and scheduler objects"
)
_BUILT_OPTIMIZER = (
    "hetero.initialize takes a built torch optimizer as its second argument, not the model's parameters: "
    "engine = hetero.initialize(model, torch.optim.AdamW(model.parameters(), lr=...), config) (for a DeepSpeed "
    "JSON, Config.from_deepspeed's warning prints the torch.optim line for its optimizer section; None makes an "
    "inference engine). "
)
# deepspeed.initialize's keywords that hetero.initialize has none of, with what to do instead
_INITIALIZE_KWARGS = {
    "model_parameters": "build the optimizer on them yourself and pass it as optimizer",
    "training_data": "hetero does not load data: build your DataLoader and feed the engine its micro-batches",
    "collate_fn": "hetero does not load data: give it to your DataLoader",
    "mpu": "set the config's parallel section (tensor, pipeline) instead",
    "dist_init_required": "hetero joins the world from torchrun's environment, or takes comm=",
    "config_params": "pass the config as config= (a hetero.Config, or Config.from_deepspeed(...) of the JSON)",
    "args": "pass the config as config= (a hetero.Config, or Config.from_deepspeed(...) of the JSON)",
}


def check_initialize_args(optimizer: Any, kwargs: dict[str, Any]) -> None:
    """A TypeError for deepspeed.initialize's calling style: its keywords, and parameters where hetero takes the
    optimizer (a generator or a list of param-group dicts met `object has no attribute 'param_groups'`)."""
    if kwargs:
        named = "; ".join(
            f"{k}: {_INITIALIZE_KWARGS[k]}" if k in _INITIALIZE_KWARGS else f"{k}: not one of hetero.initialize's"
            for k in kwargs
        )
        raise TypeError(f"hetero.initialize got keyword arguments it does not take ({named}). " + _BUILT_OPTIMIZER
                        + ENGINE_ALONE)  # fmt: skip
    if optimizer is MISSING:
        raise TypeError("hetero.initialize: no optimizer given. " + _BUILT_OPTIMIZER + ENGINE_ALONE)
    if optimizer is not None and not hasattr(optimizer, "param_groups"):
        raise TypeError(
            f"hetero.initialize: the optimizer is a {type(optimizer).__name__}, not a torch optimizer. "
            + _BUILT_OPTIMIZER
            + ENGINE_ALONE
        )
