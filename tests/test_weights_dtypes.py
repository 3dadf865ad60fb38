"""weights= with tensors of other dtypes than the model's: floating ones are cast as from_pretrained casts them
(exactly: a bf16 value is an fp32 value), integer, boolean and 8-bit float ones in place of floating weights
(quantized checkpoints) are errors that name each tensor, before anything is read."""

from __future__ import annotations

import pytest
import torch

import hetero

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {k: v.contiguous() for k, v in _llama().state_dict().items()}


def _load(path) -> dict[str, torch.Tensor]:
    with hetero.lazy_init():
        model = _llama()
    config = {"zero_stage": 3, "chunk_size": 4096, "progress": False}
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config, weights=path)
    got = engine.full_state_dict()
    engine.close()
    return got


def test_floating_weights_of_another_precision_are_cast(tmp_path):
    state = {k: v.to(torch.bfloat16) for k, v in _state().items()}
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    got = _load(tmp_path)
    for k, v in state.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v.float()), k


@pytest.mark.parametrize("suffix", ["safetensors", "bin"])
def test_integer_boolean_and_float8_tensors_for_floating_weights_are_named(tmp_path, suffix):
    state = _state()
    state["lm_head.weight"] = torch.ones(64, 32, dtype=torch.int8)  # a quantized weight's codes
    state["model.norm.weight"] = torch.ones(32, dtype=torch.bool)
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    if suffix == "bin":
        torch.save(state, tmp_path / "pytorch_model.bin")
    else:
        safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(hetero.WeightsError) as err:
        _load(tmp_path)
    msg = str(err.value)
    assert "3 in dtypes the model cannot take" in msg and "dequantize" in msg
    for name, dtype in [
        ("lm_head.weight", "torch.int8"),
        ("model.norm.weight", "torch.bool"),
        ("model.layers.0.mlp.up_proj.weight", "torch.float8_e4m3fn"),
    ]:
        assert f"{name}: file {dtype}, model torch.float32" in msg
