"""Padded batches under tensor x pipeline parallelism (hetero/parallel/tensor.py, hetero/parallel/pipeline/hf.py).

Each alone was tested with padding (tests/test_tensor_parallel.py, tests/test_pipeline_hf_masks.py); together they
were not: each tensor rank of a stage binds the micro-batch's mask and positions from its own copy of the batch and
applies them to its share of the heads, the vocabulary-sharded embedding keeps its pad row's gradient at zero, and
the last stage's vocabulary-parallel loss averages over the tokens that are not -100. Here 4 ranks (tensor 2 x
pipeline 2, the cut given) train a tiny Llama and a tiny Qwen2 (its sliding-window layer on the second stage) at
ZeRO-1 and ZeRO-3, 1F1B and GPipe, tied head or not, clipped or not, on batches padded on the left and on the
right by other numbers of pad tokens per row, one micro-batch holding a row that is mostly padding. Losses,
gradient norms and the whole model's weights after every step, and eval_batch's loss and logits, match plain
PyTorch over the same micro-batches: fp32 within fp32's own distance from a float64 run (tests/tolerance.py,
[Note: tolerances from the arithmetic]; the layouts only reorder fp32 sums: the row-parallel all-reduces, the
vocabulary-parallel softmax, ZeRO's reductions). Dropping the pad row's exemption, the sliding window, the second
stage's mask, or binding one micro-batch's mask for all, each fails this by 1e3 times the bound or more. Position
ids counted from each row's first token are passed in two cases; under rotary embeddings they shift every real
token alike, so they reach the layers' arguments but cannot change the result here."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

try:
    from tests import grid_parity, pipe_parity, tolerance
    from tests.dist import NEEDS_DEGREES, ranks_apart, run_distributed
except ImportError:  # tests/ itself on sys.path
    import grid_parity  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import NEEDS_DEGREES, ranks_apart, run_distributed  # type: ignore[no-redef]

transformers = pytest.importorskip("transformers")

ROWS, SEQ, MICRO, STEPS = 4, 8, 2, 3
WINDOW = 4  # Qwen2's sliding window over SEQ = 8 positions: its sliding layer sees less than a full one
# Pad tokens per row and side: micro-batch 0 holds a left- and a right-padded row, micro-batch 1 a row that is
# mostly padding (2 tokens of 8, so 1 label counts after the shift) and an unpadded one.
PADDING = (("left", 2), ("right", 3), ("left", 6), ("right", 0))
# Pipeline cut before the second decoder layer, given (a time-balanced split differs under HETERO_STANDIN=1).
SPLIT = ["model.layers.1"]
CLIP = 1.0  # below every step's gradient norm here (the test checks it), so clipping acts


def build(family: str, tied: bool) -> nn.Module:
    """A tiny Llama or Qwen2 (grouped-query attention, 4 heads and 2 key/value heads, so each of 2 tensor ranks
    holds whole query groups), its weights moved off their init so that every parameter trains visibly; `tied`: the
    head shares the embedding's weight, which the cut puts on both pipeline ranks and the plan shards by vocabulary
    on each (its pad row, id 0, gets no gradient from the lookup)."""
    torch.manual_seed(0)
    shape = dict(
        vocab_size=grid_parity.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0,
        tie_word_embeddings=tied,
    )  # fmt: skip
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    else:  # layers from max_window_layers on slide: layer 1, on the second stage
        cfg = transformers.Qwen2Config(**shape, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
        model = transformers.Qwen2ForCausalLM(cfg)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def padded(step: int, positions: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The step's batch padded as PADDING says (pad id 0, labels -100 at the padding); with `positions`, position
    ids counted from each row's first token, else the model's own (0..SEQ-1 whatever the padding)."""
    g = torch.Generator().manual_seed(11 + step)
    x = torch.randint(1, grid_parity.VOCAB, (ROWS, SEQ), generator=g)
    mask = torch.ones_like(x)
    for row, (side, pads) in enumerate(PADDING):
        if side == "left":
            mask[row, :pads] = 0
        elif pads:
            mask[row, SEQ - pads :] = 0
    batch = {"input_ids": x.masked_fill(mask == 0, 0), "attention_mask": mask}
    if positions:
        batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return batch, x.masked_fill(mask == 0, -100)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def micro(batch: dict[str, torch.Tensor], labels: torch.Tensor) -> list[tuple[dict, torch.Tensor]]:
    """The micro-batches train_batch cuts (consecutive rows), as the model's keyword arguments."""
    rows = ROWS // MICRO
    return [
        ({k: v[i * rows : (i + 1) * rows] for k, v in batch.items()}, labels[i * rows : (i + 1) * rows])
        for i in range(MICRO)
    ]


class Case(NamedTuple):
    family: str
    stage: int  # ZeRO stage
    schedule: str
    positions: bool  # position ids in the batch
    tied: bool  # the head tied to the embedding
    clip: float | None  # grad_clip_norm


CASES = {
    "llama-zero1-1f1b": Case("llama", 1, "1f1b", False, False, None),
    "llama-zero3-gpipe-tied-clip": Case("llama", 3, "gpipe", True, True, CLIP),
    "qwen2-zero1-gpipe-tied": Case("qwen2", 1, "gpipe", True, True, None),
    "qwen2-zero3-1f1b-clip": Case("qwen2", 3, "1f1b", False, False, CLIP),
}


