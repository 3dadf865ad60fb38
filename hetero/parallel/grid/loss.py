"""The language-model loss on grid-cut logits: [b/B, s, V/q] on each rank (batch part, vocabulary part).

The cross entropy of one token needs its whole vocabulary row: the 1D vocabulary-parallel cross entropy over the
group that cuts the vocabulary (the layout's hidden group) gives it without gathering the logits. The mean over the
batch then sums the per-token losses and the token counts over the groups that cut the batch (main.batch, and the
depth group in 2.5D). That sum is `reduce_from_region`: every rank computes the same mean from it, so each rank's
gradient flows back to its own tokens unchanged.
"""

from __future__ import annotations

import torch

from hetero.parallel.grid.layers import own_rows
from hetero.parallel.grid.mesh import Grid
from hetero.parallel.tp_ops import reduce_from_region
from hetero.parallel.vocab import vocab_parallel_cross_entropy


def grid_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    grid: Grid,
    *,
    ignore_index: int = -100,
    num_items: torch.Tensor | int | None = None,
    label_smoothing: float = 0.0,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross entropy of this rank's logits [b/B, s, V/q] against the whole batch's labels [b, s] (this rank's
    rows are taken here); the same value on every rank of the tensor group. ``label_smoothing`` and ``weight`` (class
    weights of the whole vocabulary [V]) as torch's cross_entropy takes them; a weighted mean divides by the targets'
    weights unless ``num_items`` is given."""
    mine = own_rows(labels, grid, "the labels").to(logits.device)
    total = vocab_parallel_cross_entropy(
        logits,
        mine,
        grid.main.hidden,
        ignore_index=ignore_index,
        reduction="sum",
        label_smoothing=label_smoothing,
        weight=weight,
    )
    total = reduce_from_region(reduce_from_region(total, grid.main.batch), grid.outer)
    if num_items is None:
        valid = mine != ignore_index
        if weight is None:
            count = valid.sum().to(total.dtype)
        else:  # torch divides a weighted mean by the weights of the targets counted
            count = (weight.to(total)[torch.where(valid, mine, torch.zeros_like(mine))] * valid).sum()
        grid.main.batch.all_reduce(count)
        grid.outer.all_reduce(count)
    elif isinstance(num_items, torch.Tensor):
        count = num_items.to(total.device, total.dtype)
    else:
        return total / float(num_items)  # a number goes with the kernel: made a tensor on a GPU, it would wait for it
    return total / count
