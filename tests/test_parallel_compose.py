"""Tensor (and sequence) parallelism composed with pipeline and data parallelism and ZeRO, through train_batch:
the same losses, global gradient norm and weights as plain PyTorch on the whole batch."""

from __future__ import annotations

import re

import pytest
import torch

from hetero.errors import ConfigError
from hetero.models.gpt import GPTConfig
from hetero.models.gpt_pipe import TP_PLAN, GPTPipe
from tests.dist import NEEDS_DEGREES, ONE_RANK_FAULTS, ranks_apart

try:
    from tests import pipe_parity
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import pipe_parity  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]


def _matrix(rank: int, world: int, configs: list[dict]) -> list[dict]:
    torch.set_num_threads(1)
    return [pipe_parity.run(rank, world, c) for c in configs]


def _check_all(configs: dict[str, dict], results: list[list[dict]]) -> None:
    for i, name in enumerate(configs):
        try:
            pipe_parity.check([r[i] for r in results])
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err


WORLD2 = {
    "tp2-micro2-zero1": {"zero_stage": 1, "parallel": {"tensor": 2, "tensor_plan": TP_PLAN, "microbatches": 2}},
    "tp2-sp-zero3": {"zero_stage": 3, "parallel": {"tensor": 2, "tensor_plan": TP_PLAN, "sequence": True}},
}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_tensor_and_sequence_parallel_through_train_batch():
    results = run_distributed(_matrix, 2, list(WORLD2.values()), timeout=240)
    _check_all(WORLD2, results)
    assert [r[0]["coords"] for r in results] == [(0, 0, 0), (1, 0, 0)]
    assert results[0][0]["shards"] and results[0][0]["shards"].keys() == results[1][0]["shards"].keys()


def _layout(stage: int, schedule: str, sequence: bool = False) -> dict:
    parallel = {"tensor": 2, "tensor_plan": TP_PLAN, "sequence": sequence, "pipeline": 2, "microbatches": 2}
    return {"zero_stage": stage, "parallel": {**parallel, "schedule": schedule}}


WORLD8 = {
    "tp2xpp2xdp2-zero1-1f1b": _layout(1, "1f1b"),
    "tp2xpp2xdp2-zero3-interleaved-sp": {**_layout(3, "interleaved_1f1b", sequence=True), "grad_clip_norm": 1e9},
}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(600)
def test_tp_pp_dp_2x2x2_with_zero1_and_zero3():
    results = run_distributed(_matrix, 8, list(WORLD8.values()), timeout=540)
    _check_all(WORLD8, results)
    # tensor fastest, then data, then pipeline
    assert [r[0]["coords"] for r in results] == [(t, d, p) for p in range(2) for d in range(2) for t in range(2)]


def _llama(width: int) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=width, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _gpt(seed: int, **cfg: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return GPTPipe(GPTConfig(**{**pipe_parity.CFG, **cfg}))


# Each case: a model on each of 4 ranks and its "parallel" section; one stage's ranks (or one tensor group) fail a
# check that the others pass.
STOPS = {
    # The layer whose MLP width (49) 2 ranks cannot cut is on stage 0; stage 1 holds the norm and the head.
    "width": (lambda rank: _llama(49), {"tensor": 2, "pipeline": 2, "pipeline_split": "params"}),
    # Stage 0's two tensor ranks built different models, stage 1's the same one.
    "replicas-pipeline": (lambda rank: _gpt(min(rank, 2)), {"tensor": 2, "pipeline": 2, "tensor_plan": TP_PLAN}),
    # The first tensor group built different models, the second the same one (the engine's broadcast covers only
    # the data-parallel group).
    "replicas-data": (lambda rank: _gpt(min(rank, 2)), {"tensor": 2, "tensor_plan": TP_PLAN}),
    # Ulysses over 2 ranks cannot split 3 heads: the attention is on stage 1, stage 0 holds the embeddings alone.
    "ulysses-heads": (
        lambda rank: _gpt(0, n_head=3, n_embd=48, n_layer=1),
        {"tensor": 2, "sequence": "ulysses", "pipeline": 2, "pipeline_split": ["layers.0"], "tensor_plan": TP_PLAN},
    ),
}


def _stop(rank: int, world: int, case: str) -> str:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    build, parallel = STOPS[case]
    model = build(rank)
    import hetero

    config = {"zero_stage": 1, "comm_timeout": 60, "parallel": {"microbatches": 2, **parallel}}
    try:
        engine = hetero.initialize(model, None, config)
    except ConfigError as err:
        return str(err)
    engine.close()
    return "initialized"


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", list(STOPS))
def test_a_check_one_stage_or_group_fails_stops_every_rank(case):
    """Checks of the model ran on each pipeline stage's part (or each tensor group's copy) after the cut: the ranks
    whose part passed went on to initialize and waited for the ones that raised until comm_timeout. Now every rank
    raises the same ConfigError at once."""
    results = run_distributed(_stop, 4, case, timeout=120)
    assert len(set(results)) == 1 and results[0] != "initialized", results
    expected = {
        "width": r"model\.layers\.0\.mlp\.gate_proj \(colwise\): dimension 0 of shape \(49, 32\) does not divide",
        "replicas-pipeline": r"hold different values of \d+ parameters .*global ranks \[0, 1\]",
        "replicas-data": r"hold different values of \d+ parameters .*global ranks \[0, 1\]",
        "ulysses-heads": r"layers\.0\.attn: n_head = 3 does not divide by the tensor-parallel degree 2",
    }[case]
    assert re.search(expected, results[0], re.S), results[0]
    if case == "width":  # found on the whole model before the cut, not after it on stage 0 and passed on
        assert "pipeline stage" not in results[0], results[0]
