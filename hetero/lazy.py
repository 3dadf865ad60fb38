"""`hetero.lazy_init()`: build a model without memory, for `hetero.initialize` to materialise into chunks."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator

import torch


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
