"""Activation memory: checkpointing chosen blocks, and offloading their saved inputs to host memory.

[Note: checkpointing in place]
`"activation_checkpointing": true` picks the repeated blocks (the children of the model's ModuleLists); a list picks
modules by class name or by fully qualified name pattern (`fnmatch`, e.g. "layers.*"). Each chosen module keeps its
place and its parameter names: only its `forward` is replaced, on the instance, by one that runs the original under
`torch.utils.checkpoint` (non-reentrant). Module hooks still fire on the module itself, and the recomputation in
backward calls the children as modules, so stage 3's hooks gather their parameters again for it: a recomputed
child enters and exits its chunk like a second use, whose count keeps the chunk gathered while backward uses it.
Where stage 3's tiled layers take turns over several ranks, the recomputation runs inside `recomputing` and whole
([Note: tile gathers in turns] in `hetero/zero/turns.py`).

[Note: offloading block inputs]
What a checkpointed block keeps from forward to backward is its input: its floating-point tensors given by position
or by keyword (the others, and tensors inside a tuple, stay as given). With `"activation_offload": true` they are
copied, as forward moves on, into a host chunk of the manager (pinned with CUDA, counted in the host ledger) on a
worker thread (on CUDA on a copy stream after the compute stream's progress, see `hetero/device.py`), and the
device copy is dropped. In backward, the blocks recompute in reverse order of their forward: when one starts, its
input is waited for and the next one's (the block before it) is brought back ahead of need. The checkpoint is given
only a zero-size tensor on the device, so that it still saves and restores the device's random state (dropout):
torch's checkpoint saves the state of the devices of its positional tensors alone. Without offload the same tensor
goes first, so that a block given its device tensors by keyword only redraws its dropout masks too.
A tensor given to several blocks of a step (an additive attention mask, an encoder's output for every decoder layer)
is copied once, its host chunk shared and freed when the last of them has recomputed (a copy per block took the host
memory of as many copies); one written in place since (its version counter moved) is copied again. An input written
in place after its block ran, before its copy landed, is refused in backward as torch's checkpoint refuses a saved
input written since (the copy raced the write: the recomputation could read either values).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from hetero.device import Device
from hetero.errors import ConfigError, TierOutOfMemoryError, add_note
from hetero.kv_cache import cache_off_when_recomputing
from hetero.memory import Chunk, ChunkManager, TensorState, Tier

log = logging.getLogger("hetero.activation")


def choose_blocks(
    model: nn.Module, selection: bool | list[str] | tuple[str, ...], *, strict: bool = True
) -> list[tuple[str, nn.Module]]:
    """The modules to checkpoint, outermost only, in module order. strict=False: a selection may match nothing (a
    pipeline stage without blocks; the selection was checked on the whole model before it was cut)."""
    if selection is True:
        picked = [
            (f"{name}.{child_name}" if name else child_name, child)
            for name, m in model.named_modules()
            if isinstance(m, nn.ModuleList)
            for child_name, child in m.named_children()
        ]
        if not picked and strict:
            raise ConfigError(
                "activation_checkpointing: true picks the children of the model's ModuleLists, and this model has "
                "none; list the blocks to checkpoint by class name or name pattern instead"
            )
    else:
        named = list(model.named_modules())
        picked, unmatched = [], []
        for pattern in selection:
            hits = [(n, m) for n, m in named if n and (type(m).__name__ == pattern or fnmatch.fnmatchcase(n, pattern))]
            if not hits:
                unmatched.append(pattern)
            picked.extend(hits)
        if unmatched and strict:
            classes = sorted({type(m).__name__ for _, m in named})
            raise ConfigError(
                f"activation_checkpointing: {unmatched} match no module by class name or qualified-name pattern; "
                f"class names in this model: {classes[:20]}"
            )
    picked = [block for name, module in picked for block in _called(name, module)]
    order = {id(m): i for i, m in enumerate(model.modules())}
    outer: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    for name, module in sorted(picked, key=lambda nm: order[id(nm[1])]):
        if id(module) in seen or any(name.startswith(f"{o}.") for o, _ in outer):
            continue  # inside a block already chosen, or chosen twice
        seen.add(id(module))
        outer.append((name, module))
    return outer


def _called(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that stand for a chosen one when it runs: a ModuleList or ModuleDict is never called (checkpointing
    it recomputed nothing, its blocks skipped as inside it), so the blocks it holds stand for it."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [(name, module)]
    return [block for child, m in module.named_children() for block in _called(f"{name}.{child}", m)]


def _offloadable(value: Any) -> bool:
    """Whether a block's input goes to the host under offload: a floating-point tensor (ids and masks stay)."""
    return isinstance(value, torch.Tensor) and value.is_floating_point()


