"""The plain single-process PyTorch loop every parity test compares against, written once."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def train_plain(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    clip: float | None = None,
) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """Train a Hugging Face model (it takes `labels=`) on `batches`: the losses, the final weights (copies) and the
    last step's gradient norm before clipping (clipping at infinity when `clip` is None, to measure it all the same)."""
    losses, norm = [], float("nan")
    for x, y in batches:
        loss = model(x, labels=y).loss
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else float("inf")))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norm
