"""The names a training loop written for DeepSpeed's engine calls, answered by hetero's engine.

A loop ported from DeepSpeed logs `engine.get_lr()` and `engine.get_global_grad_norm()`, checks
`engine.was_step_applied()` after an fp16 step, and asks `engine.gradient_accumulation_steps()` or
`engine.zero_optimization_stage()`; with these it runs unchanged (its `initialize` call and config aside:
`hetero.Config.from_deepspeed`). Each is hetero's own figure under DeepSpeed's name and meaning.
"""

from __future__ import annotations

from typing import Any

from hetero.errors import HeteroError


class DeepSpeedNames:
    """Mixed into `hetero.Engine`."""

    optimizer: Any
    config: Any
    stage: int
    last_grad_norm: float | None
    last_update_skipped: bool
    global_steps: int

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


def refuse_deepspeed_kwargs(method: str, kwargs: dict[str, Any]) -> None:
    """Raise a TypeError naming each of DeepSpeed's keywords of `method` in kwargs, with hetero's way instead."""
    known = _DEEPSPEED_KWARGS[method]
    found = [k for k in kwargs if k in known]
    if found:
        raise TypeError(
            f"{method}: " + "; ".join(f"{k} is DeepSpeed's keyword: {known[k]}" for k in found) + ". Leave it out"
        )
