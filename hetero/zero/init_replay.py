"""Running a meta-device model's own initialiser, as normal construction runs it, through a torch function mode that
hands each meta tensor's writes to real memory ([Note: initialising on meta, chunk by chunk] in materialize.py).

[Note: counting the writes first]
An initialiser may write one tensor more than once in one pass: GPT-2's `_init_weights` draws every Conv1D's weight,
then, on the attention and MLP modules (after their children, as transformers' walk goes), draws `c_proj.weight`
again at its scaled standard deviation; a `reset_parameters` may draw a weight and scale it after writing another.
Normal construction keeps the last write. A chunk is loaded (this rank's share kept, the staging buffer freed) once
its tensors are complete, so "written once" is not enough: the rewrite came after the chunk had loaded and was
refused (GPT-2 could not be initialised on meta at all). So the initialiser first runs on the meta device, where
every operation is free, draws nothing and writes nothing, to count each tracked tensor's writes in the pass that
keeps it; the real run completes a tensor at its last counted write. The random state is restored after the count
(it draws nothing on meta, but an initialiser may draw on the CPU for something else). An initialiser that cannot
run on meta (it reads a value: `.item()`) is counted as one write per tensor, as before. The count also finds the
tensors of a Hugging Face model that no `_init_weights` walk writes (a model's own `_init_weights` without a
LayerNorm branch): normal construction leaves torch's default init there, so the replay's default init writes them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from hetero.lazy import construction_draws, tie_makers
from hetero.zero.shard_reads import shard_intervals, shard_runs

log = logging.getLogger("hetero.zero")


class StandIn(TorchFunctionMode):
    """Replaces tracked meta tensors by real ones in every torch function call (see the note in materialize.py)."""

    def __init__(self, real: Callable[[torch.Tensor], torch.Tensor | None], on_write: Callable[[int], None]) -> None:
        super().__init__()
        self._real = real  # tracked tensor -> its stand-in (None: not tracked)
        self._on_write = on_write  # called with id() of a tracked tensor a function writes in place
        self._aliases: dict[int, int] = {}  # id of a live `.data` alias -> id of the tensor it aliases

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _writes(name):
            # The written tensor comes first: positional, or by keyword (`nn.init` passes `tensor=`).
            target = args[0] if args else next(iter(kwargs.values()), None)
            if isinstance(target, torch.Tensor):
                self._on_write(self._aliases.get(id(target), id(target)))
        swapped, kwargs = tree_map(self._swap, (args, kwargs))
        out = func(*swapped, **kwargs)
        if name == "__get__" and getattr(func, "__self__", None) is _DATA and isinstance(args[0], torch.Tensor):
            # `p.data.normal_()` (transformers 4's _init_weights) writes p through an alias: a write to the alias
            # is a write to p. The entry goes with the alias (not kept alive: it may view a staging buffer).
            self._aliases[id(out)] = self._aliases.get(id(args[0]), id(args[0]))
            weakref.finalize(out, self._aliases.pop, id(out), None)
        return out

    def _swap(self, x: Any) -> Any:
        # Tracked tensors are meta until their chunk loads; after that they view chunk memory that the initialiser
        # must not touch (at stage 3 it has no bytes): `real` decides for both.
        if isinstance(x, torch.Tensor):
            real = self._real(x)
            if real is not None:
                return real
        return x


# The descriptor of `Tensor.data`: its getter reaches torch function modes as a method-wrapper bound to it.
_DATA = next(vars(c)["data"] for c in torch.Tensor.__mro__ if "data" in vars(c))
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_"})  # in-place by name, but they change no values


def _writes(name: str) -> bool:
    """Whether a torch function of this name writes its first argument in place (`normal_`, `copy_`, ...)."""
    if name in _NOT_WRITES:
        return False
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))


def scratch(t: torch.Tensor) -> torch.Tensor | None:
    """A throwaway CPU tensor for a parameter (or meta tensor) whose writes must draw their numbers and be dropped: at
    the whole tensor's shape where tensor parallelism cut it ([Note: initialising a tensor-parallel shard])."""
    return torch.empty(whole_shape(t), dtype=t.dtype) if t.is_meta or isinstance(t, nn.Parameter) else None


# [Note: initialising a tensor-parallel shard]
# Tensor parallelism cuts the meta model before its initialiser is replayed, so each sharded parameter has its shard's
# shape there. Drawn at that shape, the numbers are not the whole tensor's (16 of 21 tensors of a tiny Llama differed
# at tensor 2), and an initialiser that reads the shape (torch's kaiming bound from fan_in) computes another bound. So
# the replay stands a whole-shape scratch tensor in for a cut parameter (`whole_shape`), the initialiser draws the
# whole tensor as normal construction does, and once its last write is in, this rank's slice is copied out of it
# (`take_shard`, by the runs of [Note: reading a tensor-parallel shard] in shard_reads.py) and the scratch is dropped:
# one whole weight at a time beside the shards. A vocabulary-split embedding's padding row is a global row again
# while the initialiser runs (`whole_modules`): the module's own padding_idx is the shard's row.


