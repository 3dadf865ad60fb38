"""Pipelines of Hugging Face causal LMs (hetero/parallel/pipeline/hf.py, tied.py): Llama and GPT-2 built from configs
go through `hetero.initialize` with `"pipeline"` as they are, cut into embeddings, decoder layers and head with
their parameter names and state_dict keys unchanged; GPT-2's embedding tied to the head lives on the first and last
stages, whose gradients are summed and whose copies stay bit-identical. Parity with plain PyTorch (fp32, rel 1e-5 on
losses, gradient norm and every weight; tolerances from tests/tolerance.py) under 1F1B, GPipe, interleaved and
Chimera at 2 processes, and 2D tensor x pipeline 2 (1F1B) at 8; a checkpoint consolidates to the plain state_dict."""

from __future__ import annotations

import copy

import pytest
import torch

from hetero.errors import ConfigError
from hetero.parallel.pipeline.split import cut_stages, units_of
from tests.dist import NEEDS_DEGREES, ranks_apart

try:
    from tests import grid_parity
    from tests.dist import run_distributed
    from tests.test_grid_parallel import _case, _check_consolidated
except ImportError:  # tests/ itself on sys.path
    import grid_parity  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]
    from test_grid_parallel import _case, _check_consolidated  # type: ignore[no-redef]

transformers = pytest.importorskip("transformers")

SPLIT = {"llama": ["model.layers.1"], "gpt2": ["transformer.h.1"]}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_units_run_the_model_forward(family, attn):
    """The units, run one after the other, compute the model's own logits and loss bit for bit (SDPA's causal
    kernel without a mask, eager attention with Hugging Face's additive mask)."""
    model = grid_parity.build(family)
    model.config._attn_implementation = attn
    x, y = grid_parity.batches(family)[0]
    ref = model(x, labels=y, use_cache=False)  # units keep no cache (with one, newer models' kernels differ by ulps)
    units = units_of(model)
    assert [n for n, _ in units][0] == "embeddings" and units[-1][0] == "head"
    assert [n for n, _ in units][1:-1] == [f"{SPLIT[family][0][:-1]}{i}" for i in range(2)]
    h = x
    for _, unit in units[:-1]:
        h = unit(h)
    out = units[-1][1](h, labels=y)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    assert torch.equal(units[-1][1](h), ref.logits)  # without labels: the logits


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cut_keeps_names_and_finds_the_tied_embedding(family):
    full = grid_parity.build(family).state_dict()
    kept = []
    for rank in range(2):
        model = grid_parity.build(family)
        chunks, ties = cut_stages(model, rank=rank, ranks=2, virtual=1, split=SPLIT[family])
        state = model.state_dict()
        assert all(torch.equal(v, full[k]) for k, v in state.items())  # names and values unchanged
        kept.append(set(state))
        if family == "gpt2":  # the embedding is the head's weight: on both stages, under each stage's name
            assert ties.sets == [(0, 1)] and len(ties.mine) == 1
            assert ties.mine[0][1] is (model.transformer.wte if rank == 0 else model.lm_head).weight
        else:
            assert ties.sets == [] and ties.mine == []
    assert kept[0] | kept[1] == set(full)
    assert ("lm_head.weight" in kept[0]) is False and ("lm_head.weight" in kept[1])
    # Chimera: ranks 0 and 1 both hold stages 0 and 1, so the tied uses sit together: nothing to sum
    model = grid_parity.build(family)
    _, ties = cut_stages(model, rank=0, ranks=2, virtual=1, split=SPLIT[family], bidirectional=True)
    assert ties.sets == [] and set(model.state_dict()) == set(full)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_estimator_holds_each_ranks_parameters_as_the_cut(family):
    """The estimator's pipeline ranks hold the parameters the engine's cut keeps, under the same names and in the
    same order (GPT-2's tied embedding on both stages: `lm_head.weight` on the last)."""
    from hetero.profiler.parallel_layout import Layout, rank_parts

    with torch.device("meta"):
        meta = grid_parity.build(family)
    ids = torch.zeros(4, 8, dtype=torch.long, device="meta")
    layout = Layout(pipeline=2, microbatches=2, split=tuple(SPLIT[family]))
    parts, _, _ = rank_parts(
        meta, grid_parity.optimizer(meta), layout, world=2, inputs={"input_ids": ids, "labels": ids},
        dtype=torch.float32, checkpointing=False,
    )  # fmt: skip
    for rank, part in enumerate(parts):
        model = grid_parity.build(family)
        cut_stages(model, rank=rank, ranks=2, virtual=1, split=SPLIT[family])
        assert [n for n, _ in part.params] == [n for n, _ in model.named_parameters()]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_units_of_a_meta_model_count_their_flops(family):
    """`pipeline_split: "auto"` on a model built on the meta device counts each unit's FLOPs there: a Hugging Face
    Llama's mask looked for packed sequences with `.item()` (refused on meta), so `initialize` failed. Equal decoder
    layers cost the same (the mask on meta is materialised where a built model's sdpa needs none, so the counts are
    not a built model's to the FLOP)."""
    from hetero.parallel.pipeline.balance import flop_costs, sample_input

    with torch.device("meta"):
        meta = grid_parity.build(family)
    names = [n for n, _ in units_of(meta)]
    costs = dict(zip(names, flop_costs(units_of(meta), sample_input(meta, units_of(meta)))))
    layers = {c for n, c in costs.items() if n.split(".")[-2:-1] in (["layers"], ["h"])}
    assert len(layers) == 1 and min(costs.values()) >= 1, costs


