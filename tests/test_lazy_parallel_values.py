"""A model built under hetero.lazy_init() gets, under tensor parallelism, the values a normally built model gets from
the same seed, bit for bit ([Note: initialising a tensor-parallel shard] in hetero/zero/init_replay.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

import hetero
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
