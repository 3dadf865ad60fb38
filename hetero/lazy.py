"""`hetero.lazy_init()`: build a model without memory, for `hetero.initialize` to materialise into chunks."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hetero.errors import WeightsError


@contextlib.contextmanager
def lazy_init() -> Iterator[None]:
    """Build models inside this context on the meta device: parameters get shapes but no memory.

    `hetero.initialize` then runs the model's own initialiser (reset_parameters, or a Hugging Face model's
    _init_weights) chunk by chunk, each rank keeping only its share, or streams `weights=` files in; see
    `hetero/zero/materialize.py`. Seed every rank the same before building: each initialises from its own generator.
    """
    if "torch._dynamo" not in sys.modules and torch.__version__ < "2.13":
        # Imported for the first time inside the context, torch 2.6's dynamo (which transformers' model modules
        # import) runs tensor code at import on the meta device and fails ("Tensor.item() cannot be called on meta
        # tensors"); 2.13's imports there. Versions between were not tried: imported first, outside.
        importlib.import_module("torch._dynamo")
    hook = torch.nn.modules.module.register_module_parameter_registration_hook(_record)
    _depth[0] += 1
    try:
        with torch.device("meta"), _Draws():
            yield
    finally:
        hook.remove()
        _depth[0] -= 1
        if not _depth[0]:
            _owner.clear()  # needed only while modules are built: ids outlive their parameters


# module -> {parameter name: (its id, when registered there)}, for models built under lazy_init: of the modules that
# hold one tied parameter, the one that registered it first made it (the tie registered it again on the others).
# Kept by module, weakly: a parameter is not weakly referenced, as torch.utils.swap_tensors refuses one that is.
_registered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_clock = itertools.count()


def _record(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    held = _registered.setdefault(module, {})
    if held.get(name, (None,))[0] != id(param):  # the same parameter registered again keeps its first time
        held[name] = (id(param), next(_clock))
        if param is not None:
            _owner.setdefault(id(param), (weakref.ref(module), name))


# [Note: draws in constructors]
# A module may draw its parameters' numbers in its constructor rather than in a reset_parameters (transformers'
# Conv1D, GPT-2's layers: `nn.init.normal_(self.weight, std=0.02)` in `__init__`). Normal construction consumes the
# random generator there; the replay of a Hugging Face model's construction ([Note: initialising on meta, chunk by
# chunk] in hetero/zero/materialize.py) must draw as many numbers at the same point, or every later value (the whole
# of GPT-2 after its first Conv1D) differs from normal construction's. Under lazy_init each random in-place call a
# module's own `__init__` makes on a parameter it registered is recorded, to be drawn again on a scratch tensor in
# its place (`construction_draws`). Under a bare torch.device("meta") there is no record.
_RANDOM = frozenset(
    {"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
     "xavier_normal_", "orthogonal_", "sparse_", "bernoulli_", "exponential_", "random_", "cauchy_", "log_normal_",
     "geometric_"}
)  # fmt: skip
_owner: dict[int, tuple[weakref.ref, str]] = {}  # parameter id -> (its module, its name), while lazy_init is entered
_depth = [0]  # lazy_init contexts entered (nested ones keep the record)
# module -> [(function, parameter name, arguments after the tensor, keyword arguments)] of its constructor's draws
_draws: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Draws(TorchFunctionMode):
    """Records the random draws modules' constructors make on their own parameters (see the note above)."""

    def __init__(self) -> None:
        super().__init__()
        self._aliases: dict[int, int] = {}  # id of a live `.data` alias -> id of its parameter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        # The drawn tensor comes first: positional, or by keyword (`nn.init` passes `tensor=`).
        target = args[0] if args else kwargs.get("tensor")
        if name in _RANDOM and isinstance(target, torch.Tensor):
            key = self._aliases.get(id(target), id(target))  # `self.weight.data.normal_()` draws the parameter
            owner = _owner.get(key)
            module = owner[0]() if owner is not None else None
            rest, named = args[1:], {k: v for k, v in kwargs.items() if k != "tensor" or args}
            if (
                module is not None
                and id(getattr(module, owner[1], None)) == key
                and not any(isinstance(a, (torch.Tensor, torch.Generator)) for a in (*rest, *named.values()))
                and _in_constructor_of(module)
            ):
                _draws.setdefault(module, []).append((func, owner[1], rest, named))
        out = func(*args, **kwargs)
        if name == "__get__" and getattr(func, "__self__", None) is _DATA and id(target) in _owner:
            self._aliases[id(out)] = id(target)
            weakref.finalize(out, self._aliases.pop, id(out), None)
        return out


# The descriptor of `Tensor.data`: its getter reaches torch function modes as a method-wrapper bound to it.
_DATA = next(vars(c)["data"] for c in torch.Tensor.__mro__ if "data" in vars(c))


def _in_constructor_of(module: nn.Module, depth: int = 4) -> bool:
    """Whether the call comes from `module.__init__` (not from an initialiser that transformers 4's post_init runs on
    the meta device, which the replay runs itself)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False


def construction_draws(module: nn.Module) -> list[tuple[Any, str, tuple, dict]]:
    """The random draws `module`'s constructor made on its parameters under lazy_init (see the note above)."""
    return list(_draws.get(module, ()))


def tie_makers(model: nn.Module) -> dict[int, nn.Module]:
    """Parameter id -> the module whose construction made it, for parameters tied across modules of a model built
    under lazy_init, where that module has a reset_parameters: tied at construction, the parameter has its values
    (nanoGPT's `wte.weight = lm_head.weight` keeps the head's, `lm_head.weight = embed.weight` the embedding's)."""
    holders: dict[int, list[tuple[int, nn.Module]]] = {}  # parameter id -> (when registered, module), each holder
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((_registered.get(m, {}).get(name, (None, -1))[1], m))
    makers = {}
    for key, held in holders.items():
        if len(held) < 2 or any(when < 0 for when, _ in held):
            continue  # not tied, or tied outside lazy_init (unknown: module order decides, see materialize.py)
        maker = min(held, key=lambda wm: wm[0])[1]
        if callable(getattr(maker, "reset_parameters", None)):
            makers[key] = maker
    return makers


def refuse_meta_adapters(model: nn.Module) -> None:
    """PEFT adapters added to a model built on meta cannot get their first values here: refused, with what works.

    hetero replays the model's own initialiser (hetero/zero/materialize.py); PEFT's adapters are initialised by
    `get_peft_model` (LoRA's B at zero, so that the model starts as its base model), which no replay runs: a Hugging
    Face model's _init_weights would give B small random values instead. Weight files of the base model do not
    name PEFT's wrapped layers (`base_layer`) either."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")  # imported wherever a model holds adapters
    layer = getattr(tuners, "BaseTunerLayer", None)
    if layer is None:
        return
    names = [n for n, m in model.named_modules() if isinstance(m, layer) and any(p.is_meta for p in m.parameters())]
    if names:
        raise WeightsError(
            f"PEFT adapters on the meta device ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): "
            "hetero cannot initialise them as peft.get_peft_model does (LoRA's B at zero), nor read a base model's "
            "weight files into PEFT's names. Build the base model with its weights (from_pretrained), then "
            "get_peft_model, then hetero.initialize"
        )
