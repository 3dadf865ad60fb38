"""Parity runs for the grid tensor modes (2D, 2.5D, 3D) and the sequence-split modes (Ulysses, ring) through
`hetero.initialize`: a tiny Hugging Face GPT-2 or Llama (or the pipelineable GPTPipe) trained by plain PyTorch on
the global batch, and by hetero's `train_batch` under a "parallel" config. Results are checked by
`pipe_parity.check` (losses and the gradient norm at rel 1e-5 on every rank, weights merged over stages and
unsharded over tensor ranks)."""

from __future__ import annotations

import copy
from typing import Any

import torch

import hetero

try:
    from tests import pipe_parity
except ImportError:  # tests/ itself on sys.path
    import pipe_parity  # type: ignore[no-redef]

VOCAB, SEQ, STEPS, ROWS = 64, 8, 3, 8
LR = 1e-3  # see test_tensor_parallel: Adam turns rounding on near-zero gradients into lr-sized steps
CHUNK = 4096


def build(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if family == "gpt_pipe":
        return pipe_parity.build(seed)
    import transformers

    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(cfg)


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def batches(family: str, steps: int = STEPS, rows: int = ROWS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
        x = ids[:, :-1].clone()
        y = ids[:, 1:].clone() if family == "gpt_pipe" else x.clone()  # transformers shift labels themselves
        y[0, 2] = y[-1, 5] = -100
        out.append((x, y))
    return out


def reference(family: str, clip: float | None = None) -> tuple[list[float], dict, float]:
    """Plain PyTorch on the global batch: losses, final weights, the last step's gradient norm (before clipping)."""
    model = build(family)
    opt = optimizer(model)
    losses, norm = [], float("nan")
    for x, y in batches(family):
        loss = model(x, labels=y).loss
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else float("inf")))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norm


def run(rank: int, world: int, family: str, config: dict) -> dict[str, Any]:
    """hetero on this rank's share of each global batch: losses, this stage's weights (first data-parallel rank),
    the coordinates, the gradient norm and the tensor cuts, for `pipe_parity.check`."""
    torch.manual_seed(1234 + rank)  # the model must not depend on a rank's RNG
    model = build(family)
    config = copy.deepcopy(config)
    config.setdefault("chunk_size", CHUNK)
    save_to = config.pop("_checkpoint", None)  # a root to save a checkpoint to after training (tests consolidate it)
    engine = hetero.initialize(model, optimizer(model), config)
    dp, dpr = engine.data_parallel_size, engine.data_parallel_rank
    local = ROWS // dp
    losses = [
        float(engine.train_batch(x[dpr * local : (dpr + 1) * local], y[dpr * local : (dpr + 1) * local]))
        for x, y in batches(family)
    ]
    if save_to is not None:
        engine.save_checkpoint(save_to)
    mesh = engine.mesh
    state = {k: v.float() for k, v in engine.full_state_dict().items()}  # collective at stage 3: every rank
    out = {
        "losses": losses,
        "state": state if mesh.dp_rank == 0 else None,
        "coords": (mesh.tp_rank, mesh.dp_rank, mesh.pp_rank),
        "grad_norm": engine.last_grad_norm,
        "shards": {
            n: p._hetero_tp for n, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "_hetero_tp")
        },
        "mesh": repr(mesh),
    }
    engine.close()
    return out


def matrix(rank: int, world: int, cases: list[tuple[str, dict]]) -> list[dict]:
    torch.set_num_threads(1)
    return [run(rank, world, family, config) for family, config in cases]


def check_all(cases: dict[str, tuple[str, dict]], results: list[list[dict]]) -> None:
    refs: dict[tuple, Any] = {}
    for i, (name, (family, config)) in enumerate(cases.items()):
        clip = config.get("grad_clip_norm")
        key = (family, clip)
        if key not in refs:
            refs[key] = reference(family, clip)
        try:
            pipe_parity.check([r[i] for r in results], refs[key], weight_atol=1e-5)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err
