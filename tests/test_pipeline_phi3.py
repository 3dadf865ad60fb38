"""Phi-3 and Phi-4 through a pipeline, and tensor x pipeline (hetero/parallel/pipeline/hf.py; the fused projections'
cuts: [Note: fused q/k/v projections] in hetero/parallel/fused_qkv.py, hetero/parallel/fused_mlp.py).

Phi-3-medium and Phi-4 (14B) need tensor x pipeline to fit. Tiny Phi-3s (tests/phi3_tiny.py: fused q/k/v of unequal
blocks, of equal blocks with a sliding window, and Phi-4-mini's LongRoPE over a partial rotary dimension) are cut
into embeddings, four decoder layers and head; each stage builds its layers' masks and rotary tables from its own
copy of the model's rotary module. Checked against a plain single-process PyTorch loop (float64 as the exact run,
plain fp32's distance from it as the scale, and rel 1e-5: tests/tolerance.py, grid_parity.check): pipeline 2 under
1F1B at ZeRO 1 and 3 with 2 and 4 micro-batches, and tensor 2 x pipeline 2 at ZeRO 1 and 3; a checkpoint saved by
the tensor x pipeline layout consolidates to the plain model's keys, shapes and trained weights. Nothing of this
failed when it was first run; what did: a tied embedding refused under a pipeline was named as the pipeline's unit
holds it ('embeddings.embed_tokens.weight'), not as the model does."""

from __future__ import annotations

import copy

import pytest
import torch

from hetero.errors import ConfigError
from hetero.parallel.pipeline.split import cut_stages
from hetero.parallel.pipeline.tied import TiedGrads
from tests.dist import NEEDS_DEGREES, ranks_apart

try:
    from tests import grid_parity, phi3_tiny, pipe_parity, tolerance
    from tests.dist import run_distributed
    from tests.test_grid_parallel import _case, _check_consolidated
except ImportError:  # tests/ itself on sys.path
    import grid_parity  # type: ignore[no-redef]
    import phi3_tiny  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]
    from test_grid_parallel import _case, _check_consolidated  # type: ignore[no-redef]

transformers = pytest.importorskip("transformers")

SPLIT = ["model.layers.2"]  # the second stage begins at the third of four layers


@pytest.mark.parametrize("family", list(phi3_tiny.FAMILIES))
def test_the_second_stage_computes_the_whole_models_logits(family):
    """The second of two stages, cut from its own copy of the model and given the whole model's hidden states after
    layer 1, gives the whole model's logits and loss bit for bit, and its layers take the whole model's rotary
    tables: at 3 positions (inside LongRoPE's original context: its short factors), 8 (beyond it: the long factors
    and their attention scale) and 3 again (LongRoPE switches back). The second stage keeps no embedding."""
    whole, cut = grid_parity.build(family), grid_parity.build(family)
    (chunk,), _ = cut_stages(cut, rank=1, ranks=2, virtual=1, split=SPLIT)
    assert [n for n, _ in chunk.units] == ["model.layers.2", "model.layers.3", "head"]
    assert not any(k.startswith("model.embed_tokens") for k in cut.state_dict())
    g = torch.Generator().manual_seed(2)
    first = []  # the tables' first 3 positions, per run
    for seq in (3, 8, 3):
        x = torch.randint(0, phi3_tiny.VOCAB, (2, seq), generator=g)
        ref = whole(x, labels=x, use_cache=False, output_hidden_states=True)
        hidden = ref.hidden_states[2]  # the embeddings' output, then each layer's: layer 1's
        out = chunk(hidden, labels=x, batch=x)
        assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss), (family, seq)
        tables = chunk.units[0][1].ctx.of(hidden, 2)["position_embeddings"]
        want = whole.model.rotary_emb(hidden, torch.arange(seq).unsqueeze(0))
        assert all(torch.equal(a, b) for a, b in zip(tables, want, strict=True)), (family, seq)
        first.append(tables[0][0, :3])
    assert torch.equal(first[0], first[2])
    assert torch.equal(first[0], first[1]) is (family != "phi3-long")  # LongRoPE's long factors: other tables


def test_a_tied_embedding_is_named_as_the_model_names_it():
    """Phi-4-mini's embedding tied to its head, found by the cut on the stages' units, is reported under the model's
    names: a tied parameter split over chunks is refused naming them. It was named 'embeddings.embed_tokens.weight',
    the embeddings unit's name for it, which the model does not have."""
    model = grid_parity.build("phi3-long")
    _, ties = cut_stages(model, rank=1, ranks=2, virtual=1, split=SPLIT)
    ((where, param, holders),) = ties.mine
    assert param is model.lm_head.weight and holders == (0, 1)
    with pytest.raises(ConfigError, match=r"^parallel: 'model.embed_tokens.weight' \(also 'lm_head.weight'\) is tied"):
        TiedGrads(ties, {}, {}, 1)  # no chunk holds it whole


def _tied_copies_equal(results: list[dict]) -> None:
    """The tied embedding's copies on the first and last stages, each tensor rank's block: the same, bit for bit."""
    for r in results:
        if r["state"] is not None and r["coords"][2] == 0:
            last = next(o for o in results if o["state"] is not None and o["coords"][::2] == (r["coords"][0], 1))
            assert torch.equal(r["state"]["model.embed_tokens.weight"], last["state"]["lm_head.weight"])


