"""`hetero.lazy_init()`: build a model without memory, for `hetero.initialize` to materialise into chunks."""

from __future__ import annotations

import contextlib
import importlib
import sys
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
    with torch.device("meta"):
        yield


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
