"""A parameter built on the meta device given real memory in place, its gradient hooks kept.

[Note: hooks across swap_tensors]
A meta tensor cannot take another device's data (`p.data = real` raises), so a parameter built on the meta device
(`hetero.lazy_init()`, `with torch.device("meta")` with or without `weights=`) gets its memory from
`torch.utils.swap_tensors(p, new)`, which keeps the Parameter object the optimizer and tied modules refer to. The swap
moves the tensor's implementation and its `__dict__`, but the gradient hooks registered on the parameter
(`register_hook`, `register_post_accumulate_grad_hook`) stay installed on the old implementation, now the discarded
tensor's, while the attributes that list them (`_backward_hooks`, `_post_accumulate_grad_hooks`) still show them on
the parameter: they never ran again. Tensor parallelism registers such hooks before the chunks are built (a
`head_norm`, or a `norm` under Megatron-SP, sums its gradient over the tensor ranks: hetero/parallel/sequence.py), so
Qwen3 on the meta device at tensor 2 trained its q/k norms on one rank's part of their gradient, silently (the
forty-fourth session's fuzzer found it; a real model loading the same `weights=` was right). Setting the attributes
again installs them on the parameter's new implementation.
"""

from __future__ import annotations

import torch
from torch import nn

_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")  # what torch installs on the implementation when set


def give_memory(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make the meta `param` (the same object) hold `value`, with its attributes and gradient hooks."""
    new = nn.Parameter(value, requires_grad=param.requires_grad)
    new.__dict__.update(vars(param))  # swap_tensors swaps __dict__ too: the parameter's attributes go with it
    torch.utils.swap_tensors(param, new)
    for attr in _HOOKS:
        hooks = getattr(param, attr, None)
        if hooks:
            setattr(param, attr, hooks)
