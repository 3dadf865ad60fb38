"""`hetero.lazy_init()`: build a model without memory, for `hetero.initialize` to materialise into chunks."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import sys
import weakref
from collections.abc import Iterator

import torch
from torch import nn

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
    try:
        with torch.device("meta"):
            yield
    finally:
        hook.remove()


# module -> {parameter name: (its id, when registered there)}, for models built under lazy_init: of the modules that
# hold one tied parameter, the one that registered it first made it (the tie registered it again on the others).
# Kept by module, weakly: a parameter is not weakly referenced, as torch.utils.swap_tensors refuses one that is.
_registered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_clock = itertools.count()


def _record(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    held = _registered.setdefault(module, {})
    if held.get(name, (None,))[0] != id(param):  # the same parameter registered again keeps its first time
        held[name] = (id(param), next(_clock))


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
