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
from hetero.config import LossScaleConfig
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
    # ... its loss-scale settings translated all the same, for when TrainingArguments choose fp16
    assert config.loss_scale == LossScaleConfig(growth_interval=1000, hysteresis=2, deepspeed_window=True)
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
    assert config.grad_clip_norm == 1.0  # no gradient_clipping: DeepSpeed's default since 0.19.3 (none before)
    assert (config.loss_scale.hysteresis, config.loss_scale.growth_interval) == (2, 1000)  # DeepSpeed's defaults
    assert "optimizer" in caplog.text and "train_batch_size" in caplog.text
    assert hetero.Config.from_deepspeed({"zero_optimization": False}).zero_stage == 0
    out = parity.run_hetero(0, 1, steps=4, rows=4, config=config.to_dict())
    assert out["skipped"] == 0
    parity.check(out, "fp16", steps=4, rows=4, clip=1.0)  # fp16 against float64, fp16's own error as the scale


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


# DeepSpeed's batch-size rules (deepspeed/runtime/config.py, _set_batch_related_parameters and _batch_assertion):
# (train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps) -> the accumulation, or refused.
BATCH_CASES = [
    ((16, 4, None), 4),  # derived: 16 / 4 / world 1
    ((16, 4, 2), None),  # 16 != 4 * 2 * 1: refused
    ((18, 4, None), None),  # 18 / 4 -> 4, and 18 != 4 * 4: refused
    ((16, None, 2), 2),
    ((None, 4, 3), 3),
    ((16, None, None), 1),
    (("auto", "auto", "auto"), 1),  # Hugging Face's: the Trainer fills them
]