def test_pipeline_errors_for_models_it_cannot_cut():
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    )
    with pytest.raises(ConfigError, match="not a Hugging Face decoder hetero can pipeline"):
        units_of(bert)
    # Chimera keeps stages r and p - 1 - r together: a parameter shared by stages 0 and 1 of 4 cannot be
    model = grid_parity.build("llama")
    model.model.layers[0].mlp.up_proj.weight = model.model.embed_tokens.weight
    with pytest.raises(ConfigError, match="Chimera places on different pairs"):
        cut_stages(model, rank=0, ranks=4, virtual=1, split="params", bidirectional=True)


def _pp(family: str, schedule: str, **extra: object) -> dict:
    return {"pipeline": 2, "microbatches": 2, "schedule": schedule, "pipeline_split": SPLIT[family], **extra}


def _tied_copies_equal(results: list[dict]) -> None:
    """GPT-2's embedding on the first stage and the head on the last: the same weights, bit for bit."""
    first = next(r for r in results if r["coords"] == (0, 0, 0))["state"]
    last = next(r for r in results if r["coords"][2] == 1 and r["coords"][:2] == (0, 0))["state"]
    assert torch.equal(first["transformer.wte.weight"], last["lm_head.weight"])


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(400)
def test_hf_pipelines_on_2_ranks(tmp_path):
    """Pipeline only: 1F1B, GPipe, interleaved (each unit a stage) and Chimera, ZeRO 0-3, clipping; GPT-2's tied
        embedding summed across stages; each rank's ledgers equal the estimator's bytes for its pipeline rank (the tied
    embedding counted on both stages); a checkpoint consolidates to the plain state_dict."""
    root = str(tmp_path / "ckpt")
    cases = {
        "gpt2-1f1b-zero1-clip-ckpt": _case("gpt2", 1, _pp("gpt2", "1f1b"), clip=True, _checkpoint=root, _estimate=True),
        "llama-gpipe-zero3": _case("llama", 3, _pp("llama", "gpipe"), _estimate=True),
        "gpt2-interleaved-zero3-clip": _case(
            "gpt2", 3, _pp("gpt2", "interleaved_1f1b", pipeline_split="params"), clip=True
        ),  # fmt: skip
        "gpt2-chimera-zero2": _case("gpt2", 2, _pp("gpt2", "chimera")),
        "llama-1f1b-zero0-auto": _case("llama", 0, _pp("llama", "1f1b", pipeline_split="auto")),
        # hetero's GPTPipe with tie_weights: the same tie across stages, on a model whose children run in order
        "gptpipe-tied-1f1b-zero2": _case("gpt_pipe_tied", 2, _pp("gpt2", "1f1b", pipeline_split=["layers.1"])),
    }
    results = run_distributed(grid_parity.matrix, 2, list(cases.values()), timeout=360)
    grid_parity.check_all(cases, results)
    names = list(cases)
    for i, name in enumerate(names):
        if name.startswith("gpt2") and "chimera" not in name:
            _tied_copies_equal([r[i] for r in results])
    tied = [r[names.index("gptpipe-tied-1f1b-zero2")]["state"] for r in results]
    assert torch.equal(tied[0]["embed.tok.weight"], tied[1]["head.lm_head.weight"])
    _check_consolidated(root, "gpt2", [r[0] for r in results], clip=0.5)


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(400)
def test_2d_x_hf_pipeline_on_8_ranks():
    """The issue's row "2D x pipeline 2, 1F1B, 8 processes" for Hugging Face Llama and GPT-2."""
    cases = {
        f"2dxpp2-1f1b-{family}-zero{stage}": _case(
            family, stage, {"tensor": 4, "tensor_mode": "2d", **_pp(family, "1f1b")}, clip=clip, _estimate=True
        )
        for family, stage, clip in (("llama", 1, True), ("gpt2", 3, False))
    }
    results = run_distributed(grid_parity.matrix, 8, copy.deepcopy(list(cases.values())), timeout=360)
    grid_parity.check_all(cases, results)
    assert [r[0]["coords"] for r in results] == [(t, 0, p) for p in range(2) for t in range(4)]
    gpt2 = [r[1] for r in results]
    for t in range(4):  # each tensor rank's block of the tied embedding, on both stages
        first = next(r for r in gpt2 if r["coords"] == (t, 0, 0))["state"]["transformer.wte.weight"]
        last = next(r for r in gpt2 if r["coords"] == (t, 0, 1))["state"]["lm_head.weight"]
        assert torch.equal(first, last)


