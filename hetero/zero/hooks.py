"""Module and parameter hooks that drive the chunks through forward and backward.

Stage 3 gathers a unit's chunks just before the unit runs (see [Note: units]) and lets the collective protocol
decide when to release them (`hetero/zero/protocol.py`). Backward needs the parameters again: a unit's outputs pass
through `_OnBackward`, an identity whose backward runs before the unit's own, and gathers them there (modules have
no reliable pre-backward hook); its inputs pass through another `_OnBackward`, whose backward runs once the unit's
backward is done. Every stage takes gradients from a post-accumulate-grad hook: the moment a parameter's gradient of
this micro-batch is complete it is added into the chunk's gradient buffer and `param.grad` is cleared, so no
per-parameter gradient outlives its use.

[Note: one backward hook per unit]
In forward each module with parameters pins them while it runs (its pre- and post-forward hooks), so a unit's chunks
are gathered as late as its modules allow. In backward, where every rank's device budget holds a whole unit pinned
(`unit_rules`), the unit's own pre-backward gathers its chunks and pins every parameter of the unit until its gradient
arrives (or the unit's backward ends); a module then wraps its outputs for a backward hook of its own only where it
ran outside its unit's forward (a module of one block called from another, or from no block), where its unit's
backward may come too late. Autograd runs a device's nodes in reverse order of creation, so a module's backward falls
between its unit's pre- and post-backward, except where the unit's outputs reach no loss and something the unit kept
aside does (its pre-backward never runs): the first backward runs with every module's hook and notes whether any
module's backward came outside its unit's (`Gathers.learn`, agreed by every rank); only where none did do the units
pin whole, from the second backward on. (A pipeline's schedule, which interleaves micro-batches, never learns it:
there every module keeps its hook.) Wrapping every module's outputs cost an autograd node and a hook call per module
and step, the larger part of the hooks' cost on small layers (`benchmarks/host_overhead.py`: 28-30 -> 21-23 ms over
plain PyTorch on a 16-layer Llama). Under a tighter budget every module keeps its backward hook and pins only its own
parameters while its backward runs, so the unit's other chunks may move to the host meanwhile. Which of the two is a
shared decision: it changes where backward's gathers fall between the reduce-scatters.

[Note: one forward hook per unit]
Where units pin whole (`gathers.whole`, from the second step on), a unit's forward does the same: its pre-forward
gathers its chunks in layout order and pins all of its parameters, its post-forward unpins them, and a module that
runs inside its unit's forward with parameters all of that unit skips its own pin and unpin (its hooks still run,
and return at once). Nothing about collectives changes: the unit's start gathers what its modules would have
gathered one by one, in the same layout order, and gathering ahead has usually done it already. What it saves is a
dictionary walk, a state change and a class swap per module and parameter per forward (`benchmarks/host_overhead.py`).
A module called outside its unit's forward, or whose parameters belong to another unit, pins its own as before.

[Note: a parameter read outside its module]
A module's hooks gather its parameters around its own forward, but models also read another module's weight in their
own code: a head tied to the embedding as `F.linear(h, self.wte.weight)` or `h @ self.embed.weight.t()`, the
embedding looked up in the head's weight, a forward hook of one layer reading another's. At stage 3 that weight is
released there. So an operation that reads released parameters while the model's forward runs (the root's hooks
count its calls) treats that operation as a call of their modules outside their unit: it gathers and pins them
(`Gathers.use`, a checked collective at the same point of every rank's program, the chunk reduced once the unit it
ran in has ended its backward: [Note: reductions at shared points]), runs, unpins, and wraps its outputs so that
backward gathers them again before the operation's own backward reads them. A result that is a view of a parameter
(`.t()`, a slice) is copied: the chunk is released while the view lives on, and autograd would save the view itself,
read in backward before the view's own backward gathered it. Inside `engine.backward` a read (a custom autograd
Function's backward reading a weight it kept in ctx, a gradient hook) gathers and holds the parameters until their
gradients arrive, as a module's backward does. An in-place operation on a released parameter and a read outside the
model's forward and the engine's backward stay errors (ReleasedParameterError): `gathered_parameters` is the way
there. Before, each of these reads raised that error, whose advice (`gathered_parameters` in a forward) released the
weight before the backward that reads it.
The root's own hooks count the model's forwards in progress. A hook registered on the root after `initialize` runs
outside that count (a forward hook after hetero's counting one, a pre-hook with prepend=True before it), and a read
of a weight there raised the error: a read with the count at zero therefore looks for the root's call on the
thread's stack (`_calling`, only on this path), so hooks on the root, registered whenever, read weights as hooks on
any other module do (on the others, hooks registered after hetero's run inside the count).

[Note: hetero's hooks under torch.compile]
`model.compile()` (or `torch.compile(model)`) traces a forward through the modules' hooks. At stage 3 those gather,
pin and release chunks, swap the class of released parameters and wrap outputs in `_OnBackward`: none of it a tensor
program, and tracing it read a released parameter (an InternalTorchDynamoError naming `released.py`). So the forward
hooks, and a tiled layer's forward, which gathers tile by tile (`tiling.py`), are kept out of the trace
(`outside_compile`): the compiler breaks its graph around each and compiles what lies between them, the modules' own
arithmetic, and the hooks run as they do without it, collectives in the same order on every rank. The first step
compiles (and recompiles a few frames that the breaks split); the later ones reuse it (tests/test_compile.py).
Gradient hooks run in autograd's engine, outside the trace, at any stage. Tensor parallelism needs nothing of the
kind: its collectives go through torch.distributed, where the compiler breaks its graph by itself.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hetero.zero import released
from hetero.zero.gathers import Gathers
from hetero.zero.outside_inference import in_normal_mode, outside_inference_mode
from hetero.zero.protocol import in_backward
from hetero.zero.units import Entry, Unit, module_units


class _OnBackward(torch.autograd.Function):
    """An identity on tensors whose backward calls `hook` when the gradients of all of them have arrived. On a
    unit's outputs that is just before the unit's backward (pre-backward: gather); on its inputs, just after it
    (post-backward: the moment the unit's parameters can be released)."""

    @staticmethod
    def forward(ctx: Any, hook: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hook()
        return (None, *grads)


def wrap_outputs(output: Any, hook: Callable[[], None]) -> Any:
    """Pass every floating tensor of output that requires grad through one `_OnBackward` calling `hook`."""
    found: list[torch.Tensor] = []
    _collect(output, found)
    if not found:
        return output
    wrapped = iter(_OnBackward.apply(hook, *found))
    return _replace(output, lambda t: next(wrapped))


def needs_grad(x: Any) -> bool:
    """Whether any floating tensor in `x` (containers walked as `wrap_outputs` walks them) requires a gradient."""
    found: list[torch.Tensor] = []
    _collect(x, found)
    return bool(found)


def _wants(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()


def _collect(x: Any, out: list[torch.Tensor]) -> None:
    if _wants(x):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _collect(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _collect(v, out)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            _collect(getattr(x, f.name), out)


def _replace(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Same traversal order as _collect, rebuilding containers."""
    if _wants(x):
        return fn(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(_replace(v, fn) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_replace(v, fn) for v in x)
    if isinstance(x, dict):
        # Hugging Face ModelOutput is a dict and a dataclass; setting items keeps both views in step.
        for k in list(x.keys()):
            x[k] = _replace(x[k], fn)
        return x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        # A copy with every field set, as _collect walks them: `dataclasses.replace` passes only the init fields to
        # the constructor, so a field with init=False that the module set after construction came back as its
        # default (or a tensor collected from it took the next field's place), and __post_init__ ran again.
        out = copy.copy(x)
        for f in dataclasses.fields(x):
            object.__setattr__(out, f.name, _replace(getattr(x, f.name), fn))  # frozen ones too
        return out
    return x


class Hooks:
    """Installs and removes the hooks for one engine: gradient hooks on every trainable parameter, and at stage 3
    the hooks that gather at unit events and pin parameters while their module runs (see [Note: units],
    [Note: every rank in step])."""

    def __init__(
        self,
        entries: dict[int, Entry],
        *,
        model: nn.Module,
        units: list[Unit],
        gathers: Gathers | None,
        on_grad: Callable,
    ) -> None:
        self.handles: list[RemovableHandle] = []
        for e in entries.values():
            if e.info.trainable:
                self.handles.append(e.info.param.register_post_accumulate_grad_hook(on_grad))
        if gathers is None:
            return
        root_of = {id(u.module): u for u in units}
        unit_of = {id(e.info.param): u for u in units for e in u.entries}
        around = module_units(model, units)
        # [Note: a parameter read outside its module]: the model's forwards in progress, and the reader they enable.
        forwards = [0]
        self.handles.append(model.register_forward_pre_hook(lambda *_: _count(forwards, 1), prepend=True))
        self.handles.append(model.register_forward_hook(lambda *_: _count(forwards, -1), always_call=True))
        self._read = [e.info.param for e in entries.values()]
        released.set_reader(self._read, _reader(entries, unit_of, gathers, forwards, weakref.ref(model)))
        for m in model.modules():
            own = [entries[id(p)] for p in m.parameters(recurse=False) if id(p) in entries]
            unit = root_of.get(id(m))
            if unit is None and not own:
                continue
            # The unit around it (`module_units`), not the last unit holding its first parameter: a weight tied across
            # blocks is in both blocks' units.
            owner = unit or around.get(id(m)) or unit_of[id(own[0].info.param)]
            # Its parameters are pinned with its unit's ([Note: one forward hook per unit]) if they are all the unit's.
            covered = {id(e) for e in own} <= {id(e) for e in owner.entries}
            pre = _pre_forward(unit, owner, own, gathers, covered)
            # Outside torch.compile's trace: [Note: hetero's hooks under torch.compile]
            post = _post_forward(unit, owner, own, gathers, covered)
            # First among the module's pre-hooks: a hook registered before `initialize` that reads the module's weights
            # (pruning's mask, weight_norm's and spectral_norm's recomputed weight) runs with them gathered.
            # Outside inference mode too: [Note: hetero's memory under inference mode]
            pre, post = in_normal_mode(pre), in_normal_mode(post)
            self.handles.append(m.register_forward_pre_hook(outside_compile(pre), with_kwargs=True, prepend=True))
            self.handles.append(m.register_forward_hook(outside_compile(post)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        released.set_reader(getattr(self, "_read", []), None)


def _count(forwards: list[int], step: int) -> None:
    forwards[0] += step


def _calling(root: weakref.ref[nn.Module]) -> bool:
    """Whether this thread is inside a call of the root module, its hooks included: a hook registered on it after
    `initialize` runs before its counting pre-hook (prepended) or after its counting forward hook (appended)."""
    module = root()
    frame = sys._getframe(1)
    while frame is not None and module is not None:
        if frame.f_code.co_name == "_call_impl" and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False


def _reader(
    entries: dict[int, Entry],
    unit_of: dict[int, Unit],
    gathers: Gathers,
    forwards: list[int],
    root: weakref.ref[nn.Module],
) -> Callable:
    """An operation reading released parameters during the model's forward: run as a call of their modules outside
    their units ([Note: a parameter read outside its module])."""

    def read(func: Callable, args: tuple, kwargs: dict, params: list[nn.Parameter]) -> Any:
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") and not name.endswith("__") or name in ("__setitem__", "__set__")
        backward = in_backward()
        if in_place or any(id(p) not in unit_of for p in params):
            return NotImplemented
        if not (gathers.accumulating if backward else forwards[0] or _calling(root)):
            return NotImplemented
        groups: dict[int, tuple[Unit, list[Entry]]] = {}
        for p in params:
            unit = unit_of[id(p)]
            groups.setdefault(unit.index, (unit, []))[1].append(entries[id(p)])
        with outside_inference_mode():  # [Note: hetero's memory under inference mode]
            for unit, own in groups.values():
                gathers.use(own, unit)  # in backward: held until their gradients arrive, or the backward ends
        try:
            out = func(*args, **kwargs)
        finally:
            if not backward:
                with outside_inference_mode():
                    for _, own in groups.values():
                        gathers.done_using(own)
        out = _copy_views(out, {p.untyped_storage().data_ptr() for p in params})
        if backward or not torch.is_grad_enabled():
            return out

        def pre_backward() -> None:
            for unit, own in groups.values():
                gathers.use(own, unit)

        return wrap_outputs(out, pre_backward)

    return read


def _copy_views(x: Any, storages: set[int]) -> Any:
    """x, with each tensor viewing one of `storages` (a parameter's) replaced by a copy."""
    if isinstance(x, torch.Tensor):
        return x.clone() if x.untyped_storage().data_ptr() in storages else x
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_copy_views(v, storages) for v in x)
    return x


def outside_compile(fn: Callable) -> Callable:
    """`fn`, run as it is where torch.compile traces a call of it ([Note: hetero's hooks under torch.compile]).
    `torch.compiler.disable` alone costs ~2.5 us a call without a compiler too (it switches the frame evaluator);
    `is_compiling()` is a flag read, and a constant True to the tracer, which then breaks its graph at the call.
    The skipping wrapper is made at the first call under a compiler: making it imports torch._dynamo (1.8 s on the
    2-core VM), which `import hetero` paid before (the tiled layers' forwards are wrapped at import): 2.2 s against
    0.5 s now, for the estimator's and profiler's command lines too. A training run imports it anyway when it makes a
    torch optimizer."""
    if torch.__version__ < "2.5":
        # Torch 2.4's tracer recompiled `call` below once per wrapped function, then ran it eagerly with its callees
        # still compiled, and failed inside hetero's bookkeeping; there the disabled function is the hook itself
        # (and `import hetero` imports the compiler).
        return torch.compiler.disable(fn)
    skipped: list[Callable] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            if not skipped:
                skipped.append(torch.compiler.disable(fn))
            return skipped[0](*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def _pre_forward(unit: Unit | None, owner: Unit, own: list[Entry], gathers: Gathers, covered: bool) -> Callable:
    """unit: the unit this module is the root of, if any; owner: the unit its parameters are gathered with;
    covered: its parameters are all its owner's (pinned with the whole unit where `gathers.pinned(owner)`)."""

    def post_backward() -> None:
        gathers.exit_unit_backward(unit)

    def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
        if unit is not None:
            gathers.enter_unit(unit)
            gathers.pin_unit(unit)
        if own and not (covered and gathers.pinned(owner)):
            gathers.use(own, owner)
        if unit is not None and torch.is_grad_enabled() and not in_backward():
            both = (args, kwargs)
            wrapped = wrap_outputs(both, post_backward)
            gathers.will_end(unit, ends=wrapped is not both)  # [Note: reductions at shared points]
            args, kwargs = wrapped
        return args, kwargs

    return hook


def _post_forward(unit: Unit | None, owner: Unit, own: list[Entry], gathers: Gathers, covered: bool) -> Callable:
    # A unit's backward pins all of its parameters (where `gathers.whole`); a module's own, only where it ran outside
    # its unit's forward. See [Note: one backward hook per unit].
    def pre_backward() -> None:
        if unit is not None:
            gathers.enter_unit(unit, backward=True)
        used = unit.entries if unit is not None and gathers.whole else own
        if used:
            gathers.use(used, owner)

    def pre_backward_inside() -> None:  # a module that ran inside its unit's forward, before `gathers.whole`
        gathers.module_backward(owner)
        pre_backward()

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        training = torch.is_grad_enabled()
        if own and not (covered and gathers.pinned(owner)):
            gathers.done_using(own)
        inside = False
        if unit is not None:
            gathers.unpin_unit(unit)
            gathers.exit_unit_forward(unit, training=training)
        elif gathers.running(owner):
            if gathers.whole:
                return output  # its unit's backward gathers and pins it
            inside = True
        if training and not in_backward():
            return wrap_outputs(output, pre_backward_inside if inside else pre_backward)
        return output

    return hook
