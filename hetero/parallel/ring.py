"""Ring self-attention (Li et al., 2021, Colossal-AI's sequence parallelism; Liu et al., 2023, Ring Attention): every
rank of the group holds all the weights and a part of the sequence; attention passes the key/value blocks around
the ring, so each rank's queries meet every key without any rank holding the whole sequence.

[Note: ring attention]
The sequence is cut in 2p chunks and rank r holds chunks r and 2p-1-r (zig-zag, ``seq_split.SeqLayout``). In step
t = 0 .. p-1, rank r holds the keys and values of rank r - t (mod p) and computes, for each of its two query chunks
and each of the visiting two key chunks, with chunk numbers cq and ck:

    ck < cq: the whole block; ck == cq: the causal triangle; ck > cq: nothing (every key lies in the future).

With the zig-zag every rank computes exactly two whole-block equivalents per step (step 0: a block and two
triangles; later steps: two blocks), where contiguous parts would leave rank 0 one block and rank p-1 up to 2p - 1:
the causal triangle's work is balanced. Without a causal mask every pair is a whole block.

Blocks are merged by their log-sum-exp (the online softmax of flash attention): a block's normalised output o_j
and lse_j = log sum exp s_j fold into the running (o, lse) as lse' = log(e^lse + e^lse_j),
o' = o e^(lse - lse') + o_j e^(lse_j - lse'). Only q, k, v, the output and the final lse are kept for backward,
which passes the keys and values around the ring again with their gradient accumulators dk, dv: for a block,
p = exp(s - lse), dv += p^T do, ds = p (do v^T - rowsum(do o)), dq += scale ds k, dk += scale ds^T q; after p steps
(and one last hop) every accumulator is back with its owner. Per layer and rank that is (p-1) sends of k and v
forward, (p-1) of k and v and p of dk and dv backward (``benchmarks/tp_comm.py`` counts them). Grouped-query
attention passes the compact key/value heads and widens them locally.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.autograd import Function

from hetero.comm import Comm
from hetero.errors import ConfigError
from hetero.parallel.seq_split import SeqLayout, apply_sequence_split

_TAG = 0x5249  # gloo matches point-to-point by tag: one tag for the ring's messages


def _shift(tensors: list[torch.Tensor], comm: Comm) -> list[torch.Tensor]:
    """Send `tensors` to the next rank of the ring and receive the previous rank's (same shapes), in one message."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    got = torch.empty_like(flat)
    nxt, prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for h in comm.batch_p2p([("send", flat, nxt, _TAG), ("recv", got, prev, _TAG)]):
        h.wait()
    out, at = [], 0
    for t in tensors:
        out.append(got[at : at + t.numel()].view_as(t))
        at += t.numel()
    return out


def _pairs(rank: int, src: int, size: int, causal: bool) -> list[tuple[int, int, bool]]:
    """(query chunk, key chunk, triangle) pairs rank computes against src's keys ([Note: ring attention])."""
    mine, theirs = (rank, 2 * size - 1 - rank), (src, 2 * size - 1 - src)
    out = []
    for i, cq in enumerate(mine):
        for j, ck in enumerate(theirs):
            if not causal or ck < cq:
                out.append((i, j, False))
            elif ck == cq:
                out.append((i, j, True))
    return out


