"""A model built under hetero.lazy_init() gets the values a normally built model gets from the same seed, bit for bit,
under tensor parallelism ([Note: initialising a tensor-parallel shard] in hetero/zero/init_replay.py) and under a
pipeline ([Note: replaying the stages a rank dropped] there, and GPTPipe's own reset_parameters)."""

from __future__ import annotations

import pytest
import torch
import transformers

import hetero
from hetero.models.gpt import GPTConfig
from hetero.models.gpt_pipe import GPTPipe
from tests.dist import NEEDS_DEGREES, ranks_apart, run_distributed

# pad_token_id 40: the padding row is in tensor rank 1's half of the vocabulary (its local row 8).
LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=16,
    pad_token_id=40,
)


def _llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def _lazy_tensor(rank: int, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    with hetero.lazy_init():
        model = _llama()
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"parallel": {"tensor": 2}})
    full = engine.full_state_dict()
    engine.close()
    return full


def _differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert set(got) >= set(want), sorted(set(want) - set(got))
    return [k for k in want if not torch.equal(got[k].cpu(), want[k])]


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(180)
def test_lazy_llama_at_tensor_2_is_the_normally_built_model() -> None:
    torch.manual_seed(0)
    want = _llama().state_dict()
    got = run_distributed(_lazy_tensor, 2, timeout=150)[0]
    assert _differing(got, want) == []
    assert torch.equal(got["model.embed_tokens.weight"][40], torch.zeros(32))  # the padding row, on rank 1


GPT_CFG = dict(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16, bias=True)


def _lazy_pipeline(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """The step-0 values of a lazy Llama and a lazy GPTPipe (tied and not) at pipeline 2 ("params": the layers
    split between the stages)."""
    out = []
    for build in (_llama, lambda: GPTPipe(GPTConfig(**GPT_CFG, tie_weights=False)), _tied_gpt_pipe):
        torch.manual_seed(0)
        with hetero.lazy_init():
            model = build()
        cfg = {"parallel": {"pipeline": 2, "pipeline_split": "params"}}
        engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
        out.append(engine.full_state_dict())
        engine.close()
    return out


def _tied_gpt_pipe() -> torch.nn.Module:
    return GPTPipe(GPTConfig(**GPT_CFG, tie_weights=True))


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(180)
def test_lazy_models_at_pipeline_2_are_the_normally_built_ones() -> None:
    wants = []
    for build in (_llama, lambda: GPTPipe(GPTConfig(**GPT_CFG, tie_weights=False)), _tied_gpt_pipe):
        torch.manual_seed(0)
        wants.append(build().state_dict())
    gots = run_distributed(_lazy_pipeline, 2, timeout=150)[0]
    for got, want in zip(gots, wants):
        assert _differing(got, want) == []
