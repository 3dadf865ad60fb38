"""Tensor (and sequence) parallelism composed with pipeline and data parallelism and ZeRO, through train_batch:
the same losses, global gradient norm and weights as plain PyTorch on the whole batch."""

from __future__ import annotations

import pytest
import torch

from hetero.models.gpt_pipe import TP_PLAN
from tests.dist import NEEDS_DEGREES, ranks_apart

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
