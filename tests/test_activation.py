"""Activation checkpointing and input offload: the same losses as without, and less activation memory held on the
compute device between forward and backward."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import hetero
from hetero.models.gpt import GPT, GPTConfig
from tests.parity import CHUNK, batches, check, make_optimizer, run_hetero

CONFIGS = {
    "ckpt-stage0": {"zero_stage": 0, "activation_checkpointing": True},
    "ckpt-stage3": {"zero_stage": 3, "activation_checkpointing": ["Block"], "offload": {"params": "host"}},
    "offload-stage3": {
        "zero_stage": 3,
        "activation_checkpointing": ["layers.*"],
        "activation_offload": True,
        "offload": {"params": "host", "optimizer": "host"},
        "memory": {"device_budget": 96 << 10},  # a few chunks: stage 3 gathers and drops during recomputation
    },
    "offload-stage1": {"zero_stage": 1, "activation_checkpointing": True, "activation_offload": True},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_losses_as_without(name):
    out = run_hetero(0, 1, steps=4, rows=4, config=CONFIGS[name])
    check(out, steps=4, rows=4)
    if CONFIGS[name].get("activation_offload"):
        assert out["stats"]["host"]["peak"] > 0  # the offloaded inputs went through the host ledger


def _tiny_llama(transformers, *, use_cache: bool):
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=use_cache,
    )


def test_hf_llama_decoder_layers():
    transformers = pytest.importorskip("transformers")
    cfg = _tiny_llama(transformers, use_cache=False)  # use_cache=True: tests/test_kv_cache.py
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 64, (2, 10), generator=g) for _ in range(3)]
    results = []
    for extra in ({}, {"activation_checkpointing": ["LlamaDecoderLayer"], "activation_offload": True}):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        engine = hetero.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero_stage": 3, "chunk_size": 8192, **extra}
        )
        losses = []
        for ids in data:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.close()
        results.append(losses)
    torch.testing.assert_close(torch.tensor(results[1]), torch.tensor(results[0]), rtol=1e-5, atol=1e-6)


def _held_activation_bytes(engine, x, y) -> int:
    """Bytes of activations held on the compute device at the end of forward (the peak, before backward frees
    anything): tensors autograd saved for backward outside checkpointed blocks, found with saved-tensor hooks, plus
    the blocks' inputs that are still alive (a checkpoint keeps them for its recomputation), found with weak
    references. Memory of chunks (parameters) is not activation memory and is left out."""
    chunk_ptrs = {c.payload.untyped_storage().data_ptr() for c in engine.manager.chunks if c.payload is not None}
    chunk_ptrs |= {c.kept.untyped_storage().data_ptr() for c in engine.manager.chunks if c.kept is not None}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in chunk_ptrs and t.device == engine.device.torch_device:
            saved[s.data_ptr()] = s.nbytes()
        return t

    inputs = []
    handles = [
        block.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
        for block in engine.module.layers
    ]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = engine(x, labels=y)
    gc.collect()
    alive = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (r() for r in inputs) if t is not None
    }
    held = sum({**saved, **alive}.values())
    for h in handles:
        h.remove()
    engine.backward(out.loss)
    engine.step()
    return held


def test_lower_activation_memory():
    cfg = GPTConfig(vocab_size=64, n_layer=4, n_head=2, n_embd=64, block_size=128, bias=False)
    x, y = batches(1, 8, seq=128)[0]
    held = {}
    for name, extra in {
        "none": {},
        "ckpt": {"activation_checkpointing": True},
        "ckpt+offload": {"activation_checkpointing": True, "activation_offload": True},
    }.items():
        torch.manual_seed(0)
        model = GPT(cfg)
        engine = hetero.initialize(model, make_optimizer(model), {"zero_stage": 3, "chunk_size": CHUNK, **extra})
        held[name] = _held_activation_bytes(engine, x, y)
        engine.close()
    print("activation bytes held at the end of forward:", held)
    # Checkpointing keeps one input per block instead of every intermediate; offload keeps none of them.
    assert held["ckpt"] < 0.5 * held["none"], held
    per_block_input = 8 * 128 * 64 * 4
    assert held["ckpt"] - held["ckpt+offload"] >= 3 * per_block_input, held


def test_config_errors():
    model = GPT(GPTConfig(vocab_size=16, n_layer=1, n_head=1, n_embd=8, block_size=8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(hetero.ConfigError, match="Blok.*class names in this model"):
        hetero.initialize(model, opt, {"activation_checkpointing": ["Blok"]})
    with pytest.raises(hetero.ConfigError, match="set activation_checkpointing too"):
        hetero.Config.from_dict({"activation_offload": True})
    with pytest.raises(hetero.ConfigError, match="activation_checkpointing"):
        hetero.Config.from_dict({"activation_checkpointing": "yes"})