def reference(case: Case, dtype: torch.dtype) -> dict[str, Any]:
    """Plain PyTorch over the same micro-batches: each step's loss the mean of theirs, as train_batch's (the
    micro-batches hold other numbers of tokens, so it is not the whole batch's token mean), the gradient norm
    before clipping and the weights after each step; then eval_batch's loss and logits on a batch not trained on."""
    model = build(case.family, case.tied).to(dtype)
    opt = optimizer(model)
    losses, norms, states = [], [], []
    for step in range(STEPS):
        total = 0.0
        for x, y in micro(*padded(step, case.positions)):
            loss = model(**x, labels=y, use_cache=False).loss / MICRO
            loss.backward()
            total += loss.item()
        clip = case.clip if case.clip is not None else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
        states.append({k: v.detach().double().clone() for k, v in model.state_dict().items()})
    parts = micro(*padded(STEPS, case.positions))
    with torch.no_grad():
        evaluated = sum(model(**x, labels=y, use_cache=False).loss.item() for x, y in parts) / MICRO
        logits = torch.cat([model(**x, use_cache=False).logits for x, _ in parts]).double()
    return {"losses": losses, "norms": norms, "states": states, "eval": evaluated, "logits": logits}


def _train(case: Case) -> dict[str, Any]:
    import hetero

    model = build(case.family, case.tied)
    parallel = {"tensor": 2, "pipeline": 2, "microbatches": MICRO, "schedule": case.schedule, "pipeline_split": SPLIT}
    config = {"zero_stage": case.stage, "chunk_size": grid_parity.CHUNK, "comm_timeout": 60, "parallel": parallel}
    engine = hetero.initialize(model, optimizer(model), {**config, "grad_clip_norm": case.clip})
    losses, norms, states = [], [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(*padded(step, case.positions))))
        norms.append(engine.last_grad_norm)
        states.append({k: v.double() for k, v in engine.local_state_dict().items()})  # collective at stage 3
    batch, labels = padded(STEPS, case.positions)
    evaluated = float(engine.eval_batch(batch, labels))
    logits = engine.eval_batch(batch)  # the whole logits on every rank (gathered over the tensor ranks)
    mesh = engine.mesh
    shards = {n: p._hetero_tp for n, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "_hetero_tp")}
    engine.close()
    return {
        "losses": losses, "norms": norms, "states": states, "eval": evaluated,
        "logits": getattr(logits, "logits", logits).double(), "shards": shards,
        "coords": (mesh.tp_rank, mesh.dp_rank, mesh.pp_rank),
    }  # fmt: skip


def _job(rank: int, world: int, cases: list[Case]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [_train(case) for case in cases]


def test_the_batches_are_padded_as_the_test_says():
    """Left and right padding, other numbers of pad tokens per row, a row mostly padding: what the parity test
    claims to cover is in its data."""
    batch, labels = padded(0, True)
    mask = batch["attention_mask"]
    assert mask.sum(-1).tolist() == [6, 5, 2, 8]
    assert mask[0, :2].sum() == 0 and mask[1, -3:].sum() == 0 and mask[2, :6].sum() == 0
    assert torch.equal(labels == -100, mask == 0)
    assert batch["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5]


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(600)
def test_padded_batches_under_tensor_and_pipeline_parallelism_match_plain_pytorch():
    """Tensor 2 x pipeline 2 on gloo: Llama and Qwen2 at ZeRO-1 and ZeRO-3, 1F1B and GPipe, with and without
    position ids, with the head tied to the embedding or not, with clipping or not. On every rank: the loss and
    the gradient norm at every step, eval_batch's loss and whole logits after training; after every step the whole
    model's weights (stages merged, tensor shards joined): all within fp32's own distance of the float64 run of
    plain PyTorch over the same micro-batches."""
    check(run_distributed(_job, 4, list(CASES.values()), timeout=540), CASES)


def check(results: list[list[dict[str, Any]]], cases: dict[str, Case]) -> None:
    """Each case's results on every rank against plain PyTorch in float64, fp32's own error the scale."""
    for i, (name, case) in enumerate(cases.items()):
        exact, plain = reference(case, torch.float64), reference(case, torch.float32)
        if case.clip is not None:  # the clip must act for the case to test it
            assert min(exact["norms"]) > case.clip, (name, exact["norms"])
        ranks = [r[i] for r in results]
        assert sorted(r["coords"] for r in ranks) == [(t, 0, p) for t in (0, 1) for p in (0, 1)], name
        for r in ranks:
            assert "model.embed_tokens.weight" in r["shards"] or r["coords"][2] == 1, (name, r["coords"])
            try:
                tolerance.assert_losses(r["losses"], exact["losses"], plain["losses"], dtype=torch.float32)
                tolerance.assert_losses(r["norms"], exact["norms"], plain["norms"], dtype=torch.float32)
                tolerance.assert_losses([r["eval"]], [exact["eval"]], [plain["eval"]], dtype=torch.float32)
                got, want, base = ({"logits": d["logits"]} for d in (r, exact, plain))
                tolerance.assert_weights(got, want, base, dtype=torch.float32)
            except AssertionError as err:
                raise AssertionError(f"{name}, rank {r['coords']}: {err}") from err
        for step in range(STEPS):
            by_stage: dict[int, list[dict]] = {}
            for r in ranks:
                by_stage.setdefault(r["coords"][2], []).append({**r, "state": r["states"][step]})
            merged = pipe_parity.merge_ranks(by_stage)
            want = exact["states"][step]
            assert merged.keys() == want.keys(), (name, sorted(merged.keys() ^ want.keys()))
            try:
                tolerance.assert_weights(merged, want, plain["states"][step], dtype=torch.float32)
            except AssertionError as err:
                raise AssertionError(f"{name}, after step {step}: {err}") from err
