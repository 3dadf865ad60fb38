"""A tiny model whose ranks use different parameters in the same step: a data-dependent branch and mixture-of-experts
routing inside each block, and (optionally) a top-level module that only some ranks call.

Routing is by token (expert = token id mod the number of experts, weighted by a learned gate), so the test data
decides which experts each rank uses: `batches` gives rank 0 tokens = 0 or 1 mod 4 and rank 1 tokens = 1 or 2 mod
4, so expert 0 is rank 0's alone, expert 2 rank 1's alone, expert 1 shared, expert 3 nobody's; and the branch takes
`a` on rank 0 and `b` on rank 1. The reference (`reference`) runs each rank's rows separately in one process and
averages the losses, which is what data parallelism computes (a parameter a rank did not use counts as a zero
gradient there, as with DDP's find_unused_parameters).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, EXPERTS, LAYERS, SEQ = 32, 16, 4, 2, 8


class GatedExpert(nn.Module):
    """Mixtral's expert as transformers 4 writes it: w1, w2 and w3 registered in that order, called w1, w3, w2."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)
        self.w3 = nn.Linear(DIM, 2 * DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, *, gated: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.a = nn.Linear(DIM, DIM)  # the branch rank 0 takes
        self.b = nn.Linear(DIM, DIM)  # the branch rank 1 takes
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(
            GatedExpert() if gated else nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
            for _ in range(EXPERTS)
        )

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        y = self.a(h) if bool(ids[0, 0] % 4 == 0) else self.b(h)  # a data-dependent branch
        weight = self.gate(h).softmax(-1)
        route = ids % EXPERTS
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            mask = route == e
            if bool(mask.any()):  # an expert no token of this rank goes to is not called at all
                out[mask] = expert(h[mask]) * weight[mask][:, e : e + 1]
        return x + y + out


class Net(nn.Module):
    def __init__(self, *, skip_head: bool = False, gated: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(gated=gated) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)
        self.extra = nn.Linear(DIM, DIM) if skip_head else None  # a top-level module only some ranks call
        self.skip_head = skip_head

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> Any:
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, ids)
        if self.extra is not None and bool(ids[0, 0] % 4 != 0):
            x = x + self.extra(x)
        loss = F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
        return type("Out", (), {"loss": loss})()


def build(seed: int = 0, **kwargs: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def batches(
    steps: int, world: int, rows: int = 2, *, every_expert: bool = False
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, per rank: (ids, labels). Rank r's tokens are r or r + 1 mod 4 (see the module's docstring);
    every_expert: odd ranks' tokens are 1, 2 or 3 mod 4, so every expert is used by some rank, expert 0 by rank 0
    alone and experts 2-3 by rank 1 alone."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        per_rank = []
        for r in range(world):
            base = torch.randint(0, VOCAB // 4, (rows, SEQ + 1), generator=g) * 4
            pick = torch.randint(0, 3 if every_expert and r % 2 else 2, (rows, SEQ + 1), generator=g)
            x = (base + (r % 2) + pick) % VOCAB
            x[:, 0] = (x[:, 0] // 4) * 4 + (r % 2)  # the first token decides the branch: a on rank 0, b on rank 1
            per_rank.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
        out.append(per_rank)
    return out


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def reference(
    steps: int, world: int, dtype: torch.dtype = torch.float32, *, every_expert: bool = False, **kwargs: Any
) -> tuple[list[float], dict]:
    """Plain PyTorch, one process: each step, the mean of the ranks' losses, each rank's rows run on their own.
    kwargs: `build`'s."""
    model = build(**kwargs).to(dtype)
    data = batches(steps, world, every_expert=every_expert)
    return plain(model, make_optimizer(model), data, lambda m, b: m(*b).loss)


def plain(
    model: nn.Module, opt: torch.optim.Optimizer, data: list[list[Any]], loss_of: Callable[[nn.Module, Any], Any]
) -> tuple[list[float], dict]:
    """The plain PyTorch loop the parity tests compare with: each step the mean over the ranks' batches of
    `loss_of(model, batch)`, one backward, one step; the losses and the final state."""
    losses = []
    for per_rank in data:
        total = sum(loss_of(model, b) for b in per_rank) / len(per_rank)
        total.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(total.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(engine: Any, rank: int, world: int, steps: int, *, every_expert: bool = False) -> list[float]:
    """`steps` steps of this rank's share of `batches`; the loss of each, averaged over the ranks."""
    losses = []
    for per_rank in batches(steps, world, every_expert=every_expert):
        x, y = per_rank[rank]
        loss = engine(x, y).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().reshape(1)
        engine.comm.control.all_reduce(mean, op="avg")
        losses.append(float(mean))
    return losses


def run(rank: int, world: int, config: dict, steps: int, *, every_expert: bool = False) -> dict[str, Any]:
    import hetero

    model = build()
    engine = hetero.initialize(model, make_optimizer(model), copy.deepcopy(config))
    losses = train(engine, rank, world, steps, every_expert=every_expert)
    state = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {"losses": losses, "state": state}


def run_skipped_module(rank: int, world: int) -> str:
    """Stage 3 where rank 1 skips a top-level module (`skip_head`): "seconds|message" of the CollectiveMismatchError
    the step stops with, or "no error"."""
    import time

    import hetero

    torch.set_num_threads(1)
    model = build(skip_head=True)
    engine = hetero.initialize(model, make_optimizer(model), {"zero_stage": 3, "chunk_size": 512})
    x, y = batches(1, world)[0][rank]
    started = time.monotonic()
    try:
        engine.backward(engine(x, y).loss)
    except hetero.errors.CollectiveMismatchError as err:
        return f"{time.monotonic() - started:.1f}|{err}"
    return "no error"
