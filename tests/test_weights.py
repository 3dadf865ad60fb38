"""weights= as users have them: .bin and .safetensors files, directories, sharded indexes, base-model weights into
a model with a head and back (as from_pretrained maps them), unexpected keys as warnings (or errors), and errors
that name the real cause when names do not match. Loaded values are compared exactly: they are copied, not
computed."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import hetero
from hetero.errors import WeightsError

transformers = pytest.importorskip("transformers")

CFG = dict(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)


def _head(meta: bool = True) -> torch.nn.Module:
    cfg = transformers.GPT2Config(**CFG)
    if meta:
        with torch.device("meta"):
            return transformers.GPT2LMHeadModel(cfg)
    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(cfg)


def _base(meta: bool = True) -> torch.nn.Module:
    cfg = transformers.GPT2Config(**CFG)
    if meta:
        with torch.device("meta"):
            return transformers.GPT2Model(cfg)
    torch.manual_seed(2)
    return transformers.GPT2Model(cfg)


def _load(model: torch.nn.Module, path, **kw) -> dict[str, torch.Tensor]:
    engine = hetero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": 3, "chunk_size": 4096}, weights=path, **kw
    )
    state = engine.full_state_dict()
    engine.close()
    return state


def _plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state_dict as torch.save writes it: tied tensors once (GPT-2's lm_head is the embedding)."""
    return {k: v.detach().clone().contiguous() for k, v in state.items() if k != "lm_head.weight"}