def _batch_config(sizes: tuple) -> dict:
    return {k: v for k, v in zip(("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
                                 sizes) if v is not None}  # fmt: skip


@pytest.mark.parametrize(("sizes", "accumulation"), BATCH_CASES)
def test_batch_sizes_give_deepspeeds_accumulation_or_its_refusal(sizes, accumulation, monkeypatch):
    # Before, train_batch_size 16 with micro-batches of 4 trained with an accumulation of 1 (DeepSpeed's: 4), and sizes
    # DeepSpeed refuses were taken without a word.
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if accumulation is None:
        with pytest.raises(ConfigError, match=r"train_batch_size \d+ is not .*DeepSpeed refuses this config too"):
            hetero.Config.from_deepspeed(_batch_config(sizes))
    else:
        assert hetero.Config.from_deepspeed(_batch_config(sizes)).grad_accumulation_steps == accumulation


def test_batch_sizes_count_the_launchers_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: DeepSpeed divides by the data-parallel world
    assert hetero.Config.from_deepspeed(_batch_config((16, 4, None))).grad_accumulation_steps == 2
    with pytest.raises(ConfigError, match=r"\(4 x 4 x 2, the world"):
        hetero.Config.from_deepspeed(_batch_config((16, 4, 4)))


def test_batch_cases_are_deepspeeds_own():
    # The table above, against DeepSpeed's config class itself (world size 1 without a process group).
    config = pytest.importorskip("deepspeed.runtime.config")
    for sizes, accumulation in BATCH_CASES:
        if "auto" in sizes:
            continue
        try:
            got = config.DeepSpeedConfig(_batch_config(sizes)).gradient_accumulation_steps
        except AssertionError:
            got = None
        assert got == accumulation, sizes


def test_fp16_loss_scale_settings_translate_exactly(caplog):
    # Before, the settings were only named (hetero's scale had none); now they are the loss_scale section, with
    # DeepSpeed's defaults where the config gives none (tests/test_loss_scale.py runs both scalers side by side).
    deepspeeds = LossScaleConfig(growth_interval=1000, hysteresis=2, deepspeed_window=True)
    with caplog.at_level(logging.WARNING, logger="hetero.config"):
        assert hetero.Config.from_deepspeed({"fp16": {"enabled": True}}, strict=True).loss_scale == deepspeeds
    assert "fp16" not in caplog.text
    given = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 4,
             "consecutive_hysteresis": True, "min_loss_scale": 8}  # fmt: skip
    cfg = hetero.Config.from_deepspeed({"fp16": given}, strict=True)
    assert cfg.precision == "fp16" and cfg.loss_scale == LossScaleConfig(
        initial_scale=4096, growth_interval=500, hysteresis=4, consecutive_hysteresis=True, min_scale=8,
        deepspeed_window=True,
    )  # fmt: skip
    static = hetero.Config.from_deepspeed({"fp16": {**given, "loss_scale": 128}}, strict=True)
    assert static.loss_scale == LossScaleConfig(static=128)  # DeepSpeed reads no dynamic setting then
    auto = {"enabled": True, "loss_scale_window": "auto", "hysteresis": "auto"}
    assert hetero.Config.from_deepspeed({"fp16": auto}, strict=True).loss_scale == deepspeeds
    off = hetero.Config.from_deepspeed({"fp16": {"enabled": False, "hysteresis": 4}}, strict=True)
    assert off.precision == "fp32" and off.loss_scale == LossScaleConfig()
    # What still has no equivalent is named, fp16's own text; bf16's keys keep theirs.
    with pytest.raises(ConfigError, match=r"fp16.auto_cast: hetero computes in fp16 throughout"):
        hetero.Config.from_deepspeed({"fp16": {"enabled": True, "auto_cast": True}}, strict=True)
    with pytest.raises(ConfigError, match=r"fp16.fp16_master_weights_and_grads: hetero keeps fp32 master weights"):
        hetero.Config.from_deepspeed({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, strict=True)
    with pytest.raises(ConfigError, match=r"bf16.immediate_grad_update: no hetero equivalent"):
        hetero.Config.from_deepspeed({"bf16": {"enabled": True, "immediate_grad_update": True}}, strict=True)
    # Values DeepSpeed refuses are refused, named in DeepSpeed's terms where the translation reads them.
    with pytest.raises(ConfigError, match=r"fp16.loss_scale: expected a number >= 0"):
        hetero.Config.from_deepspeed({"fp16": {"enabled": True, "loss_scale": -1}})
    with pytest.raises(ConfigError, match=r"fp16.initial_scale_power: expected an integer"):
        hetero.Config.from_deepspeed({"fp16": {"enabled": True, "initial_scale_power": 1.5}})
    with pytest.raises(ConfigError, match=r"loss_scale.growth_interval: expected an integer >= 1"):
        hetero.Config.from_deepspeed({"fp16": {"enabled": True, "loss_scale_window": 0}})


def test_optimizer_and_scheduler_sections_name_what_to_build(caplog):
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false (ADAM_W_MODE_DEFAULT); the note said only "e.g.
    # torch.optim.AdamW(lr=...)", and pointed WarmupLR users at transformers' schedules, whose warmup is linear where
    # DeepSpeed's default is log.
    ds = {
        "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 10}},
    }
    with caplog.at_level(logging.WARNING, logger="hetero.config"):
        hetero.Config.from_deepspeed(ds)
    assert "torch.optim.AdamW(model.parameters(), lr=0.0003, weight_decay=0.01) (DeepSpeed's 'Adam'" in caplog.text
    assert "deepspeed.runtime.lr_schedules.WarmupDecayLR(optimizer, warmup_num_steps=10)" in caplog.text
    assert "fill total_num_steps" in caplog.text and "transformers" not in caplog.text
    plain = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}}}
    with pytest.raises(ConfigError, match=r"torch\.optim\.Adam\(model\.parameters\(\), lr=0\.001\) and pass"):
        hetero.Config.from_deepspeed(plain, strict=True)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 4}),
        (
            "WarmupDecayLR",
            {"total_num_steps": 8, "warmup_max_lr": 1e-3, "warmup_num_steps": 3, "warmup_type": "linear"},
        ),
        ("WarmupCosineLR", {"total_num_steps": 8, "warmup_num_steps": 3}),
    ],
)
def test_deepspeeds_schedulers_step_as_under_deepspeed(name, params, tmp_path):
    # What the scheduler note promises: DeepSpeed's classes given to initialize take each update's rate from the
    # schedule DeepSpeed's engine would (stepped once per accumulated update, not after an fp16 overflow).
    schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    model = parity.build()
    opt = parity.make_optimizer(model)
    sched = getattr(schedules, name)(opt, **params)
    twin = parity.make_optimizer(parity.build())
    ref = getattr(schedules, name)(twin, **params)  # stepped as DeepSpeed's engine steps it
    config = {"zero_stage": 2, "chunk_size": parity.CHUNK, "precision": "fp16", "grad_accumulation_steps": 2}
    engine = hetero.initialize(model, opt, config, lr_scheduler=sched)
    for update, (x, y) in enumerate(parity.batches(6, 2)):
        assert engine.get_lr() == [g["lr"] for g in twin.param_groups], update
        for _ in range(2):
            loss = engine(x, labels=y).loss
            engine.backward(loss * 1e6 if update == 2 else loss)  # update 2 overflows fp16 and is skipped
            engine.step()
        assert engine.was_step_applied() == (update != 2)
        if engine.was_step_applied():
            ref.step()
    saved = engine.save_checkpoint(tmp_path)
    sched.step()
    engine.load_checkpoint(saved)
    assert sched.state_dict() == ref.state_dict() == {"last_batch_iteration": 4}
    engine.close()


