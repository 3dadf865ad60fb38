"""`hetero.lazy_init()`: build a model without memory, for `hetero.initialize` to materialise into chunks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def lazy_init() -> Iterator[None]:
    """Build models inside this context on the meta device: parameters get shapes but no memory.

    `hetero.initialize` then runs the model's own initialiser (reset_parameters, or a Hugging Face model's
    _init_weights) chunk by chunk, each rank keeping only its share, or streams `weights=` files in; see
    `hetero/zero/materialize.py`. Seed every rank the same before building: each initialises from its own generator.
    """
    with torch.device("meta"):
        yield
