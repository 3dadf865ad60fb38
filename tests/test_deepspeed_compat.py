"""Coming from DeepSpeed: a ds_config.json in DeepSpeed's documented ZeRO-Infinity form translates and trains (to
plain PyTorch's losses and weights, checked like every parity run against a float64 reference: tests/tolerance.py);
config errors name the DeepSpeed equivalent; consolidate --hf writes Hugging Face's shards."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hetero
from hetero.errors import ConfigError
from tests import parity

ROOT = Path(__file__).resolve().parent.parent


def _ds_config(nvme: str) -> dict:
    """ZeRO-3 with parameters and optimizer states on NVMe, as DeepSpeed's ZeRO-Infinity documentation lays it out
    (with Hugging Face's "auto" values, which the Trainer integration fills)."""
    return {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 4},
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_size": 1e8},
            "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }


def test_docs_config_translates_and_trains(tmp_path, caplog):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_ds_config(str(tmp_path))))
    with caplog.at_level(logging.WARNING, logger="hetero.config"):
        config = hetero.Config.from_deepspeed(path)
    assert config.zero_stage == 3 and config.precision == "fp32"  # fp16 "auto": left to hetero's default
    assert (config.offload.params, config.offload.optimizer) == ("nvme", "nvme")
    assert config.offload.params_host_bytes == 4 * 10**9  # DeepSpeed's max_in_cpu default, 1e9 fp32 elements
    assert config.memory.nvme_dir == str(tmp_path)
    assert config.grad_accumulation_steps == 2 and config.grad_clip_norm == 1.0
    for named in ("optimizer", "scheduler", "train_micro_batch_size_per_gpu", "overlap_comm", "aio"):
        assert named in caplog.text  # what was not translated is named, with what to do instead
    out = parity.run_hetero(0, 1, steps=3, rows=4, config=config.to_dict())
    parity.check(out, steps=3, rows=4, accum=2, clip=1.0)  # against float64, with fp32's own error as the scale
    assert out["stats"]["moved"].get("host->nvme", 0) > 0


# DeepSpeed's getting-started page (deepspeed.ai/getting-started, "DeepSpeed Configuration"): its sample
# ds_config.json, with ZeRO in the older boolean form (true: stage 1).
GETTING_STARTED = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "fp16": {"enabled": True},
    "zero_optimization": True,
}


def test_getting_started_config_translates_and_trains(tmp_path, caplog):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(GETTING_STARTED))
    with caplog.at_level(logging.WARNING, logger="hetero.config"):
        config = hetero.Config.from_deepspeed(path)
    assert (config.zero_stage, config.precision, config.grad_accumulation_steps) == (1, "fp16", 1)
    assert "optimizer" in caplog.text and "train_batch_size" in caplog.text
    assert hetero.Config.from_deepspeed({"zero_optimization": False}).zero_stage == 0
    out = parity.run_hetero(0, 1, steps=4, rows=4, config=config.to_dict())
    assert out["skipped"] == 0
    parity.check(out, "fp16", steps=4, rows=4)  # fp16 against float64, fp16's own error as the scale


def test_translation_details():
    cfg = hetero.Config.from_deepspeed(
        {
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "tensorboard": {"enabled": True, "output_path": "runs", "job_name": "x"},
        }
    )
    assert cfg.precision == "bf16" and cfg.zero_stage == 2 and cfg.offload.optimizer == "host"
    assert cfg.log.tensorboard == "runs/x"
    with pytest.raises(ConfigError, match="not translated: optimizer"):
        hetero.Config.from_deepspeed({"optimizer": {"type": "Adam"}}, strict=True)
    with pytest.raises(ConfigError, match="both fp16 and bf16"):
        hetero.Config.from_deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="nvme_path"):
        hetero.Config.from_deepspeed({"zero_optimization": {"offload_param": {"device": "nvme"}}})


def test_config_errors_point_to_the_hetero_equivalent():
    with pytest.raises(ConfigError, match="DeepSpeed key: hetero's keys are zero_stage, offload and memory"):
        hetero.Config.from_dict({"zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigError, match="grad_clip_norm.*from_deepspeed"):
        hetero.Config.from_dict({"gradient_clipping": 1.0})
    with pytest.raises(ConfigError, match="'cpu' is DeepSpeed's name: hetero calls it 'host'"):
        hetero.Config.from_dict({"offload": {"optimizer": "cpu"}})
    with pytest.raises(ConfigError, match="nvme_dir"):
        hetero.Config.from_dict({"memory": {"nvme_path": "/x"}})


def test_consolidate_hf_writes_shards_with_an_index(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    )
    engine = hetero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero_stage": 3})
    x = torch.randint(0, 64, (2, 16))
    engine.backward(engine(x, labels=x).loss)
    engine.step()
    expected = engine.full_state_dict()
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    out = tmp_path / "export"
    cmd = [sys.executable, "-m", "hetero.checkpoint", "consolidate", str(tmp_path / "ckpt"), str(out), "--hf"]
    cmd += ["--dtype", "bf16", "--max-shard-size", "20KB"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 1 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in expected.values() if v.is_floating_point())
    assert all((out / s).stat().st_size <= 20_000 + 4096 for s in shards)  # each under the limit (plus header)
    back = transformers.GPT2LMHeadModel.from_pretrained(str(out), dtype=torch.bfloat16)
    for k, v in back.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, expected[k].to(torch.bfloat16)), k
