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
What a checkpointed block keeps from forward to backward is its input. With `"activation_offload": true` that input
is copied, as forward moves on, into a host chunk of the manager (pinned with CUDA, counted in the host ledger) on a
worker thread (on CUDA on a copy stream after the compute stream's progress, see `hetero/device.py`), and the
device copy is dropped. In backward, the blocks recompute in reverse order of their forward: when one starts, its
input is waited for and the next one's (the block before it) is brought back ahead of need. The checkpoint is given
only a zero-size tensor on the device, so that it still saves and restores the device's random state (dropout).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import inspect
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from hetero.device import Device
from hetero.errors import ConfigError
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
    order = {id(m): i for i, m in enumerate(model.modules())}
    outer: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    for name, module in sorted(picked, key=lambda nm: order[id(nm[1])]):
        if id(module) in seen or any(name.startswith(f"{o}.") for o, _ in outer):
            continue  # inside a block already chosen, or chosen twice
        seen.add(id(module))
        outer.append((name, module))
    return outer


def _no_kv_cache(model: nn.Module) -> None:
    """Turn off a Hugging Face model's key/value cache, as its own gradient checkpointing does. A checkpointed block
    runs its forward twice; a cache passed in (transformers 4 makes one whenever `config.use_cache` is set) grows on
    each run, so the recomputed keys are twice as long as those saved and backward fails."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        log.warning(
            "activation checkpointing: setting the model's config.use_cache = False (a cache filled again "
            "by each recomputation would not match the forward pass)"
        )
        config.use_cache = False


class _Saved:
    """One checkpointed call's input, on its way to the host and back."""

    def __init__(self) -> None:
        self.device_args: tuple | None = None  # the inputs while on the device (forward, and once fetched back)
        self.host: list[tuple[int, Chunk]] = []  # (argument position, host chunk) of each offloaded tensor
        self.meta: dict[int, tuple[torch.Size, bool]] = {}  # position -> (shape, requires_grad)
        self.args: tuple = ()  # the inputs, offloaded tensors replaced by None
        self.going: Future | None = None  # the copy to the host
        self.coming: Future | None = None  # the copy back; its result is the device inputs


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
        self.offload = offload  # saved inputs go to host memory between forward and backward
        self.m = manager
        self.device = device
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="hetero-act") if offload else None
        self._stack: list[_Saved] = []  # offloaded inputs of this step, in forward order
        self._token = device.empty((0,), torch.float32)  # see the note: carries the device's RNG state
        self.offloaded_bytes = 0  # bytes copied to the host (cumulative)
        # block -> a context around its recomputation in backward (stage 3's tile turns over several ranks: a tiled
        # layer some ranks skip, [Note: tile gathers in turns]); None: nothing around it
        self.recomputing: Callable[[nn.Module], contextlib.AbstractContextManager] | None = None
        for _, module in self.blocks:
            module.forward = functools.partial(self._forward, module, module.forward)
        _no_kv_cache(model)
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
            return _checkpoint(run_original, *args, early_stop=stop_early, **kwargs)
        saved = self._offload(args)
        given = [args]  # the inputs as given, for the forward itself; dropped then, so the device copy can go
        recompute = self._around_recompute(module, original)

        def run(_token: torch.Tensor) -> Any:
            if given[0] is not None:
                inputs, given[0] = given[0], None
                return original(*inputs, **kwargs)
            return recompute(*self._fetch_for_recompute(saved), **kwargs)

        del args
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

    def _offload(self, args: tuple) -> _Saved:
        saved = _Saved()
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        kept = list(args)
        jobs = []
        for i in positions:
            a = args[i]
            chunk = self.m.new_chunk(dtype=a.dtype, capacity=max(1, a.numel()), kind="activation")
            chunk.traced = False  # a new chunk every step: [Note: chunks of one step] in hetero/memory/policy.py
            slot = chunk.add_tensor("activation", (max(1, a.numel()),))
            self.m.access(chunk, Tier.HOST)
            chunk.set_state(slot, TensorState.HOLD)
            self.m.pin(chunk)  # nothing may move it while a copy runs
            saved.host.append((i, chunk))
            saved.meta[i] = (a.shape, a.requires_grad)
            jobs.append((chunk.payload.narrow(0, 0, a.numel()), a.detach().reshape(-1)))
            kept[i] = None
            self.offloaded_bytes += a.numel() * a.element_size()
        saved.args = tuple(kept)
        marker = self.device.compute_marker()
        saved.going = self._copier.submit(self._copy_all, jobs, marker)
        self._stack.append(saved)
        return saved

    def _copy_all(self, jobs: list[tuple[torch.Tensor, torch.Tensor]], marker: Any) -> None:
        for dst, src in jobs:
            self.device.copy(dst, src, after=marker)

    # ---- backward -----------------------------------------------------------------------------------------
    def _fetch_for_recompute(self, saved: _Saved) -> tuple:
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
        saved.going.result()  # its bytes are on the host
        args = list(saved.args)
        jobs = []
        for i, chunk in saved.host:
            shape, requires_grad = saved.meta[i]
            dev = self.device.empty(shape, chunk.dtype)
            jobs.append((dev.reshape(-1), chunk.payload.narrow(0, 0, dev.numel())))
            args[i] = (dev, requires_grad)
        # The fresh device memory may be what compute just freed, still read by queued kernels: the copy waits for
        # the compute stream's progress now.
        marker = self.device.compute_marker()

        def fetch() -> tuple:
            self._copy_all(jobs, marker)
            return tuple(a[0].requires_grad_(a[1]) if isinstance(a, tuple) else a for a in args)

        saved.coming = self._copier.submit(fetch)

    def _free(self, saved: _Saved) -> None:
        for _, chunk in saved.host:
            self.m.unpin(chunk)
            chunk.set_state(chunk.slots[0], TensorState.FREE)
            self.m.free_chunk(chunk)
        saved.host = []

    def step_end(self) -> None:
        """End of backward: inputs of blocks whose recomputation never ran (no gradient reached them) are freed."""
        for saved in self._stack:
            if saved.going is not None:
                saved.going.result()
            if saved.coming is not None:
                saved.coming.result()
            self._free(saved)
        self._stack.clear()

    def remove(self) -> None:
        """Restore the modules' own forward and stop the copy thread."""
        self.step_end()
        for _, module in self.blocks:
            module.__dict__.pop("forward", None)
        if self._copier is not None:
            self._copier.shutdown(wait=True)