# (DeepSpeed's section, hetero's grad_clip_norm). Before: no gradient_clipping gave none where DeepSpeed (since
# 0.19.3) clips at 1.0, and a negative one, which DeepSpeed reads as no clipping, was a ConfigError.
CLIP_CASES = [({}, 1.0), ({"gradient_clipping": 0}, None), ({"gradient_clipping": 0.5}, 0.5),
              ({"gradient_clipping": -1.0}, None), ({"gradient_clipping": 2}, 2.0)]  # fmt: skip


def test_gradient_clipping_as_deepspeed_reads_it(caplog):
    config = pytest.importorskip("deepspeed.runtime.config")
    for section, clip in CLIP_CASES:
        with caplog.at_level(logging.WARNING, logger="hetero.config"):
            caplog.clear()
            assert hetero.Config.from_deepspeed(section).grad_clip_norm == clip, section
        assert ("gradient_clipping is not set" in caplog.text) == (section == {})  # the default is named
        theirs = config.DeepSpeedConfig({"train_batch_size": 1, **section}).gradient_clipping
        assert (clip or 0.0) == max(theirs, 0.0), section  # DeepSpeed clips only at a value > 0
    assert hetero.Config.from_deepspeed({"gradient_clipping": "auto"}).grad_clip_norm is None  # the Trainer's
    with pytest.raises(ConfigError, match=r"gradient_clipping: expected a number \(0: no clipping\) or \"auto\""):
        hetero.Config.from_deepspeed({"gradient_clipping": "max"})  # was float()'s ValueError


@pytest.mark.parametrize("flag", [True, False, "true", "false", "False", "yes", "off", 0, 1])
def test_enabled_reads_as_deepspeeds(flag):
    # "enabled": "false" is off under DeepSpeed (pydantic's booleans); here bool("false") turned fp16 on.
    config = pytest.importorskip("deepspeed.runtime.config")
    theirs = config.DeepSpeedConfig({"train_batch_size": 1, "fp16": {"enabled": flag}}).float16_config.enabled
    ours = hetero.Config.from_deepspeed({"fp16": {"enabled": flag}, "tensorboard": {"enabled": flag}})
    assert (ours.precision == "fp16") == theirs and (ours.log.tensorboard is not None) == theirs


def test_sections_deepspeed_refuses_are_named():
    # Each was skipped without a word (precision fp32, no log) where DeepSpeed stops.
    with pytest.raises(ConfigError, match=r"fp16: expected a section such as \{\"enabled\": true\}, got True"):
        hetero.Config.from_deepspeed({"fp16": True})
    with pytest.raises(ConfigError, match=r"bf16.enabled: expected true or false \(or \"auto\"\), got 'maybe'"):
        hetero.Config.from_deepspeed({"bf16": {"enabled": "maybe"}})
    with pytest.raises(ConfigError, match=r"tensorboard: expected a section"):
        hetero.Config.from_deepspeed({"tensorboard": "runs"})
    with pytest.raises(ConfigError, match=r"zero_optimization.offload_optimizer: expected a section such as"):
        hetero.Config.from_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}})
    none = {"stage": 3, "offload_optimizer": None, "offload_param": None}  # DeepSpeed's "no offload"
    assert hetero.Config.from_deepspeed({"zero_optimization": none}).offload.optimizer == "device"


def test_min_loss_scale_zero_halves_as_deepspeeds_scaler(monkeypatch):
    # "min_loss_scale": 0.0 (seen in configs in the wild): DeepSpeed halves without a floor; it was refused here with
    # an error naming loss_scale.min_scale, which the DeepSpeed config does not have.
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    from hetero.zero.precision import LossScaler

    monkeypatch.setattr(loss_scaler, "dist", type("Rank0", (), {"get_rank": staticmethod(lambda: 0)}))
    fp16 = {"enabled": True, "initial_scale_power": 2, "hysteresis": 1, "loss_scale_window": 3}
    for floor in (0.0, 0, -1):
        ours = LossScaler.configured(
            hetero.Config.from_deepspeed({"fp16": {**fp16, "min_loss_scale": floor}}).loss_scale
        )
        theirs = loss_scaler.DynamicLossScaler(4.0, 3, floor, 1, False, raise_error_at_min_scale=False)
        for i, overflow in enumerate([True] * 12 + [False] * 7 + [True] * 3):  # down to 2**-10, up, down again
            ours.update(overflow)
            theirs.update_scale(overflow)
            assert ours.scale == theirs.cur_scale, (floor, i)
        assert ours.scale < 1