def _pp(**extra: object) -> dict:
    return {"pipeline": 2, "microbatches": 2, "schedule": "1f1b", "pipeline_split": SPLIT, **extra}


def _accumulated(family: str, parts: int, dtype: torch.dtype) -> tuple[list[float], dict, float]:
    """Plain PyTorch accumulating the gradients of `parts` micro-batches per step, each loss divided by `parts`: a
    pipeline's loss is the mean of its micro-batches' losses (README), which with the batches' two ignored labels
    in different micro-batches is not the batch's mean (4 micro-batches of 13, 14, 14 and 13 tokens)."""
    model = grid_parity.build(family).to(dtype)
    opt = grid_parity.optimizer(model)
    losses, norm = [], float("nan")
    for x, y in grid_parity.batches(family):
        total = 0.0
        for xs, ys in zip(x.chunk(parts), y.chunk(parts), strict=True):
            loss = model(xs, labels=ys).loss / parts
            loss.backward()
            total += loss.item()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norm


def _check_accumulated(results: list[dict], family: str, parts: int) -> None:
    """grid_parity.check's losses, gradient norm and merged weights, against `_accumulated`."""
    exact_losses, exact, exact_norm = _accumulated(family, parts, torch.float64)
    plain_losses, plain, plain_norm = _accumulated(family, parts, torch.float32)
    by_stage: dict[int, list[dict]] = {}
    for r in results:
        tolerance.assert_losses(r["losses"], exact_losses, plain_losses, dtype=torch.float32)
        tolerance.assert_losses([r["grad_norm"]], [exact_norm], [plain_norm], dtype=torch.float32)
        if r["state"] is not None:
            by_stage.setdefault(r["coords"][2], []).append(r)
    merged = pipe_parity.merge_ranks(by_stage)
    assert merged.keys() == plain.keys(), sorted(set(plain) ^ set(merged))
    tolerance.assert_weights(merged, exact, plain, dtype=torch.float32)


PIPE = {
    "phi3-1f1b-zero1": _case("phi3", 1, _pp()),
    "phi3-1f1b-zero3-clip": _case("phi3", 3, _pp(), clip=True),
    "phi3-mha-1f1b-zero3": _case("phi3-mha", 3, _pp()),
    "phi3-long-1f1b-zero1": _case("phi3-long", 1, _pp(), chunk_size=phi3_tiny.TIED_CHUNK),
}
PIPE_MB4 = _case("phi3", 3, _pp(microbatches=4))


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_phi3_pipelines_on_2_ranks():
    """Pipeline 2, 1F1B: unequal and equal fused blocks (the latter with a sliding window) and Phi-4-mini's LongRoPE
    over a partial rotary dimension, ZeRO 1 and 3 (clipping at 0.5 clips): plain PyTorch's losses, gradient norm,
    eval_batch's loss and logits and weights (grid_parity.check); with 4 micro-batches, plain PyTorch accumulating
    them. Phi-4-mini's embedding tied to its head: its copies on the two stages stay bit-identical."""
    cases = copy.deepcopy([*PIPE.values(), PIPE_MB4])
    results = run_distributed(grid_parity.matrix, 2, cases, timeout=260)
    grid_parity.check_all(PIPE, results)
    _check_accumulated([r[len(PIPE)] for r in results], "phi3", 4)
    _tied_copies_equal([r[list(PIPE).index("phi3-long-1f1b-zero1")] for r in results])
    assert [r[0]["coords"] for r in results] == [(0, 0, 0), (0, 0, 1)]


TP_PP = {
    "phi3-tp2xpp2-zero1": _case("phi3", 1, _pp(tensor=2)),
    "phi3-long-tp2xpp2-zero3-clip": _case("phi3-long", 3, _pp(tensor=2), clip=True, chunk_size=phi3_tiny.TIED_CHUNK),
}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_phi3_tensor_x_pipeline_on_4_ranks(tmp_path):
    """Tensor 2 x pipeline 2, 1F1B, ZeRO 1 (unequal fused blocks; saved) and 3 (LongRoPE, partial rotary, clipping):
    plain PyTorch's results (grid_parity.check); each tensor rank holds its slice of q, of k and of v; the checkpoint
    consolidates into the plain model strictly, holding the blocks the ranks trained, joined (the plain weights);
    each tensor rank's block of the tied embedding is the same on both stages."""
    root = str(tmp_path / "ckpt")
    cases = copy.deepcopy(TP_PP)
    cases["phi3-tp2xpp2-zero1"][1]["_checkpoint"] = root
    results = run_distributed(grid_parity.matrix, 4, list(cases.values()), timeout=260)
    grid_parity.check_all(cases, results)
    assert sorted(r[0]["coords"] for r in results) == [(t, 0, p) for t in range(2) for p in range(2)]
    name = "model.layers.0.self_attn.qkv_proj.weight"
    first = [r[0] for r in results if r[0]["coords"][2] == 0]
    assert all(r["shards"][name].sizes == (64, 32, 32) for r in first)  # q of 4 heads of 16, k and v of 2
    assert all(r["state"][name].shape == (64, 64) for r in first)  # 2 query heads, 1 key and 1 value head each
    _check_consolidated(root, "phi3", [r[0] for r in results])
    _tied_copies_equal([r[1] for r in results])
