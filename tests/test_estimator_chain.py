"""A pipeline layout of hetero's own GPT, the parameter-count model, whose children do not run as a chain (its forward
adds the position embedding beside the token one): cut by its children, the program failed on meta and a rank's
activations were the saved bytes walked through the schedule, 20-45% below what a rank holds. Cut as GPTPipe, the
same modules in order (what initialize asks a user to pipeline instead), it is that model's estimate, which
test_estimator.py::test_pipeline_rank_step_matches_the_runtime checks against the runtime."""

from __future__ import annotations

import pytest
import torch

from hetero.models.gpt import GPT, GPTConfig
from hetero.models.gpt_pipe import GPTPipe
from hetero.profiler import estimate
from tests.parity import GPT_CFG, make_optimizer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("parallel", [{"schedule": "1f1b"}, {"schedule": "gpipe", "pipeline_split": "params"}], ids=str)
def test_gpt_is_cut_as_its_pipelineable_twin(parallel):
    with torch.device("meta"):
        gpt = GPT(GPTConfig(**GPT_CFG))
        pipe = GPTPipe(GPTConfig(**GPT_CFG))
    config = {"zero_stage": 1, "chunk_size": 4096, "activation_checkpointing": True, "parallel": parallel}
    kw = {"world_size": 2, "batch_size": 2, "seq_len": 16, "machine": False, "pipeline": 2, "microbatches": 4}
    got = estimate(gpt, config, optimizer=make_optimizer(gpt), **kw)
    want = estimate(pipe, config, optimizer=make_optimizer(pipe), **kw)
    assert "saved bytes only" not in got.activations.note, got.activations.note
    assert got.per_pipeline_rank == want.per_pipeline_rank
    assert got.to_dict()["resident"] == want.to_dict()["resident"]
