"""A pipeline rank's activations for many micro-batches ([Note: micro-batches past the warm-up]): the program run for
three counts past the warm-up and extended along the line they lie on gives the bytes of the whole batch's program,
byte for byte, on the device and on the host, for every schedule; and the estimate no longer runs a forward and a
backward on meta for every micro-batch (64 micro-batches took seconds per rank, and grew with them)."""

from __future__ import annotations

import pytest
import torch

from hetero.profiler import estimate, pipeline_peak
from tests.test_unmodified_models import TINY_DECODER

# pipeline, parallel section, activation_checkpointing, activation_offload, micro-batches: the fewest past three
# times the counts the line is drawn from (the warm-up's (virtual + 1) x pipeline and a step, the counts it takes)
CASES = [
    (2, {"schedule": "1f1b"}, False, False, 16),
    (2, {"schedule": "gpipe"}, True, True, 16),  # every block input on the host at once: the host's line too
    (2, {"schedule": "chimera"}, False, False, 20),  # micro-batches in multiples of the pipeline
    (2, {"schedule": "interleaved_1f1b", "virtual_stages": 2}, True, False, 26),
    (4, {"schedule": "1f1b"}, False, False, 28),
]


def _llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(**{**TINY_DECODER, "num_hidden_layers": 4})
        )


def _per_rank(model: torch.nn.Module, p: int, parallel: dict, ckpt: bool, offload: bool, m: int) -> list[tuple]:
    config = {"zero_stage": 1, "parallel": parallel, "activation_checkpointing": ckpt, "activation_offload": offload}
    est = estimate(model, config, world_size=p, batch_size=2, seq_len=16, machine=False, pipeline=p, microbatches=m)
    assert "failed" not in est.activations.note and "saved bytes only" not in est.activations.note, est.activations
    return [(r["activations"], r["host_activations"]) for r in est.per_pipeline_rank]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p,parallel,ckpt,offload,m", CASES, ids=str)
def test_the_line_past_the_warm_up_is_the_whole_batch(p, parallel, ckpt, offload, m, monkeypatch):
    model = _llama()
    run: list[int] = []
    whole = pipeline_peak.rank_step_peak

    def counted(*args, **kwargs):
        run.append(args[3].microbatches)
        return whole(*args, **kwargs)

    monkeypatch.setattr(pipeline_peak, "rank_step_peak", counted)
    extended = _per_rank(model, p, parallel, ckpt, offload, m)
    assert len(run) == 3 * p and max(run) < m, run  # per rank three counts, none the whole batch
    assert any(h for _, h in extended) == offload, extended
    monkeypatch.setattr(pipeline_peak, "schedule_peak", whole)  # the whole batch's program, every rank
    assert extended == _per_rank(model, p, parallel, ckpt, offload, m)
