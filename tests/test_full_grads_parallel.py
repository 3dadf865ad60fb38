"""[Note: the whole model's gradients]: under the `"parallel"` section `engine.full_grads()` gives the whole model's
gradients, as `full_state_dict()` gives its values: plain PyTorch's parameter names (in its order), shapes and
gradients on the same batch, on every rank (rank0_only: on rank 0 alone). Tensor 2: Llama at ZeRO-2 with a frozen
split weight (no gradient, no key), Qwen3 under Megatron-SP (norms and per-head q/k norms, whose gradients the
tensor ranks sum) at ZeRO-1, GPT-2 (a vocabulary-parallel embedding tied to the head) at ZeRO-3. Pipeline 2: GPT-2
with the embedding tied across stages; `train_batch` runs its backwards and `step()` in one call, so the test reads
the gradients in its `on_grads` callback, where they are final (more layouts: tests/test_full_grads_pipeline.py).

Tolerance: plain float64's gradients, within a factor of plain fp32's distance from them (tests/tolerance.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hetero
from tests import tolerance
from tests.dist import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, ROWS = 64, 8, 4
FROZEN = "model.layers.0.mlp.up_proj.weight"
CASES: dict[str, tuple[str, dict]] = {
    "llama-tp2-z2-frozen": ("llama", {"zero_stage": 2, "parallel": {"tensor": 2}}),
    "qwen3-tp2-sp-z1": ("qwen3", {"zero_stage": 1, "parallel": {"tensor": 2, "sequence": True}}),
    "gpt2-tp2-z3": ("gpt2", {"zero_stage": 3, "parallel": {"tensor": 2}}),
    "gpt2-pp2-z1": (
        "gpt2",
        {"zero_stage": 1, "parallel": {"pipeline": 2, "microbatches": 2, "pipeline_split": ["transformer.h.1"]}},
    ),
}


def _build(family: str, frozen: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )
        return transformers.GPT2LMHeadModel(cfg)
    shape = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=16,
    )  # fmt: skip
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape))
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    if frozen:
        model.get_parameter(FROZEN).requires_grad_(False)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    return x, x.clone()


def _plain(family: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = _build(family, frozen=True).to(dtype)
    x, y = _batch()
    model(x, labels=y).loss.backward()
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def _job(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {}
    for name, (family, config) in CASES.items():
        model = _build(family, frozen=True)
        engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"chunk_size": 4096, **config})
        x, y = _batch()
        read: dict[str, Any] = {}
        if engine.mesh.pp_size > 1:
            engine.train_batch(
                x, y, on_grads=lambda e, read=read: read.update(all=e.full_grads(), rank0=e.full_grads(rank0_only=True))
            )
        else:
            engine.backward(engine(x, labels=y).loss)
            read.update(all=engine.full_grads(), rank0=engine.full_grads(rank0_only=True))
            engine.step()
        engine.close()
        out[name] = read
    return out


@pytest.mark.timeout(200)
def test_full_grads_are_the_whole_models_under_tensor_and_pipeline_parallelism():
    results = run_distributed(_job, 2, timeout=180)
    for name, (family, _) in CASES.items():
        exact, plain = _plain(family, torch.float64), _plain(family, torch.float32)
        got = results[0][name]["all"]
        assert list(got) == list(exact), (name, list(got))  # the model's names, in its order; none frozen
        for k, e in exact.items():
            assert got[k].shape == e.shape and got[k].dtype == torch.float32, (name, k, got[k].shape, e.shape)
        tolerance.assert_weights(got, exact, plain, dtype=torch.float32)
        other = results[1][name]
        assert all(torch.equal(got[k], other["all"][k]) for k in got), name  # every rank holds the same
        assert all(torch.equal(got[k], results[0][name]["rank0"][k]) for k in got) and other["rank0"] == {}, name
