"""Memory-centric tiling: a layer whose weight is split over several chunks computes on one tile at a time.

[Note: computing on tiles]
A weight larger than a chunk is split over chunks of its own, one tile of whole dim-0 rows each (`layout.py`,
[Note: tiles]); the chunk size follows the budgets, so a weight that would not fit the device's working set is always
split. Its module then never sees the whole weight: its `forward` is replaced, on the instance, by one that runs an
autograd function over the tiles, each made resident (at stage 3 gathered from every rank's shard), used and
released before the next, in forward and again in backward, ZeRO-Infinity's memory-centric tiling:

  nn.Linear (weight [out, in], rows = output features): y[..., rows_t] = x @ W_t^T, the tiles' outputs joined;
      backward: dx = sum_t dy[..., rows_t] @ W_t, dW_t = dy[..., rows_t]^T x.
  nn.Embedding (weight [vocab, dim], rows = tokens): each tile looks up the tokens in its row range;
      backward: dW_t = the output gradients of those tokens summed per row (padding_idx's row gets none).
  transformers' Conv1D (weight [in, out], rows = input features): y = sum_t x[..., rows_t] @ W_t;
      backward: dx[..., rows_t] = dy @ W_t^T, dW_t = x[..., rows_t]^T dy.

Each tile's gradient goes straight into its chunk's gradient buffer (`TileRunner.deliver`), so no gradient of the
whole weight ever exists. A weight used twice in a micro-batch (an embedding tied to the head) gets its tiles'
gradients added; the chunk counts as complete (and, at stages 2-3, is reduce-scattered) after the backward of its
last use. Only modules whose class is exactly one of the three, unsubclassed (a subclass may compute differently),
holding the parameter as `weight`, are tiled, and a parameter is split only when every module holding it is such a
module; Embedding options that change the weight or its gradient (`max_norm`, `scale_grad_by_freq`, `sparse`) rule
it out. The parameter object stays, with its name and shape, but its values are never whole: reading it raises
`ReleasedParameterError` outside `engine.gathered_parameters()`, which assembles it.

Collectives: at stage 3 a tile is gathered when its module's forward (or backward) reaches it, in tile order, through
the same `Checker` as a unit's gathers. Over several ranks the tiled modules of a unit take turns, so that a rank
that skips one (a branch, an expert its router passed over) takes part in its gathers at the point the others make
them ([Note: tile gathers in turns] in `hetero/zero/turns.py`).

[Note: backwards that are not the training one]
A loop may run backwards of its own beside `engine.backward`: `torch.autograd.grad(loss, inputs)` for an input's
gradient (an adversarial example), with `create_graph=True` for a gradient penalty that is differentiated again. A
plain parameter's gradient then never reaches hetero (autograd.grad accumulates no `.grad`), but a tiled layer's
backward computes its tiles' gradients itself, and delivered them into the chunks, adding the first loss's weight
gradient to the update. So a tile's gradient is computed and delivered only inside `engine.backward` (or
`train_batch`'s), which the engine marks (`accumulating`); any other backward computes the input's gradient only.
A second derivative through a trainable tiled layer is refused: its backward reads tiles that require no gradient,
so the penalty's gradient with respect to the weight would be silently lost. At stage 3 such a backward gathers
along the units as the training one does and reduces nothing (a unit's end reduces only inside `engine.backward`);
its unit ends count against the forwards it answers, so the training backward that follows in the same step still
reduces each chunk once every forward of it is answered. Before, those ends reduced chunks with no gradient yet, and
the training backward's gradients arrived after their reduction ("arrived after every unit using it had ended its
backward"): such backwards were refused, now they work. A second derivative through a stage-3 model stays refused
(`Gathers.enter_unit`): the graph it builds keeps gathered parameters that stage 3 releases as each unit ends.

[Note: hooks on tiled gradients]
A tile's gradient goes into its chunk without passing through autograd's accumulation, so a hook registered on the
parameter never runs. Sequence parallelism that keeps layers whole registers one: under Ulysses and ring attention
each rank computes a weight's gradient on its share of the sequence, and the hook scales it by the group's size (the
engine's reduction averages over those ranks too) or, applied by hand, sums it over the group. Without it the tiled
MLP weights and embedding of a Llama trained on half their gradient at tensor 2, silently. So those two hooks say
what they do on the parameter (`_hetero_grad_factor`, `_hetero_grad_comm`) and `deliver` does it to each tile's
gradient of a use, which is what the hook does to the whole gradient, row by row. A hook of the user's (or a
post-accumulate one) sees the whole gradient, which a tiled weight never has: such a weight is left whole
(`tileable.tile_rows`). tests/test_seq_split_tiles.py.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hetero.errors import HeteroError
from hetero.io.hugepages import fresh
from hetero.memory import Chunk, ChunkManager, TensorState, Tier
from hetero.zero import released
from hetero.zero.hooks import outside_compile
from hetero.zero.meta_swap import give_memory
from hetero.zero.outside_inference import in_normal_mode
from hetero.zero.protocol import BACKWARD, FORWARD, GATHER, in_backward
from hetero.zero.tile_autograd import TiledConv1D, TiledEmbedding, TiledLinear
from hetero.zero.tileable import bases, layer_kind

if TYPE_CHECKING:
    from hetero.zero.protocol import Checker
    from hetero.zero.units import Entry

log = logging.getLogger("hetero.zero")

_T = TensorState


@dataclass(eq=False)
class Tiled:
    """One parameter split over several chunks, as the engine tracks it."""

    name: str  # the parameter's name
    param: nn.Parameter
    tiles: list[Entry]  # one per chunk, in row order
    uses: int = 0  # forward uses in this micro-batch whose backward has not run yet
    modules: list[str] = field(default_factory=list)  # names of the modules computing on it

    @property
    def trainable(self) -> bool:
        return self.tiles[0].info.trainable


class TileRunner:
    """Makes tiles resident for the tiled modules, one at a time, and takes their gradients; see [Note: computing
    on tiles]. One per engine."""

    def __init__(
        self,
        model: nn.Module,
        tiled: dict[int, Tiled],
        *,
        stage: int,
        check: Checker,
        deliver: Callable[[Entry, torch.Tensor, bool], None],
        target: Callable[[Entry], torch.Tensor | None] | None = None,
    ) -> None:
        self.tiled = tiled  # param id -> its tiles
        self.stage = stage
        self.check = check
        self._deliver = deliver  # (tile, gradient, last use of this micro-batch) -> into its chunk
        self._target = target  # tile -> where its gradient may be computed in place (its chunk's buffer), or None
        self._patched: list[nn.Module] = []
        self.layers: dict[str, tuple[Tiled, str]] = {}  # tiled layer's name -> (its weight, its kind), module order
        # (layer, in its backward) -> before the layer gathers its tiles ([Note: tile gathers in turns]); set by
        # `Gathers.take_turns` at stage 3 over several ranks
        self.turn: Callable[[str, bool], bool] | None = None
        # The layer taking its turn gathers off the shared order (its turn went by): each of its gathers waits for
        # its check ([Note: a gather off the turns waits for its check] in turns.py).
        self._off_turn = False
        # Inside engine.backward: a tile's gradient goes into its chunk only then ([Note: backwards that are not the
        # training one]); set by `Engine.backward_open`.
        self.accumulating = False
        me = weakref.ref(self)  # the model may outlive the engine: its layers must not keep the engine alive
        for name, module in model.named_modules():
            weight = dict(module.named_parameters(recurse=False)).get("weight")
            kind = layer_kind(module)
            if weight is None or id(weight) not in tiled or kind is None:
                continue
            tiled[id(weight)].modules.append(name)
            self.layers[name] = (tiled[id(weight)], kind)
            module.__dict__["_hetero_tiles"] = (me, tiled[id(weight)], name)
            module.__class__ = _twin(type(module), kind)  # one pointer write; names and hooks unchanged
            self._patched.append(module)

    def remove(self) -> None:
        """Give the layers their own class back."""
        for module in self._patched:
            module.__class__ = _original(type(module))
            module.__dict__.pop("_hetero_tiles", None)
        self._patched.clear()
        self.turn = None

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tiled parameter: the modules computing on it, its tiles, and the bytes of the largest."""
        return {
            t.name: {
                "modules": list(t.modules),
                "tiles": len(t.tiles),
                "tile_bytes": max(e.chunk.full.nbytes for e in t.tiles),
                "shape": list(t.param.shape),
            }
            for t in self.tiled.values()
        }

    # ---- one tile at a time -------------------------------------------------------------------------------
    @in_normal_mode  # [Note: hetero's memory under inference mode]
    def take_turn(self, layer: str, *, backward: bool) -> None:
        """`layer`'s forward (or backward) is about to gather its tiles."""
        self._off_turn = self.turn is not None and self.turn(layer, backward)

    @in_normal_mode  # [Note: hetero's memory under inference mode]
    def open(self, e: Entry) -> torch.Tensor:
        """The tile's values on the device, pinned there until `close`."""
        zc = e.chunk
        if zc.layout.params_sharded:
            if not zc.gathered:
                self.check(GATHER, chunk=zc.spec.index, phase=BACKWARD if in_backward() else FORWARD)
                if self._off_turn:
                    self.check.comm.verify_checks()  # marks the failure, as a wait would
            zc.unshard()
            zc.full.set_state(e.slot, _T.COMPUTE)
        return zc.full.view(e.slot)

    @in_normal_mode  # [Note: hetero's memory under inference mode]
    def close(self, e: Entry) -> None:
        zc = e.chunk
        if zc.layout.params_sharded:
            zc.full.set_state(e.slot, _T.HOLD)
            zc.reshard()

    def begin_use(self, t: Tiled) -> bool:
        """A forward use starts; True when its backward will deliver gradients (counted until then)."""
        counted = torch.is_grad_enabled() and t.param.requires_grad and not in_backward()
        if counted:
            t.uses += 1
        return counted

    def grad_out(self, e: Entry, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised buffer for a tile's gradient (the tile's shape, `like`'s dtype and device): its place in
        the chunk's gradient buffer where the chunk takes it whole, so `deliver` copies nothing; else a fresh one,
        on huge pages where the CPU computes ([Note: huge pages for fresh CPU buffers])."""
        out = self._target(e) if self._target is not None else None
        if out is not None and out.dtype == like.dtype and out.device == like.device:
            return out
        return fresh(torch.empty(e.info.shape, dtype=like.dtype, device=like.device))

    def wants_grads(self, t: Tiled) -> bool:
        """Whether this backward computes `t`'s tiles' gradients ([Note: backwards that are not the training one])."""
        if not t.trainable:
            return False
        if torch.is_grad_enabled():  # autograd runs a backward with grad mode on only for create_graph=True
            raise HeteroError(
                "a backward with create_graph=True (a second derivative, as a gradient penalty takes) reached the "
                f"tiled weight {t.name!r}: tiled layers compute first-order gradients only, and the weight's part "
                "of the second derivative would be lost. Keep its weight whole: a chunk_size of at least "
                f'{t.param.numel()} elements (its size), or "tiling": false'
            )
        return self.accumulating

    def deliver(self, t: Tiled, e: Entry, grad: torch.Tensor, counted: bool) -> None:
        """One tile's gradient of one use; the last tile of the last use completes the parameter."""
        last = not counted or t.uses <= 1
        # What the parameter's gradient hook does to the whole gradient, done to each tile's ([Note: hooks on tiled
        # gradients]); `grad` holds this use's gradient alone (a fresh buffer, or its chunk's taken whole).
        factor = getattr(t.param, "_hetero_grad_factor", None)
        if factor is not None:
            grad.mul_(factor)
        comm = getattr(t.param, "_hetero_grad_comm", None)
        if comm is not None:
            comm.all_reduce(grad)
        self._deliver(e, grad, last)

    def end_backward(self, t: Tiled, counted: bool) -> None:
        if counted and t.uses > 0:
            t.uses -= 1

    def step_end(self) -> None:
        """End of backward: uses whose backward never ran (an output the loss ignored) are forgotten."""
        for t in self.tiled.values():
            t.uses = 0


# ---- the layers' tiled forwards ---------------------------------------------------------------------------------
# A tiled layer's class is swapped for a twin: a subclass of its class whose MRO puts the tiled forward of its base
# layer right above that base, so the class's own forward (if it has one) runs and its `super().forward` computes on
# the tiles.
def _state(layer: nn.Module) -> tuple[TileRunner, Tiled, str]:
    ref, tiled, name = layer.__dict__["_hetero_tiles"]
    runner = ref()
    if runner is None:
        raise RuntimeError(f"the engine of the tiled layer computing on {tiled.name!r} was closed")
    return runner, tiled, name


def _linear_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    r, t, name = _state(self)
    out = TiledLinear.apply(x, _anchor(t.param, x), r, t, r.begin_use(t), name)
    return out if self.bias is None else out + self.bias


def _embedding_forward(self: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    r, t, name = _state(self)
    r.take_turn(name, backward=False)  # its backward gathers nothing
    return TiledEmbedding.apply(ids, _anchor(t.param, ids), r, t, r.begin_use(t), self.padding_idx)


def _conv1d_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    r, t, name = _state(self)
    shape = x.shape[:-1] + (self.nf,)
    out = TiledConv1D.apply(x.reshape(-1, x.shape[-1]), _anchor(t.param, x), r, t, r.begin_use(t), name)
    return (out + self.bias).view(shape)


# Run as they are under torch.compile: they gather and release tiles ([Note: hetero's hooks under torch.compile]).
_FORWARDS = {
    "linear": outside_compile(_linear_forward),
    "embedding": outside_compile(_embedding_forward),
    "conv1d": outside_compile(_conv1d_forward),
}
_TWINS: dict[tuple[type, str], type] = {}  # (a layer class, its kind) -> its tiled twin
_ORIGINALS: dict[type, type] = {}  # twin -> the class it stands for


def _twin(cls: type, kind: str) -> type:
    twin = _TWINS.get((cls, kind))
    if twin is None:
        tiled_base = _tiled_base(kind)
        base = tiled_base.__mro__[1]
        parents = (tiled_base,) if cls is base else (cls, tiled_base)
        twin = type(f"Tiled{cls.__name__}", parents, {"__module__": __name__})
        _TWINS[(cls, kind)] = twin
        _ORIGINALS[twin] = cls
    return twin


@functools.cache
def _tiled_base(kind: str) -> type:
    """The layer's base class with the tiled forward: the twin's MRO reaches it right above that base."""
    base = next(b for b, k in bases() if k == kind)
    return type(f"Tiled{base.__name__}", (base,), {"forward": _FORWARDS[kind], "__module__": __name__})


def _original(cls: type) -> type:
    return _ORIGINALS.get(cls, cls)


def _anchor(param: nn.Parameter, like: torch.Tensor) -> torch.Tensor:
    """A tensor with no elements standing in for the weight in the graph: it requires grad when the weight does, so
    the output does too (its own gradient is never computed; the tiles' go to their chunks)."""
    device = like.device
    return torch.empty(0, device=device).requires_grad_(param.requires_grad)


# ---- the parameter object of a tiled weight ---------------------------------------------------------------------
def detach_tiled(tiled: dict[int, Tiled], *, dtype: torch.dtype, device: torch.device) -> None:
    """Give each tiled parameter a stand-in with its shape, dtype and device and one element of memory, marked
    released: its values are only ever in its tiles (see [Note: computing on tiles])."""
    for t in tiled.values():
        p = t.param
        stub = torch.empty(1, dtype=dtype, device=device).expand(p.shape)
        if p.is_meta:  # its attributes and hooks kept ([Note: hooks across swap_tensors])
            give_memory(p, stub)
        else:
            p.data = stub
        p.__dict__["_hetero_tiled"] = True
        released.release([p], [t.name])


@contextlib.contextmanager
def assembled(tiled: list[Tiled], manager: ChunkManager, *, modify: bool) -> Iterator[None]:
    """Tiled parameters whole, readable through the parameters, for the duration of the block (the chunks must be
    gathered: `engine.gathered_parameters`); with `modify`, what the block wrote goes back into the tiles. Each
    whole value is a device chunk of the manager (the device ledger counts it)."""
    held: list[tuple[Tiled, Chunk, torch.Tensor]] = []
    try:
        for t in tiled:
            c = manager.new_chunk(dtype=t.tiles[0].chunk.dtype, capacity=t.param.numel(), kind="assembled")
            c.traced = False  # a new chunk at every use: [Note: chunks of one step] in hetero/memory/policy.py
            slot = c.add_tensor(t.name, t.param.shape)
            manager.access(c, Tier.DEVICE)
            c.set_state(slot, _T.COMPUTE)  # pinned on the device while the block reads it
            whole = c.view(slot)
            for e in t.tiles:
                manager.access(e.chunk.full, Tier.DEVICE, write=False)
                a, b = e.info.rows
                whole[a:b].copy_(e.chunk.full.view(e.slot))
            released.restore([t.param])  # its stub is readable again (released below, in any case)
            held.append((t, c, t.param.data))
            t.param.data = whole
        yield
        if modify:
            for t, _c, _ in held:
                for e in t.tiles:
                    manager.access(e.chunk.full, Tier.DEVICE)
                    a, b = e.info.rows
                    e.chunk.full.view(e.slot).copy_(t.param.data[a:b])
    finally:
        for t, c, stub in held:
            t.param.data = stub
            released.release([t.param], [t.name])
            c.set_state(c.slots[0], _T.HOLD)
            c.set_state(c.slots[0], _T.FREE)
            manager.free_chunk(c)