def test_bin_file_directory_and_sharded_index(tmp_path):
    src = _base(meta=False)
    state = _plain(src.state_dict())
    torch.save(state, tmp_path / "pytorch_model.bin")
    for path in (tmp_path / "pytorch_model.bin", tmp_path):
        got = _load(_base(), path)
        for k, v in src.state_dict().items():
            assert torch.equal(got[k], v), k
    # Hugging Face's sharded .bin layout.
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    keys = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
    for name, ks in shards.items():
        torch.save({k: state[k] for k in ks}, shard_dir / name)
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (shard_dir / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    got = _load(_base(), shard_dir)
    for k, v in src.state_dict().items():
        assert torch.equal(got[k], v), k


def test_bin_is_loaded_without_unpickling_code(tmp_path):
    torch.save({"h.0.attn.c_attn.weight": torch.zeros(1), "evil": object()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(WeightsError, match="weights_only"):
        _load(_base(), tmp_path / "pytorch_model.bin")


def test_base_weights_into_head_model_and_back(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    base = _base(meta=False)
    safetensors_torch.save_file(_plain(base.state_dict()), str(tmp_path / "base.safetensors"))
    got = _load(_head(), tmp_path / "base.safetensors")  # keys gain "transformer."; lm_head is tied to wte
    for k, v in base.state_dict().items():
        assert torch.equal(got[f"transformer.{k}"], v), k
    assert torch.equal(got["lm_head.weight"], base.state_dict()["wte.weight"])

    head = _head(meta=False)
    torch.save(_plain(head.state_dict()), tmp_path / "head.bin")
    got = _load(_base(), tmp_path / "head.bin")  # "transformer." is removed
    for k, v in got.items():
        assert torch.equal(v, head.state_dict()[f"transformer.{k}"]), k


def test_unexpected_keys_warn_or_fail(tmp_path, caplog):
    state = _plain(_base(meta=False).state_dict())
    state["pooler.dense.weight"] = torch.zeros(3, 3)
    torch.save(state, tmp_path / "w.bin")
    with caplog.at_level(logging.WARNING, logger="hetero.zero"):
        got = _load(_base(), tmp_path / "w.bin")
    assert "pooler.dense.weight" in caplog.text and "strict_weights" in caplog.text
    assert torch.equal(got["wte.weight"], state["wte.weight"])
    with pytest.raises(WeightsError, match="pooler.dense.weight"):
        _load(_base(), tmp_path / "w.bin", strict_weights=True)


def test_missing_tensors_keep_a_built_models_values_and_fail_a_meta_one(tmp_path, caplog):
    state = _plain(_base(meta=False).state_dict())
    del state["ln_f.weight"]
    torch.save(state, tmp_path / "w.bin")
    built = _base(meta=False)
    own = built.ln_f.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="hetero.zero"):
        got = _load(built, tmp_path / "w.bin")
    assert torch.equal(got["ln_f.weight"], own) and "ln_f.weight" in caplog.text
    with pytest.raises(WeightsError, match="ln_f.weight"):
        _load(_base(), tmp_path / "w.bin")


def test_errors_name_the_cause(tmp_path):
    state = _plain(_base(meta=False).state_dict())
    # Saved from a DDP wrapper: every key carries "module.".
    torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "ddp.bin")
    with pytest.raises(WeightsError, match="prefix 'module.'"):
        _load(_base(), tmp_path / "ddp.bin")
    # Another architecture: nothing matches.
    llama = transformers.LlamaModel(
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
    )
    torch.save(_plain(llama.state_dict()), tmp_path / "llama.bin")
    with pytest.raises(WeightsError, match="another architecture"):
        _load(_base(), tmp_path / "llama.bin")
    # Same names, other shapes: another config (not a naming problem).
    other = transformers.GPT2Model(transformers.GPT2Config(**{**CFG, "n_embd": 16}))
    torch.save(_plain(other.state_dict()), tmp_path / "small.bin")
    with pytest.raises(WeightsError, match="another config"):
        _load(_base(), tmp_path / "small.bin")


def test_a_damaged_file_is_named(tmp_path):
    """A shard cut short (an interrupted download) stops the load with its own name, among many."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = _plain(_base(meta=False).state_dict())
    keys = sorted(state)
    names = [f"model-0000{i + 1}-of-00003.safetensors" for i in range(3)]
    for i, name in enumerate(names):
        safetensors_torch.save_file({k: state[k] for k in keys[i::3]}, str(tmp_path / name))
    index = {"metadata": {}, "weight_map": {k: names[keys.index(k) % 3] for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    damaged = tmp_path / names[1]
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    with pytest.raises(WeightsError, match=f"{names[1]}.*damaged or was not fully written"):
        _load(_base(), tmp_path)
    torch.save(state, tmp_path / "w.bin")
    (tmp_path / "w.bin").write_bytes((tmp_path / "w.bin").read_bytes()[:1000])
    with pytest.raises(WeightsError, match="w.bin.*damaged or was not fully written"):
        _load(_base(), tmp_path / "w.bin")


def test_a_trainer_output_directory_loads_its_weights(tmp_path):
    """transformers' Trainer saves pytorch_model.bin beside its own state: training_args.bin (a pickled object that
    weights_only refuses), optimizer.pt, rng_state.pth. from_pretrained reads the weights; so does weights=."""
    import argparse

    src = _base(meta=False)
    torch.save(_plain(src.state_dict()), tmp_path / "pytorch_model.bin")
    torch.save(argparse.Namespace(learning_rate=1e-4), tmp_path / "training_args.bin")
    torch.save({"state": {}, "param_groups": []}, tmp_path / "optimizer.pt")
    torch.save({"cpu_rng_state": torch.get_rng_state()}, tmp_path / "rng_state.pth")
    got = _load(_base(), tmp_path, strict_weights=True)
    for k, v in src.state_dict().items():
        assert torch.equal(got[k], v), k


def test_keys_from_pretrained_drops_are_no_surprise(tmp_path, caplog):
    """Older checkpoints hold buffers that are no longer saved: GPT-2's causal masks (`attn.bias`, which GPT-2 lists
    in `_keys_to_ignore_on_load_unexpected`) and each layer's rotary `inv_freq` (Llama). from_pretrained drops them
    silently; weights= drops them too, strict_weights included."""
    src = _base(meta=False)
    state = _plain(src.state_dict())
    for i in range(CFG["n_layer"]):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, CFG["n_positions"], CFG["n_positions"]))
    torch.save(state, tmp_path / "gpt2.bin")
    with caplog.at_level(logging.WARNING, logger="hetero.zero"):
        got = _load(_base(), tmp_path / "gpt2.bin", strict_weights=True)
    assert torch.equal(got["h.1.attn.c_attn.weight"], src.h[1].attn.c_attn.weight)

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(cfg)
    state = {k: v.contiguous() for k, v in llama.state_dict().items()}
    for i in range(cfg.num_hidden_layers):
        state[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = llama.model.rotary_emb.inv_freq.clone()
    torch.save(state, tmp_path / "llama.bin")
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(cfg)
    with caplog.at_level(logging.WARNING, logger="hetero.zero"):
        got = _load(meta, tmp_path / "llama.bin", strict_weights=True)
    assert torch.equal(got["model.norm.weight"], llama.model.norm.weight)
    assert "not have" not in caplog.text  # nothing warned as left out


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc/self/status")
def test_reading_safetensors_maps_no_file_pages(tmp_path):
    """Every page of a checkpoint read through a memory map stays resident until its file closes: a model larger than
    the host raised the RSS peak by the whole checkpoint, whatever the budgets ([Note: reading .safetensors without a
    memory map]). Read with positioned reads, the file adds nothing to the process's file-backed memory."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from hetero.zero.weights import WeightSource

    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(14)}
    state["b"] = torch.randn(1024, generator=g).to(torch.bfloat16)
    state["s"] = torch.tensor(3.5, dtype=torch.float16)  # a 0-d tensor
    path = tmp_path / "big.safetensors"  # 56 MiB
    safetensors_torch.save_file(state, str(path))
    with WeightSource([path]) as source:
        before = _rss_file()
        for k, v in state.items():
            assert torch.equal(source.read(k), v), k
        assert torch.equal(source.read_elements("w3", 5000, 9000), state["w3"].reshape(-1)[5000:9000])
        grew = _rss_file() - before
    # Mapped, the file's 56 MiB would be resident now; code paged in on first use is a few MiB at most.
    assert grew < 8 << 20, f"file-backed memory grew {grew >> 20} MiB reading the checkpoint"


def test_checkpoints_transformers_converts_on_load(tmp_path):
    """transformers 5 saves a Mixtral in its original layout (one tensor per expert, `block_sparse_moe`) and fuses
    the experts in from_pretrained ([Note: transformers' checkpoint conversions]): weights= loads the same values,
    and a range of a fused tensor (a rank's share) is read from the expert tensors it covers."""
    if not hasattr(transformers, "MixtralConfig"):
        pytest.skip("no Mixtral in this transformers")
    pytest.importorskip("transformers.conversion_mapping")
    from hetero.zero import weights

    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=3,
    )
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path)
    ref = transformers.MixtralForCausalLM.from_pretrained(tmp_path).state_dict()
    with hetero.lazy_init():
        model = transformers.MixtralForCausalLM(cfg)
    with weights.WeightSource(weights.weight_files(tmp_path)) as files:
        names = files.keys()
        assert "model.layers.1.block_sparse_moe.experts.2.w3.weight" in names  # saved the old way
    with weights.open_source(tmp_path, model) as source:
        fused = ref["model.layers.1.mlp.experts.gate_up_proj"].reshape(-1)
        a, b = 500, 3 * 512 + 7  # across w1 and w3 of expert 0 and into expert 1
        assert torch.equal(source.read_elements("model.layers.1.mlp.experts.gate_up_proj", a, b), fused[a:b])
    got = _load(model, tmp_path, strict_weights=True)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
