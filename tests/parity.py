"""Parity runs: the same tiny GPT trained by a plain PyTorch loop and by hetero, for tests to compare.

The reference is one process on the global batch. hetero runs on `world` ranks, rank r on rows [r*B, (r+1)*B) of
each global batch, so the mean gradient over ranks equals the reference's. Mixed precision in the reference keeps
fp32 master weights and steps them with the user's optimizer, casting the model's low-precision gradients up, which
is what hetero does.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch

import hetero
from hetero.models.gpt import GPT, GPTConfig

try:
    from tests import tolerance
except ImportError:  # tests/ itself on sys.path
    import tolerance  # type: ignore[no-redef]

# No biases: a key projection's bias gets a zero gradient in exact arithmetic (softmax ignores a per-query constant),
# so Adam turns its rounding noise into full-size updates and no two summation orders agree on it.
GPT_CFG = dict(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16, bias=False)
CHUNK = 4096  # elements: the tiny model spreads over several chunks
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(seed: int = 0, **overrides: Any) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**GPT_CFG, **overrides}))


def batches(steps: int, rows: int, seed: int = 1, seq: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable sequences: each row counts up from a random start by a random stride of 1-3 (mod the vocabulary),
    so the model can predict the next token from the two before it, and training moves the weights far more than
    rounding does (see [Note: tolerances from the arithmetic])."""
    g = torch.Generator().manual_seed(seed)
    vocab = GPT_CFG["vocab_size"]
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (rows, 1), generator=g)
        stride = torch.randint(1, 4, (rows, 1), generator=g)
        x = (start + stride * torch.arange(seq + 1)) % vocab
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def initial_state(**overrides: Any) -> dict[str, torch.Tensor]:
    """The weights every run starts from (the model `build` makes)."""
    return {k: v.detach().clone() for k, v in build(**overrides).state_dict().items()}


def make_optimizer(model: torch.nn.Module, name: str = "adamw") -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
    if name == "adam":
        return torch.optim.Adam(groups, lr=3e-3)
    if name == "adamw-l2":  # one group decoupled (AdamW's), one with torch's per-group L2 decay
        groups[1].update(weight_decay=0.05, decoupled_weight_decay=False)
        return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True)
    raise ValueError(name)


def reference(
    *,
    steps: int,
    rows: int,
    precision: str = "fp32",
    accum: int = 1,
    clip: float | None = None,
    optimizer: str = "adamw",
    freeze: tuple[str, ...] = (),
    frozen_steps: tuple[int, int] | None = None,
    model_overrides: dict | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: losses per update (mean over the micro-batches of the step) and final weights. freeze: the
    parameters (by name prefix) frozen from the start, or with frozen_steps (first, end) in those steps only."""
    model = build(**(model_overrides or {}))
    _freeze(model, freeze, frozen_steps is None)
    dtype = DTYPES[precision]
    full = dtype in (torch.float32, torch.float64)  # no separate master weights
    master = copy.deepcopy(model) if not full else model
    model = model.to(dtype)
    opt = make_optimizer(master, optimizer)
    losses: list[float] = []
    data = batches(steps * accum, rows)
    for step in range(steps):
        if frozen_steps is not None:
            _freeze(model, freeze, frozen_steps[0] <= step < frozen_steps[1])
        total = 0.0
        for micro in range(accum):
            x, y = data[step * accum + micro]
            loss = model(x, labels=y).loss
            (loss / accum).backward()
            total += loss.item() / accum
        if not full:
            for pm, p in zip(master.parameters(), model.parameters()):
                pm.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if not full:
            with torch.no_grad():
                for pm, p in zip(master.parameters(), model.parameters()):
                    p.copy_(pm)
        losses.append(total)
    state = {k: v.detach().clone() if full else v.detach().float().clone() for k, v in model.state_dict().items()}
    return losses, state


def _freeze(model: torch.nn.Module, prefixes: tuple[str, ...], frozen: bool) -> None:
    for n, p in model.named_parameters():
        if any(n.startswith(f) for f in prefixes):
            p.requires_grad_(not frozen)


_REFERENCES: dict[str, tuple] = {}


def cached_reference(precision: str, **kwargs: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    key = repr((precision, sorted(kwargs.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(precision=precision, **kwargs)
    return _REFERENCES[key]


def check(result: dict, precision: str = "fp32", **kwargs: Any) -> None:
    """hetero's losses and weights against plain PyTorch in float64 (the exact run), with plain PyTorch in the same
    precision setting the scale of rounding error (see [Note: tolerances from the arithmetic] in tests/tolerance.py).
    kwargs: the run, as `reference` takes it (steps, rows, accum, clip, optimizer, freeze, model_overrides)."""
    exact_losses, exact = cached_reference("fp64", **kwargs)
    plain_losses, plain = cached_reference(precision, **kwargs)
    dtype = DTYPES[precision]
    tolerance.assert_losses(result["losses"], exact_losses, plain_losses, dtype=dtype)
    if dtype == torch.float32:
        tolerance.assert_weights(result["state"], exact, plain, dtype=dtype)
    else:
        initial = initial_state(**(kwargs.get("model_overrides") or {}))
        tolerance.assert_learns(exact, plain, initial)
        tolerance.assert_weights(result["state"], exact, plain, dtype=dtype, initial=initial)


def run_hetero(
    rank: int,
    world: int,
    *,
    steps: int,
    rows: int,
    config: dict,
    optimizer: str = "adamw",
    freeze: tuple[str, ...] = (),
    frozen_steps: tuple[int, int] | None = None,
    model_overrides: dict | None = None,
    nvme_dir: str | None = None,
    device: str | None = None,
    on_step: Callable[[Any, int], None] | None = None,
) -> dict[str, Any]:
    """hetero on this rank's rows; losses are means over the whole global batch (all ranks). device: the engine's
    (default: the GPU where there is one, or the stand-in under HETERO_STANDIN=1). on_step(engine, step): called
    before each step's first micro-batch (step from 0)."""
    model = build(**(model_overrides or {}))
    _freeze(model, freeze, frozen_steps is None)
    opt = make_optimizer(model, optimizer)
    config = copy.deepcopy(config)
    config.setdefault("chunk_size", CHUNK)
    if nvme_dir is not None:
        config.setdefault("memory", {})["nvme_dir"] = os.path.join(nvme_dir, f"rank{rank}")
        os.makedirs(config["memory"]["nvme_dir"], exist_ok=True)
    engine = hetero.initialize(model, opt, config, device=device)
    accum = config.get("grad_accumulation_steps", 1)
    local = rows // world
    data = batches(steps * accum, rows)
    losses: list[float] = []
    for step in range(steps):
        if frozen_steps is not None:
            _freeze(model, freeze, frozen_steps[0] <= step < frozen_steps[1])
        if on_step is not None:
            on_step(engine, step)
        total = torch.zeros(())
        for micro in range(accum):
            x, y = data[step * accum + micro]
            x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
            loss = engine(x, labels=y).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().cpu() / accum
        engine.comm.control.all_reduce(total, op="avg")
        losses.append(total.item())
    state = {k: v.float() for k, v in engine.full_state_dict().items()}
    out = {
        "losses": losses,
        "state": state if rank == 0 else None,
        "stats": engine.memory_stats(),
        "skipped": engine.skipped_steps,
        "chunks": len(engine.chunks),
        "grad_norm": engine.last_grad_norm,
    }
    engine.close()
    return out


def key(config: dict) -> str:
    return repr(sorted((k, repr(v)) for k, v in config.items()))
