"""The delayed update and its prediction under tensor, pipeline and data parallelism composed with ZeRO: the same
losses and weights as plain PyTorch running the delayed algorithm on the whole batch ([Note: the delayed parameter
update], [Note: predicting past the delay])."""

from __future__ import annotations

import pytest
import torch

from hetero.models.gpt_pipe import TP_PLAN
from tests.dist import NEEDS_DEGREES, OWN_BATCHES, ranks_apart

try:
    from tests import pipe_parity, tolerance
    from tests.dist import run_distributed
    from tests.test_delayed import delayed_reference
except ImportError:  # tests/ itself on sys.path
    import pipe_parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]
    from test_delayed import delayed_reference  # type: ignore[no-redef]

STEPS, WARMUP = 6, 1
DELAYED = {"offload": {"optimizer": "host"}, "delayed_param_update": True, "delayed_param_update_warmup": WARMUP}
PREDICTED = {**DELAYED, "delayed_param_update_prediction": True}
TP2 = {"tensor": 2, "tensor_plan": TP_PLAN}
PP2 = {"pipeline": 2, "microbatches": 2}
WORLD2 = {
    "tp2-zero1": {**DELAYED, "zero_stage": 1, "parallel": TP2},
    "tp2-zero3-predicted": {**PREDICTED, "zero_stage": 3, "parallel": TP2},
    "pp2-zero1-predicted": {**PREDICTED, "zero_stage": 1, "parallel": PP2},
    "pp2-zero3": {**DELAYED, "zero_stage": 3, "parallel": PP2},
}
WORLD4 = {
    "tp2xdp2-zero2-predicted": {**PREDICTED, "zero_stage": 2, "parallel": TP2},
    "pp2xdp2-zero3-predicted": {**PREDICTED, "zero_stage": 3, "parallel": PP2},
}


def _matrix(rank: int, world: int, configs: list[dict]) -> list[dict]:
    torch.set_num_threads(1)
    return [pipe_parity.run(rank, world, c, steps=STEPS) for c in configs]


def _check(configs: dict[str, dict], results: list[list[dict]]) -> None:
    for i, (name, cfg) in enumerate(configs.items()):
        run = dict(warmup=WARMUP, predict=cfg.get("delayed_param_update_prediction", False), steps=STEPS)
        common = dict(build=pipe_parity.build, rows=pipe_parity.ROWS, **run)
        exact_losses, exact = delayed_reference(torch.float64, **common)
        plain_losses, plain = delayed_reference(torch.float32, **common)
        by_stage: dict[int, list[dict]] = {}
        for r in (ranks[i] for ranks in results):
            try:
                tolerance.assert_losses(r["losses"], exact_losses, plain_losses, dtype=torch.float32)
            except AssertionError as err:
                raise AssertionError(f"{name}, rank {r['coords']}: {err}") from err
            if r["state"] is not None:
                by_stage.setdefault(r["coords"][2], []).append(r)
        merged = pipe_parity.merge_ranks(by_stage)
        assert merged.keys() == exact.keys(), (name, sorted(set(exact) ^ set(merged)))
        try:
            tolerance.assert_weights(merged, exact, plain, dtype=torch.float32)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_delayed_update_with_tensor_and_pipeline_parallelism():
    _check(WORLD2, run_distributed(_matrix, 2, list(WORLD2.values()), timeout=240))


@ranks_apart(OWN_BATCHES)
@pytest.mark.timeout(300)
def test_delayed_update_with_parallelism_and_data_parallel_ranks():
    _check(WORLD4, run_distributed(_matrix, 4, list(WORLD4.values()), timeout=240))
