"""What a user hands to `hetero.initialize`: the model, checked to be one hetero can place, and the optimizer, kept
from doing silently nothing afterwards.

[Note: a model already wrapped for data parallelism]
hetero does data parallelism itself (its chunks are reduced, sharded and gathered across the ranks). A model wrapped
in DistributedDataParallel or DataParallel, or sharded by FSDP (its wrapper, or FSDP2's `fully_shard` on any of its
modules), would reduce or shard each gradient a second time on hooks of its own, which fire where hetero's do and
expect gradients hetero has moved into chunks; so it is refused, naming the module to pass instead. So is a model
another engine holds: its parameters view that engine's chunks and carry its hooks (a second engine's backward met
the first one's hooks), until that engine closes; and at stage 3 a closed engine leaves them without values.

[Note: the optimizer handed over]
Once the engine holds a model, the optimizer object the user built still has its param groups (shared with
`engine.optimizer`, so a loop's own `group["lr"] = ...` and a scheduler built on it still drive the update), but its
parameters never get a `.grad` (gradients go into chunks) and its `state` stays empty (states live in chunks across
tiers and ranks). So a loop ported from plain PyTorch that calls `optimizer.step()` updated nothing, without a word
(measured: the loss of every step equal to the first, at every stage); `optimizer.state_dict()` saved an empty state
a resume would take for the real one; `add_param_group` added parameters no chunk holds, never trained. The engine
gives that object instance methods that raise, saying what to call instead, and removes them when it closes.
`zero_grad` clears no gradient that exists, so a loop that keeps calling it loses nothing; but its `set_to_none`
is the loop's choice of torch's semantics and is passed on: `set_to_none=False` makes the engine keep zero gradients
for the parameters it steps, as `engine.optimizer.zero_grad(set_to_none=False)` does ([Note: zero gradients kept]).
Ignored, a block frozen after such a call was skipped where torch steps it with a zero gradient (its moments decay,
weight decay shrinks it): 0.0093 off plain PyTorch's fourth loss.
An LR scheduler built on the object after `initialize` wraps the refusing `step` as it would the class's (torch's
schedulers wrap `optimizer.step` to count calls), and the engine steps schedulers without calling it.

[Note: loading weights into a held model]
A loop ported from DDP loads a checkpoint into the model after wrapping it (`model.load_state_dict(ckpt)`, on every
rank). Into a model hetero holds, that copied into the parameters' views of the chunks, and the next update stepped
from the fp32 master weights, which still held the old values: the loaded weights were gone after one step (measured
at stage 0 in fp32, 1.0 off plain PyTorch's), and at stage 3 the copy failed on the released parameters. The engine
gives each module an instance `load_state_dict` that loads inside `engine.gathered_parameters(params, modify=True)`:
the parameters the state dict names gathered, the copy, then rank 0's values taken by every rank, the master weights
included, and those at the values loaded where these are finer than the compute dtype (an fp32 checkpoint into a
bf16 model: its masters are not rounded to bf16). It is collective as that block is (every rank loads, as DDP's loop
has it), gathers them at once (an adapter's weights loaded into a stage-3 model leave its base weights sharded; a
model whose weights do not fit the device at once loads through `hetero.initialize(..., weights=path)` or
`engine.load_checkpoint`), runs the class's own `load_state_dict` (its strict key check and returned missing and
unexpected keys unchanged; its error comes after what matched is loaded, master weights included, as torch loads it
before raising), and calls straight through inside a block the user opened. `assign=True` would put new tensors in
place of the chunks' views: refused.

[Note: casting or moving a held model]
`model.half()`, `model.to(torch.bfloat16)`, `model.double()`, `model.cuda()` to another device, `model.to_empty()`:
torch converts each parameter and swaps the result in as its `.data`. A parameter of a model hetero holds is a view
of a chunk (or, at stage 3, released between uses): after the swap the model computed with a detached copy, and
the updates went into the chunks it no longer read (measured: `model.double()` after initialize at stage 0, every
step's loss the first one's), and at stage 3 the conversion failed reading a released parameter. Each module gets
an instance `_apply` (the one method all of them go through) that first asks the conversion what it would make of a
parameter-like empty tensor (same dtype and device): where that is the tensor itself the call changes nothing and
goes through (`model.to(device)` where the parameters already are, `model.float()` of an fp32 model; the parameters
are left untouched, which a released one needs), else it is refused with the config keys that choose dtype and
device. Buffers convert as before.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from hetero.errors import ConfigError, HeteroError
from hetero.zero.released import is_released

# Class names (anywhere in a module's class hierarchy) of torch's data-parallel wrappers and sharded modules; by name,
# so that checking needs no import of torch.distributed (hetero/comm is its one place).
_WRAPPERS = {"DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "FSDPModule"}

_INSTEAD = {
    "step": (
        "runs no update: hetero.initialize took over this optimizer and its parameters get no .grad (gradients go "
        "into hetero's chunks). Call engine.backward(loss) then engine.step() (the update happens there, at the "
        "accumulation boundary), or engine.train_batch(inputs, labels)"
    ),
    "state_dict": (
        "would be empty: hetero keeps the optimizer's states (and fp32 master weights) in chunks across tiers and "
        "ranks. Save them with engine.save_checkpoint(path) and restore them with engine.load_checkpoint(path); "
        "engine.optimizer.hyperparameters() gives the param groups' settings"
    ),
    "load_state_dict": (
        "would load into an optimizer hetero no longer steps: load a plain optimizer's state before "
        "hetero.initialize (its states are taken over), or restore a hetero checkpoint with engine.load_checkpoint"
    ),
    "add_param_group": (
        "would add parameters no hetero chunk holds, and they would never train: hetero lays its chunks out once. "
        "Build the optimizer with every param group up front (a group may start with lr 0 and be raised later, "
        "or its parameters may start with requires_grad False)"
    ),
}


_HELD: dict[int, weakref.ref] = {}  # id of a parameter an open engine holds -> the parameter (weakly)


def hold(model: torch.nn.Module) -> Callable[[], None]:
    """Mark `model`'s parameters as an open engine's; returns what unmarks them (the engine's close)."""
    params = list(model.parameters())
    for p in params:
        _HELD[id(p)] = weakref.ref(p)

    def undo() -> None:
        for p in params:
            ref = _HELD.get(id(p))
            if ref is not None and ref() is p:
                del _HELD[id(p)]

    return undo


def check_model(model: object) -> None:
    """Refuse what hetero cannot place: not an nn.Module (an engine, say), or a model already wrapped or sharded for
    data parallelism ([Note: a model already wrapped for data parallelism])."""
    if not isinstance(model, torch.nn.Module):
        hint = " (an engine: pass its model, engine.module)" if hasattr(model, "module") else ""
        raise ConfigError(f"hetero.initialize takes the model as an nn.Module; got {type(model).__name__}{hint}")
    for name, m in model.named_modules():
        wrapper = next((c.__name__ for c in type(m).__mro__ if c.__name__ in _WRAPPERS), None)
        if wrapper is not None:
            where = f"module {name!r}" if name else "the model"
            inner = f" (model.{name + '.' if name else ''}module, the one it wraps)" if hasattr(m, "module") else ""
            raise ConfigError(
                f"{where} is a {wrapper}: hetero does data parallelism itself, and a second one would reduce or "
                f"shard every gradient again. Pass the model unwrapped{inner}, built without fully_shard / "
                "DistributedDataParallel; hetero's zero_stage chooses what is sharded"
            )
    for name, p in model.named_parameters():
        ref = _HELD.get(id(p))
        if ref is not None and ref() is p:
            raise ConfigError(
                f"parameter {name!r} belongs to an open hetero engine (this model was given to hetero.initialize "
                "before): train through that engine, or close it first (engine.close()) and pass a model with "
                "values (a closed stage-3 engine leaves none: take engine.full_state_dict() before closing)"
            )
        if is_released(p):
            raise ConfigError(
                f"parameter {name!r} has no values: a hetero engine at zero_stage 3 held this model and closed. "
                "Take its weights before closing (engine.full_state_dict(), or a checkpoint) and load them into a "
                "new model, or pass weights= to hetero.initialize"
            )


def take_over(optimizer: torch.optim.Optimizer, keep_zeros: Callable[[bool], None]) -> Callable[[], None]:
    """Make `optimizer`'s step, state_dict, load_state_dict and add_param_group raise, and its zero_grad pass its
    `set_to_none` to `keep_zeros` ([Note: the optimizer handed over]); returns what undoes it."""
    before = {name: optimizer.__dict__.get(name) for name in (*_INSTEAD, "zero_grad")}
    for name in _INSTEAD:
        setattr(optimizer, name, types.MethodType(_refusal(name), optimizer))

    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        keep_zeros(bool(set_to_none))

    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)  # type: ignore[method-assign]

    def undo() -> None:
        for name, own in before.items():
            if own is None:
                optimizer.__dict__.pop(name, None)
            else:
                optimizer.__dict__[name] = own

    return undo


