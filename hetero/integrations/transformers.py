"""`HeteroTrainer`: Hugging Face's `transformers.Trainer`, training through hetero.

```python
from hetero.integrations.transformers import HeteroTrainer

trainer = HeteroTrainer(model=model, args=TrainingArguments(...), train_dataset=..., eval_dataset=...,
                        hetero_config={"zero_stage": 3, "offload": {"optimizer": "nvme"},
                                       "memory": {"nvme_dir": "/mnt/nvme"}})
trainer.train()        # under torchrun too: every rank runs it
```

[Note: the Trainer's loop around an engine]
The Trainer keeps its own loop (data, gradient accumulation, LR schedule, logging, evaluation, saving) and hetero
takes the model's state, as DeepSpeed does under the Trainer:
- `create_optimizer` builds the Trainer's optimizer as usual (`TrainingArguments.optim`, weight-decay groups) and
  hands it to `hetero.initialize` with a config whose accumulation, clipping and precision come from the
  TrainingArguments (a hetero_config that says otherwise is an error). The Trainer then holds `_TrainerOptimizer`,
  whose param groups are the engine's (so the Trainer's scheduler drives the engine's learning rates) and whose
  `step` does nothing: the update has already happened.
- `_wrap_model` gives the Trainer `EngineModule`, an nn.Module whose forward is the engine's, in place of DDP (so
  accelerate never wraps the model; hetero reduces gradients itself). For the same reason there is no
  nn.DataParallel: one process on a machine with several GPUs trains on one (`args.n_gpu` set to 1, with a
  warning naming torchrun), with the per-device batch and the plain Trainer's loss scaling.
- Data parallelism only: the Trainer's loader gives each rank its own batch, so a config with tensor or
  pipeline ranks is refused before the engine is built (they need one batch per group, or train_batch).
- `training_step` computes the loss exactly as the Trainer does (its `compute_loss`, its division for
  accumulation) and calls `engine.backward(loss, scale_wrt_gas=False)` then `engine.step()`. The Trainer marks the
  micro-batch that ends an accumulation (`accelerator.sync_gradients`, also at a shorter last accumulation of an
  epoch); the engine is told so (`set_gradient_accumulation_boundary`) and updates there.
- `bf16_full_eval` / `fp16_full_eval` (the Trainer casts the wrapped model before an evaluation outside train()):
  hetero computes in the precision it trains in, so they are taken only in that precision (bf16=True /
  fp16=True), where the cast changes nothing; in another they are refused before the first update.
- The LR scheduler is the Trainer's own (`lr_scheduler_type`, warmup), stepped by the Trainer after each update,
  except after an update skipped for fp16 overflow (accelerate's convention, and hetero's).
- The gradient norm the Trainer logs is the engine's (computed in the update, before clipping); inf for an update
  skipped for fp16 overflow, as the plain Trainer logs the overflowed norm.
- `model_init`: the Trainer builds a fresh model for each train() (hyperparameter search's trials); a new engine
  takes it and the old one is closed.
- `torch_compile=True`: accelerate compiles the models it prepares, and the Trainer never prepares hetero's; the
  model is compiled in place once the engine holds it (`model.compile`, with the arguments' backend and mode).
- A checkpoint (`save_steps`) is the Trainer's directory (weights gathered for `from_pretrained`, trainer state,
  RNG) with the engine's own checkpoint in `hetero/` under it: master weights, optimizer states wherever they
  live, scheduler. `resume_from_checkpoint` restores from there. A checkpoint-N saved again (a run resumed from an
  earlier one) is replaced whole, as the plain Trainer replaces its own files. The checkpoint tools take the
  checkpoint-N folder itself (`python -m hetero.checkpoint consolidate out/checkpoint-N model.safetensors`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from collections import defaultdict
from typing import Any

import torch
from torch import nn

import hetero
from hetero.checkpoint.manifest import NESTED
from hetero.config import Config
from hetero.config_deepspeed_origin import check_trainer_args, deepspeed_origin
from hetero.errors import ConfigError
from hetero.integrations.roll_call import roll_call
from hetero.zero.optim import step_scheduler

try:
    import transformers
except ImportError as e:  # an optional extra
    raise ImportError(
        "hetero.integrations.transformers needs transformers and accelerate: pip install 'hetero[transformers]'"
    ) from e

# The Trainer methods overridden here (_clip_grad_norm, _get_grad_norm, loss_is_scaled_for_ga, ...) are those of
# transformers 5; 4.x computes the gradient norm inline in its loop, where hetero's could not be reported.
MIN_TRANSFORMERS = (5, 0)
if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < MIN_TRANSFORMERS:
    raise ImportError(
        f"HeteroTrainer needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} (found "
        f"{transformers.__version__}): pip install -U 'hetero[transformers]'"
    )

log = logging.getLogger("hetero.integrations")

HETERO_DIR = NESTED  # the engine's checkpoint root inside a Trainer checkpoint directory
# How long process zero waits in save_model for the other ranks to call it too ([Note: a roll call before save_model])
SAVE_MODEL_WAIT_S = 30.0
_EVERY_RANK = (
    "At ZeRO stage 3 (or with delayed_param_update) save_model gathers the weights from every rank's shard: call "
    "trainer.save_model() on every rank, not under `if trainer.is_world_process_zero():` (only process zero writes "
    "the files, as with the plain Trainer)"
)


class EngineModule(nn.Module):
    """What the Trainer calls "the wrapped model": forward runs through the engine; the model is its submodule."""

    def __init__(self, engine: hetero.Engine) -> None:
        super().__init__()
        object.__setattr__(self, "engine", engine)  # not a submodule: the engine is no nn.Module
        self.module = engine.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def _get_name(self) -> str:
        # The Trainer's label smoother shifts the labels where this names a causal LM class, and for a PEFT model it
        # asks the base model (`base_model.model`): by the PeftModel's own class name it smoothed unshifted labels.
        peft = sys.modules.get("peft")  # a PEFT model exists only once peft is imported
        kinds = tuple(getattr(peft, k) for k in ("PeftModel", "PeftMixedModel") if hasattr(peft, k))
        if kinds and isinstance(self.module, kinds):
            return type(self.module.base_model.model).__name__
        return type(self.module).__name__


class _TrainerOptimizer(torch.optim.Optimizer):
    """The Trainer's optimizer: the engine's param groups; `step` is a no-op (the engine updated in
    training_step), and loading a state dict copies hyperparameters into the engine's groups in place."""

    def __init__(self, engine: hetero.Engine) -> None:  # no super().__init__: the groups are the engine's
        self._engine = engine
        self.defaults = engine.optimizer.defaults
        self.state: defaultdict = defaultdict(dict)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._engine.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self._copy_hyperparameters(groups)

    def _copy_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        for mine, theirs in zip(self.param_groups, groups):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("hetero's optimizer takes no closure")

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # the update cleared the accumulated gradients

    def state_dict(self) -> dict[str, Any]:
        groups, start = [], 0
        for g in self.param_groups:
            groups.append(
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": list(range(start, start + len(g["params"]))),
                }
            )
            start += len(g["params"])
        return {"state": {}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._copy_hyperparameters(state_dict["param_groups"])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("hetero's chunks are laid out once: build the optimizer with every param group up front")

    def __repr__(self) -> str:
        return f"HeteroTrainerOptimizer({type(self._engine.optimizer).__name__})"


class _SchedulerAfterRealUpdates:
    """The Trainer's LR scheduler, not stepped after an update skipped for fp16 overflow."""

    def __init__(self, scheduler: Any, engine: hetero.Engine) -> None:
        self.scheduler = scheduler
        self._engine = engine

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._engine.last_update_skipped:
            return
        if args or kwargs:
            self.scheduler.step(*args, **kwargs)
        else:  # a scheduler built on the user's optimizer (optimizers=) warned that its step was never called
            step_scheduler(self.scheduler)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


class HeteroTrainer(transformers.Trainer):
    """A `transformers.Trainer` whose model trains through hetero (see [Note: the Trainer's loop around an engine]).

    hetero_config: a hetero config (dict, .json/.yaml path, or `hetero.Config`; default ZeRO stage 0 on the
    device); gradient accumulation, clipping and precision come from the TrainingArguments. hetero_weights: weight
    files streamed into the chunks (`weights=` of `hetero.initialize`, for a model built on the meta device).
    """

    def __init__(self, *args: Any, hetero_config: Any = None, hetero_weights: Any = None, **kwargs: Any) -> None:
        self.hetero_config = Config.from_any(hetero_config)
        self.hetero_weights = hetero_weights
        self.engine: hetero.Engine | None = None
        self._engine_module: EngineModule | None = None
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled:
            # A user moving a DeepSpeed run over keeps its JSON: say where each of its parts goes under the Trainer
            # (from_deepspeed's own notes on the optimizer and scheduler sections speak of hetero.initialize).
            raise ConfigError(
                "HeteroTrainer trains through hetero, not DeepSpeed: leave TrainingArguments' deepspeed unset and pass "
                "the same config as hetero_config=hetero.Config.from_deepspeed(<the JSON's path or dict>). Its "
                '"auto" values come from the TrainingArguments as under DeepSpeed (batch sizes, '
                "gradient_accumulation_steps, max_grad_norm, bf16/fp16), and its optimizer and scheduler sections are "
                "the TrainingArguments' optim, learning_rate, weight_decay, lr_scheduler_type and warmup_steps"
            )
        if self.is_fsdp_enabled:
            raise ConfigError(
                "HeteroTrainer trains through hetero, not FSDP: leave TrainingArguments' fsdp unset (hetero shards "
                'the model itself: hetero_config={"zero_stage": 3} is what FSDP\'s full sharding does)'
            )
        if self.args.n_gpu > 1:
            # One process on a machine with several GPUs: the Trainer would run nn.DataParallel, with batches of
            # n_gpu x per_device_train_batch_size and its loss multiplied by n_gpu for the replicas' mean. hetero's
            # engine is one device per process (cuda:LOCAL_RANK), so that batch and factor went into one model:
            # the loss, its gradient and the logs n_gpu times the plain Trainer's. The Trainer forces the same for
            # model parallelism (`is_model_parallel`).
            log.warning(
                "%d GPUs visible to one process: HeteroTrainer trains on one of them (one device per process); "
                "launch with torchrun --nproc_per_node=%d to train on all",
                self.args.n_gpu,
                self.args.n_gpu,
            )
            self.args._n_gpu = 1
            self._train_batch_size = self.args.train_batch_size

    # ---- building the engine ------------------------------------------------------------------------------
    def engine_config(self) -> Config:
        """hetero_config with accumulation, clipping and precision from the TrainingArguments."""
        args, cfg, default = self.args, self.hetero_config, Config()
        if cfg.parallel.tensor > 1 or cfg.parallel.pipeline > 1:
            # The Trainer's data loader gives every rank a batch of its own (accelerate shards by global rank): the
            # ranks of a tensor group stopped at their first forward with a BatchMismatchError telling them to shard
            # by data-parallel rank, which a Trainer user cannot do, and a pipeline with an error naming train_batch.
            raise ConfigError(
                f"hetero_config.parallel: tensor {cfg.parallel.tensor} x pipeline {cfg.parallel.pipeline}, but "
                "HeteroTrainer trains data parallel only (ZeRO 0-3 and offload over every rank): the Trainer gives "
                "each rank a batch of its own, where a tensor group (sequence modes included) needs one batch on all "
                "its ranks and a pipeline runs through engine.train_batch. Leave parallel.tensor and "
                "parallel.pipeline at 1, or train such a layout with your own loop (examples/train_parallel.py)"
            )
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else cfg.precision
        full_eval = "bf16" if args.bf16_full_eval else "fp16" if args.fp16_full_eval else None
        if full_eval is not None and full_eval != precision:
            # The Trainer casts the wrapped model to that dtype before an evaluation outside train() (evaluate() at
            # the end, predict()); hetero's guard refused the cast there, after the whole run had trained
            raise ConfigError(
                f"{full_eval}_full_eval evaluates a model cast to {full_eval}, but hetero computes in one precision, "
                f"the one it trains in ({precision} here): set {full_eval}=True to train and evaluate in {full_eval}, "
                f"or leave {full_eval}_full_eval off to evaluate in {precision}"
            )
        clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        wanted = {
            "grad_accumulation_steps": args.gradient_accumulation_steps,
            "grad_clip_norm": clip,
            "precision": precision,
        }
        # A config from a DeepSpeed JSON: its given values are checked against the TrainingArguments as Hugging
        # Face's DeepSpeed integration checks them (micro-batch size and precision included), its "auto" ones filled
        # ([Note: a config's DeepSpeed origin]); the values it translated to are not hetero_config's own choices.
        check_trainer_args(cfg, args)
        for key, value in wanted.items():
            mine = getattr(cfg, key)
            if deepspeed_origin(cfg) is None and mine != getattr(default, key) and mine != value:
                raise ConfigError(
                    f"hetero_config.{key} = {mine!r} but the TrainingArguments give {value!r}: the Trainer drives "
                    f"{key}; set it in TrainingArguments (gradient_accumulation_steps, max_grad_norm, bf16/fp16) "
                    "and leave it out of hetero_config (or make the two agree)"
                )
        try:
            return dataclasses.replace(cfg, **wanted)
        except ConfigError as e:
            # hetero_config was valid alone: what clashes is a value the TrainingArguments gave, which the user may
            # never have set (max_grad_norm is 1.0 by default), so name where each one comes from
            raise ConfigError(
                f"{e}. Under HeteroTrainer these come from the TrainingArguments: grad_clip_norm is max_grad_norm "
                f"(here {args.max_grad_norm}; the Trainer's default is 1.0, and 0 turns clipping off), precision is "
                "bf16 / fp16, grad_accumulation_steps is gradient_accumulation_steps"
            ) from None

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.engine is not None:
            if self.engine.module is self.model:
                return self.optimizer
            # model_init built a fresh model for this train() (a second call, a hyperparameter search's next trial)
            # and the Trainer dropped its optimizer, as the plain Trainer starts over: the old engine lets the old
            # model go and a new one takes this one (the old engine's optimizer, None by then, failed the scheduler)
            self.engine.close()
            self.engine = None
        user = super().create_optimizer(model)
        self.engine = hetero.initialize(self.model, user, self.engine_config(), weights=self.hetero_weights)
        if self.args.torch_compile:  # accelerate compiles what it prepares, which is never hetero's model
            kwargs = {"backend": self.args.torch_compile_backend or "inductor", "mode": self.args.torch_compile_mode}
            self.model.compile(**kwargs)  # in place, names unchanged: [Note: hetero's hooks under torch.compile]
        self._engine_module = EngineModule(self.engine)
        self.optimizer = _TrainerOptimizer(self.engine)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if not isinstance(scheduler, (_SchedulerAfterRealUpdates, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            self.lr_scheduler = _SchedulerAfterRealUpdates(scheduler, self.engine)
        return self.lr_scheduler

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if self.engine is None:
            self.create_optimizer()  # evaluation before training: the engine is built once, for both
        return self._engine_module

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        pass  # hetero places the model's state in its chunks (the model may be on the meta device)

    # ---- a training step ----------------------------------------------------------------------------------
    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        engine = self.engine
        model.train()
        inputs = self._prepare_inputs(inputs)
        main = getattr(self.model, "main_input_name", "input_ids")
        tokens = int(inputs[main].numel()) if isinstance(inputs.get(main), torch.Tensor) else None
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if self.args.n_gpu > 1:
            loss = loss.mean()
        # The Trainer's own scaling for accumulation (transformers.Trainer.training_step).
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        engine.set_gradient_accumulation_boundary(bool(self.accelerator.sync_gradients))
        try:
            engine.backward(loss, scale_wrt_gas=False)
            engine.step(tokens=tokens)
        finally:
            engine.set_gradient_accumulation_boundary(None)
        return loss.detach()

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        return self._get_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        # The engine clipped in its update (grad_clip_norm = max_grad_norm) and kept the norm before clipping.
        if self.engine is None:
            return grad_norm
        if self.engine.last_update_skipped:
            # fp16 overflow: the engine keeps the last applied update's norm, which the log would show as this
            # step's; the plain Trainer logs the unscaled overflowed gradient's norm, inf (nan for a nan gradient)
            return math.inf
        return self.engine.last_grad_norm

    # ---- saving and resuming ------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model's full weights for `from_pretrained`, gathered from the chunks (every rank must call it)."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.engine.stage == 3 or self.engine.config.delayed_param_update:
            # the gathers below need every rank: one alone fails in seconds, saying so, instead of waiting comm_timeout
            # for ranks an `is_world_process_zero()` guard kept out ([Note: a roll call before save_model])
            roll_call(self.engine.comm, "HeteroTrainer.save_model", limit_s=SAVE_MODEL_WAIT_S, advice=_EVERY_RANK)
        state = self.engine.full_state_dict()
        self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # A run resumed from an earlier checkpoint saves checkpoint-N folders again, and the Trainer has already
        # written its own files there: hetero's must be replaced too (it stands until the new one is complete).
        root = os.path.join(output_dir, HETERO_DIR)
        self.engine.save_checkpoint(root, lr_scheduler=self._scheduler(), replace=True)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        root = os.path.join(checkpoint, HETERO_DIR)
        if not os.path.isdir(root):
            raise ConfigError(
                f"{checkpoint} holds no hetero checkpoint ({HETERO_DIR}/): it was not saved by HeteroTrainer (or "
                "with save_only_model=True), so the optimizer states cannot be resumed from it. To start from its "
                "weights with fresh optimizer states, load the model with from_pretrained(checkpoint) and train "
                "without resume_from_checkpoint; to resume later runs, save them without save_only_model"
            )
        self.engine.load_checkpoint(root, lr_scheduler=self._scheduler())

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if os.path.isdir(os.path.join(resume_from_checkpoint, HETERO_DIR)):
            return  # the engine's checkpoint restores the fp32 master weights (in _load_optimizer_and_scheduler)
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if self.engine is None or not os.path.isdir(os.path.join(best, HETERO_DIR)):
            return super()._load_best_model()
        log.info("loading the best checkpoint %s (score %s) into the engine", best, self.state.best_metric)
        self.engine.load_checkpoint(os.path.join(best, HETERO_DIR), lr_scheduler=self._scheduler())

    def _scheduler(self) -> Any:
        s = self.lr_scheduler
        return s.scheduler if isinstance(s, _SchedulerAfterRealUpdates) else s