# [Note: replaying the stages a rank dropped]
# A pipeline cut drops the units of other ranks' stages before the initialiser is replayed (split.py). Replayed on its
# own stages only, a rank's stream was not normal construction's: the second stage's layers differed, since the
# first stage's draws never came before them. The cut keeps the dropped units of a meta model (`_hetero_dropped`,
# free: no memory), `whole_modules` puts them back while the initialiser runs, and their tensors (those no kept stage
# shares) stand in as scratch tensors that draw their numbers and drop them: the walk is the whole model's, in its
# order, and the rank's own tensors get the numbers normal construction gives them.
def whole_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole tensor a tensor-parallel cut (`_hetero_tp`) took `t` from; `t`'s own shape if uncut."""
    cut = getattr(t, "_hetero_tp", None)
    return tuple(cut.full_shape) if cut is not None else tuple(t.shape)


def take_shard(whole: torch.Tensor, cut: Any, out: torch.Tensor) -> None:
    """Copy this rank's shard (`cut`: a TPShard or BlockShard) of `whole` into `out` (the shard's shape)."""
    src, dst = whole.reshape(-1), out.view(-1)
    for at, start, n in shard_runs(tuple(whole.shape), shard_intervals(cut), 0, out.numel()):
        dst.narrow(0, at, n).copy_(src.narrow(0, start, n))


@contextmanager
def whole_modules(model: nn.Module) -> Iterator[set[int]]:
    """The model as normal construction built it, while the initialiser runs (see the notes above): a vocabulary-
    split embedding's padding_idx (`_hetero_padding_idx`, recorded by the cut) and the pipeline stages this rank
    dropped, put back. Yields the ids of the tensors only those stages hold (their stand-ins are scratch tensors)."""
    dropped = getattr(model, "_hetero_dropped", [])
    own = {id(t) for t in tensors(model)}
    saved = [(m, m.padding_idx) for m in model.modules() if hasattr(m, "_hetero_padding_idx")]
    try:
        for parent, leaf, module in dropped:
            setattr(parent, leaf, module)
        for m, _ in saved:
            m.padding_idx = m._hetero_padding_idx
        yield {id(t) for _, _, module in dropped for t in tensors(module)} - own
    finally:
        for m, local in saved:
            m.padding_idx = local
        for parent, leaf, _ in dropped:
            setattr(parent, leaf, None)


def tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def is_hf(model: nn.Module) -> bool:
    return callable(getattr(model, "_init_weights", None)) and callable(getattr(model, "init_weights", None))


def _tie_keepers(model: nn.Module) -> dict[int, nn.Module]:
    """Tied parameter id -> the PreTrainedModel whose walk gives its values: the innermost one holding the tie's
    source (transformers' `all_tied_weights_keys`, target -> source). In normal construction each name is a tensor
    of its own until the outermost post_init ties them, keeping the source's values: Llama's head takes the base
    model's embedding (written by the inner walk), T5's encoder and decoder embeddings take `shared`, which the
    outer walk writes after theirs. On meta the names are one tensor from the start: the other walks' writes draw."""
    keepers: dict[int, nn.Module] = {}
    for source in set((getattr(model, "all_tied_weights_keys", None) or {}).values()):
        keeper, at = model, model
        for part in source.split(".")[:-1]:
            at = getattr(at, part, None)
            if at is None:
                break
            if is_hf(at):
                keeper = at
        try:
            keepers[id(model.get_parameter(source))] = keeper
        except AttributeError:  # not a parameter here (a tie pattern): the first write keeps its values, as before
            continue
    return keepers


@dataclass
class _Defaults:
    """Torch's default inits in a Hugging Face replay (see `_replay_hf`)."""

    kept: set[int] = field(default_factory=set)  # tensors no _init_weights walk writes: their default init stays
    seen: Callable[[int], None] = lambda key: None  # told of each default init's write (the count on meta)