class _HostCopy:
    """A block input's bytes in a host chunk: one for every block of the step that is given that same tensor."""

    def __init__(self, chunk: Chunk, owner: _Saved) -> None:
        self.chunk = chunk
        self.owner: _Saved | None = owner  # the call whose copy job (`owner.going`) fills the chunk; None once freed
        self.users = 1  # calls whose recomputation still needs it; the chunk is freed when none is left
        self.written: tuple[int, int] | None = None  # (version copied, version found): written before it landed


class _Saved:
    """One checkpointed call's input, on its way to the host and back. An input is keyed by its argument position
    (int) or its keyword (str)."""

    def __init__(self) -> None:
        self.host: list[tuple[int | str, _HostCopy]] = []  # (input key, its host copy) of each offloaded tensor
        self.meta: dict[int | str, tuple[torch.Size, bool]] = {}  # input key -> (shape, requires_grad)
        self.args: tuple = ()  # the positional inputs, offloaded tensors replaced by None
        self.kwargs: dict[str, Any] = {}  # the keyword inputs, offloaded tensors replaced by None
        self.module: nn.Module | None = None  # the block called
        # the checkpointed function, weakly: the autograd graph of the forward holds it until a backward through it
        # (or the loss's end) releases it; dead, nothing can recompute the block any more
        self.graph: weakref.ref | None = None
        self.going: Future | None = None  # the copy to the host
        self.coming: Future | None = None  # the copy back; its result is the device inputs (args, kwargs)


# torch 2.4 takes no `early_stop` argument (later ones do): its context manager sets the same flag, which
# `checkpoint` reads as the forward runs (on torch 2.4.1 the activation tests failed on the argument before).
_TAKES_EARLY_STOP = "early_stop" in inspect.signature(checkpoint).parameters


def _checkpoint(fn: Callable[..., Any], *args: Any, early_stop: bool, **kwargs: Any) -> Any:
    """torch's non-reentrant checkpoint of `fn(*args, **kwargs)`, the RNG state preserved for its recomputation."""
    if _TAKES_EARLY_STOP:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, early_stop=early_stop, **kwargs)
    with set_checkpoint_early_stop(early_stop):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


