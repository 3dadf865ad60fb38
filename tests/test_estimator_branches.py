"""The estimate of a model whose forward branches on its tensors' values ([Note: branches on meta]): a Hugging Face
decoder configured for training (`use_cache=False`) asks whether its position ids pack several sequences per row,
which raised on meta, and the estimate counted no activations at all. Counted, they match a real step's."""

from __future__ import annotations

import pytest
import torch

from hetero.profiler import estimate
from tests.test_estimator import BATCH, SEQ, _check_activations, _hf, _measure


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_decoder_without_a_cache_is_counted(name):
    meta = _hf(name, meta=True)
    meta.config.use_cache = False
    config = {"zero_stage": 1, "chunk_size": 4096}
    est = estimate(meta, config, batch_size=BATCH, seq_len=SEQ, optimizer="adamw", machine=False)
    assert est.activations.bytes > 0 and "failed" not in est.activations.note, est.activations
    model = _hf(name, meta=False)
    model.config.use_cache = False
    measured = _measure(model, config, make_opt=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    args = measured["activations"], measured["step_peak"], measured["norm_stats"], est.precision
    _check_activations(est.activations, *args, f"{name} use_cache=False")