def _replay_hf(
    module: nn.Module,
    real: Callable,
    on_write: Callable,
    passes: list[int],
    draw: Callable,
    keepers: dict,
    defaults: _Defaults,
) -> None:
    """The initialisation order of a Hugging Face model's normal construction: each layer runs torch's default init
    as it is built, and each PreTrainedModel (a causal LM wraps a base model: two) runs post_init's _init_weights
    walk at the end of its own construction, over the modules not yet initialised. The default inits are
    overwritten, so they only need to advance the random generator: they run on scratch tensors (`draw`), except
    for tensors no walk writes (a model's own _init_weights without a LayerNorm branch), which keep them as in
    normal construction."""
    if is_hf(module):
        # transformers 4 marks each module initialised during construction on meta (no values there): unmarked,
        # before the inner models' walks, which mark theirs as normal construction does, so that this model's walk
        # skips them (and draws no numbers for them) as normal construction's does. Unmarked after them, an untied
        # head's numbers came after the whole base model's drawn again: another head than normal construction's.
        for m in module.modules():
            if getattr(m, "_is_hf_initialized", False):
                m._is_hf_initialized = False
        for child in module.children():
            _replay_hf(child, real, on_write, passes, draw, keepers, defaults)
        passes[0] += 1
        other = {key for key, keeper in keepers.items() if keeper is not module}  # tied: another walk's values
        swap = (lambda t: draw(t) if id(t) in other else real(t)) if other else real
        with StandIn(swap, lambda key: None if key in other else on_write(key)), torch.no_grad():
            module.init_weights()  # what post_init runs: _init_weights per module, then tying
        return
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        kept = defaults.kept

        def write(key: int) -> None:
            defaults.seen(key)
            if key in kept:
                on_write(key)

        with StandIn(lambda t: real(t) if id(t) in kept else draw(t), write), torch.no_grad():
            reset()
    else:
        for func, name, args, kwargs in construction_draws(module):  # [Note: draws in constructors] in lazy.py
            into = draw(getattr(module, name))
            if into is not None:
                with torch.no_grad():
                    func(into, *args, **kwargs)
    for child in module.children():
        _replay_hf(child, real, on_write, passes, draw, keepers, defaults)


def run_initialiser(
    model: nn.Module,
    real: Callable,
    on_write: Callable,
    written: set,
    passes: list[int],
    draw: Callable = scratch,
    defaults: _Defaults | None = None,
) -> None:
    """reset_parameters() of every module in module order, each a pass; a Hugging Face model replays its own.
    draw: the stand-in of a tensor whose numbers are drawn and dropped. defaults: see `_replay_hf`."""
    defaults = defaults if defaults is not None else _Defaults()
    makers = tie_makers(model)

    def visit(module: nn.Module) -> None:
        if is_hf(module):
            _replay_hf(module, real, on_write, passes, draw, _tie_keepers(module), defaults)
            return
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            passes[0] += 1
            # A weight tied to this module that another module made: that one's call writes it, this one's draws.
            lose = {id(p) for p in module.parameters(recurse=False) if makers.get(id(p), module) is not module}
            swap = (lambda t: draw(t) if id(t) in lose else real(t)) if lose else real
            with StandIn(swap, lambda key: None if key in lose else on_write(key)), torch.no_grad():
                reset()
        for child in module.children():
            own = list(tensors(child))
            if own and all(id(t) in written for t in own):
                continue  # an ancestor's reset_parameters covered this subtree (hetero's GPT does)
            visit(child)

    visit(model)


def count_writes(model: nn.Module, tracked: set[int]) -> tuple[dict[int, int], _Defaults]:
    """Tracked tensor id -> how many times the initialiser writes it in the pass that keeps its values, from a run on
    the meta device ([Note: counting the writes first]), and the default inits that stay (see `_replay_hf`); no
    counts, and no default init kept, when the initialiser cannot run there."""
    counts: dict[int, int] = {}
    first_pass: dict[int, int] = {}
    written: set[int] = set()
    passes = [0]
    by_default: dict[int, int] = {}

    def seen(key: int) -> None:
        if key in tracked:
            by_default[key] = by_default.get(key, 0) + 1

    def on_write(key: int) -> None:
        written.add(key)  # a dropped stage's tensor too: a subtree its ancestor wrote is not walked again
        if key not in tracked:
            return
        if first_pass.setdefault(key, passes[0]) == passes[0]:  # a later pass's write is dropped (materialize.py)
            counts[key] = counts.get(key, 0) + 1

    try:
        with torch.random.fork_rng(devices=[]):
            none = lambda t: None  # noqa: E731 - meta tensors stay meta
            run_initialiser(model, none, on_write, written, passes, draw=none, defaults=_Defaults(seen=seen))
    except Exception as e:  # noqa: BLE001 - any failure on meta only means the writes cannot be counted
        log.debug("the initialiser cannot run on the meta device to count its writes (%s): one write each", e)
        return {}, _Defaults()
    kept = set(by_default) - written  # drawn by default inits only: normal construction keeps those
    return {**counts, **{k: by_default[k] for k in kept}}, _Defaults(kept=kept)