class _InPlaceOf:
    """A module's instance method standing in for its class's while an engine holds the module. Pickled or copied
    (`torch.save(model)`, `copy.deepcopy(model)`), it becomes the class's own method of that module: the copy is
    held by no engine, and the stand-in's closure over the engine would neither pickle nor belong to the copy."""

    def __init__(self, module: torch.nn.Module, name: str, fn: Callable[..., Any]) -> None:
        self.module, self.name, self.fn = module, name, fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return functools.partial, (getattr(type(self.module), self.name), self.module)


def route_loads(model: torch.nn.Module, loading: Callable[[list[torch.Tensor], dict], Any]) -> Callable[[], None]:
    """Give every module of `model` a `load_state_dict` that loads under `loading(its parameters)` ([Note: loading
    weights into a held model]); returns what takes them away."""
    patched = []
    for module in model.modules():
        if "load_state_dict" in module.__dict__:
            continue  # the user's own instance override: theirs to keep
        module.__dict__["load_state_dict"] = _InPlaceOf(module, "load_state_dict", _loader(module, loading))
        patched.append(module)

    def undo() -> None:
        for module in patched:
            module.__dict__.pop("load_state_dict", None)

    return undo


def _loader(module: torch.nn.Module, loading: Callable[[list[torch.Tensor], dict], Any]) -> Callable[..., Any]:
    own = type(module).load_state_dict

    def load_state_dict(state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if assign:
            raise HeteroError(
                "load_state_dict(assign=True) on a model hetero holds would put new tensors in place of the "
                "parameters, which are views of hetero's chunks, and they would train no more: load without assign "
                "(the values are copied into the chunks)"
            )
        # The values as given, for master weights finer than the compute dtype (fp32 loaded into a bf16 model).
        exact = {
            id(p): state_dict[name]
            for name, p in module.named_parameters()
            if isinstance(state_dict.get(name), torch.Tensor) and state_dict[name].shape == p.shape
        }
        # Only the parameters the state dict names are copied: only they are gathered (an adapter's weights loaded
        # into a stage-3 model leave its base weights where they are).
        named = [p for name, p in module.named_parameters(remove_duplicate=False) if name in state_dict]
        error = None
        with loading(list({id(p): p for p in named}.values()), exact):
            try:
                result = own(module, state_dict, strict=strict)
            except RuntimeError as e:  # torch raises after loading what matched: the block still ends as after a load
                error = e
        if error is not None:
            raise error
        return result

    return load_state_dict


def guard_casts(model: torch.nn.Module) -> Callable[[], None]:
    """Give every module of `model` an `_apply` that refuses a conversion of its parameters ([Note: casting or
    moving a held model]); returns what takes them away."""
    patched = []
    for module in model.modules():
        if "_apply" in module.__dict__:
            continue
        module.__dict__["_apply"] = _InPlaceOf(module, "_apply", _guarded_apply(module))
        patched.append(module)

    def undo() -> None:
        for module in patched:
            module.__dict__.pop("_apply", None)

    return undo


def _guarded_apply(module: torch.nn.Module) -> Callable[..., Any]:
    def _apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        for name, p in module.named_parameters(recurse=recurse):
            like = torch.empty(0, dtype=p.dtype, device=p.device)
            if fn(like) is not like:
                raise HeteroError(
                    f"converting or moving the parameters of a model hetero holds (parameter {name!r}, "
                    f"{p.dtype} on {p.device}) would detach them from hetero's chunks: the model would compute on "
                    "a copy the updates never reach. hetero places them: the compute dtype comes from the config's "
                    '"precision" ("fp32", "bf16", "fp16"), the device from hetero.initialize(..., device=...), and '
                    'the tier from "offload". Convert the model before hetero.initialize, or not at all'
                )
        # A no-op for every parameter: torch's own walk would still call fn on each and read it (a released one
        # raises), so the walk is done here, over the buffers and the children, as torch does it.
        if recurse:
            for child in module.children():
                child._apply(fn)
        for name, buf in module.named_buffers(recurse=False):
            setattr(module, name, fn(buf))
        return module

    return _apply


# Modules of held models -> what to tell when one of them registers a parameter or a submodule (a head replaced, an
# adapter added): the engine then walks its model's parameters at the next backward, and not at every one (the walk
# cost 0.3-0.5 ms a backward on a 16-layer model, most of hetero's host overhead there).
_STRUCTURE: weakref.WeakKeyDictionary[torch.nn.Module, Callable[[], None]] = weakref.WeakKeyDictionary()
_registration_hooks: list[Any] = []


def watch_structure(model: torch.nn.Module, changed: Callable[[], None]) -> Callable[[], None]:
    """Call `changed` whenever a module of `model` registers a parameter or a submodule; returns what stops it."""
    if not _registration_hooks:  # torch's global hooks, once a process: they look the module up
        from torch.nn.modules import module as torch_module

        _registration_hooks.append(torch_module.register_module_parameter_registration_hook(_registered))
        _registration_hooks.append(torch_module.register_module_module_registration_hook(_registered))
    modules = list(model.modules())
    for m in modules:
        _STRUCTURE[m] = changed

    def undo() -> None:
        for m in modules:
            if _STRUCTURE.get(m) is changed:
                del _STRUCTURE[m]

    return undo


def _registered(module: torch.nn.Module, name: str, value: Any) -> None:
    changed = _STRUCTURE.get(module)
    if changed is not None:
        changed()


def _refusal(name: str) -> Callable[..., NoReturn]:
    def refuse(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> NoReturn:
        given = f"{type(self).__name__}.{name}() on the optimizer given to hetero.initialize"
        raise HeteroError(f"{given} {_INSTEAD[name]}")

    refuse.__name__ = name
    return refuse
