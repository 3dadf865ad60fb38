"""Sequence parallelism with a pipeline of a Hugging Face decoder (hetero/parallel/pipeline/hf.py, [Note: a split
sequence through the stages]).

Tensor x Megatron-SP x pipeline on Llama is the standard large-model layout, yet `initialize` refused any sequence
split with a pipeline of a Hugging Face decoder: a layer unit built its causal mask and rotary tables from its
input's length, which inside the region is the rank's slice, so attention (which sees, or indexes into, the whole
sequence) got tables of the wrong length ('The size of tensor a (8) must match the size of tensor b (4)'). Now a
layer unit inside the region builds them for the whole sequence: Megatron-SP, Ulysses and ring train through a
pipeline of Llama, Qwen2 and GPT-2, padded batches included, with plain PyTorch's losses, gradient norm, eval_batch
and weights (fp32 within fp32's own distance of a float64 run, and rel 1e-5: tests/tolerance.py), ZeRO 1 and 3; and
the estimator runs those layouts' pipeline ranks on meta instead of falling back to the saved bytes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from hetero.parallel.pipeline.split import units_of
from tests.dist import NEEDS_DEGREES, ranks_apart

try:
    from tests import grid_parity, pipe_parity, tolerance
    from tests import test_pipeline_hf_masks as masks
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import grid_parity  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]
    import test_pipeline_hf_masks as masks  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

transformers = pytest.importorskip("transformers")

SPLIT = {"llama": ["model.layers.1"], "qwen2": ["model.layers.1"], "gpt2": ["transformer.h.1"]}
FORMS = ("megatron", "ulysses", "ring")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_a_layer_unit_given_a_slice_builds_the_whole_sequences_tables(family):
    """A layer unit told its input is one of 2 slices builds, from the micro-batch's whole mask and positions, the
    masks, position ids and rotary tables the unit given the whole sequence builds (Qwen2: its sliding layer's too)."""
    model = masks.build(family)
    batch, _ = masks.padded(0, True)
    contexts = []
    for units in (units_of(model), units_of(model)):  # two contexts: each computes its own tables
        units[0][1](batch)  # binds the micro-batch's mask and positions
        contexts.append(units[1][1].ctx)
    whole = torch.randn(masks.ROWS, grid_parity.SEQ, model.config.hidden_size)
    for index in range(model.config.num_hidden_layers):
        want = contexts[0].of(whole, index)
        got = contexts[1].of(whole[:, : grid_parity.SEQ // 2], index, parts=2)
        assert want.keys() == got.keys()
        for key, value in want.items():
            for a, b in zip(*(v if isinstance(v, tuple) else (v,) for v in (value, got[key])), strict=True):
                assert (a is None and b is None) or torch.equal(a, b), (family, index, key)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_estimator_runs_the_pipeline_ranks_on_meta(family, form):
    """The estimator lays the whole meta model out, then cuts it into units: those units learn from the region's
    marks which layers take a slice (Llama: every layer after the first, which holds the scatter; GPT-2: every
    layer, the embeddings' dropout holding it), and each pipeline rank's program runs on meta. Before, Llama's last
    rank failed there on the slice's mask ('Attempting to broadcast a dimension of length 8') and was counted by
    saved bytes only; and `estimate` refused the layout outright."""
    from hetero.parallel.pipeline.hf import Layer
    from hetero.profiler.estimator import estimate
    from hetero.profiler.parallel_layout import Layout, rank_parts

    with torch.device("meta"):
        meta = grid_parity.build(family)
    ids = torch.zeros(4, 16, dtype=torch.long, device="meta")
    layout = Layout(tensor=2, sequence=form, pipeline=2, microbatches=2, split=tuple(SPLIT[family]))
    parts, _, _ = rank_parts(meta, grid_parity.optimizer(meta), layout, world=4, inputs={"input_ids": ids,
                             "labels": ids}, dtype=torch.float32, checkpointing=False)  # fmt: skip
    assert [p.note for p in parts] == ["", ""], [p.note for p in parts]
    sharded = parts[0].model
    split = [u.sequence_parts for _, u in units_of(sharded) if isinstance(u, Layer)]
    assert split == ([1, 2] if family == "llama" else [2, 2])
    est = estimate(meta, {}, world_size=4, machine=False, tensor=2, sequence=form, pipeline=2, microbatches=2)
    assert len(est.per_pipeline_rank) == 2


def _case(family: str, stage: int, form: str, schedule: str = "1f1b", **extra: Any) -> tuple[str, dict]:
    parallel = {"tensor": 2, "sequence": form, "pipeline": 2, "microbatches": 2, "schedule": schedule}
    return family, {"zero_stage": stage, "parallel": {**parallel, "pipeline_split": SPLIT[family]}, **extra}


WORLD4 = {
    "llama-megatron-1f1b-zero1-clip": _case("llama", 1, "megatron", grad_clip_norm=0.5, _estimate=True),
    "gpt2-megatron-gpipe-zero3": _case("gpt2", 3, "megatron", "gpipe", _estimate=True),
    "llama-megatron-chimera-zero3": _case("llama", 3, "megatron", "chimera"),
    "llama-ulysses-1f1b-zero3": _case("llama", 3, "ulysses"),
    "gpt2-ring-1f1b-zero1": _case("gpt2", 1, "ring"),
}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(500)
def test_sequence_splits_x_hf_pipeline_on_4_ranks(monkeypatch):
    """Tensor 2 x pipeline 2 under the CPU stand-in: Megatron-SP on Llama (1F1B, ZeRO-1, clipping; Chimera, ZeRO-3)
    and GPT-2 (GPipe, ZeRO-3, its tied embedding on both stages), Ulysses on Llama and ring on GPT-2: plain
    PyTorch's losses, gradient norm, eval_batch's loss and whole logits, and weights (grid_parity.check); the
    ledgers equal the estimator's bytes for each pipeline rank."""
    monkeypatch.setenv("HETERO_STANDIN", "1")
    results = run_distributed(grid_parity.matrix, 4, copy.deepcopy(list(WORLD4.values())), timeout=460)
    grid_parity.check_all(WORLD4, results)
    for r in results:
        assert r[0]["coords"][0] in (0, 1) and r[0]["coords"][2] in (0, 1)


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(400)
def test_megatron_sp_x_hf_pipeline_x_data_on_8_ranks():
    """Tensor 2 x pipeline 2 x data 2: Llama under Megatron-SP, 1F1B, ZeRO-3 (each data-parallel rank its half of
    the batch): plain PyTorch's results on the global batch. One micro-batch of 4 rows per rank: the loss is the
    mean of the micro-batches' means, and the batch's two ignored labels (rows 0 and 7) then fall one in each, so
    that it is the global batch's mean, as the reference's (micro-batches of 2 rows would weight row 0's less)."""
    family, config = _case("llama", 3, "megatron")
    config["parallel"]["microbatches"] = 1
    cases = {"llama-megatron-1f1b-zero3-dp2": (family, config)}
    results = run_distributed(grid_parity.matrix, 8, copy.deepcopy(list(cases.values())), timeout=360)
    grid_parity.check_all(cases, results)
    assert sorted(r[0]["coords"] for r in results) == [(t, d, p) for t in range(2) for d in range(2) for p in range(2)]


# ---- padded batches: the micro-batch's mask and positions, whole on every rank of the group ----------------------
_LEFT_PADDED = masks.padded  # kept: the test puts `_padded` in its place for the reference


def _padded(step: int, positions: bool) -> tuple[dict, torch.Tensor]:
    """tests/test_pipeline_hf_masks.py's left-padded batch, without the label of each padded row's first token: the
    last padding position predicts it, a query that attends to nothing, whose output is arbitrary (ring attention's
    is 0, plain PyTorch's sdpa's another), as tests/test_tensor_parallel.py weights such outputs 0."""
    batch, labels = _LEFT_PADDED(step, positions)
    first = batch["attention_mask"].argmax(-1)
    rows = torch.nonzero(first > 0).flatten()
    return batch, labels.index_put((rows, first[rows]), torch.tensor(-100))


def _train_padded(family: str, config: dict, positions: bool) -> dict:
    import hetero

    model = masks.build(family)
    engine = hetero.initialize(model, masks.optimizer(model), {"chunk_size": grid_parity.CHUNK, **config})
    losses = [float(engine.train_batch(*_padded(step, positions))) for step in range(masks.STEPS)]
    batch, labels = _padded(masks.STEPS, positions)
    evaluated = float(engine.eval_batch(batch, labels))
    out = engine.eval_batch(batch)
    logits = getattr(out, "logits", out).double()
    state = {k: v.double() for k, v in engine.local_state_dict().items()}
    mesh = engine.mesh
    shards = {n: p._hetero_tp for n, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "_hetero_tp")}
    engine.close()
    coords = (mesh.tp_rank, mesh.dp_rank, mesh.pp_rank)
    return {"losses": losses, "eval": evaluated, "logits": logits, "state": state, "shards": shards, "coords": coords}


def _padded_job(rank: int, world: int, cases: list[tuple[str, dict, bool]]) -> list[dict]:
    torch.set_num_threads(1)
    return [_train_padded(*case) for case in cases]


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(400)
def test_padded_batches_through_a_sequence_split_pipeline(monkeypatch):
    """Left-padded batches (`_padded`) on tensor 2 x pipeline 2: Qwen2 (a full and a sliding layer, each its own
    mask) under Megatron-SP with the mask alone, ZeRO-3; Llama under ring with position ids too, ZeRO-1: plain
    PyTorch's losses, eval_batch's loss and logits, and weights over the same micro-batches."""
    monkeypatch.setattr(masks, "padded", _padded)  # the reference's batches (its own module's function)
    cases = {
        "qwen2-megatron-zero3": ("qwen2", _case("qwen2", 3, "megatron")[1], False),
        "llama-ring-zero1": ("llama", _case("llama", 1, "ring")[1], True),
    }
    results = run_distributed(_padded_job, 4, list(cases.values()), timeout=360)
    real = _padded(masks.STEPS, False)[0]["attention_mask"].unsqueeze(-1)  # a padding position's logits: arbitrary
    for i, (name, (family, _, positions)) in enumerate(cases.items()):
        exact, plain = (masks.reference(family, positions, dtype) for dtype in (torch.float64, torch.float32))
        by_stage: dict[int, list[dict]] = {}
        for r in results:
            got = r[i]
            tolerance.assert_losses(got["losses"], exact["losses"], plain["losses"], dtype=torch.float32)
            tolerance.assert_losses([got["eval"]], [exact["eval"]], [plain["eval"]], dtype=torch.float32)
            tolerance.assert_weights(
                *({"logits": r["logits"] * real} for r in (got, exact, plain)), dtype=torch.float32
            )
            by_stage.setdefault(got["coords"][2], []).append(got)
        merged = pipe_parity.merge_ranks(by_stage)
        assert merged.keys() == exact["state"].keys(), name
        tolerance.assert_weights(merged, exact["state"], plain["state"], dtype=torch.float32)


# ---- dropout: a later stage's tensor ranks draw their own masks for their own positions ---------------------------
def _dropout_masks(rank: int, world: int) -> dict:
    import hetero

    try:
        from tests import test_tp_dropout as drop
    except ImportError:  # tests/ itself on sys.path
        import test_tp_dropout as drop  # type: ignore[no-redef]

    torch.set_num_threads(1)
    model = drop._gpt2()  # dropout everywhere, eager attention (its dropout is F.dropout)
    config = {"zero_stage": 1, "parallel": _case("gpt2", 1, "megatron")[1]["parallel"]}
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    torch.manual_seed(3)  # every rank draws alike from here
    record = drop._Recorder()
    drop.F.dropout = record
    try:
        engine.train_batch(drop._batches()[0], drop._batches()[0])
    finally:
        drop.F.dropout = record.plain
    out = {"stage": engine.mesh.pp_rank, "masks": record.masks}
    engine.close()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
def test_a_later_stage_of_gpt2_draws_each_tensor_ranks_masks():
    """GPT-2's `sequence_scatter` is its embeddings' dropout, which the pipeline's "embeddings" unit runs under
    another name: the second stage did not see that its input was inside the region and did not enter it, so its
    tensor ranks drew one mask for their different positions (the residual and MLP dropouts). Every dropout of each
    stage now differs between its two tensor ranks."""
    results = run_distributed(_dropout_masks, 4, timeout=160)
    for stage in (0, 1):
        a, b = (r["masks"] for r in results if r["stage"] == stage)
        assert len(a) == len(b) >= 3
        for i, (m, t) in enumerate(zip(a, b, strict=True)):
            assert m.any() and not m.all() and not torch.equal(m, t), f"stage {stage}, dropout {i}: one mask"
