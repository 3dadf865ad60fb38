"""Llama's relatives and padded batches through a pipeline (hetero/parallel/pipeline/hf.py).

Qwen2, Qwen3, Mistral, Phi-3, Gemma, Gemma 2 and Gemma 3 were refused by the pipeline's cut (a ConfigError naming
Llama and GPT-2 as the only families): their layers take a sliding-window mask per layer type, Gemma 3 a rotary
table per type, Gemma 2 and 3 soft-cap their logits. Now their units run the model's own forward bit for bit. A
padded batch (a dict of input_ids, attention_mask and optionally position_ids) was refused too, and users had to pad
on the right; now every stage reads its micro-batch's mask and positions from its own copy of the batch, and training
and evaluation give plain PyTorch's losses, weights and logits (fp32 within fp32's own distance from a float64 run:
tests/tolerance.py). A later stage given another mask than the first is stopped by name instead of attending to the
padding."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch
from torch import nn

from hetero.errors import ConfigError
from hetero.parallel.pipeline.split import units_of
from tests.dist import NEEDS_DEGREES, ranks_apart

try:
    from tests import grid_parity, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import grid_parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

transformers = pytest.importorskip("transformers")

RELATIVES = ("qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3")
WINDOW = 4  # the sliding window, over grid_parity.SEQ = 8 positions: a sliding layer sees less than a full one
ROWS, MICRO, STEPS = 4, 2, 3


def build(family: str) -> nn.Module:
    """A tiny model of the family (two layers: a full and a sliding one where the family has both), its weights
    moved off their init (Gemma's norm weights start at 0, read as 1 + w); Llama and GPT-2 as grid_parity builds
    them."""
    if family in ("llama", "gpt2"):
        return grid_parity.build(family)
    torch.manual_seed(0)
    shape = dict(
        vocab_size=grid_parity.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0,
    )  # fmt: skip
    types = ["full_attention", "sliding_attention"]
    t = transformers
    if family in ("qwen2", "qwen3"):  # layers from max_window_layers on slide
        cls, config = (t.Qwen2ForCausalLM, t.Qwen2Config) if family == "qwen2" else (t.Qwen3ForCausalLM, t.Qwen3Config)
        cfg = config(**shape, head_dim=8, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    elif family in ("mistral", "phi3"):  # every layer slides
        cls, config = (
            (t.MistralForCausalLM, t.MistralConfig) if family == "mistral" else (t.Phi3ForCausalLM, t.Phi3Config)
        )
        cfg = config(**shape, sliding_window=WINDOW)
    elif family == "gemma":
        cls, cfg = t.GemmaForCausalLM, t.GemmaConfig(**shape, head_dim=8)
    else:  # Gemma 2 (eager attention: SDPA cannot soft-cap) and Gemma 3 (a rotary table per layer type)
        cls, config = (
            (t.Gemma2ForCausalLM, t.Gemma2Config) if family == "gemma2" else (t.Gemma3ForCausalLM, t.Gemma3TextConfig)
        )
        cfg = config(**shape, head_dim=8, sliding_window=WINDOW, layer_types=types, final_logit_softcapping=3.0)
    model = cls(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def padded(step: int, positions: bool | None) -> tuple[Any, torch.Tensor]:
    """A left-padded batch: rows 1, 2 and 3 padded by 3, 5 and 1 (so the micro-batches of 2 rows hold other
    numbers of tokens), labels -100 at the padding; with `positions`, counted from each row's first token.
    positions None: the ids alone, unpadded."""
    g = torch.Generator().manual_seed(11 + step)
    x = torch.randint(1, grid_parity.VOCAB, (ROWS, grid_parity.SEQ), generator=g)
    if positions is None:
        return x, x
    mask = torch.ones_like(x)
    mask[1, :3] = mask[2, :5] = mask[3, :1] = 0
    batch = {"input_ids": x.masked_fill(mask == 0, 0), "attention_mask": mask}
    if positions:
        batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return batch, x.masked_fill(mask == 0, -100)


@pytest.mark.parametrize("family", ("llama", "gpt2", *RELATIVES))
def test_units_run_the_model_forward(family):
    """The units, one after the other, give the model's own logits and loss bit for bit: on ids alone, on a padded
    batch, and on one with position ids. Before, every family but Llama and GPT-2 was refused, and any dict."""
    model = build(family)
    if family in ("qwen2", "qwen3", "gemma2", "gemma3"):  # both kinds of layer: each its own mask
        assert sorted(model.config.layer_types) == ["full_attention", "sliding_attention"]
    units = units_of(model)
    assert [n for n, _ in units][0] == "embeddings" and units[-1][0] == "head" and len(units) == 4
    for positions in (None, False, True):
        batch, labels = padded(0, positions)
        kwargs = batch if isinstance(batch, dict) else {"input_ids": batch}
        ref = model(**kwargs, labels=labels, use_cache=False)
        h = batch
        for _, unit in units[:-1]:
            h = unit(h)
        out = units[-1][1](h, labels=labels)
        assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss), (family, positions)


def test_a_padded_batch_the_pipeline_cannot_take_is_named():
    """Keys besides ids, mask and positions, a mask of another shape, and a mask whose rows are not the
    activations' (a grid tensor mode cuts rows) are ConfigErrors saying what to pass."""
    units = units_of(build("llama"))
    embed, layer = units[0][1], units[1][1]
    batch, _ = padded(0, True)
    cases = {
        "labels": ({**batch, "labels": batch["input_ids"]}, "got keys labels besides (pass labels as the second"),
        "token types": ({**batch, "token_type_ids": batch["input_ids"]}, "got keys token_type_ids besides"),
        "mask shape": ({**batch, "attention_mask": batch["attention_mask"][:, :4]}, "attention_mask must be a"),
        "positions": ({**batch, "position_ids": batch["position_ids"][:2]}, "position_ids must be a [batch or 1"),
    }
    for bad, text in cases.values():
        with pytest.raises(ConfigError, match=re.escape(text)):
            embed(bad)
    embed(batch)
    with pytest.raises(ConfigError, match="the attention mask has 4 rows and the activations 2"):
        layer(torch.zeros(2, grid_parity.SEQ, 32))
    with pytest.raises(ConfigError, match="takes its inputs as a tensor of token ids, or a dict"):
        embed([batch["input_ids"]])


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def micro(batch: Any, labels: torch.Tensor) -> list[tuple[dict, torch.Tensor]]:
    """The micro-batches train_batch cuts, as the model's keyword arguments."""
    rows = ROWS // MICRO
    batch = batch if isinstance(batch, dict) else {"input_ids": batch}
    return [
        ({k: v[i * rows : (i + 1) * rows] for k, v in batch.items()}, labels[i * rows : (i + 1) * rows])
        for i in range(MICRO)
    ]


def reference(family: str, positions: bool | None, dtype: torch.dtype) -> dict:
    """Plain PyTorch over the same micro-batches: each step's loss the mean of theirs, as train_batch's (with
    padding the micro-batches hold other numbers of tokens, so it is not the whole batch's mean)."""
    model = build(family).to(dtype)
    opt = optimizer(model)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for x, y in micro(*padded(step, positions)):
            loss = model(**x, labels=y, use_cache=False).loss / MICRO
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    batch, labels = padded(STEPS, positions)
    with torch.no_grad():
        evaluated = sum(model(**x, labels=y, use_cache=False).loss.item() for x, y in micro(batch, labels)) / MICRO
        logits = torch.cat([model(**x, use_cache=False).logits for x, _ in micro(batch, labels)]).double()
    state = {k: v.detach().double() for k, v in model.state_dict().items()}
    return {"losses": losses, "eval": evaluated, "logits": logits, "state": state}


def _train(family: str, config: dict, positions: bool | None) -> dict:
    import hetero

    model = build(family)
    engine = hetero.initialize(model, optimizer(model), {"chunk_size": grid_parity.CHUNK, **config})
    losses = [float(engine.train_batch(*padded(step, positions))) for step in range(STEPS)]
    batch, labels = padded(STEPS, positions)
    evaluated = float(engine.eval_batch(batch, labels))
    logits = engine.eval_batch(batch).double()
    state = {k: v.double() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {"losses": losses, "eval": evaluated, "logits": logits, "state": state}


def _mismatch() -> dict:
    """The first stage given a padded batch, the second the ids alone; then both the batch."""
    import hetero
    from hetero.parallel.pipeline.runtime import PipelineError

    model = build("llama")
    config = {"zero_stage": 1, "comm_timeout": 60, "chunk_size": grid_parity.CHUNK}
    config["parallel"] = {"pipeline": 2, "microbatches": MICRO, "pipeline_split": ["model.layers.1"]}
    engine = hetero.initialize(model, optimizer(model), config)
    batch, labels = padded(0, False)
    start, error = time.monotonic(), None
    try:
        engine.train_batch(batch if engine.mesh.pp_rank == 0 else batch["input_ids"], labels)
    except PipelineError as e:
        error = str(e)
    out = {"stage": engine.mesh.pp_rank, "error": error, "seconds": time.monotonic() - start}
    out["after"] = float(engine.train_batch(batch, labels))
    engine.close()
    return out


def _job(rank: int, world: int, cases: list[tuple[str, dict, bool | None]]) -> dict:
    torch.set_num_threads(1)
    return {"trained": [_train(*case) for case in cases], "mismatch": _mismatch()}


def _pp(schedule: str, stage: int, split: object) -> dict:
    parallel = {"pipeline": 2, "microbatches": MICRO, "schedule": schedule, "pipeline_split": split}
    return {"zero_stage": stage, "parallel": parallel}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(400)
def test_relatives_and_padded_batches_train_through_a_pipeline():
    """Padded batches on 2 pipeline ranks: Qwen2 (1F1B, ZeRO-1; mask only), Gemma 3 (Chimera, ZeRO-3; positions too),
    GPT-2 (interleaved, ZeRO-2, each unit a stage: the position embedding reads the positions, the tied embedding
    on both ranks); Gemma 2 (GPipe, ZeRO-0) on ids alone (its eager float64 reference gives NaN at a left
    padding's rows): the losses, eval_batch's loss and logits, and the weights of
    plain PyTorch over the same micro-batches. A second stage given the ids alone while the first has the mask
    stops with a PipelineError naming the micro-batch (the first names the second's rank) within seconds, and the
    next batch trains."""
    cases = {
        "qwen2-1f1b-zero1": ("qwen2", _pp("1f1b", 1, ["model.layers.1"]), False),
        "gemma3-chimera-zero3": ("gemma3", _pp("chimera", 3, ["model.layers.1"]), True),
        "gpt2-interleaved-zero2": ("gpt2", _pp("interleaved_1f1b", 2, "params"), True),
        "gemma2-gpipe-zero0": ("gemma2", _pp("gpipe", 0, ["model.layers.1"]), None),
    }
    results = run_distributed(_job, 2, list(cases.values()), timeout=360)
    for i, (name, (family, _, positions)) in enumerate(cases.items()):
        exact, plain = (reference(family, positions, dtype) for dtype in (torch.float64, torch.float32))
        merged = {k: v for r in results for k, v in r["trained"][i]["state"].items()}
        assert merged.keys() == exact["state"].keys(), name
        for r in results:
            got = r["trained"][i]
            tolerance.assert_losses(got["losses"], exact["losses"], plain["losses"], dtype=torch.float32)
            tolerance.assert_losses([got["eval"]], [exact["eval"]], [plain["eval"]], dtype=torch.float32)
            logits = {"logits": got["logits"]}
            tolerance.assert_weights(
                logits, {"logits": exact["logits"]}, {"logits": plain["logits"]}, dtype=torch.float32
            )
        tolerance.assert_weights(merged, exact["state"], plain["state"], dtype=torch.float32)
    stopped = {r["mismatch"]["stage"]: r["mismatch"] for r in results}
    assert "pipeline rank 1 was given another attention mask or position ids for micro-batch 0" in stopped[1]["error"]
    assert "pipeline rank 1 (global rank 1) raised" in stopped[0]["error"]
    assert all(r["seconds"] < 30 for r in stopped.values())
    assert stopped[0]["after"] == stopped[1]["after"]
