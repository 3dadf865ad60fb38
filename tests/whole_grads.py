"""The whole model's gradients from a tensor-parallel model's ranks: each rank's gradient gathered, split ones joined
in tensor rank order (`hetero.parallel.unshard`), for a comparison with plain PyTorch's `param.grad`."""

from __future__ import annotations

import torch
from torch import nn

from hetero.comm import Comm
from hetero.parallel import unshard


def whole_grads(model: nn.Module, comm: Comm) -> dict[str, torch.Tensor]:
    """Every rank calls it (it gathers over `comm`, the tensor group); each rank gets the joined gradients."""
    grads = {}
    for name, p in model.named_parameters():
        every = comm.all_gather_object(p.grad.detach().clone())
        cut = getattr(p, "_hetero_tp", None)
        grads[name] = every[0] if cut is None else unshard(every, cut)
    return grads
