"""Vocabulary parallelism: an embedding sharded by vocabulary range, and a cross entropy on vocabulary-sharded
logits that never gathers them.

Rank r of t holds the rows [r*V/t, (r+1)*V/t) of the embedding matrix. Tied to the LM head (GPT-2, and the GPT of
``hetero.models``), the same shard makes the head's logits sharded by the same ranges, and the loss works on those
shards: softmax cross entropy needs only the maximum, the sum of exponentials and the target's logit over the whole
vocabulary, three all-reduces of one number per token instead of an all-gather of V/t numbers per token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import Function

from hetero.comm import Comm
from hetero.parallel.tp_ops import reduce_from_region


class _VocabParallelCE(Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        start: int,
        comm: Comm,
        ignore_index: int,
        smoothing: float,
        weight: torch.Tensor | None,
        weight_total: torch.Tensor | None,
    ) -> torch.Tensor:
        n_local = logits.shape[-1]
        vocab = n_local * comm.size
        # Softmax is shift-invariant: subtract the global maximum so that exp never overflows.
        peak = logits.detach().max(dim=-1).values
        comm.all_reduce(peak, op="max")
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        comm.all_reduce(total)
        valid = target != ignore_index
        local = target - start
        mine = valid & (local >= 0) & (local < n_local)
        idx = torch.where(mine, local, torch.zeros_like(local))
        # Sums over the vocabulary in one all-reduce: the target's logit (exactly one rank holds each valid target),
        # its class weight, and under smoothing the (weighted) sum of all the logits.
        cols = [shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * mine]
        if weight is not None:
            cols.append(weight[idx] * mine)
        if smoothing:
            cols.append((shifted if weight is None else shifted * weight).sum(dim=-1))
        sums = torch.stack(cols, -1)
        comm.all_reduce(sums)
        lse = total.log()  # -log p_j = lse - shifted_j
        w_target = None if weight is None else sums[:, 1]
        loss = lse - sums[:, 0] if weight is None else w_target * (lse - sums[:, 0])
        if smoothing:
            # torch's definition: (1 - e) * w_y * (-log p_y) + e / V * sum_j w_j * (-log p_j), w = 1 unweighted.
            w_all = vocab if weight is None else weight_total
            loss = (1 - smoothing) * loss + smoothing / vocab * (w_all * lse - sums[:, -1])
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        exp.div_(total.unsqueeze(-1))  # now the local part of the softmax, kept for backward
        ctx.smoothing, ctx.vocab = smoothing, vocab
        ctx.save_for_backward(exp, idx, mine, valid, w_target, weight, weight_total)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, idx, mine, valid, w_target, weight, weight_total = ctx.saved_tensors
        e, vocab = ctx.smoothing, ctx.vocab
        # d loss_i / d logit_ij = (1 - e) w_y (p_ij - [j is i's target]) + e / V (W p_ij - w_j), W = sum_j w_j;
        # zero for ignored tokens. Unweighted (w = 1, W = V): p_ij - (1 - e) [j is i's target] - e / V.
        hit = (1 - e) * mine.to(softmax.dtype)
        out = softmax.clone()
        if weight is not None:
            hit = hit * w_target
            out.mul_(((1 - e) * w_target + e / vocab * weight_total).unsqueeze(-1))
        out.scatter_add_(-1, idx.unsqueeze(-1), -hit.unsqueeze(-1))
        if e:
            out.sub_(e / vocab if weight is None else weight * (e / vocab))
        out.mul_((grad * valid).unsqueeze(-1))
        return out, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    comm: Comm,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items: torch.Tensor | int | None = None,
    label_smoothing: float = 0.0,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross entropy of ``logits`` [..., V/t] (this rank's vocabulary range, ranks in order) against ``target`` [...].

    Equals ``F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), ignore_index=, label_smoothing=,
    weight=)``, computed in fp32 (fp64 logits in fp64), with the same value on every rank. ``reduction``: "mean"
    (over tokens not ignored, weighted by their targets' ``weight`` as torch does; ``num_items``, when given,
    replaces that denominator, as Hugging Face's trainer passes it), "sum" or "none". ``weight``: torch's class
    weights for the whole vocabulary [V], the same on every rank (each rank reads its range).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction = {reduction!r}: expected 'mean', 'sum' or 'none'")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree before the vocab")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing = {label_smoothing}: it must be between 0.0 and 1.0, as torch requires")
    n_local = logits.shape[-1]
    flat = logits.reshape(-1, n_local).to(torch.promote_types(logits.dtype, torch.float32))
    tgt = target.reshape(-1).to(flat.device)
    start = comm.rank * n_local
    mine_w = weight_total = None
    if weight is not None:
        if weight.shape != (n_local * comm.size,):
            raise ValueError(
                f"weight has shape {tuple(weight.shape)}: give one weight per class of the whole vocabulary, "
                f"({n_local * comm.size},), the same on every rank ({comm.size} ranks hold {n_local} classes each)"
            )
        full = weight.to(flat.device, flat.dtype)
        mine_w, weight_total = full[start : start + n_local].contiguous(), full.sum()
    per_token = _VocabParallelCE.apply(
        flat, tgt, start, comm, ignore_index, float(label_smoothing), mine_w, weight_total
    )
    if reduction == "none":
        return per_token.view(target.shape)
    if reduction == "sum":
        return per_token.sum()
    if num_items is not None:
        count = num_items
    elif weight is None:
        count = (tgt != ignore_index).sum()
    else:  # torch divides a weighted mean by the weights of the targets counted (every rank holds all of them)
        valid = tgt != ignore_index
        count = (full[torch.where(valid, tgt, torch.zeros_like(tgt))] * valid).sum()
    if isinstance(count, torch.Tensor):
        return per_token.sum() / count.to(per_token.device)
    return per_token.sum() / count  # a number goes with the kernel: made a tensor on a GPU, it would wait for it


def embed_vocab_parallel(
    ids: torch.Tensor, n_local: int, comm: Comm, lookup: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """A vocabulary-sharded embedding's forward: ``lookup`` (the layer's own forward on this rank's ``n_local`` rows:
    a subclass may scale its output, as Gemma's does) reads the ids this rank holds, the others read as zero, then
    the ranks' parts sum. Whatever the layer does after the row lookup must be linear in the row (a scale), since
    the sum comes after it."""
    local = ids - comm.rank * n_local
    outside = (local < 0) | (local >= n_local)
    out = lookup(local.masked_fill(outside, 0))
    return reduce_from_region(out.masked_fill(outside.unsqueeze(-1), 0.0), comm)


def local_padding_idx(padding_idx: int | None, n_local: int, rank: int) -> int | None:
    """The row of this rank's shard that is the padding row (no gradient), or None when another rank holds it."""
    if padding_idx is None:
        return None
    local = padding_idx - rank * n_local
    return local if 0 <= local < n_local else None


