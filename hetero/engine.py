"""The engine: a user's model and optimizer, trained with their states in chunks across tiers and ranks.

It composes the pieces and holds the training-loop state (micro-step, loss scale); the mechanisms live in
`hetero/memory` (placement) and `hetero/zero` (layout, chunks, hooks, optimizer update).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from hetero.comm import Comm, init_from_env
from hetero.config import Config
from hetero.device import make_device
from hetero.memory import ChunkManager, ChunkState, TensorState, Tier
from hetero.memory.auto import AutoPlacement
from hetero.parallel import engine_glue
from hetero.zero.activation import ActivationMemory, choose_blocks
from hetero.zero.chunks import Homes, ZeroChunk
from hetero.zero.hooks import Hooks
from hetero.zero.layout import build_layout
from hetero.zero.materialize import load_values
from hetero.zero.optim import algorithm_of, update
from hetero.zero.precision import COMPUTE_DTYPES, LossScaler
from hetero.zero.protocol import SUMMON, UPDATE, Checker, Gathers, Reducer, keep_units
from hetero.zero.units import Entry, find_units

log = logging.getLogger("hetero.engine")

# Gradient reduce-scatters left running while backward goes on; each holds its full-size gradient buffer.
_REDUCES_IN_FLIGHT = 2
_UPDATE_LOOKAHEAD = 2  # chunks whose optimizer states are read ahead of the one stepping (NVMe offload)
_UPDATE_ROOM = 0.85  # of the compute tier's budget, at most, for the chunks stepping and read ahead
_TIERS = {"device": Tier.DEVICE, "host": Tier.HOST, "nvme": Tier.NVME}


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config | dict[str, Any] | str | os.PathLike | None = None,
    *,
    comm: Comm | None = None,
    device: torch.device | str | None = None,
    weights: str | os.PathLike | None = None,
) -> Engine:
    """Wrap a model and its optimizer; returns the engine to train with.

    config: a dict, a path to a .json/.yaml file, or a `hetero.Config`. comm: the group to train on (default: the
    world, joined from torchrun's environment when not yet initialised); `config.parallel`'s tensor and pipeline
    degrees split it into a mesh (`engine.mesh`) and the rest is data parallel. device: default cuda:LOCAL_RANK, else
    CPU. The model may be on the meta device (`hetero.lazy_init()`): it is initialised straight into chunks. weights:
    a .safetensors file, a directory of them or a Hugging Face index, streamed into the chunks instead.
    """
    return Engine(model, optimizer, Config.from_any(config), comm=comm, device=device, weights=weights)


class ZeroOptimizer(torch.optim.Optimizer):
    """`engine.optimizer`: the user's param groups and hyperparameters (LR schedulers drive them); `step` runs the
    chunked update."""

    def __init__(self, engine: Engine, user: torch.optim.Optimizer) -> None:
        super().__init__(user.param_groups, user.defaults)
        self._engine = weakref.ref(engine)  # the engine owns the optimizer, not the reverse

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("hetero's optimizer takes no closure: call engine.backward(loss) and engine.step()")
        self._engine()._update()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine()._zero_grads()


class Engine:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: Config,
        *,
        comm: Comm | None = None,
        device: torch.device | str | None = None,
        weights: str | os.PathLike | None = None,
    ) -> None:
        self.config = config
        if comm is None:
            world = init_from_env(timeout_s=config.comm_timeout)
        else:
            world = comm.with_timeout(config.comm_timeout)
        self.device = make_device(device)
        if config.activation_checkpointing and config.parallel.pipeline > 1:
            choose_blocks(model, config.activation_checkpointing)  # on the whole model: a stage may hold no block
        # Tensor and pipeline degrees split the world; the model is cut to this rank's stages and sharded in place.
        self.mesh, self._stages, self.comm = engine_glue.setup_parallel(
            model, optimizer, config.parallel, world, self.device
        )  # comm: the group ZeRO shards and reduces over (data-parallel; with Chimera, both replicas' ranks)
        self.module = model  # the user's model, modified in place: parameter names unchanged
        self.algorithm = algorithm_of(optimizer)
        self.dtype = COMPUTE_DTYPES[config.precision]  # parameters' compute dtype
        self.stage = config.zero_stage
        homes = _homes(config)
        self.manager = ChunkManager.from_config(config.memory, device=self.device, prefetch_depth=config.prefetch_depth)
        chunk_numel = None if config.chunk_size == "auto" else config.chunk_size
        specs = build_layout(model, optimizer, chunk_numel=chunk_numel, world=self.comm.size)
        self.chunks: list[ZeroChunk] = []
        self._entries: dict[int, Entry] = {}  # param id -> where the parameter lives
        for spec in specs:
            zc = ZeroChunk(
                spec,
                manager=self.manager,
                comm=self.comm,
                stage=self.stage,
                dtype=self.dtype,
                homes=homes,
                state_names=self.algorithm.state_names,
            )
            self.chunks.append(zc)
            for info, slot in zip(spec.params, zc.slots):
                self._entries[id(info.param)] = Entry(zc, info, slot)
        # Rank 0's values broadcast, a meta model's own initialiser chunk by chunk, or weight files streamed in.
        load_values(model, self.chunks, manager=self.manager, comm=self.comm, weights=weights)
        self._trainable = [zc for zc in self.chunks if zc.spec.trainable]
        self.auto = None  # "auto" placement: the device budget follows the step's activations
        if "auto" in (config.offload.params, config.offload.optimizer):
            self.auto = AutoPlacement(self.manager, self.device, prefetch_depth=config.prefetch_depth)
        self._move_buffers(model)
        self.optimizer = ZeroOptimizer(self, optimizer)
        self.scaler = LossScaler() if config.precision == "fp16" else None  # dynamic loss scale (fp16 only)
        self.micro_steps = 0  # micro-batches seen (engine.step calls)
        self.global_steps = 0  # optimizer updates applied
        self.skipped_steps = 0  # updates skipped for fp16 overflow
        self._in_step = False  # between the first forward of a micro-batch and its backward's end
        # The collective protocol ([Note: every rank in step]): units and gathers at stage 3, the reduce order at
        # stages 2-3, and the check that every rank is about to run the same collective.
        self.units = find_units(model, self._entries) if self.stage == 3 else []
        self.check = Checker(self.comm, enabled=config.check_collectives, units=self.units, chunks=self.chunks)
        self.gathers = None
        if self.stage == 3:
            keep = keep_units(self.units, self.comm, self.manager.ledgers[Tier.DEVICE].budget)
            self.gathers = Gathers(self.units, self.chunks, self.check, keep=keep)
        self._unit_of = {id(e.info.param): u for u in self.units for e in u.entries}  # a parameter's (first) unit
        sharded_grads = [zc for zc in self._trainable if zc.grad_full is not None]
        self.reducer = Reducer(sharded_grads, self.check, in_flight=self._reduces_in_flight)
        # The model's hooks reach the engine weakly: the model may outlive it, and a dropped engine must free its
        # memory and swap files.
        on_grad = weakref.WeakMethod(self._on_grad)
        self.hooks = Hooks(
            self._entries, model=model, units=self.units, gathers=self.gathers, on_grad=lambda p: on_grad()(p)
        )
        self.activations = None  # checkpointing / input offload on the chosen blocks (hetero/zero/activation.py)
        if config.activation_checkpointing:
            self.activations = ActivationMemory(
                model,
                config.activation_checkpointing,
                offload=config.activation_offload,
                manager=self.manager,
                device=self.device,
                strict=self._stages is None,
            )
        self._closed = False
        self._runtime = None  # the pipeline runtime, made at the first train_batch

    # ---- the training loop ----------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A training step (for the access trace) runs from its first forward to the end of its backward; a forward
        # without autograd (evaluation, generation) is a step of its own.
        training = torch.is_grad_enabled()
        if self._stages is not None:
            raise RuntimeError(
                "with parallel.pipeline > 1 the model runs in stages: call engine.train_batch or engine.eval_batch"
            )
        if not self._in_step:
            self.manager.step_begin()
            self._in_step = True
        args, kwargs = self._to_device((args, kwargs))
        saving = self.auto.saved_tensors() if self.auto is not None else contextlib.nullcontext()
        with self.device.compute_context(), saving:
            out = self.module(*args, **kwargs)
        if self.gathers is not None:
            self.gathers.end_forward(training=training)
        if not training:
            self.manager.step_end()
            self._in_step = False
        return out

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of loss / grad_accumulation_steps (scaled for fp16): the accumulated gradient is the mean."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        with self.device.compute_context():
            (loss * (scale / self.config.grad_accumulation_steps)).backward()
        # Chunks whose gradients did not all arrive (parameters this rank did not use) are reduced now, in the
        # reduce order, which is the same on every rank.
        self.reducer.flush()
        for zc in self._trainable:
            zc.grads_seen.clear()
        if self.gathers is not None:
            self.gathers.release_all()
        if self.activations is not None:
            self.activations.step_end()
        if self.config.grad_accumulation_steps != 1:
            self.manager.step_end()
        # else: the update that follows belongs to the step's trace, so that prefetch and eviction see it coming
        # (backward then keeps the gradients the update reads first); `_update`, or the next forward, ends it.
        self._in_step = False

    def step(self) -> None:
        """Call after every micro-batch: updates (and zeroes gradients) at the accumulation boundary."""
        self.micro_steps += 1
        if self.micro_steps % self.config.grad_accumulation_steps == 0:
            self.optimizer.step()

    def train_batch(self, inputs: Any, labels: Any = None, loss_fn: Any = None) -> torch.Tensor:
        """Forward, backward and step on this data-parallel rank's batch, split into `parallel.microbatches`
        micro-batches (through the pipeline stages when there are any); returns the mean loss over the global batch,
        on every rank. loss_fn None: the model's own `.loss` from `model(inputs, labels=labels)`."""
        if self._stages is not None or self.config.parallel.microbatches > 1:
            return engine_glue.train_batch(self, inputs, labels, loss_fn)
        if loss_fn is None:
            out = self(inputs, labels=labels)
            loss = out.loss if hasattr(out, "loss") else out["loss"]
        else:
            loss = loss_fn(self(inputs), labels.to(self.device.torch_device))
        self.backward(loss)
        self.step()
        mean = self.device.to_host(loss.detach(), torch.float32, copy=True)
        self.comm.control.all_reduce(mean, op="avg")
        return mean

    def eval_batch(self, inputs: Any, labels: Any = None, loss_fn: Any = None) -> Any:
        """A forward only, through every stage and shard (no gradients, weights unchanged). With labels: the mean
        loss over the global batch, on every rank (loss_fn None: the model's own `.loss` with labels=). Without:
        the outputs of this data-parallel rank's batch (the last stage's, whole logits), on every rank. See
        `hetero/parallel/evaluation.py`."""
        from hetero.parallel.evaluation import eval_batch

        return eval_batch(self, inputs, labels, loss_fn)

    # ---- the update ---------------------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        e = self._entries[id(param)]
        grad = param.grad
        param.grad = None
        complete = e.chunk.add_grad(e, grad)
        if self.gathers is not None:
            self.gathers.grad_arrived(e, self._unit_of[id(param)])
        if complete and self.stage >= 2 and not e.chunk.accumulate_full:  # accumulate_full: reduced once per batch
            self.reducer.ready(e.chunk)

    def _reduces_in_flight(self, zc: ZeroChunk) -> int:
        # Each reduce in flight holds a full gradient buffer on the device: keep them only with room to spare. This
        # decides only when a rank waits, never what it issues or in which order.
        roomy = self.manager.ledgers[Tier.DEVICE].free >= 4 * zc.grad_full.nbytes
        return _REDUCES_IN_FLIGHT if roomy else 0

    @torch.no_grad()
    def _update(self) -> None:
        self.check(UPDATE)
        for zc in self._trainable:
            zc.reduce_at_update()
        inv_scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        # Without clipping or loss scaling the norm is only reported: summed during the update, so that gradients
        # spilled to NVMe are read once, not twice (see [Note: the update pipeline]).
        # Under tensor or pipeline parallelism the norm needs more than the data-parallel sum: computed up front.
        fused_norm = (
            self.scaler is None
            and self.config.grad_clip_norm is None
            and self.mesh.tp_size == 1
            and self.mesh.pp_size == 1
        )
        sq, finite = (torch.zeros((), dtype=torch.float64), True) if fused_norm else self._grad_stats()
        if self.scaler is not None:
            overflow = not finite
            self.scaler.update(overflow)
            if overflow:
                self.skipped_steps += 1
                log.info("fp16 gradients overflowed: step skipped, loss scale now %g", self.scaler.scale)
                self._zero_grads()
                self.manager.step_end()
                return
        coef = inv_scale
        if self.config.grad_clip_norm is not None:
            norm = math.sqrt(sq) * inv_scale
            coef *= min(1.0, self.config.grad_clip_norm / (norm + 1e-6))
        if not fused_norm:
            self.last_grad_norm = math.sqrt(sq) * inv_scale  # before clipping, like clip_grad_norm_'s return
        names = self.algorithm.state_names
        used = torch.cat([zc.used for zc in self._trainable])
        self.comm.control.all_reduce(used, op="max")  # a parameter any rank used has a (mean) gradient
        used_of = used.split([len(zc.spec.params) for zc in self._trainable])
        for i, zc in enumerate(self._trainable):
            if zc.homes.optim is Tier.NVME:
                if self.stage == 3 and zc.shard.slots[0].state is TensorState.HOLD:
                    # Overwritten whole by write_back below: say so now, before anything reads it ahead of use.
                    zc.shard.set_state(zc.shard.slots[0], TensorState.FREE)
                self._prefetch_update(i, zc.homes.compute)
            grad = zc.grad_view()
            if fused_norm:
                sq += torch.linalg.vector_norm(grad, dtype=torch.float64).cpu() ** 2
            with self.manager.pinned(zc.grad):
                if coef != 1.0:
                    grad.mul_(coef)
                master, states = zc.optimizer_views()
                with self.manager.pinned(zc.optim):
                    group = self.optimizer.param_groups[zc.spec.group]
                    for a, b, steps in zc.update_segments(used_of[i]):
                        seg_states = {n: st[a:b] for n, st in zip(names, states)}
                        step = torch.tensor(float(steps), device=master.device)
                        update(self.algorithm, group, master[a:b], grad[a:b], seg_states, step)
                    zc.write_back(master)
            if zc.homes.optim is Tier.NVME:
                self.manager.move(zc.optim, Tier.NVME, wait=False)  # written back while the next chunk steps
                if zc.grad.all_free and zc.grad.state is not ChunkState.EMPTY:
                    self.manager.release(zc.grad)  # zeroed (stages 2-3 hold no data until the next reduce)
                self._prefetch_update(i + 1, zc.homes.compute)
        if fused_norm:
            if self.stage >= 1:
                self.comm.control.all_reduce(sq, op="sum")
            self.last_grad_norm = math.sqrt(float(sq))
        self.global_steps += 1
        self.manager.step_end()  # a no-op unless backward left the step open for the update

    def _prefetch_update(self, i: int, tier: Tier) -> None:
        """[Note: the update pipeline]
        With optimizer states on NVMe the update streams them: chunk i steps while the states (and any gradient
        spilled to NVMe) of chunks i+1 and i+2 are read and chunk i-1 is written back. A read that finds the host
        full is chained behind a write-back of the same size (see the manager's [Note: reads chained behind
        write-backs]), so it starts the moment that write ends, not at the next call into the manager."""
        # Chunk i first, then as many of the next _UPDATE_LOOKAHEAD as leave the tier room to spare (a read ahead
        # that crowds out the chunk stepping now is evicted again before its use).
        room = int(self.manager.ledgers[tier].budget * _UPDATE_ROOM)
        ahead: list[ZeroChunk] = []
        for zc in self._trainable[i : i + 1 + _UPDATE_LOOKAHEAD]:
            room -= zc.grad.nbytes + zc.optim.nbytes + (zc.shard.nbytes if zc.shard is not None else 0)
            if ahead and room < 0:
                break
            ahead.append(zc)
        wanted = [c for zc in ahead for c in (zc.grad, zc.optim)]
        # Every gradient still to be used stays: evicting one for a read ahead would write it only to read it back.
        later = [zc.grad for zc in self._trainable[i + len(ahead) :]]
        self.manager.prefetch(wanted, tier, keep=wanted + later)

    def _grad_stats(self) -> tuple[float, bool]:
        """Sum of squares of the (scaled) gradient over all ranks, and whether it is finite everywhere."""
        if self.mesh.tp_size > 1 or self.mesh.pp_size > 1:
            return engine_glue.grad_stats(self)
        sq = torch.zeros((), dtype=torch.float64)
        for zc in self._trainable:
            sq += torch.linalg.vector_norm(zc.grad_view(), dtype=torch.float64).cpu() ** 2
        if self.stage >= 1:  # shards are disjoint: sum them; at stage 0 every rank holds the whole reduced gradient
            self.comm.control.all_reduce(sq, op="sum")
        value = float(sq)
        return value, math.isfinite(value)

    def _zero_grads(self) -> None:
        for zc in self._trainable:
            zc.zero_grad()

    # ---- views of the model ---------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with full values (CPU copies, compute dtype), gathered chunk by chunk; the keys
        are the model's own, tied parameters under each of their names. Every rank calls it (it gathers)."""
        values: dict[int, torch.Tensor] = {}
        for zc in self.chunks:
            with self._summoned([zc]):
                for info, value in zip(zc.spec.params, zc.full_values().values()):
                    values[id(info.param)] = value
        return {
            name: values[id(t)] if id(t) in values else t.detach().to("cpu", copy=True)
            for name, t in self.module.state_dict(keep_vars=True).items()
        }

    @contextlib.contextmanager
    def gathered_parameters(self, params: Iterable[torch.Tensor] | None = None, modify: bool = False) -> Iterator[None]:
        """Make the full values of `params` (default: every parameter) readable through the model's own parameters,
        on every rank, for the duration of the block. Every rank must enter it with the same parameters (it
        gathers). With `modify=True`, what rank 0 writes to them inside the block is what every rank holds after it:
        rank 0's values are broadcast, and the fp32 master weights take every element that changed.

        At stage 3, outside such a block (and outside forward and backward) a parameter's values are not on the
        rank: reading one raises `ReleasedParameterError`, and `model.state_dict()` does too; use this block, or
        `full_state_dict()` for a copy of every weight."""
        if params is None:
            chunks = list(self.chunks)
        else:
            wanted = {id(p) for p in params}
            unknown = wanted - set(self._entries)
            if unknown:
                raise ValueError(
                    f"gathered_parameters: {len(unknown)} of the tensors given are not parameters this engine manages"
                )
            chunks = [zc for zc in self.chunks if any(id(i.param) in wanted for i in zc.spec.params)]
        with self._summoned(chunks):
            yield
            if modify:
                self._adopt_rank0(chunks)

    @contextlib.contextmanager
    def _summoned(self, chunks: list[ZeroChunk]) -> Iterator[None]:
        """Gather the chunks (if not gathered) and hold every parameter of them in use; release what was gathered
        for the purpose on the way out."""
        fresh = [zc for zc in chunks if not zc.gathered]
        entries = [self._entries[id(i.param)] for zc in chunks for i in zc.spec.params]
        for zc in chunks:
            if not zc.gathered:
                self.check(SUMMON, chunk=zc.spec.index)
            zc.unshard()
            for e in entries:
                if e.chunk is zc:
                    zc.enter(e)
        try:
            yield
        finally:
            for e in entries:
                e.chunk.exit(e, TensorState.HOLD)
            for zc in fresh:
                zc.reshard()

    def _adopt_rank0(self, chunks: list[ZeroChunk]) -> None:
        """After `gathered_parameters(modify=True)`: every rank takes rank 0's values, shards and master weights
        included (an element whose compute-dtype value did not change keeps its fp32 master)."""
        for zc in chunks:
            full = zc.full.payload
            self.comm.broadcast(full, src=0)
            if zc.optim is None:  # frozen: no master weights
                if zc.stage == 3:
                    zc.write_shard(full)
                continue
            master, _ = zc.optimizer_views()
            mine = zc.master_range(full)
            new = self.device.to_host(mine, torch.float32) if master.device.type == "cpu" else mine.float()
            changed = new != master.to(self.dtype).to(torch.float32)
            master[changed] = new[changed]
            if zc.stage == 3:
                zc.write_shard(full)

    # ---- checkpoints (hetero/checkpoint) -------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike, client_state: Any = None, **kwargs: Any) -> str:
        """Save a checkpoint under the root directory `path` (every rank calls it); returns its directory.
        Keyword-only extras: lr_scheduler=, tag=. See `hetero.checkpoint.save`."""
        from hetero.checkpoint import save_checkpoint

        return save_checkpoint(self, path, client_state, **kwargs)

    def load_checkpoint(self, path: str | os.PathLike, **kwargs: Any) -> Any:
        """Restore a checkpoint (a root: its latest; or a checkpoint directory), resharding as needed; returns the
        saved client_state. Keyword-only extra: lr_scheduler=. See `hetero.checkpoint.load`."""
        from hetero.checkpoint import load_checkpoint

        return load_checkpoint(self, path, **kwargs)

    def memory_stats(self) -> dict[str, Any]:
        """Per tier: current, cached, peak and budget bytes; bytes moved per tier pair; counters (and, with "auto"
        placement, what it measured). Every buffer hetero allocates is in a tier's ledger: staging included."""
        stats = self.manager.memory_stats()
        if self.auto is not None:
            stats["auto"] = self.auto.stats()
        return stats

    def _pipeline_runtime(self) -> engine_glue.PipelineRuntime:
        if self._runtime is None:
            self._runtime = engine_glue.make_runtime(self)
        return self._runtime

    @property
    def data_parallel_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.dp_size

    def close(self) -> None:
        """Remove the hooks, free every chunk and delete swap files. The model's parameters are left empty."""
        if self._closed:
            return
        self._closed = True
        self.hooks.remove()
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
    def _to_device(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            cast = obj.is_floating_point() and self.dtype != torch.float32
            return self.device.to_device(obj, self.dtype if cast else None)
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._to_device(v) for v in obj)
        if isinstance(obj, dict):
            return {k: self._to_device(v) for k, v in obj.items()}
        return obj

    def _move_buffers(self, model: nn.Module) -> None:
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is None:
                    continue
                cast = buf.is_floating_point() and self.dtype != torch.float32
                module._buffers[name] = self.device.to_device(buf, self.dtype if cast else None)


def _homes(config: Config) -> Homes:
    # "auto": home on the device, evicted down as the step's activations need the room (hetero/memory/auto.py).
    # Config checks that offloaded parameters come with stage 3.
    params = _TIERS.get(config.offload.params, Tier.DEVICE)
    optim = _TIERS.get(config.offload.optimizer, Tier.DEVICE)
    compute = Tier.DEVICE if optim is Tier.DEVICE else Tier.HOST
    return Homes(params=params, optim=optim, compute=compute)
