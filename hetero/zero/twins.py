"""Tensors a module computes in its constructor and no initialiser sets again, for a model built on the meta device:
taken from a twin of the module built on the CPU."""

from __future__ import annotations

import torch
from torch import nn


def buffers_from_twins(model: nn.Module) -> None:
    """Buffers a module computes in its constructor and no initialiser sets again (transformers 4's rotary
    `inv_freq`, GPT-2's causal mask) are taken from a twin built on the CPU from the module's own config: one twin
    per class and config, as every layer's buffers are the same."""
    twins: dict[tuple[type, int], nn.Module | None] = {}
    for module in model.modules():
        meta = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        # Plain tensor attributes too (transformers 4 keeps `original_inv_freq` beside the buffer).
        meta += [n for n, v in vars(module).items() if isinstance(v, torch.Tensor) and v.is_meta]
        config = getattr(module, "config", None)
        if not meta or config is None:
            continue
        key = (type(module), id(config))
        if key not in twins:
            try:
                with torch.device("cpu"):
                    twins[key] = type(module)(config)
            except Exception:  # a constructor that takes more than its config: the error below names the buffer
                twins[key] = None
        twin = twins[key]
        if twin is None:
            continue
        values = {
            **{n: v for n, v in vars(twin).items() if isinstance(v, torch.Tensor)},
            **dict(twin.named_buffers(recurse=False)),
        }
        for name in meta:
            value = values.get(name)
            if value is not None and value.shape == getattr(module, name).shape:
                setattr(module, name, value.clone())  # a buffer keeps its persistence