def _widen(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for grouped-query attention (as transformers' repeat_kv)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _narrow(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_widen`: sums each key/value head's group."""
    b, h, s, d = g.shape
    return g if h == kv_heads else g.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, triangle: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if triangle:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


class _RingAttention(Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, scale: float, causal: bool
    ) -> torch.Tensor:
        p, r, heads = comm.size, comm.rank, q.shape[1]
        qs = q.float().chunk(2, 2)  # this rank's two query chunks
        out = [torch.zeros_like(c) for c in qs]
        lse = [torch.full(c.shape[:-1], float("-inf"), device=q.device) for c in qs]
        kv = [k, v]
        for t in range(p):
            src = (r - t) % p
            if t < p - 1:
                nxt = _shift(kv, comm)  # on NCCL this overlaps the compute below (batched p2p)
            ks, vs = (_widen(x.float(), heads).chunk(2, 2) for x in kv)
            for i, j, tri in _pairs(r, src, p, causal):
                s = _scores(qs[i], ks[j], scale, tri)
                block_lse = torch.logsumexp(s, -1)
                block = torch.matmul(torch.exp(s - block_lse.unsqueeze(-1)), vs[j])
                new = torch.logaddexp(lse[i], block_lse)
                out[i] = out[i] * torch.exp(lse[i] - new).unsqueeze(-1) + block * torch.exp(block_lse - new).unsqueeze(
                    -1
                )
                lse[i] = new
            if t < p - 1:
                kv = nxt
        o = torch.cat(out, 2)
        ctx.save_for_backward(q, k, v, o, torch.cat(lse, 2))
        ctx.comm, ctx.scale, ctx.causal = comm, scale, causal
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        comm, scale, causal = ctx.comm, ctx.scale, ctx.causal
        p, r, heads, kv_heads = comm.size, comm.rank, q.shape[1], k.shape[1]
        do = grad.float()
        rowdot = (do * o).sum(-1, keepdim=True)  # rowsum(do o): the softmax's gradient correction
        qs, dos, rows, lses = q.float().chunk(2, 2), do.chunk(2, 2), rowdot.chunk(2, 2), lse.chunk(2, 2)
        dq = [torch.zeros_like(c) for c in qs]
        kv = [k, v]
        dkv = [torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device)]
        for t in range(p):
            src = (r - t) % p
            ks, vs = (_widen(x.float(), heads).chunk(2, 2) for x in kv)
            dk = [torch.zeros_like(c) for c in ks]
            dv = [torch.zeros_like(c) for c in vs]
            for i, j, tri in _pairs(r, src, p, causal):
                prob = torch.exp(_scores(qs[i], ks[j], scale, tri) - lses[i].unsqueeze(-1))
                dv[j] += torch.matmul(prob.transpose(-1, -2), dos[i])
                ds = prob * (torch.matmul(dos[i], vs[j].transpose(-1, -2)) - rows[i])
                dq[i] += torch.matmul(ds, ks[j]) * scale
                dk[j] += torch.matmul(ds.transpose(-1, -2), qs[i]) * scale
            dkv = [dkv[0] + _narrow(torch.cat(dk, 2), kv_heads), dkv[1] + _narrow(torch.cat(dv, 2), kv_heads)]
            # The accumulators travel with the blocks they belong to; after the last step one hop brings them home.
            if t < p - 1:
                kv_and_grads = _shift([*kv, *dkv], comm)
                kv, dkv = kv_and_grads[:2], kv_and_grads[2:]
            else:
                dkv = _shift(dkv, comm)
        return torch.cat(dq, 2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, *, scale: float | None = None, causal: bool = True
) -> torch.Tensor:
    """Attention of this rank's queries [b, heads, 2c, d] over the whole sequence, whose keys and values
    [b, kv_heads, 2c, d] are spread over ``comm`` in the zig-zag layout ([Note: ring attention])."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention: this rank's part of the sequence ({q.shape[2]}) must be two equal chunks")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if comm.size == 1:
        s = _scores(q.float(), _widen(k.float(), q.shape[1]), scale, causal)
        return torch.matmul(torch.softmax(s, -1), _widen(v.float(), q.shape[1])).to(q.dtype)
    return _RingAttention.apply(q, k, v, comm, scale, causal)


class _HFAttention:
    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def __call__(
        self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any
    ) -> torch.Tensor:
        if kwargs.get("dropout", 0.0):
            raise ConfigError("ring attention has no attention dropout: set the model's attention dropout to 0")
        causal = getattr(module, "is_causal", True)
        out = ring_attention(query, key, value, self.comm, scale=kwargs.get("scaling"), causal=causal)
        return out.transpose(1, 2)  # transformers' layout: [b, seq, heads, d]


class _Attend:
    def __init__(self, comm: Comm, module: nn.Module) -> None:
        self.comm, self.module = comm, module

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.module.training and getattr(self.module, "dropout", 0.0):
            raise ConfigError("ring attention has no attention dropout: set the model's dropout to 0")
        return ring_attention(q, k, v, self.comm, causal=True)


def apply_ring(
    model: nn.Module,
    comm: Comm,
    *,
    plan: Mapping[str, str] | str = "auto",
    reduce_grads: bool = True,
    whole_model: bool = True,
) -> None:
    """Ring sequence parallelism over ``comm``, in place; weights stay whole, names unchanged. The plan bounds the
    region and names the attention modules as for Ulysses (``ulysses.apply_ulysses``); head counts need not divide.
    Causal (decoder) attention or full attention; padding masks are not supported (the mask is the chunks')."""
    apply_sequence_split(
        model,
        comm,
        plan=plan,
        layout=SeqLayout("zigzag", comm.size),
        gpt_attend=lambda module: _Attend(comm, module),
        hf_attention=lambda module, name: _HFAttention(comm),
        check_attention=lambda module, name: None,
        reduce_grads=reduce_grads,
        whole_model=whole_model,
    )
