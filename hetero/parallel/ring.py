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

A transformers model builds its attention mask (padding, sliding window; boolean or additive, 4-D over the whole
sequence, or flash attention's 2-D padding mask) before the layers, so every rank holds it whole and each block
takes its slice of it, chunk rows against chunk columns, with no traffic; the causal skipping above stays valid
because such masks are causal too. Masked entries get the lowest finite value instead of -inf: a query whose keys
in one block are all masked (padding) merges that block with weight 0 rather than making NaNs. A query that attends
to nothing at all (left padding's first positions) gets an arbitrary output, as in the plain model. Gemma's score
softcap (cap * tanh(s / cap), before the mask) is applied per block, and backward multiplies by its derivative.
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
from hetero.parallel.tp_rng import RegionRng

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


def _chunk(rank: int, i: int, size: int) -> int:
    """The sequence chunk that is the `i`-th (0 or 1) of `rank`'s zig-zag part."""
    return rank if i == 0 else 2 * size - 1 - rank


def _widen(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for grouped-query attention (as transformers' repeat_kv)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _narrow(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_widen`: sums each key/value head's group."""
    b, h, s, d = g.shape
    return g if h == kv_heads else g.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _bias(mask: torch.Tensor | None, full: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The model's attention mask as an additive bias [b, 1 | heads, full | 1, full] over the whole sequence, in
    the sequence's order: transformers' 4-D mask (boolean, True where a query may attend, or additive) or a 2-D
    padding mask [b, full] (flash attention's, 1 where a key is real). Masked entries get the dtype's lowest finite
    value rather than -inf, so that a block whose row is all masked merges with weight 0 instead of making NaNs."""
    if mask is None:
        return None
    if mask.dim() == 2:
        mask = mask[:, None, None, :].bool()
    if mask.dim() != 4 or mask.shape[-1] != full or mask.shape[-2] not in (1, full):
        raise ConfigError(
            f"ring attention: the attention mask has shape {tuple(mask.shape)}, expected [batch, heads or 1, {full}, "
            f"{full}] or [batch, {full}] for the whole sequence of {full} positions"
        )
    low = torch.finfo(dtype).min
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, low)
    return mask.to(dtype).clamp(min=low)  # a float64 model's lowest value is -inf in float32


def _block(bias: torch.Tensor | None, cq: int, ck: int, c: int) -> torch.Tensor | None:
    """The bias of query chunk `cq` against key chunk `ck` (chunks of `c` positions)."""
    if bias is None:
        return None
    rows = bias if bias.shape[-2] == 1 else bias[..., cq * c : (cq + 1) * c, :]
    return rows[..., ck * c : (ck + 1) * c]


def _scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, triangle: bool, softcap: float | None, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores of a block as the model's eager attention makes them (softcap, then the mask), and the softcap's
    derivative (None without one) for backward."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    dcap = None
    if softcap:
        t = torch.tanh(s / softcap)
        s, dcap = t * softcap, 1 - t * t
    if bias is not None:
        s = s + bias
    if triangle:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s, dcap


class _RingAttention(Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        comm: Comm,
        scale: float,
        causal: bool,
        bias: torch.Tensor | None,
        softcap: float | None,
    ) -> torch.Tensor:
        p, r, heads = comm.size, comm.rank, q.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)  # at least fp32; a float64 model keeps its precision
        c = q.shape[2] // 2  # positions per chunk
        qs = q.to(acc).chunk(2, 2)  # this rank's two query chunks
        out = [torch.zeros_like(x) for x in qs]
        lse = [torch.full(x.shape[:-1], float("-inf"), dtype=acc, device=q.device) for x in qs]
        kv = [k, v]
        for t in range(p):
            src = (r - t) % p
            if t < p - 1:
                nxt = _shift(kv, comm)  # on NCCL this overlaps the compute below (batched p2p)
            ks, vs = (_widen(x.to(acc), heads).chunk(2, 2) for x in kv)
            for i, j, tri in _pairs(r, src, p, causal):
                cq, ck = _chunk(r, i, p), _chunk(src, j, p)
                s, _ = _scores(qs[i], ks[j], scale, tri, softcap, _block(bias, cq, ck, c))
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
        ctx.save_for_backward(q, k, v, o, torch.cat(lse, 2), bias)
        ctx.comm, ctx.scale, ctx.causal, ctx.softcap = comm, scale, causal, softcap
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, o, lse, bias = ctx.saved_tensors
        comm, scale, causal, softcap = ctx.comm, ctx.scale, ctx.causal, ctx.softcap
        p, r, heads, kv_heads, c = comm.size, comm.rank, q.shape[1], k.shape[1], q.shape[2] // 2
        acc = o.dtype
        do = grad.to(acc)
        rowdot = (do * o).sum(-1, keepdim=True)  # rowsum(do o): the softmax's gradient correction
        qs, dos, rows, lses = q.to(acc).chunk(2, 2), do.chunk(2, 2), rowdot.chunk(2, 2), lse.chunk(2, 2)
        dq = [torch.zeros_like(x) for x in qs]
        kv = [k, v]
        dkv = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
        for t in range(p):
            src = (r - t) % p
            ks, vs = (_widen(x.to(acc), heads).chunk(2, 2) for x in kv)
            dk = [torch.zeros_like(x) for x in ks]
            dv = [torch.zeros_like(x) for x in vs]
            for i, j, tri in _pairs(r, src, p, causal):
                cq, ck = _chunk(r, i, p), _chunk(src, j, p)
                s, dcap = _scores(qs[i], ks[j], scale, tri, softcap, _block(bias, cq, ck, c))
                prob = torch.exp(s - lses[i].unsqueeze(-1))
                dv[j] += torch.matmul(prob.transpose(-1, -2), dos[i])
                ds = prob * (torch.matmul(dos[i], vs[j].transpose(-1, -2)) - rows[i])
                if dcap is not None:
                    ds = ds * dcap  # through the softcap's tanh
                dq[i] += torch.matmul(ds, ks[j]) * scale
                dk[j] += torch.matmul(ds.transpose(-1, -2), qs[i]) * scale
            dkv = [dkv[0] + _narrow(torch.cat(dk, 2), kv_heads), dkv[1] + _narrow(torch.cat(dv, 2), kv_heads)]
            # The accumulators travel with the blocks they belong to; after the last step one hop brings them home.
            if t < p - 1:
                kv_and_grads = _shift([*kv, *dkv], comm)
                kv, dkv = kv_and_grads[:2], kv_and_grads[2:]
            else:
                dkv = _shift(dkv, comm)
        return torch.cat(dq, 2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Comm,
    *,
    scale: float | None = None,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries [b, heads, 2c, d] over the whole sequence, whose keys and values
    [b, kv_heads, 2c, d] are spread over ``comm`` in the zig-zag layout ([Note: ring attention]). ``mask``: the
    model's attention mask over the whole sequence, in its order (every rank holds it whole: transformers builds it
    before the layers), 4-D [b, 1 | heads, s, s] boolean (True: attend) or additive, or a 2-D padding mask [b, s];
    ``softcap``: scores capped as cap * tanh(score / cap) before the mask (Gemma 2)."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention: this rank's part of the sequence ({q.shape[2]}) must be two equal chunks")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    bias = _bias(mask, q.shape[2] * comm.size, acc)
    if comm.size == 1:
        s, _ = _scores(q.to(acc), _widen(k.to(acc), q.shape[1]), scale, causal, softcap, bias)
        return torch.matmul(torch.softmax(s, -1), _widen(v.to(acc), q.shape[1])).to(q.dtype)
    return _RingAttention.apply(q, k, v, comm, scale, causal, bias, softcap)


class _HFAttention:
    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def __call__(
        self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any
    ) -> torch.Tensor:
        if kwargs.get("dropout", 0.0):
            raise ConfigError("ring attention has no attention dropout: set the model's attention dropout to 0")
        for sink in ("s_aux", "sinks"):
            if kwargs.get(sink) is not None:
                raise ConfigError(f"ring attention does not take attention sinks ({sink}): use Ulysses or tensor_mode")
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise ConfigError(
                f"ring attention: the model's attention mask is a {type(mask).__name__}; build the model with "
                "attn_implementation 'eager' or 'sdpa' (their masks are tensors)"
            )
        full, window = query.shape[2] * self.comm.size, kwargs.get("sliding_window")
        if window is not None and window < full and (mask is None or mask.dim() != 4):
            raise ConfigError(
                f"ring attention: a sliding window of {window} over {full} positions needs the window in the model's "
                "4-D attention mask (attn_implementation 'eager' or 'sdpa')"
            )
        causal = getattr(module, "is_causal", True)
        out = ring_attention(
            query,
            key,
            value,
            self.comm,
            scale=kwargs.get("scaling"),
            causal=causal,
            mask=mask,
            softcap=kwargs.get("softcap"),
        )
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
) -> RegionRng:
    """Ring sequence parallelism over ``comm``, in place; weights stay whole, names unchanged. The plan bounds the
    region and names the attention modules as for Ulysses (``ulysses.apply_ulysses``); head counts need not divide.
    Causal (decoder) attention or full attention; a transformers model's attention mask (padding, sliding window)
    and score softcap apply block by block."""
    return apply_sequence_split(
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