class ActivationMemory:
    """Checkpointing (and optionally input offload) installed on a model's blocks; see the notes above."""

    def __init__(
        self,
        model: nn.Module,
        selection: bool | list[str] | tuple[str, ...],
        *,
        offload: bool,
        manager: ChunkManager,
        device: Device,
        strict: bool = True,
    ) -> None:
        self.blocks = choose_blocks(model, selection, strict=strict)  # (qualified name, module), checkpointed
        self._names = {id(module): name for name, module in self.blocks}  # id(block) -> its name, for errors
        self.offload = offload  # saved inputs go to host memory between forward and backward
        self.m = manager
        self.device = device
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="hetero-act") if offload else None
        self._stack: list[_Saved] = []  # offloaded inputs of this step, in forward order
        # id(tensor) -> (the tensor, weakly; its version when copied; its host copy): a tensor given to several blocks
        # of the step (a mask, an encoder's output) is copied once ([Note: offloading block inputs])
        self._copies: dict[int, tuple[weakref.ref, int, _HostCopy]] = {}
        self._token = device.empty((0,), torch.float32)  # see the note: carries the device's RNG state
        self.offloaded_bytes = 0  # bytes copied to the host (cumulative)
        # block -> a context around its recomputation in backward (stage 3's tile turns over several ranks: a tiled
        # layer some ranks skip, [Note: tile gathers in turns]); None: nothing around it
        self.recomputing: Callable[[nn.Module], contextlib.AbstractContextManager] | None = None
        # before the blocks' forwards are replaced: it reads their signatures
        self._cache_back = cache_off_when_recomputing(model, [name for name, _ in self.blocks])
        for _, module in self.blocks:
            module.forward = functools.partial(self._forward, module, module.forward)
        log.info("activation checkpointing on %d blocks (offload: %s)", len(self.blocks), offload)

    # ---- forward ------------------------------------------------------------------------------------------
    def _forward(self, module: nn.Module, original: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        # A recomputation with a context around it runs whole: stopped early, it would end where this rank's data
        # says (after the last tensor it saved), and the context's end is where every rank must meet.
        stop_early = self.recomputing is None
        if not self.offload:
            run_original = self._around_recompute(module, original)

            names, n = tuple(kwargs), len(args)

            def run_given(_token: torch.Tensor, *inputs: Any) -> Any:
                return run_original(*inputs[:n], **dict(zip(names, inputs[n:])))

            # Every input positional, the device token first: torch's checkpoint saves and restores the random state
            # of the devices of its positional tensors only, and checks only those for writes in place after the
            # block ran. A block given its tensors by keyword (`block(x=h)`) redrew other dropout masks on the GPU
            # in its recomputation, and recomputed from a keyword input written in place since: wrong gradients,
            # silently.
            return _checkpoint(run_given, self._token, *args, *kwargs.values(), early_stop=stop_early)
        saved = self._offload(module, args, kwargs)
        given = [(args, kwargs)]  # the inputs as given, for the forward itself; dropped then, so the device copy can go
        recompute = self._around_recompute(module, original)

        def run(_token: torch.Tensor) -> Any:
            if given[0] is not None:
                (a, kw), given[0] = given[0], None
                return original(*a, **kw)
            a, kw = self._fetch_for_recompute(saved)
            return recompute(*a, **kw)

        # Neither the checkpoint nor `run` may hold the inputs, positional or keyword: only the host copy stays.
        del args, kwargs
        saved.graph = weakref.ref(run)
        return _checkpoint(run, self._token, early_stop=stop_early)

    def _around_recompute(self, module: nn.Module, fn: Any) -> Any:
        """`fn`, run inside `recomputing(module)` when it runs in backward (the recomputation)."""
        around = self.recomputing
        if around is None:
            return fn

        def run(*args: Any, **kwargs: Any) -> Any:
            if torch._C._current_graph_task_id() == -1:  # the forward itself
                return fn(*args, **kwargs)
            with around(module):
                return fn(*args, **kwargs)

        return run

    def _offload(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> _Saved:
        saved = _Saved()
        saved.module = module
        # Inputs given by keyword count as those given by position: a block called as `block(x=h)` keeps `h` as
        # `block(h)` does (only positional ones were offloaded before, and such a block's inputs stayed on the device).
        inputs: dict[int | str, Any] = {**dict(enumerate(args)), **kwargs}
        kept = dict(inputs)
        jobs = []
        try:
            for i, a in inputs.items():
                if not _offloadable(a):
                    continue
                saved.meta[i] = (a.shape, a.requires_grad)
                kept[i] = None
                copy = self._copy_of(a)
                if copy is not None:  # given to an earlier block of the step, and unchanged since
                    copy.users += 1
                    saved.host.append((i, copy))
                    continue
                chunk = self.m.new_chunk(dtype=a.dtype, capacity=max(1, a.numel()), kind="activation")
                chunk.traced = False  # a new chunk every step: [Note: chunks of one step] in hetero/memory/policy.py
                slot = chunk.add_tensor("activation", (max(1, a.numel()),))
                copy = _HostCopy(chunk, saved)
                saved.host.append((i, copy))  # from here on `_free` forgets it, should the host have no room
                self.m.access(chunk, Tier.HOST)
                chunk.set_state(slot, TensorState.HOLD)
                self.m.pin(chunk)  # nothing may move it while a copy runs
                jobs.append((chunk.payload.narrow(0, 0, a.numel()), a.detach().reshape(-1), a._version, copy))
                self._copies[id(a)] = (weakref.ref(a), a._version, copy)
                self.offloaded_bytes += a.numel() * a.element_size()
        except BaseException as e:
            # Not on the stack yet, so no step_end would free them: the chunks of this call's inputs that already
            # held host memory stayed pinned for good (the budget shrank by them), and every one stayed listed.
            self._free(saved)
            if isinstance(e, TierOutOfMemoryError):
                need = sum(a.numel() * a.element_size() for a in inputs.values() if _offloadable(a))
                add_note(
                    e,
                    f"hetero: activation_offload was moving the inputs of checkpointed block {self._names[id(module)]} "
                    f"({need} B) to host memory; raise memory.host_budget, set memory.nvme_dir, use smaller "
                    "micro-batches, or turn activation_offload off (the inputs then stay on the device)",
                )
            raise
        saved.args = tuple(kept[i] for i in range(len(args)))
        saved.kwargs = {k: kept[k] for k in kwargs}
        marker = self.device.compute_marker()
        saved.going = self._copier.submit(self._copy_to_host, jobs, marker)
        self._stack.append(saved)
        return saved

    def _copy_of(self, tensor: torch.Tensor) -> _HostCopy | None:
        """The host copy this step already made of `tensor`, if its bytes are still those copied."""
        entry = self._copies.get(id(tensor))
        if entry is None:
            return None
        ref, version, copy = entry
        if ref() is not tensor or version != tensor._version or copy.users == 0:
            return None  # another tensor at a reused id, written in place since, or its copy already freed
        return copy

    def _copy_to_host(self, jobs: list[tuple[torch.Tensor, torch.Tensor, int, _HostCopy]], marker: Any) -> None:
        for dst, src, version, copy in jobs:
            self.device.copy(dst, src, after=marker)
            # A write issued before the bytes landed may or may not be in the copy; one issued after is not (the
            # view shares the input's version counter, which a write moves when it is issued).
            if src._version != version:
                copy.written = (version, src._version)

    def _copy_all(self, jobs: list[tuple[torch.Tensor, torch.Tensor]], marker: Any) -> None:
        for dst, src in jobs:
            self.device.copy(dst, src, after=marker)

    # ---- backward -----------------------------------------------------------------------------------------
    def _fetch_for_recompute(self, saved: _Saved) -> tuple[tuple, dict[str, Any]]:
        """This block's inputs back on the device; starts bringing back the next block backward will need."""
        if saved.coming is None:
            self._start_fetch(saved)
        index = next((k for k, s in enumerate(self._stack) if s is saved), None)
        if index is not None and index > 0:
            self._start_fetch(self._stack[index - 1])  # backward runs the blocks in reverse order
        args = saved.coming.result()
        self._free(saved)
        if index is not None:
            del self._stack[index]
        return args

    def _start_fetch(self, saved: _Saved) -> None:
        if saved.coming is not None:
            return
        back: dict[int | str, tuple[torch.Tensor, bool]] = {}
        jobs = []
        for key, copy in saved.host:
            copy.owner.going.result()  # its bytes are on the host
            if copy.written is not None:
                # What torch's checkpoint raises for a positional input written in place after the block ran: the
                # recomputation would not read what the forward read (here, the host copy raced the write).
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: input {key!r} of checkpointed block {self._names[id(saved.module)]} was written in "
                    f"place after the block ran (version {copy.written[0]}, then {copy.written[1]}) and before "
                    "activation_offload's copy of it reached the host; write to a new tensor (or a clone) instead"
                )
            shape, requires_grad = saved.meta[key]
            dev = self.device.empty(shape, copy.chunk.dtype)
            jobs.append((dev.reshape(-1), copy.chunk.payload.narrow(0, 0, dev.numel())))
            back[key] = (dev, requires_grad)
        # The fresh device memory may be what compute just freed, still read by queued kernels: the copy waits for
        # the compute stream's progress now.
        marker = self.device.compute_marker()

        def fetch() -> tuple[tuple, dict[str, Any]]:
            self._copy_all(jobs, marker)
            landed = {key: dev.requires_grad_(requires_grad) for key, (dev, requires_grad) in back.items()}
            args = tuple(landed.get(i, a) for i, a in enumerate(saved.args))
            return args, {k: landed.get(k, a) for k, a in saved.kwargs.items()}

        saved.coming = self._copier.submit(fetch)

    def _free(self, saved: _Saved) -> None:
        for _, copy in saved.host:
            copy.users -= 1
            if copy.users > 0:
                continue  # a block of the step given the same tensor has yet to recompute
            if copy.owner.going is not None:
                copy.owner.going.result()  # never free a chunk a copy still writes
            chunk = copy.chunk
            if chunk.pins:  # else an offload that failed before the chunk was filled
                self.m.unpin(chunk)
                chunk.set_state(chunk.slots[0], TensorState.FREE)
            self.m.free_chunk(chunk)
            # The step's table of copies (`_copies`) keeps the copy until step_end; through its owner it kept the
            # owner's inputs brought back to the device (`coming`) alive too, every recomputed block's until the
            # batch's end. Nothing reads the owner of a freed copy.
            copy.owner = None
        saved.host = []

    def step_end(self) -> None:
        """End of backward: inputs of blocks whose recomputation never ran (no gradient reached them) are freed,
        unless their forward's graph still awaits a backward of its own. In a failure (called while the engine
        handles an error: a forward that raised) every one is freed."""
        # Two forwards, then a backward of each (`a = engine(x); b = engine(y); engine.backward(a.loss);
        # engine.backward(b.loss)`), train without offload; with it, the first backward freed the second forward's
        # inputs too, whose recomputation then ran on None (a TypeError deep in the model). What no graph holds any
        # more can never recompute; a failed forward's graph may live on in its traceback, and its host memory is
        # what a retry with a smaller batch needs.
        self._release(every=sys.exc_info()[0] is not None)

    def _release(self, *, every: bool) -> None:
        kept = []
        for saved in self._stack:
            if not every and saved.graph is not None and saved.graph() is not None:
                kept.append(saved)
                continue
            if saved.going is not None:
                saved.going.result()
            if saved.coming is not None:
                saved.coming.result()
            self._free(saved)
        self._stack = kept
        self._copies.clear()  # only sharing ends: a copy lives while its users do

    def remove(self) -> None:
        """Restore the modules' own forward and KV cache, and stop the copy thread."""
        self._release(every=True)
        self._cache_back()
        for _, module in self.blocks:
            module.__dict__.pop("forward", None)
        if self._copier is not None:
            self._copier.shutdown(wait=True)
