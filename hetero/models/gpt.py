"""A small GPT (nanoGPT style, pure torch) for tests, benchmarks and examples.

Parameter names are plain and stable (`layers.0.attn.q_proj.weight`, ...) because tests and chunk layouts refer to
them. Every custom module has `reset_parameters()`, which re-initialises its whole subtree the way GPT-2 does, so a
model built under `torch.device("meta")` can later be materialised with `model.to_empty(device=...)` followed by
`model.reset_parameters()`. Call it on the custom modules, not on the `nn.Linear` inside them: those reset to torch's
default (Kaiming) init, not GPT-2's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02  # GPT-2's std for every weight matrix and embedding


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    """Longest sequence the position embedding covers."""
    dropout: float = 0.0
    bias: bool = True
    """Biases in the Linear layers and LayerNorms."""
    tie_weights: bool = True
    """Share one matrix between the token embedding and the output projection."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd = {self.n_embd} must be divisible by n_head = {self.n_head}")


@dataclass
class GPTOutput:
    logits: torch.Tensor
    """[batch, seq, vocab]"""
    loss: torch.Tensor | None = None
    """Mean next-token cross entropy when labels were given, else None."""


def _init_linear(linear: nn.Linear, std: float = INIT_STD) -> None:
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_layer, self.dropout = config.n_head, config.n_layer, config.dropout
        d = config.n_embd
        self.head_dim = d // config.n_head
        self.q_proj = nn.Linear(d, d, bias=config.bias)
        self.k_proj = nn.Linear(d, d, bias=config.bias)
        self.v_proj = nn.Linear(d, d, bias=config.bias)
        self.o_proj = nn.Linear(d, d, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def reset_parameters(self) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            _init_linear(proj)
        # GPT-2: projections that add into the residual stream are scaled by 1/sqrt(number of residual adds), so the
        # stream's variance does not grow with depth.
        _init_linear(self.o_proj, INIT_STD / math.sqrt(2 * self.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Head count from the projections' width (-1): tensor parallelism leaves each rank a share of the heads.
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = self.attend(q, k, v)
        return self.resid_drop(self.o_proj(y.transpose(1, 2).reshape(b, t, -1)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention on [batch, heads, seq, head_dim]. A hook point: Ulysses sequence parallelism wraps it,
        per instance, in all-to-alls."""
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_layer = config.n_layer
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def reset_parameters(self) -> None:
        _init_linear(self.fc)
        _init_linear(self.proj, INIT_STD / math.sqrt(2 * self.n_layer))  # a residual projection, as o_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def reset_parameters(self) -> None:
        for m in (self.ln_1, self.attn, self.ln_2, self.mlp):
            m.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        target = torch.empty(0).device  # the default device; get_default_device() misses `with torch.device` in 2.4
        # Build on meta, then initialise once: nn.Linear's own init would consume the RNG before ours, so the same
        # seed would not give the same weights from GPT(config) and from reset_parameters(). Under a meta default
        # device the model stays on meta, uninitialised, for the caller to materialise.
        with torch.device("meta"):
            self.embed = nn.Embedding(config.vocab_size, config.n_embd)
            self.pos_embed = nn.Embedding(config.block_size, config.n_embd)
            self.drop = nn.Dropout(config.dropout)
            self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if target.type != "meta":
            self.to_empty(device=target)
            self.reset_parameters()
        else:
            self.tie_weights()

    def tie_weights(self) -> None:
        """Make lm_head use the token embedding's matrix (when config.tie_weights); idempotent."""
        if self.config.tie_weights:
            self.lm_head.weight = self.embed.weight

    def reset_parameters(self) -> None:
        # Re-tie first: to_empty() may have given the two modules separate tensors.
        self.tie_weights()
        nn.init.normal_(self.embed.weight, mean=0.0, std=INIT_STD)
        nn.init.normal_(self.pos_embed.weight, mean=0.0, std=INIT_STD)
        for block in self.layers:
            block.reset_parameters()
        self.ln_f.reset_parameters()
        if not self.config.tie_weights:
            _init_linear(self.lm_head)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> GPTOutput:
        """Logits for `input_ids` [batch, seq], and the loss when `labels` is given.

        `labels` is already aligned with `input_ids`: labels[:, t] is the target for the prediction at position t
        (the token that follows input_ids[:, t]); nothing is shifted here. Positions labelled -100 are ignored.
        Unlike Hugging Face models, do not pass labels = input_ids.
        """
        t = input_ids.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.embed(input_ids) + self.pos_embed(pos))
        for block in self.layers:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if labels is None else self.loss_function(logits, labels)
        return GPTOutput(logits=logits, loss=loss)

    def loss_function(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of aligned labels, -100 ignored. A hook point: tensor parallelism replaces it, per
        instance, by a vocabulary-parallel loss on sharded logits."""
        # In fp32: bf16/fp16 logits would round away the small differences the log-softmax is made of.
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


@torch.no_grad()
def generate_greedy(
    forward: Callable[..., Any], input_ids: torch.Tensor, *, max_new_tokens: int, block_size: int
) -> torch.Tensor:
    """Append `max_new_tokens` greedy tokens to `input_ids` [1, seq] and return the whole sequence.

    `forward` is anything called as `forward(input_ids=...)` that returns an object with `.logits` (a GPT, a
    Hugging Face causal LM), or a hetero engine, whose `eval_batch` it calls: that gives every rank the whole logits
    of its batch under any layout, where `engine(...)` leaves them cut by vocabulary over tensor ranks (each rank
    picked another token, by its index in its part) or by rows under a grid, and a pipeline runs no `engine(...)`.
    Each call sees exactly `block_size` tokens: the context is right-padded, which a causal model cannot see from
    earlier positions, so every call has the same shape (a training engine replays the same access pattern) and the
    logits at the last real position are exact.
    """
    whole = getattr(forward, "eval_batch", None)  # an engine's
    ids = input_ids
    for _ in range(max_new_tokens):
        ctx = ids[:, -block_size:]
        n = ctx.shape[1]
        padded = F.pad(ctx, (0, block_size - n))
        out = whole(padded) if whole is not None else forward(input_ids=padded)
        logits = getattr(out, "logits", out)  # a pipeline's eval_batch gives the last stage's output as it is
        nxt = logits[:, n - 1].argmax(dim=-1, keepdim=True).to(ids.device, ids.dtype)  # logits may be on a GPU
        ids = torch.cat([ids, nxt], dim=1)
    return ids