# ---- a bare base model (LlamaModel, GPT2Model): a reward or embedding model trained with a loss_fn ----------------
BARE_LAYERS = {"llama": "layers", "gpt2": "h"}  # the base model's decoder layers, as its own FQNs name them


def _bare(family: str) -> torch.nn.Module:
    """The family's causal LM's base model, alone (the same weights as `grid_parity.build`'s under their names)."""
    return grid_parity.build(family).base_model


def _hidden_loss(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss_fn on the last hidden states: each position's mean feature regressed onto a target."""
    return torch.nn.functional.mse_loss(hidden.mean(-1), targets.to(hidden.dtype))


def _bare_data(steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    shape = (rows, grid_parity.SEQ)
    return [
        (torch.randint(0, grid_parity.VOCAB, shape, generator=g), torch.randn(shape, generator=g)) for _ in range(steps)
    ]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_bare_base_model_is_cut_as_its_forward_runs(family):
    """Embeddings, layers and the final norm, run one after the other, give the base model's last hidden states bit
    for bit. Before, it was cut by its top-level children in registration order (Llama's rotary module last, GPT-2's
    position embedding given the token embeddings) and failed in the first layer ('cannot unpack non-iterable
    NoneType'); labels without a loss_fn now say a base model has no loss."""
    model = _bare(family)
    x = _bare_data(1, 2)[0][0]
    units = units_of(model)
    norm, layers = ("norm" if family == "llama" else "ln_f"), BARE_LAYERS[family]
    assert [n for n, _ in units] == ["embeddings", f"{layers}.0", f"{layers}.1", "norm"]
    h = x
    for _, unit in units:
        h = unit(h)
    assert torch.equal(h, model(x, use_cache=False).last_hidden_state)
    with pytest.raises(ConfigError, match="has no head and computes no loss: pass loss_fn"):
        units[-1][1](h, labels=h)
    full = model.state_dict()
    model = _bare(family)
    cut_stages(model, rank=1, ranks=2, virtual=1, split=[f"{layers}.1"])
    assert f"{norm}.weight" in model.state_dict() and all(
        torch.equal(v, full[k]) for k, v in model.state_dict().items()
    )


def _train_bare(rank: int, world: int, family: str, config: dict, steps: int, rows: int) -> dict:
    import hetero

    torch.set_num_threads(1)
    model = _bare(family)
    engine = hetero.initialize(model, grid_parity.optimizer(model), {"chunk_size": grid_parity.CHUNK, **config})
    losses = [float(engine.train_batch(x, y, loss_fn=_hidden_loss)) for x, y in _bare_data(steps, rows)]
    x, y = _bare_data(1, rows)[0]
    evaluated = float(engine.eval_batch(x, y, loss_fn=_hidden_loss))
    state = {k: v.double() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {"losses": losses, "eval": evaluated, "state": state}


def _bare_reference(family: str, dtype: torch.dtype, steps: int, rows: int) -> tuple[list[float], dict, float]:
    model = _bare(family).to(dtype)
    opt = grid_parity.optimizer(model)
    losses = []
    for x, y in _bare_data(steps, rows):
        loss = _hidden_loss(model(x, use_cache=False).last_hidden_state, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    x, y = _bare_data(1, rows)[0]
    with torch.no_grad():
        evaluated = _hidden_loss(model(x, use_cache=False).last_hidden_state, y).item()
    return losses, {k: v.detach().double() for k, v in model.state_dict().items()}, evaluated


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_a_bare_base_model_trains_through_a_pipeline_like_plain_pytorch():
    """LlamaModel (1F1B, ZeRO-3) and GPT2Model (GPipe, ZeRO-1) on 2 pipeline ranks with a loss_fn on the hidden
    states: the losses, eval_batch's loss and the weights of plain PyTorch (fp32, within fp32's own error of the
    float64 run: tests/tolerance.py)."""
    from tests import tolerance

    steps, rows = 3, 4
    cases = {"llama": (3, "1f1b"), "gpt2": (1, "gpipe")}
    for family, (stage, schedule) in cases.items():
        split = [f"{BARE_LAYERS[family]}.1"]
        config = {"zero_stage": stage, "parallel": {"pipeline": 2, "microbatches": 2, "schedule": schedule}}
        config["parallel"]["pipeline_split"] = split
        results = run_distributed(_train_bare, 2, family, config, steps, rows, timeout=240)
        exact_losses, exact, exact_eval = _bare_reference(family, torch.float64, steps, rows)
        plain_losses, plain, plain_eval = _bare_reference(family, torch.float32, steps, rows)
        merged = {k: v for r in results for k, v in r["state"].items()}
        assert merged.keys() == exact.keys()
        for r in results:
            tolerance.assert_losses(r["losses"], exact_losses, plain_losses, dtype=torch.float32)
            tolerance.assert_losses([r["eval"]], [exact_eval], [plain_eval], dtype=torch.float32)
        tolerance.assert_weights(merged, exact, plain, dtype=torch.float32)
