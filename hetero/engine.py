"""The engine: a user's model and optimizer, trained with their states in chunks across tiers and ranks.

It composes the pieces and holds the training-loop state (micro-step, loss scale); the mechanisms live in
`hetero/memory` (placement) and `hetero/zero` (layout, chunks, hooks, optimizer update).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hetero import standin
from hetero.activation import ActivationMemory, choose_blocks
from hetero.checkpoint.host_copy import HostCopy
from hetero.comm import Comm, collective_failed, init_from_env
from hetero.comm.scoped import ForwardScope
from hetero.comm.watch import post_failure, stopped
from hetero.config import Config
from hetero.config_deepspeed_origin import warn_unfilled_auto
from hetero.config_ranks import agree_config
from hetero.device import make_device
from hetero.errors import CheckpointError, CommError, ConfigError, HeteroError, RankFailedError, add_note
from hetero.events import Events
from hetero.integrations.deepspeed_names import (
    ENGINE_ALONE,
    MISSING,
    DeepSpeedNames,
    check_initialize_args,
    refuse_deepspeed_kwargs,
)
from hetero.memory import ChunkManager, Tier
from hetero.memory.auto import AutoPlacement
from hetero.metrics import Monitor
from hetero.parallel.agree import BatchAgreement
from hetero.parallel.batches import mean_over_ranks, train_batch
from hetero.parallel.pipeline.runtime import PipelineRuntime
from hetero.parallel.pipeline.tied import TiedGrads
from hetero.parallel.setup import by_hand_tensor_parallel, setup_parallel
from hetero.zero import backwards
from hetero.zero.buckets import DenseReduce
from hetero.zero.delayed import DelayedUpdate
from hetero.zero.gathers import Gathers
from hetero.zero.generate import keep_ranks_generating, refuse_generating
from hetero.zero.grad_views import full_grads, named_full_grads
from hetero.zero.handed_over import check_model, guard_casts, hold, route_loads, take_over, watch_structure
from hetero.zero.hooks import Hooks, needs_grad
from hetero.zero.in_backward import InBackward
from hetero.zero.layout import build_layout, chunk_cap, warn_small_chunks
from hetero.zero.loop_clip import route as route_clips
from hetero.zero.loop_watch import LoopWatch
from hetero.zero.loop_writes import LoopWrites
from hetero.zero.materialize import load_values
from hetero.zero.optim import algorithm_of, check_scheduler, step_scheduler
from hetero.zero.optimizer import ZeroOptimizer
from hetero.zero.outside_inference import in_callers_mode, outside_inference_mode
from hetero.zero.precision import COMPUTE_DTYPES, LossScaler
from hetero.zero.predict import Prediction
from hetero.zero.protocol import (
    BACKWARD,
    BACKWARD_FAILED,
    CHECKPOINT,
    FORWARD_FAILED,
    READ_GRADS,
    Checker,
    Reducer,
    adopt_observed_order,
)
from hetero.zero.read_ahead import states_in_backward
from hetero.zero.segments import zero_mode
from hetero.zero.stages import Placement, shard_homes
from hetero.zero.tiling import Tiled, TileRunner, detach_tiled
from hetero.zero.unit_rules import unit_rules
from hetero.zero.units import Entry, find_units
from hetero.zero.update import Updater
from hetero.zero.views import ParameterViews
from hetero.zero.zero_chunk import ZeroChunk

log = logging.getLogger("hetero.engine")
# nn.Module methods that move or cast parameters: the engine does not pass them on to its model.
_MOVERS = frozenset({"to", "cuda", "cpu", "half", "float", "double", "bfloat16", "type", "to_empty", "xpu", "ipu"})

# Gradient reduce-scatters left running while backward goes on; each holds its full-size gradient buffer.
_REDUCES_IN_FLIGHT = 2
_TIERS = {"device": Tier.DEVICE, "host": Tier.HOST, "nvme": Tier.NVME}


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = MISSING,  # type: ignore[assignment]
    config: Config | dict[str, Any] | str | os.PathLike | None = None,
    lr_scheduler: Any = None,
    *,
    comm: Comm | None = None,
    device: torch.device | str | None = None,
    weights: str | os.PathLike | None = None,
    strict_weights: bool = False,
    pipeline_cut_from: str | os.PathLike | None = None,
    **deepspeed_kwargs: Any,
) -> Engine:
    """Wrap a model and its optimizer; returns the engine to train with.

    config: a dict, a path to a .json/.yaml file, or a `hetero.Config`. comm: the group to train on (default: the
    world, joined from torchrun's environment when not yet initialised); `config.parallel`'s tensor and pipeline
    degrees split it into a mesh (`engine.mesh`) and the rest is data parallel. device: default cuda:LOCAL_RANK, else
    CPU. The model may be on the meta device (`hetero.lazy_init()`): it is initialised straight into chunks. weights:
    a .safetensors or .bin file, a directory of them or a Hugging Face index, streamed into the chunks instead
    (hetero/zero/weights.py); strict_weights makes keys the model does not have an error rather than a warning.
    pipeline_cut_from: the checkpoint this run will resume from (`engine.load_checkpoint` it after): pipeline_split
    "auto" cuts the stages where it was cut instead of timing them ([Note: the cut a checkpoint records]).
    optimizer None: an inference engine (forward only, no gradients). lr_scheduler: a scheduler built on `optimizer`;
    the engine steps it once per real update (see `Engine.step`) and saves it in checkpoints.
    """
    check_initialize_args(optimizer, deepspeed_kwargs)  # DeepSpeed's calling style, named
    check_model(model)  # [Note: a model already wrapped for data parallelism]
    config = Config.from_any(config)
    warn_unfilled_auto(config)  # [Note: a config's DeepSpeed origin]
    return Engine(
        model,
        optimizer,
        config,
        lr_scheduler=lr_scheduler,
        comm=comm,
        device=device,
        weights=weights,
        strict_weights=strict_weights,
        pipeline_cut_from=pipeline_cut_from,
    )


class Engine(DeepSpeedNames):
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        config: Config,
        *,
        lr_scheduler: Any = None,
        comm: Comm | None = None,
        device: torch.device | str | None = None,
        weights: str | os.PathLike | None = None,
        strict_weights: bool = False,
        pipeline_cut_from: str | os.PathLike | None = None,
    ) -> None:
        self.config = config
        self.inference = optimizer is None  # forward only: every chunk frozen, no gradients, no update
        # Hook points, any number of subscribers each (the profiler): the phases of a step, then close.
        self.events = Events(
            (
                "forward_begin",
                "forward_end",
                "backward_begin",
                "backward_end",
                "update_begin",
                "update_end",
                "micro_step",
                "close",
                "span",  # (track, name, start, end): background work, timed ([Note: measuring overlap])
            )
        )
        if comm is None:
            world = init_from_env(timeout_s=config.comm_timeout)
        else:
            world = comm.with_timeout(config.comm_timeout)
        agree_config(config, world)  # before any group is made from it: [Note: one config for every rank]
        if config.grad_clip_norm and config.parallel.tensor == 1 and by_hand_tensor_parallel(model):
            raise ConfigError(
                "grad_clip_norm with a model made tensor-parallel by hand (apply_tensor_parallel before "
                'hetero.initialize, no "parallel" config section): each tensor rank would clip by the norm of '
                "its own shards and their replicated weights drift apart. Give the degree in the config's "
                '"parallel" section instead (the engine then sums the norm over the tensor ranks), or leave '
                "grad_clip_norm unset"
            )
        self.device = make_device(device)
        if config.activation_checkpointing and config.parallel.pipeline > 1:
            choose_blocks(model, config.activation_checkpointing)  # on the whole model: a stage may hold no block
        # Tensor and pipeline degrees split the world; the model is cut to this rank's stages and sharded in place.
        saved_cut = None
        if pipeline_cut_from is not None and config.parallel.pipeline > 1:
            from hetero.checkpoint.describe import read_cut

            saved_cut = read_cut(pipeline_cut_from)  # every rank reads it; setup_parallel agrees on it
        self.mesh, self.stages, self.comm, tied = setup_parallel(
            model, optimizer, config.parallel, world, self.device, saved_cut
        )  # comm: the group ZeRO shards and reduces over (data-parallel; with Chimera, both replicas' ranks)
        # The tensor (or sequence) group's ranks agree on each batch before a layer runs ([Note: a batch agreed over
        # the model-parallel group]); the values too while the collective schedule is checked.
        self.agree = BatchAgreement.of(self.mesh, values=config.check_collectives)
        self.module = model  # the user's model, modified in place: parameter names unchanged
        self.algorithm = algorithm_of(optimizer)
        self.dtype = COMPUTE_DTYPES[config.precision]  # parameters' compute dtype
        self.stage = config.zero_stage
        placement = Placement.of(config.offload.params, config.offload.optimizer)
        self.manager = ChunkManager.from_config(config.memory, device=self.device, prefetch_depth=config.prefetch_depth)
        self.manager.storage.backend_may_write = collective_failed  # once a wait failed, memory stays put
        if self.manager.storage.store is not None:  # a failed disk stops every rank, not only this one
            self.manager.storage.store.on_failure = post_failure  # [Note: a rank's failure told to the others]
        chunk_numel = None if config.chunk_size == "auto" else config.chunk_size
        # "auto": at most what the budgets hold with room to spare, the same on every rank (the smallest budgets').
        every = self.mesh.world if self.mesh.pp_size * self.mesh.tp_size > 1 else None  # tied copies tile alike
        cap = (
            None
            if chunk_numel is not None
            else chunk_cap(config, self.manager, self.algorithm, self.comm, agree_over=every)
        )
        specs = build_layout(
            model, optimizer, chunk_numel=chunk_numel, world=self.comm.size, max_chunk_numel=cap, tiling=config.tiling
        )
        warn_small_chunks(config, specs, self.manager, n_states=len(self.algorithm.state_names), world=self.comm.size)
        # Out-of-memory advice names the size "auto" chose ([Note: a figure at the chunk size it was counted at]).
        if chunk_numel is None:
            self.manager.storage.auto_chunk_numel = max((s.chunk_numel for s in specs), default=None)
        self.chunks: list[ZeroChunk] = []
        self._entries: dict[int, Entry] = {}  # param id -> where the parameter lives (a whole one)
        tiled: dict[int, Tiled] = {}  # param id -> its tiles, for a parameter split over chunks ([Note: tiles])
        homes = shard_homes(  # [Note: parameter shards kept on the host]
            [s.capacity for s in specs],
            placement,
            world=self.comm.size,
            itemsize=self.dtype.itemsize,
            host_bytes=config.offload.params_host_bytes,
        )
        for spec, home in zip(specs, homes):
            zc = ZeroChunk(
                spec,
                manager=self.manager,
                comm=self.comm,
                stage=self.stage,
                dtype=self.dtype,
                placement=dataclasses.replace(placement, params=home),
                state_names=self.algorithm.state_names,
                keep_master=config.delayed_param_update_prediction,
            )
            self.chunks.append(zc)
            for info, slot in zip(spec.params, zc.slots):
                if info.tiled:
                    t = tiled.setdefault(id(info.param), Tiled(info.name, info.param, []))
                    t.tiles.append(Entry(zc, info, slot))
                else:
                    self._entries[id(info.param)] = Entry(zc, info, slot)
        # Rank 0's values broadcast, a meta model's own initialiser chunk by chunk, or weight files streamed in.
        load_values(
            model,
            self.chunks,
            manager=self.manager,
            comm=self.comm,
            weights=weights,
            strict=strict_weights,
            progress=config.progress,
        )
        detach_tiled(tiled, dtype=self.dtype, device=self.device.torch_device)
        # Parameters held by several pipeline ranks (a tied embedding): their gradients summed before reduction.
        self.tied = TiedGrads(*tied, self._entries, self.mesh.pp_rank) if tied is not None else None
        self.trainable = [zc for zc in self.chunks if zc.spec.trainable]
        self.auto = None  # "auto" placement: the device budget follows the step's activations
        if "auto" in (config.offload.params, config.offload.optimizer):
            self.auto = AutoPlacement(self.manager, self.device, prefetch_depth=config.prefetch_depth)
        self._move_buffers(model)
        self.micro_steps = 0  # micro-batches seen (engine.step calls)
        self.accumulated = 0  # micro-batches since the last update (0: at an accumulation boundary)
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's override of the count
        self._in_step = False  # between the first forward of a micro-batch and its backward's end
        self._grads_final = False  # the backward that ends an accumulation ran, its step() has not: full_grads
        self._backward_open = False  # inside engine.backward or train_batch: gradients may arrive ([Note: the
        # optimizer handed over] in hetero/zero/handed_over.py says why a loop's own loss.backward() is refused)
        in_groups = {id(p) for g in (optimizer.param_groups if optimizer is not None else []) for p in g["params"]}
        # Parameters the optimizer holds that were frozen at initialize: no chunk keeps a gradient or state for them.
        self._frozen_in_groups = [
            e.info for e in self._entries.values() if not e.info.trainable and id(e.info.param) in in_groups
        ]
        # The collective protocol ([Note: every rank in step]): units and gathers at stage 3, the reduce order at
        # stages 2-3, and the check that every rank is about to run the same collective.
        self.units = find_units(model, self._entries) if self.stage == 3 else []
        self.check = Checker(self.comm, enabled=config.check_collectives, units=self.units, chunks=self.chunks)
        check = self.check  # (not self: the store's judges would keep the engine alive)
        # Without the checks, a forward that raises is agreed in the store ([Note: a forward that fails]).
        scoped = self.comm.size > 1 and not self.check.enabled and self.mesh.tp_size == 1
        self._forwards = ForwardScope(self.comm, lambda: check.seq) if scoped else None
        self._backwards = ForwardScope(self.comm, lambda: check.seq, kind="backward") if scoped else None
        self.gathers = None
        if self.stage == 3:
            budget, host = self.manager.ledgers[Tier.DEVICE].budget, self.manager.ledgers[Tier.HOST].budget
            rules = unit_rules(self.units, self.comm, budget, ahead=config.gather_ahead, host_budget=host)
            self.gathers = Gathers(
                self.units, self.chunks, self.check, keep=rules.keep, may_pin_whole=rules.whole, ahead=rules.ahead
            )
        self._unit_of = {id(e.info.param): u for u in self.units for e in u.entries}  # a parameter's (last) unit
        # Forwards gather across ranks: Hugging Face's generate runs until every rank has ended ([Note: generating in
        # step] in hetero/zero/generate.py).
        in_step = self.stage == 3 and self.comm.size > 1 and self.mesh.pp_size == 1 and world.is_job
        # A tensor group generates from one prompt and one random stream ([Note: one prompt and one stream per tensor
        # group]).
        grouped = self.mesh.batch_group.size > 1
        self._generating = None
        if in_step or grouped:
            agree = self.agree.check if grouped else None
            self._generating = keep_ranks_generating(
                model, synced=in_step, agree=agree, device_rng=self.device.rng_state
            )
        if self.mesh.pp_size > 1 or self.mesh.sequence_parts > 1:  # refused by name, not deep inside the model
            parts = self.mesh.sequence_parts
            self._generating = refuse_generating(model, pipeline=self.mesh.pp_size > 1, sequence_parts=parts)
        deliver = weakref.WeakMethod(self._on_tile_grad)
        target = weakref.WeakMethod(self._tile_grad_target)
        # Layers whose weight is split over chunks compute on one tile at a time ([Note: computing on tiles]).
        self.tiles = TileRunner(
            model,
            tiled,
            stage=self.stage,
            check=self.check,
            deliver=lambda e, g, last: deliver()(e, g, last),
            target=lambda e: target()(e),
        )
        sharded_grads = [zc for zc in self.trainable if zc.grad_full is not None]
        self.reducer = Reducer(sharded_grads, self.check, in_flight=self._reduces_in_flight)
        if self.gathers is not None and self.comm.size > 1:
            # Backward also gathers: a chunk's reduction goes out when the units using it end their backward, the
            # same point on every rank ([Note: reductions at shared points]).
            self.reducer.at_unit_ends = True
            done = weakref.WeakMethod(self._units_done)
            self.gathers.on_done = lambda chunks: done()(chunks)
            for t in self.tiles.tiled.values():
                for e in t.tiles:
                    self.gathers.watch_tile(e.chunk, t.modules)
            self.gathers.take_turns(self.tiles)  # a tiled layer some ranks skip ([Note: tile gathers in turns])
        # Stages 0-1 reduce during the backward before an update ([Note: reducing during backward at stages 0-1]).
        dense = [zc for zc in self.trainable if zc.grad_full is None]
        self.dense = DenseReduce(dense, manager=self.manager, comm=self.comm, check=self.check)
        self.updater = Updater(
            self.chunks,
            manager=self.manager,
            mesh=self.mesh,
            config=config,
            algorithm=self.algorithm,
            check=self.check,
            comm=self.comm,
        )
        self.updater.reduced_early = self.dense.take
        spans = weakref.WeakMethod(self._span)

        def on_span(*a: object) -> None:
            fn = spans()
            if fn is not None:
                fn(*a)

        for part in (self.reducer, self.dense.reducer, self.updater):
            part.on_span = on_span
        self.optimizer = ZeroOptimizer(self.updater, optimizer) if optimizer is not None else None
        keep = functools.partial(zero_mode, self.chunks)  # [Note: the optimizer handed over]
        self._handed_back = take_over(optimizer, keep) if optimizer is not None else None
        self._loads_back = route_loads(model, _loading(weakref.ref(self)))  # [Note: loading weights into a held model]
        self._casts_back = guard_casts(model)  # [Note: casting or moving a held model]
        self._clips_back = route_clips(model.parameters(), self)  # [Note: the loop's clip_grad_norm_]
        self._structure_changed = False  # a module of the model registered a parameter or submodule since
        me = weakref.ref(self)
        self._unwatch = watch_structure(model, lambda: setattr(me(), "_structure_changed", True) if me() else None)
        self.lr_scheduler = check_scheduler(lr_scheduler, optimizer)  # stepped once per real update
        # What the loop steps besides the engine: [Note: a loop stepping what the engine steps]
        self.watch = LoopWatch(grad_accumulation_steps=config.grad_accumulation_steps, scheduler=self.lr_scheduler)
        self.monitor = Monitor(self)  # metrics(): throughput, losses, and the optional tensorboard / wandb sink
        # The model's hooks reach the engine weakly: the model may outlive it, and a dropped engine must free its
        # memory and swap files.
        on_grad = weakref.WeakMethod(self._on_grad)
        self.hooks = Hooks(
            self._entries, model=model, units=self.units, gathers=self.gathers, on_grad=lambda p: on_grad()(p)
        )
        if config.delayed_param_update:  # the update runs during the next step ([Note: the delayed parameter update])
            predict = None
            if config.delayed_param_update_prediction:  # [Note: predicting past the delay]
                tp = self.mesh.tp if self.mesh.tp_size > 1 else None  # a tensor's slices make one scale
                predict = Prediction(self.algorithm, self.updater.chunks, self.updater.comm, tp)  # trainable
            self.updater.delayed = DelayedUpdate(self.updater, model, predict)
        self.in_backward = None  # update_in_backward: chunks step as backward completes them
        if config.update_in_backward:
            if self.mesh.tp_size > 1 or self.mesh.pp_size > 1:
                raise ConfigError(
                    "update_in_backward: the gradient norm under tensor or pipeline parallelism is summed over "
                    "ranks before any chunk steps; set parallel.tensor and parallel.pipeline to 1, or leave "
                    "update_in_backward false"
                )
            self.in_backward = self.updater.in_backward = InBackward(self.updater)
            for reducer in (self.reducer, self.dense.reducer):
                reducer.on_issued = self.in_backward.issued
                reducer.on_reduced = self.in_backward.reduced
        self.views = ParameterViews(
            model,
            self.chunks,
            self._entries,
            check=self.check,
            comm=self.comm,
            device=self.device,
            dtype=self.dtype,
            tiled=self.tiles.tiled,
            manager=self.manager,
            mesh=self.mesh,
        )
        if self.stages:  # full_state_dict in the model's key order ([Note: the whole model's order])
            self.views.order = self.stages[0].model_keys
        # Stages 0-2: the loop's in-place writes into parameters reach the masters ([Note: the loop's writes into
        # parameters] in hetero/zero/loop_writes.py); taken in as a gathered block opens, noted after one that wrote.
        self.loop_writes = LoopWrites(self.trainable, self.device, self.dtype, delayed=config.delayed_param_update)
        self.views.on_enter, self.views.on_modified = self.loop_writes.adopt, self.loop_writes.note
        self.activations = None  # checkpointing / input offload on the chosen blocks (hetero/activation.py)
        if config.activation_checkpointing:
            self.activations = ActivationMemory(
                model,
                config.activation_checkpointing,
                offload=config.activation_offload,
                manager=self.manager,
                device=self.device,
                strict=self.stages is None,
            )
            if self.gathers is not None and self.gathers.turns is not None:  # [Note: tile gathers in turns]
                self.activations.recomputing = self.gathers.turns.recomputing
        self._closed = False
        self._runtime = None  # the pipeline runtime, made at the first train_batch
        self.pending_save: Any = None  # an async_save not yet committed (hetero/checkpoint/background.py)
        self.checkpoint_copy = HostCopy()  # host memory async saves' copies hold ([Note: the checkpoint copy's memory])
        self._unhold = hold(model)  # another initialize of this model is refused until close
        # An inference engine's parameters take no gradient: frozen while it holds them, so that a loss of another
        # model backpropagated through this one (a reward or perceptual model judging it) computes its inputs'
        # gradients only ([Note: a backward through another engine's model] in hetero/zero/backwards.py).
        self._unfreeze = [p for p in model.parameters() if p.requires_grad] if self.inference else []
        for p in self._unfreeze:
            p.requires_grad_(False)

    # ---- the training loop ----------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The engine's bookkeeping outside inference mode, the model's compute in the caller's mode: [Note: hetero's
        # memory under inference mode] in hetero/zero/outside_inference.py.
        inference = torch.is_inference_mode_enabled()
        with outside_inference_mode():
            return self._forward(inference, args, kwargs)

    def _forward(self, inference: bool, args: tuple, kwargs: dict) -> Any:
        # A training step (for the access trace) runs from its first forward to the end of its backward; a forward
        # without autograd (evaluation, generation) is a step of its own, of another kind: each kind replays its own
        # trace ([Note: one trace per kind of step] in hetero/memory/policy.py).
        training = torch.is_grad_enabled() and not self.inference
        if self.stages is not None:
            raise RuntimeError("with parallel.pipeline > 1 the model runs in stages: call train_batch or eval_batch")
        self._refuse_if_stopped("a forward")
        self.agree.check({**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}, "engine(...)")
        # A forward without autograd between a training forward and its backward (a target computed by the same
        # model) belongs to that step: ending the step there would drop what its backward needs.
        within = self._in_step
        if not self._in_step:
            # One without autograd between a backward and its update (a metric on the batch) is a step within that
            # training step, which resumes for the update ([Note: a step within a step] in hetero/memory/policy.py).
            self._begin_step(training)
        self.events.emit("forward_begin")
        self.watch.forward(training=training)
        args, kwargs = self.to_device((args, kwargs))
        saving = self.auto.saved_tensors() if self.auto is not None else contextlib.nullcontext()
        # An inference engine records autograd only for inputs that require a gradient (its output then carries
        # one back to them: a loss judged by this model), as a frozen model does in plain PyTorch.
        no_grad = torch.no_grad() if self.inference and not needs_grad((args, kwargs)) else contextlib.nullcontext()
        if self._forwards is not None:
            self._forwards.begin()
        try:
            with self.device.compute_context(), saving, no_grad, in_callers_mode(inference):
                out = self.module(*args, **kwargs)
        except BaseException as e:  # [Note: a forward that fails]; an interrupt too (an evaluation stopped by hand)
            self.watch.forward_raised(training=training)  # [Note: a step without its backward]: no step() for it
            self._forward_failed(e, began=not within)
            raise
        if self._forwards is not None:
            self._forwards.end()
        if self.gathers is not None:
            self.gathers.end_forward(training=training or within)
        if training or within:
            self.manager.forward_end()  # [Note: what the forward takes again]
        else:
            self.manager.step_end()
            self._in_step = False
        self.events.emit("forward_end")
        return out

    forward = __call__

    @contextlib.contextmanager
    def forward_agreed(self, *, began: bool = False) -> Iterator[None]:
        """Around a forward that `engine(...)` does not make (a micro-batch of `train_batch`, a batch through the
        pipeline stages, train_batch's loss_fn): counted as `engine(...)`'s are, and if it raises, agreed over the
        data-parallel ranks as theirs are ([Note: a forward that fails]); the batch, not this, ends the step it runs
        in, unless `began` (the step began with this batch, and nothing else ends it)."""
        if self._forwards is not None:
            self._forwards.begin()
        try:
            yield
        except BaseException as e:
            self._forward_failed(e, began=began)
            raise
        if self._forwards is not None:
            self._forwards.end()

    def _forward_failed(self, failed: BaseException, *, began: bool) -> None:
        """After the model's forward raised: every rank agrees that it did, then this forward is undone, and the
        step with it where the forward began it. began: no forward of the step came before this one."""
        # [Note: a forward that fails]
        # A loop that catches a bad batch (token ids out of range, a shape error, an out-of-memory error, an
        # interrupted evaluation) and goes on expects what plain PyTorch gives: training as if the batch had never
        # been fed. A forward adds no gradient, so nothing of the accumulation is dropped (the earlier micro-batches'
        # gradients stay, as in plain PyTorch and DeepSpeed, and the update comes after grad_accumulation_steps
        # step() calls, which the loop makes for the batches it keeps). Before, at stage 3 the parameters the
        # failing modules had pinned stayed pinned (their post-forward hooks never ran), so the next step's release
        # raised "cannot be released while [...] are being computed on" for good; and at every stage the step stayed
        # open, so the next forward joined the failed one's step (an evaluation forward kept its chunks gathered,
        # the access trace took the two for one). Now the uses end and the units in progress are left
        # (`Gathers.abort_forward`); a forward that began its step ends it as a failed backward's does: gathered
        # chunks and saved activations released, the step not kept as the trace to replay. A forward that joined a
        # step (a second forward before one backward, a target computed without autograd) leaves that step open:
        # the earlier forward's graph is whole, and its backward runs as without the failure.
        # Over several ranks a rank cannot skip a batch alone: at stage 3 the others are inside a gather it will
        # never join, and at stages 0-2 they would pair their backward's reductions with its next batch's. So the
        # ranks agree first, with a check of the collective schedule ([Note: checks posted, verified at the wait]):
        # ranks whose forwards all raised at the same point of their programs agree and go on together; where one
        # rank failed alone the check finds the others at another collective and every rank stops with an error
        # naming both sides, instead of hanging. With check_collectives off there is no such check: the rank posts
        # its failure for this forward and point of the schedule, and the ranks agree in the job's store
        # ([Note: failures scoped to a point] in hetero/comm/watch.py): all raised there, and they go on; a rank that
        # went past that point stops at its next wait longer than a second, and so does every rank.
        # A rank of a tensor-parallel group cannot skip a batch at all: its peers wait inside the layer's collectives
        # (an all-reduce it never joins), and whether they all raised at the same point is not known (the schedule's
        # count covers the data-parallel group's collectives only); ranks that raised at different points would pair
        # their next collectives wrongly. So it posts its failure for good, which stops its peers within a second,
        # and every rank of the job with them, and this engine refuses further batches.
        # hetero's own collective errors (CommError) pass as they are: nothing more may be sent.
        if isinstance(failed, CommError):
            return
        if self.mesh.tp_size > 1:
            self._stop_for(failed)
        elif self.comm.size > 1:
            self._agree_failed(
                failed,
                lambda: self.check(FORWARD_FAILED),
                self._forwards,
                "",
                "check the batch before the forward on every rank, or skip it on every rank together",
            )
        if self.gathers is not None:
            self.gathers.abort_forward()
        if not began:
            return
        self.tiles.step_end()
        if self.gathers is not None:
            self.gathers.release_all()
        if self.activations is not None:
            self.activations.step_end()
        self.manager.step_end(keep=False)
        self._in_step = False

    def _stop_for(self, failed: BaseException, what: str = "a forward") -> None:
        """A forward, a batch or a backward (`what`) raised on a rank of a tensor-parallel group: tell every rank to
        stop ([Note: a forward that fails], [Note: a backward that fails])."""
        why = f"in {what} of tensor-parallel group {self.mesh.tp.global_ranks}, which its peers cannot skip with it"
        post_failure(failed, why=why)
        add_note(
            failed,
            f"hetero: this rank's tensor-parallel peers (global ranks {self.mesh.tp.global_ranks}) wait inside "
            f"collectives it will not join ({what} raised here), and a tensor-parallel group cannot skip a batch, not "
            "even when every rank of it raises (hetero cannot tell that they raised at the same point, and "
            "collectives issued at different points pair wrongly). Every rank of the job was told to stop, and this "
            "engine runs no further batch: find the cause (above), then resume from the last checkpoint",
        )

    def _refuse_if_stopped(self, what: str) -> None:
        own = stopped()
        if own is None:
            return
        raise RankFailedError(
            f"{what} on global rank {own.rank} refused: this rank stopped (global rank {own.origin} failed with "
            f"{own.cause}) and told every rank of the job, which stop too. Its collectives would pair with others "
            "its peers left waiting, so it runs none: resume from the last checkpoint",
            failed_rank=own.origin,
            cause=own.cause,
        )

    def __iter__(self) -> Any:
        # `engine, optimizer, _, _ = hetero.initialize(...)` (DeepSpeed's four-tuple) met "cannot unpack
        # non-iterable Engine object"; nothing iterates an engine otherwise.
        raise TypeError(ENGINE_ALONE)

    def train(self, mode: bool = True) -> Engine:
        """The model's `train(mode)`; returns the engine, as `nn.Module.train` returns the module."""
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def __getattr__(self, name: str) -> Any:
        # What the engine lacks, the model answers (`engine.parameters()`, `engine.generate(...)`,
        # `engine.compile()`), as DeepSpeed's engine does: a loop written for either runs on both. Reached only when
        # normal lookup fails; private names, and names looked up before the model is set, stay errors (the engine's
        # own attributes are never the model's by accident).
        module = self.__dict__.get("module")
        if module is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if name in _MOVERS:  # an AttributeError: hasattr(engine, "to") is False, as the engine has none
            raise AttributeError(
                f"engine.{name}(): hetero places the parameters (in its chunks, on its tiers) and moving them would "
                "take them out; choose the device with hetero.initialize(..., device=...) and the compute dtype "
                "with the config's precision"
            )
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"neither the engine nor its model ({type(module).__name__}) has an attribute {name!r}"
            ) from None

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True, retain_graph: bool | None = None) -> None:
        """Backward of loss / grad_accumulation_steps (scaled for fp16): the accumulated gradient is the mean.
        scale_wrt_gas False: backward of the loss as given (a caller that already divided it, like HF's Trainer).
        retain_graph: torch's, for a second backward through the same graph (its gradients add up before `step()`,
        as in plain PyTorch)."""
        if self.inference:
            raise RuntimeError("this engine was made with optimizer=None (inference): it has no gradients to compute")
        self._refuse_if_stopped("engine.backward")
        self.events.emit("backward_begin")
        self.monitor.loss(loss)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if scale_wrt_gas:
            scale /= self.config.grad_accumulation_steps
        boundary = self.is_gradient_accumulation_boundary()  # the next step() updates: every rank counts alike
        self.watch.backward(counted=self._boundary is None)
        self.loop_writes.adopt()  # before anything of this backward reads the masters (update_in_backward)
        if self._grads_final:  # a second backward into the same update: its gradients add to the reduced ones
            self.dense.reopen()
        self.dense.begin(last_micro_batch=boundary)
        if self.in_backward is not None:
            self.in_backward.begin(boundary=boundary)
        elif boundary and self.updater.delayed is None:  # the update after this backward reads its first states now
            states_in_backward(self.updater.manager, self.updater.chunks)
        failed = None
        with self.device.compute_context(), self.backward_open(retain_graph=bool(retain_graph)):
            if self._backwards is not None:
                self._backwards.begin()
            try:
                (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
            except CommError:
                raise  # ranks out of step (a mismatch, a rank gone): nothing more may be sent
            except Exception as e:  # [Note: a backward that fails]: agreed, ended as any, its gradients dropped
                if self.in_backward is not None:
                    self.in_backward.abort(e)  # no chunk steps after the failure (the error names those before)
                failed = e
            for zc in self.trainable:
                zc.host_sum.flush()  # stages 0-1: the gradients of chunks not complete (unused parameters) go down
        if failed is not None:
            self.watch.backward_dropped()  # no step() for it ([Note: a step without its backward])
            self._backward_failed(failed)  # raises where the ranks did not all raise at this point
        elif self._backwards is not None:
            self._backwards.end()
        try:
            self._end_backward(boundary, retain_graph=bool(retain_graph), failed=failed is not None)
        except Exception as ending:
            if failed is None:
                raise
            add_note(failed, f"hetero: ending that backward failed too: {ending!r}")
            raise failed from None  # the backward's own error first
        self.events.emit("backward_end")
        if failed is not None:
            self.drop_accumulation(failed)
            raise failed

    def _backward_failed(self, failed: Exception) -> None:
        """engine.backward raised on this rank: every data-parallel rank agrees that it raised at this point, before
        the backward is ended (which sends collectives); where they do not, raises, and this rank sends nothing
        more ([Note: a backward that fails])."""
        if self.mesh.tp_size > 1:  # its tensor peers wait in the block's backward collectives: none can skip it
            self._stop_for(failed, "engine.backward")
            raise failed
        if self.comm.size == 1:
            return
        stopped = self._agree_failed(
            failed,
            lambda: self.check(BACKWARD_FAILED, phase=BACKWARD),
            self._backwards,
            " of engine.backward",
            "this engine runs no further batch; resume from the last checkpoint",
        )
        if stopped:
            raise failed

    def _agree_failed(self, failed: Exception, post: Callable[[], Any], scope: Any, where: str, then: str) -> bool:
        """Every data-parallel rank agrees that `failed` raised at this point: a posted check (`post`) verified now,
        or without the checks `scope`'s agreement in the job's store ([Note: failures scoped to a point]). Where the
        ranks did not all raise here, this rank posts its failure for good and notes why; returns whether it did."""
        if self.check.enabled:
            post()
            try:
                self.check.verify(None)
            except CommError as e:
                raise e from failed
            return False
        stops = scope.agree(failed) if scope is not None else []
        if not stops:
            return False
        post_failure(failed)
        ranks = sorted({f.rank for f in stops})
        add_note(
            failed,
            f"hetero: global rank(s) {', '.join(map(str, ranks))} of data-parallel group {self.comm.global_ranks} did "
            f"not raise at this point{where} (check_collectives is off): a rank cannot skip a batch alone, because "
            f"the others' collectives wait for it. Every rank stops; {then}",
        )
        return True

    def _end_backward(self, boundary: bool, *, retain_graph: bool, failed: bool) -> None:
        """After the autograd pass: the reductions completed, the parts that follow units and steps reset."""
        # Chunks whose gradients did not all arrive (parameters this rank did not use) are reduced now, in the
        # reduce order, which is the same on every rank.
        self.reducer.flush()
        self.dense.end()
        if self.in_backward is not None:
            self.in_backward.end()
        if not failed:  # a partial backward teaches no order
            order = adopt_observed_order((self.reducer, self.dense.reducer), self.comm)  # once, after the first one
            if order is not None and self.in_backward is not None:
                self.in_backward.adopt(order)
        self.tiles.step_end()
        for zc in self.trainable:
            zc.grads_seen.clear()
        if self.gathers is not None:
            self.gathers.release_all(keep_forwards=retain_graph and not failed)
            if not failed:
                self.gathers.learn(self.comm)  # once, after the first backward ([Note: one backward hook per unit])
        if self.activations is not None:
            self.activations.step_end()
        if self.config.grad_accumulation_steps != 1:
            self.manager.step_end()
        # else: the update that follows belongs to the step's trace, so that prefetch and eviction see it coming
        # (backward then keeps the gradients the update reads first); the update (`Updater.step`), or the next
        # forward, ends it.
        self._in_step = False
        self._grads_final = boundary  # full_grads may read them until step()

    def drop_accumulation(self, failed: BaseException, *, what: str = "engine.backward") -> None:
        """After a backward (or a pipeline's batch: `train_batch`, or its `on_grads`: `what`) that raised: its
        gradients, and those of the accumulation's micro-batches before it, are dropped, and the accumulation starts
        again."""
        # [Note: a backward that fails]
        # A backward that raises (out of memory, a check in the model's own backward hook) had added part of its
        # gradients into the chunks: the next update stepped on them (measured: a loop skipping such a batch, as
        # plain PyTorch loops skip an out-of-memory batch after optimizer.zero_grad(), ended 0.0085 off plain
        # PyTorch's weights three steps later). The backward is ended as any other (its reductions completed, in the
        # same order on every rank, gathers and activations released), then the accumulation's gradients are
        # dropped, the earlier micro-batches' with it, and the accumulation starts again: what the plain loop's
        # zero_grad() does. Over several data-parallel ranks the ranks first agree that each raised at the same
        # point (`_backward_failed`), as a failed forward's do ([Note: a forward that fails]): with the checks on, a
        # BACKWARD_FAILED check; without them, a post for this backward and point of the collective schedule,
        # agreed in the store ([Note: failures scoped to a point] in hetero/comm/watch.py). Ranks that all raised
        # there end the backward together (the same collectives: decided from the reduce order and the schedule's
        # count, shared state). A rank that raised alone used to end its backward anyway: the reductions it sent
        # met its peers' update or next batch (gloo aborted a process on mismatched sizes, or the peers waited
        # until comm_timeout); now every rank stops within about a second, naming it, and it sends nothing more.
        # A rank of a tensor-parallel group agrees with nobody: its peers wait inside the block's backward collectives
        # (an all-reduce it never joins), and whether they all raised at the same point is not known (the schedule
        # counts the data-parallel group's collectives only). It used to end its backward and go on to its next
        # batch, its peers waiting until comm_timeout; now it posts its failure for good before sending anything
        # more (`_stop_for`, as a failed forward does), every rank stops within about a second, naming it and its
        # error, and its backward is left unended: part of its gradient stays in the chunks, so `step()`, another
        # backward, forward or batch on it is refused (RankFailedError); `close()` still frees it. Resume from the
        # last checkpoint.
        # hetero's own collective errors (a mismatch, a rank gone: CommError) pass at once: ending the backward would
        # send more collectives to ranks that are not coming (in the first try, every test of a rank diverging hung
        # there). With update_in_backward, the backward that ends an
        # accumulation steps chunks as it goes: those stepped before the failure are not undone (the error says how
        # many, and to load the last checkpoint), no other steps, and the backward is ended and dropped as here. It
        # used to pass as it was, unended: a backward before the update left its part of the gradient for the next
        # one, and after a failed update's backward neither the next step nor a checkpoint's load went on.
        dropped = self.accumulated
        self.watch.backward_dropped()
        self.settle_update()  # a pending delayed update still reads the gradient buffers
        self.updater.zero_grads()
        self.dense.forget()  # reduced ones too: the next update reduces what the accumulation adds anew
        self.accumulated = 0
        self._grads_final = False
        self.manager.step_end(keep=False)  # a partial step is no trace to replay: the next one is recorded afresh
        log.warning(
            "%s raised %s: its gradients are dropped%s, and the accumulation starts again",
            what,
            type(failed).__name__,
            f" with those of the {dropped} micro-batch(es) before it" if dropped else "",
        )

    def step(self, *, tokens: int | None = None) -> None:
        """Call after every micro-batch: updates (and zeroes gradients) at the accumulation boundary, then steps the
        LR scheduler given to `initialize`. An update skipped for fp16 overflow is no optimizer step, so the
        scheduler does not advance (torch's convention: a schedule counts `optimizer.step()`s, and GradScaler skips
        that call on overflow). tokens: this micro-batch's token count, for `metrics()["tokens_per_s"]`."""
        if self.inference:
            raise RuntimeError("this engine was made with optimizer=None (inference): there is no update to step")
        # A rank that stopped (a tensor-parallel rank's failed backward) left part of a gradient in the chunks, and
        # its update's collectives would pair with others its peers left waiting.
        self._refuse_if_stopped("engine.step")
        # Before anything is counted, and before the update's first collective: [Note: a step without its backward]
        # in hetero/zero/loop_watch.py.
        self.watch.before_step()
        boundary = self.is_gradient_accumulation_boundary()
        self._grads_final = False
        self.watch.step()
        self.micro_steps += 1
        self.accumulated += 1
        self.monitor.micro_batch(tokens)
        if boundary:
            self.events.emit("update_begin")
            # The update queues its work and never waits for it ([Note: host waits]): checked under the stand-in.
            with standin.watching(self.device):
                self.watch.before_update()
                self.loop_writes.adopt()
                with self.optimizer.stepping():  # [Note: the update is engine.step()'s]
                    self.optimizer.step()
                self.loop_writes.note()
                self.accumulated = 0
                if self.lr_scheduler is not None and not self.updater.last_update_skipped:
                    step_scheduler(self.lr_scheduler)
                    self.watch.stepped_scheduler()
                self.monitor.update()
            self.events.emit("update_end")
        self.events.emit("micro_step")
        if boundary and self.pending_save is not None:  # [Note: a save written while training goes on]
            self.pending_save.poll()

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the micro-batch being computed is the last of its accumulation: the next `step()` updates."""
        if self._boundary is not None:
            return self._boundary
        return self.accumulated + 1 >= self.config.grad_accumulation_steps

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Override the count: the next `step()` updates (True) or only accumulates (False); None: count again.
        A loop whose last accumulation is shorter (the end of an epoch) ends it with True."""
        self._boundary = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's `no_sync`, for loops written for it: the backwards inside only accumulate (no reduction across
        ranks, no update at a `step()` inside); the first backward after it ends the accumulation, and its
        `step()` updates (as the count would have it: with `grad_accumulation_steps` 1, at once)."""
        before = self._boundary
        self._boundary = False
        try:
            yield
        finally:
            self._boundary = before

    def metrics(self) -> dict[str, Any]:
        """Step, loss scale, last gradient norm, skipped steps, learning rate, tokens/s (when `step` is given tokens),
        per-tier memory and bytes moved between tiers (hetero/metrics.py)."""
        return self.monitor.metrics()

    def train_batch(
        self,
        inputs: Any,
        labels: Any = None,
        loss_fn: Any = None,
        *,
        on_grads: Callable[[Engine], Any] | None = None,
    ) -> torch.Tensor:
        """Forward, backward and step on this data-parallel rank's batch, split into `parallel.microbatches`
        micro-batches (through the pipeline stages when there are any); returns the mean loss over the global batch,
        on every rank. loss_fn None: the model's own `.loss` from `model(inputs, labels=labels)`.
        on_grads: called with the engine on every rank after the batch's last backward and before its update (and
        clipping), when this batch ends an accumulation: `engine.full_grads()` works inside it; what it returns is
        ignored. Pass it on every rank or on none ([Note: gradients read inside train_batch] in
        hetero/zero/grad_views.py)."""
        self._refuse_if_stopped("train_batch")
        if on_grads is not None and not callable(on_grads):
            raise TypeError(
                f"train_batch: on_grads must be a callable taking the engine, got {type(on_grads).__name__}"
            )
        before_update = functools.partial(self._on_grads, on_grads) if on_grads is not None else None
        with self.agree.entry({"inputs": inputs, "labels": labels}, "train_batch"):
            if self.stages is not None or self.config.parallel.microbatches > 1:
                try:
                    return train_batch(self, inputs, labels, loss_fn, before_update=before_update)
                except BaseException as e:
                    # [Note: a forward that fails]; where its forward told the others, this rank stopped already
                    # A failed async_save raised at its update boundary, on every rank alike: training may go on.
                    agreed = (CommError, CheckpointError)
                    if self.mesh.tp_size > 1 and not isinstance(e, agreed) and stopped() is None:
                        self._stop_for(e, "train_batch")
                    raise
            if loss_fn is None:
                out = self(inputs, labels=labels)
                loss = out.loss if hasattr(out, "loss") else out["loss"]
            else:
                began = not self._in_step
                out = self(inputs)
                # The loss is part of the forward: a loss_fn raising on one rank (a label out of range) left the
                # others in the backward's reductions, which its next batch met (a batch apart, silently).
                with self.forward_agreed(began=began):
                    loss = loss_fn(out, labels.to(self.device.torch_device))
                del out
            forwards_done = self.check.seq
            self.backward(loss)
            if on_grads is not None:
                self._on_grads(on_grads, reduced=True)  # engine.backward reduced them and marked them final
            self.step()
        mean = self.device.to_host(loss.detach(), torch.float32, copy=True)
        mean_over_ranks(self, mean, self.comm, forwards_done)
        return mean

    def _on_grads(self, on_grads: Callable[[Engine], Any], *, reduced: bool = False) -> None:
        """train_batch's `on_grads`, after the batch's last backward, before its update; `reduced`: the gradients are
        reduced and marked final already (engine.backward did it), else a batch of micro-batches ends here
        ([Note: gradients read inside train_batch] in hetero/zero/grad_views.py)."""
        if not self.is_gradient_accumulation_boundary():
            return  # the accumulation goes on: its last batch's callback reads the gradients
        if not reduced:
            self.dense.reduce_now()  # stages 0-1: the update's reduction, now (stages 2-3 reduced the batch already)
            self._grads_final = True
        try:
            on_grads(self)
        except BaseException as e:
            self._grads_final = False
            if isinstance(e, CommError):  # a collective inside it failed: nothing more may be sent
                raise
            if self.mesh.world.size == 1:
                self.drop_accumulation(e, what="train_batch's on_grads")
                raise
            post_failure(e, why="in train_batch's on_grads, whose collectives its peers may be inside")
            add_note(
                e,
                "hetero: on_grads raised on this rank; the other ranks may wait inside a collective of theirs "
                "(full_grads gathers) or in the update's, which this rank will not join, and where each rank stopped "
                "inside its callback is not known. Every rank of the job was told to stop, and this engine runs no "
                "further batch: fix the callback (the error above), then resume from the last checkpoint",
            )
            raise

    def eval_batch(self, inputs: Any, labels: Any = None, loss_fn: Any = None) -> Any:
        """A forward only through every stage and shard: with labels the global mean loss, else this data-parallel
        rank's whole outputs, on every rank (`hetero/parallel/evaluation.py`)."""
        from hetero.parallel.evaluation import eval_batch

        self._refuse_if_stopped("eval_batch")
        with self.agree.entry({"inputs": inputs, "labels": labels}, "eval_batch"):
            try:
                return eval_batch(self, inputs, labels, loss_fn)
            except BaseException as e:
                # [Note: a forward that fails]; where its forward told the others, this rank stopped already
                if self.mesh.tp_size > 1 and not isinstance(e, CommError) and stopped() is None:
                    self._stop_for(e, "eval_batch")
                raise

    # ---- the update ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def backward_open(self, *, retain_graph: bool = False) -> Iterator[None]:
        """Where gradients may reach the chunks: engine.backward's and train_batch's backwards (another engine's
        model it runs through drops its own: [Note: a backward through another engine's model] in
        hetero/zero/backwards.py). Checks first that no parameter frozen at initialize was unfrozen since, and that
        the model has no trainable parameter hetero does not hold."""
        if self._structure_changed and self.stages is None:  # a pipeline rank's model holds other stages' too
            self._check_no_new_parameters()
            self._structure_changed = False
        for info in self._frozen_in_groups:
            if info.param.requires_grad:
                raise HeteroError(
                    f"parameter {info.name!r} had requires_grad False when hetero.initialize laid out its chunks, so "
                    "hetero keeps no gradient or optimizer state for it and cannot train it now that it is unfrozen. "
                    "Leave it requires_grad True at initialize and freeze it with requires_grad_(False) for the steps "
                    "it should not train (its update is then skipped, as torch's optimizers skip a parameter "
                    "without a gradient)"
                )
        self.updater.clip_stats = None  # the gradient changes: a clip before this backward measured another
        self._set_backward_open(True)
        try:
            with backwards.training_backward(self, retain_graph=retain_graph):
                yield
        finally:
            self._set_backward_open(False)
        self.watch.backward_ended()  # engine.backward unmarks one that raised inside ([Note: a step without its
        # backward] in hetero/zero/loop_watch.py)

    def _check_no_new_parameters(self) -> None:
        # A module added or replaced after initialize (a new head, resize_token_embeddings, peft's get_peft_model on
        # the held model) had parameters no chunk holds: they took gradients in .grad and were never updated.
        for p in self.module.parameters():
            if p.requires_grad and id(p) not in self._entries and id(p) not in self.tiles.tiled:
                name = next(n for n, q in self.module.named_parameters() if q is p)
                raise HeteroError(
                    f"parameter {name!r} (shape {list(p.shape)}) is not one hetero.initialize laid out: a module "
                    "added or replaced after initialize (a new head, resize_token_embeddings, peft's get_peft_model "
                    "on the held model) would get gradients and never an update. Build the model completely (new "
                    "layers and adapters included) before hetero.initialize, or freeze that parameter"
                )

    def _set_backward_open(self, is_open: bool) -> None:
        # The parts that run in any backward tell the training one from torch.autograd.grad's: [Note: backwards
        # that are not the training one] in hetero/zero/tiling.py.
        self._backward_open = is_open
        self.tiles.accumulating = is_open
        if self.gathers is not None:
            self.gathers.accumulating = is_open

    def _on_grad(self, param: torch.Tensor) -> None:
        e = self._entries[id(param)]
        # Tiles' gradients never come outside it: [Note: backwards that are not the training one] in tiling.py.
        if not self._backward_open:
            if backwards.foreign():  # another engine's loss backpropagated through this model: dropped (its Note)
                param.grad = None
                if self.gathers is not None:
                    self.gathers.grad_arrived(e, self._unit_of[id(param)])
                return
            raise HeteroError(
                f"the gradient of {e.info.name!r} reached hetero outside engine.backward(loss): a loop's own "
                "loss.backward() skips what the engine does around backward (loss scaling, accumulation, the "
                "reduction across ranks), and nothing would train. Call engine.backward(loss) then engine.step(), "
                "or engine.train_batch"
            )
        grad = param.grad
        param.grad = None
        if grad.layout is not torch.strided:  # nn.Embedding(sparse=True): its chunk sums dense rows (zeros elsewhere)
            grad = grad.to_dense()
        self._add_grad(e, grad, last=True)
        if self.gathers is not None:
            self.gathers.grad_arrived(e, self._unit_of[id(param)])

    def _on_tile_grad(self, e: Entry, grad: torch.Tensor, last: bool) -> None:
        """A tile's gradient of one use of its weight; `last`: no other use of it in this micro-batch is pending."""
        self._add_grad(e, grad, last=last)

    def _tile_grad_target(self, e: Entry) -> torch.Tensor | None:
        """Where a tile's gradient may be computed in place (`ZeroChunk.grad_target`), else None."""
        if self.updater.delayed is not None:
            self.updater.delayed.settle(e.chunk)  # the pending update reads the buffer this gradient goes into
        return e.chunk.grad_target(e)

    def _add_grad(self, e: Entry, grad: torch.Tensor, *, last: bool) -> None:
        """Add a gradient into its chunk; once the chunk's are all in, hand it to its reduction (at stage 3 over
        several ranks the units' backward ends do that: [Note: reductions at shared points])."""
        if self.reducer.at_unit_ends and self.reducer.sent(e.chunk):
            raise RuntimeError(
                f"the gradient of {e.info.name!r} arrived after every unit using it (at zero_stage 3, the blocks and "
                "the top-level modules with parameters) had ended its backward, and its chunk's reduction had gone "
                "out: in forward it was used before that unit ran, where no module hook saw it (read directly, or "
                "a tiled layer called from elsewhere). Use it only inside or after its own block, or use "
                "zero_stage <= 2."
            )
        if self.updater.delayed is not None:
            self.updater.delayed.settle(e.chunk)  # the pending update reads the buffer this gradient goes into
        complete = e.chunk.add_grad(e, grad)
        if not (last and complete):
            return
        if self.stage >= 2 and not e.chunk.accumulate_full:  # accumulate_full: reduced once per batch
            if not self.reducer.at_unit_ends:
                self.reducer.ready(e.chunk)
        elif self.stage < 2:
            self.dense.ready(e.chunk)

    def _units_done(self, chunks: list[ZeroChunk]) -> None:
        """Every unit using these chunks has ended its backward, on every rank: their reductions may go out."""
        if not self._backward_open:  # [Note: a backward through another engine's model]: nothing of ours reduces
            return
        for zc in chunks:
            if zc.spec.trainable and zc.grad_full is not None and not zc.accumulate_full:
                self.reducer.ready(zc)

    def _span(self, track: str, name: str, start: float, end: float) -> None:
        if self.events.has("span"):
            self.events.emit("span", track, name, start, end)

    def _reduces_in_flight(self, zc: ZeroChunk) -> int:
        # Each reduce in flight holds a full gradient buffer on the device: keep them only with room to spare. This
        # decides only when a rank waits, never what it issues or in which order.
        roomy = self.manager.ledgers[Tier.DEVICE].free >= 4 * zc.grad_full.nbytes
        return _REDUCES_IN_FLIGHT if roomy else 0

    # ---- views of the model (hetero/zero/views.py) ----------------------------------------------------------
    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's state_dict with full values (CPU copies, compute dtype): chunks gathered one by one,
        tensor-parallel shards joined, every pipeline stage's keys collected (hetero/parallel/full_state.py); the keys
        are the model's own as before initialize, tied parameters under each of their names. Every rank calls it (it
        gathers) and every rank then holds the whole model on the CPU; rank0_only: global rank 0 alone gets it, the
        others an empty dict. This rank's own part (shards, its stage): `local_state_dict()`."""
        self.settle_update()
        return self.views.full_state_dict(rank0_only=rank0_only)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's own part of the state_dict (its tensor shards, its pipeline stage's keys) with full values over
        the ZeRO group (CPU copies, compute dtype), a pending delayed update applied first. Every rank calls it (it
        gathers over the ZeRO group)."""
        self.settle_update()
        return self.views.local_state_dict()

    def full_grads(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The gradients the next update steps on, by parameter name (trainable ones): of the accumulated loss,
        averaged over data-parallel ranks, unscaled, before clipping; fp32 CPU copies of the whole model's (tensor
        shards joined, pipeline stages collected, as `full_state_dict`). Call it after the backward that ends an
        accumulation, before `step()`, or with `train_batch` (pipelines, micro-batches) inside its `on_grads`
        callback, which runs at that point; every rank calls it (it gathers); rank0_only: global rank 0 alone gets
        them, the others an empty dict. See [Note: reading the gradients] and [Note: gradients read inside
        train_batch] in hetero/zero/grad_views.py."""
        if self.inference:
            raise RuntimeError("this engine was made with optimizer=None (inference): it has no gradients")
        if self.in_backward is not None:
            raise RuntimeError(
                "full_grads: with update_in_backward each chunk steps as soon as its gradient is final, during "
                "backward, and the gradient is gone by the time backward returns; turn it off to read gradients"
            )
        if not self._grads_final:
            raise RuntimeError(
                "full_grads reads the gradients between the backward that ends an accumulation (the next step() "
                "updates: engine.is_gradient_accumulation_boundary() was true for it) and that step(); before, a "
                "sharded gradient may not be reduced yet, and after it the update has consumed it. With train_batch "
                "(pipelines, micro-batches) call it inside train_batch(..., on_grads=fn), which runs fn(engine) there"
            )
        scale = self.scaler.scale if self.scaler is not None else 1.0
        values = full_grads(self.trainable, check=self.check, scale=scale)
        return named_full_grads(values, self.module, self.mesh, order=self.views.order, rank0_only=rank0_only)

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        parameters: list[torch.Tensor] | None = None,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """The loop's gradient clipping, as `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` (which
        calls this while the engine holds the model): returns the norm of the whole gradient (the data-parallel mean,
        unscaled) and the next update clips by it, as `grad_clip_norm` does. Call it after the backward that ends an
        accumulation, before `step()`; every rank calls it ([Note: the loop's clip_grad_norm_] in
        hetero/zero/loop_clip.py)."""
        if self.inference:
            raise RuntimeError("this engine was made with optimizer=None (inference): it has no gradients to clip")
        if self.in_backward is not None:
            raise RuntimeError(
                "clip_grad_norm_: with update_in_backward each chunk steps during backward, before the whole "
                "gradient's norm is known and before a loop could clip; turn update_in_backward off to clip"
            )
        if not self._grads_final:
            raise RuntimeError(
                "clip_grad_norm_ clips the gradient the next update steps on: call it after the backward that ends an "
                "accumulation (engine.is_gradient_accumulation_boundary() was true for it) and before that step(), "
                "as a plain loop clips before optimizer.step()"
            )
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_: hetero clips by the whole gradient's 2-norm; got norm_type={norm_type}")
        if parameters is not None:
            mine = {id(info.param) for zc in self.trainable for info in zc.spec.params}
            given = {id(p) for p in parameters if id(p) in mine or p.requires_grad}
            if given != mine:
                raise RuntimeError(
                    "clip_grad_norm_ was given part of the parameters this engine updates: hetero clips the whole "
                    "gradient at its update. Pass model.parameters() (or engine.parameters()), or set grad_clip_norm"
                )
        self.check(READ_GRADS)
        sq, _ = self.updater.stats_to_clip()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        norm = math.sqrt(sq) / scale  # nan where a gradient is nan, as torch's clip_grad_norm_ returns
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(f"the total norm of order 2.0 for gradients from `parameters` is non-finite ({norm})")
        self.updater.clip_to(float(max_norm))
        return torch.full((), norm, device=self.device.torch_device)

    def gathered_parameters(self, params: Iterable[torch.Tensor] | None = None, modify: bool = False) -> Any:
        """A context manager that makes the full values of `params` (default: every parameter) readable through the
        model's own parameters, on every rank, for the duration of the block. Every rank must enter it with the same
        parameters (it gathers). With `modify=True`, what rank 0 writes to them inside the block is what every rank
        holds after it: rank 0's values are broadcast, and the fp32 master weights take every element that changed.

        At stage 3, outside such a block (and outside forward and backward) a parameter's values are not on the
        rank: reading one raises `ReleasedParameterError`, and `model.state_dict()` does too; use this block, or
        `full_state_dict()` for a copy of every weight."""
        self.settle_update()
        return self.views.gathered(params, modify=modify)

    # ---- checkpoints (hetero/checkpoint) -------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike, client_state: Any = None, **kwargs: Any) -> str:
        """Save a checkpoint under the root directory `path` (every rank calls it); returns its directory.
        Keyword-only extras: lr_scheduler=, tag=, replace=, async_save= (return once the state is copied to host
        memory; committed at a later update or `wait_checkpoint()`). See `hetero.checkpoint.save`."""
        from hetero.checkpoint import save_checkpoint

        if isinstance(client_state, (str, int)) and "tag" not in kwargs:
            # DeepSpeed's save_checkpoint(save_dir, tag, client_state): its second argument is the tag
            raise TypeError(
                f"save_checkpoint's second argument is client_state (your own state, saved with the checkpoint and "
                f"returned by load_checkpoint); got {client_state!r}, a tag? Pass tag={client_state!r}"
            )
        kwargs = refuse_deepspeed_kwargs("save_checkpoint", kwargs)
        # Every rank saves: one alone would meet the others' next collective ([Note: every rank in step]).
        self.check(CHECKPOINT)
        self._no_update_in_flight("save_checkpoint")
        self.settle_update()
        self.loop_writes.adopt()  # the masters saved are the values the loop sees
        return save_checkpoint(self, path, client_state, **kwargs)

    def load_checkpoint(self, path: str | os.PathLike, tag: str | int | None = None, **kwargs: Any) -> Any:
        """Restore a checkpoint (a root: its latest; or a checkpoint directory), resharding as needed; returns the
        saved client_state. tag: the checkpoint under the root `path` that `save_checkpoint(path, tag=...)` wrote
        (DeepSpeed's `load_checkpoint(load_dir, tag)`). Keyword-only extra: lr_scheduler=. See
        `hetero.checkpoint.load`."""
        from hetero.checkpoint import load_checkpoint

        kwargs = refuse_deepspeed_kwargs("load_checkpoint", kwargs)
        if tag is not None:
            path = os.path.join(os.fspath(path), str(tag))
        self.check(CHECKPOINT)
        self.wait_checkpoint()
        self._no_update_in_flight("load_checkpoint")
        self.settle_update()
        loaded = load_checkpoint(self, path, **kwargs)
        self.watch.stepped_scheduler()  # restored with the checkpoint, where it was given
        self.watch.loaded()  # the next step() needs a backward of its own
        self.loop_writes.note()
        return loaded

    def wait_checkpoint(self) -> str | None:
        """Every rank: block until the pending `async_save` is committed; its directory (None if none was pending)."""
        return self.pending_save.wait() if self.pending_save is not None else None

    @property
    def checkpoint_pending(self) -> bool:
        """Whether an `async_save` is still being written, not yet committed."""
        return self.pending_save is not None

    def _no_update_in_flight(self, what: str) -> None:
        # update_in_backward: between that backward and step() the parameters are new but the update is not yet
        # counted (step count, scheduler): a checkpoint taken there would resume one update off.
        if self.in_backward is not None and self.in_backward.done:
            raise RuntimeError(
                f"{what}: with update_in_backward the backward just run already updated the parameters, and "
                "engine.step() has not counted that update yet; call engine.step() first"
            )

    def settle_update(self) -> None:
        """With `delayed_param_update`: apply the pending update now (every rank calls it: stages 1-2 gather), so
        that parameters and states are those of the last `step()`. A no-op otherwise."""
        if self.updater.delayed is not None:
            self.updater.delayed.complete()

    def memory_stats(self) -> dict[str, Any]:
        """Per tier: current, cached, peak and budget bytes; bytes moved per tier pair; counters (and, with "auto"
        placement, what it measured). Every buffer hetero allocates is in a tier's ledger: staging included."""
        stats = self.manager.memory_stats()
        stats["host"]["checkpoint_copy"] = self.checkpoint_copy.stats()  # outside the budget, while it is written
        stats["tiled"] = self.tiles.stats()  # weights split over chunks, and the modules computing on their tiles
        if self.auto is not None:
            stats["auto"] = self.auto.stats()
        return stats

    def pipeline_runtime(self) -> PipelineRuntime:
        """The runtime that runs this rank's pipeline stages by the configured schedule (made at first use)."""
        if self.stages is None:
            raise RuntimeError("this engine has no pipeline (parallel.pipeline = 1)")
        if self._runtime is None:
            cfg = self.config.parallel
            self._runtime = PipelineRuntime(
                self.stages,
                self.mesh.pp,
                schedule=cfg.schedule,
                microbatches=cfg.microbatches,
                virtual=cfg.virtual_stages,
                device=self.device.torch_device,
            )
        return self._runtime

    def _begin_step(self, training: bool) -> None:
        """Open a step of the access trace: one without autograd is an evaluation, nested in an open training step
        ([Note: one trace per kind of step], [Note: a step within a step] in hetero/memory/policy.py)."""
        self.manager.step_begin("train" if training else "eval", nested=not training)
        self._in_step = True

    @contextlib.contextmanager
    def trace_step(self, *, update_follows: bool = False) -> Iterator[None]:
        """Hold one step of the access trace open around a whole batch (`train_batch`, `eval_batch` through the
        stages), so that prefetch and eviction see its accesses as one step; inside an open micro-batch (a forward
        whose backward has not run) it adds nothing. A batch run without autograd (`eval_batch`) replays the trace of
        evaluation, not of training ([Note: one trace per kind of step] in hetero/memory/policy.py), and between a
        backward and its update is a step within that one ([Note: a step within a step]). update_follows: the batch's
        `step()` comes next; with `grad_accumulation_steps` 1 its update is the step's too, as after `backward`."""
        began = not self._in_step
        training = torch.is_grad_enabled()
        if began:
            self._begin_step(training)
        ran = False
        try:
            yield
            ran = True
        finally:
            if began:
                if not (ran and update_follows and self.config.grad_accumulation_steps == 1):
                    self.manager.step_end()
                self._in_step = False

    @property
    def scaler(self) -> LossScaler | None:
        """The loss scaler (fp16 only): dynamic, or static (config loss_scale)."""
        return self.updater.scaler

    @property
    def global_steps(self) -> int:
        """Optimizer updates applied."""
        return self.updater.global_steps

    @property
    def skipped_steps(self) -> int:
        """Updates skipped for fp16 overflow."""
        return self.updater.skipped_steps

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last update, before clipping (None before the first)."""
        return self.updater.last_grad_norm

    @property
    def last_update_skipped(self) -> bool:
        """Whether the last update was skipped for fp16 overflow."""
        return self.updater.last_update_skipped

    # ---- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The engine's own counters and the update's (steps, loss scale, last gradient norm); the chunks and the
        optimizer hold the rest, and `save_checkpoint` keeps all of it."""
        return {"micro_steps": self.micro_steps, "accumulated": self.accumulated, **self.updater.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_steps = state["micro_steps"]
        # Checkpoints from before the counter: every accumulation there had grad_accumulation_steps micro-batches.
        self.accumulated = state.get("accumulated", self.micro_steps % self.config.grad_accumulation_steps)
        self.updater.load_state_dict(state)

    @property
    def data_parallel_rank(self) -> int:
        return self.mesh.batch_rank  # which part of the global batch this rank takes (a sequence group shares one)

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.batch_size

    def close(self) -> None:
        """Remove the hooks, free every chunk and delete swap files. The model's parameters are left empty."""
        if self._closed:
            return
        if self.pending_save is not None:  # committed first (a failed one raises here; close again to close)
            self.pending_save.close()
        self.events.emit("close")
        self._closed = True
        self.monitor.close()
        self.hooks.remove()
        self.check.close()
        for scope in (self._forwards, self._backwards):
            if scope is not None:
                scope.close()
        if self.updater.delayed is not None:
            self.updater.delayed.close()
        if self.updater.overflow is not None:
            self.updater.overflow.close()
        if self.in_backward is not None:
            self.in_backward.close()
        self.tiles.remove()
        if self._generating is not None:
            self._generating()
        if self._handed_back is not None:
            self._handed_back()
        self._loads_back()
        self._casts_back()
        self._clips_back()
        self._unwatch()
        self._unhold()
        for p in self._unfreeze:
            p.requires_grad_(True)
        if self.activations is not None:
            self.activations.remove()
        self.manager.close()

    def __del__(self) -> None:
        # At interpreter shutdown tensors are being torn down under us: leave it to the manager's finalizer (an
        # atexit hook), which removes the swap files without touching tensors.
        if sys.is_finalizing():
            return
        with contextlib.suppress(Exception):
            self.close()

    # ---- helpers ------------------------------------------------------------------------------------------
    def to_device(self, obj: Any) -> Any:
        """Inputs (tensors in nested lists, tuples and dicts) on the compute device, floating ones in the compute
        dtype."""
        if isinstance(obj, torch.Tensor):
            cast = obj.is_floating_point() and self.dtype != torch.float32
            return self.device.to_device(obj, self.dtype if cast else None)
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.to_device(v) for v in obj)
        if isinstance(obj, Mapping):  # a tokenizer's BatchEncoding too (a UserDict, left on the host before)
            return {k: self.to_device(v) for k, v in obj.items()}
        return obj

    def _move_buffers(self, model: nn.Module) -> None:
        for module in model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                cast = buf.is_floating_point() and self.dtype != torch.float32
                setattr(module, name, self.device.to_device(buf, self.dtype if cast else None))  # keeps persistence


def _loading(me: weakref.ref) -> Any:
    """What a module's `load_state_dict` loads under ([Note: loading weights into a held model] in handed_over.py);
    the engine by a weak reference, as the model may outlive it."""

    def loading(params: list[torch.Tensor], exact: dict[int, torch.Tensor]) -> Any:
        engine = me()
        if engine is None or engine.views.open:  # closed, or inside the user's own gathered_parameters block
            return contextlib.nullcontext()
        engine.settle_update()
        return engine.views.gathered(params, modify=True, exact=exact)

    return loading