class CausalLMLoss:
    """Hugging Face's causal-LM loss (shift labels left by one, mean over tokens not ignored) on logits sharded by
    vocabulary over `comm`.

    Installed as ``model.loss_function``, which recent transformers call as
    ``loss_function(logits, labels, vocab_size, **kwargs)``. `entropy(logits, labels, ignore_index=, num_items=)`
    is the sharded cross entropy (default: the 1D vocabulary-parallel one over `comm`; the grid modes give theirs).
    """

    def __init__(self, comm: Comm, *, entropy: Callable[..., torch.Tensor] | None = None) -> None:
        self.comm = comm
        self.entropy = entropy or functools.partial(vocab_parallel_cross_entropy, comm=comm)

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if vocab_size is not None and logits.shape[-1] * self.comm.size != vocab_size:
            raise ValueError(
                f"logits hold {logits.shape[-1]} of {vocab_size} vocabulary entries on each of {self.comm.size} "
                "tensor ranks: the LM head is not sharded by vocabulary as the loss expects"
            )
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return self.entropy(logits, shift_labels, ignore_index=ignore_index, num_items=num_items_in_batch)


class AlignedLMLoss:
    """The loss of ``hetero.models.gpt.GPT`` (labels already aligned, -100 ignored) on sharded logits."""

    def __init__(self, comm: Comm, *, entropy: Callable[..., torch.Tensor] | None = None) -> None:
        self.entropy = entropy or functools.partial(vocab_parallel_cross_entropy, comm=comm)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.entropy(logits, labels, ignore_index=-100)
