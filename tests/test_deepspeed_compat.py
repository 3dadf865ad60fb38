"""Coming from DeepSpeed: a ds_config.json in DeepSpeed's documented ZeRO-Infinity form translates and trains (to
plain PyTorch's losses and weights, checked like every parity run against a float64 reference: tests/tolerance.py);
config errors name the DeepSpeed equivalent; consolidate --hf writes Hugging Face's shards."""

from __future__ import annotations

import dataclasses
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
        "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1},  # beside zero_optimization
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
    assert (config.memory.nvme_io_threads, config.memory.nvme_block_bytes) == (32, 262144)  # aio: the tier's own
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
    with pytest.raises(ConfigError, match="not translated:\n  optimizer"):
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
    assert caplog.text.count("under HeteroTrainer: set TrainingArguments' optim") == 2  # both, for Trainer users
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


# (zero_optimization.stage, the stage DeepSpeed 0.19.8 reads, None: refused). Its pydantic model reads "3", " 2 ",
# "3.0", 3.0 and true as stages, drops "auto" for its default 0, and refuses the rest; "3" was refused here.
STAGE_CASES = [(3, 3), ("3", 3), (" 2 ", 2), ("3.0", 3), ("+1", 1), (3.0, 3), (True, 1), (False, 0), ("auto", 0),
               (4, None), (-1, None), (3.5, None), ("three", None), ("3.", None), ("1e0", None),
               (None, None)]  # fmt: skip


def _deepspeeds_zero(section: dict):
    """DeepSpeed's own reading of a zero_optimization section (None: it refuses the section)."""
    zero = pytest.importorskip("deepspeed.runtime.zero.config")
    try:
        return zero.DeepSpeedZeroConfig(**section)
    except Exception:  # its ValidationError, or the AssertionError of a deprecated key beside its replacement
        return None


@pytest.mark.parametrize(("stage", "expected"), STAGE_CASES)
def test_zero_stage_read_as_deepspeed_reads_it(stage, expected):
    ds = {"zero_optimization": {"stage": stage}}
    if expected is None:
        with pytest.raises(ConfigError, match=r"zero_optimization.stage: expected .*DeepSpeed refuses"):
            hetero.Config.from_deepspeed(ds)
    else:
        assert hetero.Config.from_deepspeed(ds).zero_stage == expected
    theirs = _deepspeeds_zero({"stage": stage})
    assert (None if theirs is None else int(theirs.stage)) == expected


# (deprecated keys, (offload.optimizer, offload.params), None: refused) as DeepSpeed translates them: cpu_offload is
# offload_optimizer on the host, cpu_offload_param offload_param; beside the section they replace, refused.
DEPRECATED_CASES = [
    ({"stage": 2, "cpu_offload": True}, ("host", "device")),
    ({"stage": 2, "cpu_offload": "true"}, ("host", "device")),
    ({"stage": 2, "cpu_offload": False}, ("device", "device")),
    ({"stage": 3, "cpu_offload": 1, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True}, ("host", "host")),
    ({"stage": 3, "cpu_offload_param": True}, ("device", "host")),
    ({"stage": 2, "cpu_offload": "auto"}, ("device", "device")),
    ({"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}, None),
    ({"stage": 3, "cpu_offload_param": False, "offload_param": {"device": "cpu"}}, None),
    ({"stage": 2, "cpu_offload": "maybe"}, None),
    ({"stage": 3, "cpu_offload_params": True}, None),  # not DeepSpeed's name (cpu_offload_param)
]  # fmt: skip


@pytest.mark.parametrize(("section", "expected"), DEPRECATED_CASES)
def test_deprecated_cpu_offload_keys_translate_as_deepspeed_does(section, expected):
    # Before: cpu_offload was named with a hint and not translated (the optimizer stayed on the device), and
    # cpu_offload_param was "no hetero equivalent".
    if expected is None:
        with pytest.raises(ConfigError, match=r"DeepSpeed refuses"):
            hetero.Config.from_deepspeed({"zero_optimization": section})
    else:
        config = hetero.Config.from_deepspeed({"zero_optimization": section})
        assert (config.offload.optimizer, config.offload.params) == expected
    theirs = _deepspeeds_zero(section)
    if expected is None:
        assert theirs is None
    else:
        sections = (theirs.offload_optimizer, theirs.offload_param)
        assert tuple("host" if s is not None and s.device == "cpu" else "device" for s in sections) == expected


def test_a_misspelt_deprecated_key_names_deepspeeds():
    with pytest.raises(ConfigError, match=r"cpu_offload_params: not a DeepSpeed 0.19.8 key \(did you mean 'cpu_of"):
        hetero.Config.from_deepspeed({"zero_optimization": {"cpu_offload_params": True}})


def _nvme_params(tmp_path, **offload) -> dict:
    return {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), **offload}}


@pytest.mark.parametrize("precision", [{"bf16": {"enabled": "auto"}}, {"fp16": {"enabled": "auto"}}, {}])
def test_max_in_cpu_counts_elements_of_the_precision_the_parameters_get(precision, tmp_path):
    # DeepSpeed's max_in_cpu counts parameter elements. With the precision left to the Trainer ("auto", or no block),
    # the bytes were fixed at translation from fp32 (4 a element), so when HeteroTrainer then chose bf16 (2 a
    # element, as it replaces the precision: dataclasses.replace) twice the elements stayed on the host.
    config = hetero.Config.from_deepspeed({**precision, "zero_optimization": _nvme_params(tmp_path, max_in_cpu=1000)})
    assert config.precision == "fp32" and config.offload.params_host_bytes == 1000 * 4
    for name, itemsize in (("bf16", 2), ("fp16", 2), ("fp32", 4)):
        chosen = dataclasses.replace(config, precision=name)  # HeteroTrainer.engine_config's step
        assert chosen.offload.params_host_bytes == 1000 * itemsize, name
        assert hetero.Config.from_dict(chosen.to_dict()).offload.params_host_bytes == 1000 * itemsize
    given = hetero.Config.from_deepspeed({"bf16": {"enabled": True}, "zero_optimization": _nvme_params(tmp_path)})
    assert given.offload.params_host_bytes == 10**9 * 2  # DeepSpeed's default count, in bf16
    # "auto" is DeepSpeed's default too (was a ConfigError), whole floats and integer text are counts; 1.5 is not
    for value, elements in (("auto", 10**9), (1e6, 10**6), ("100", 100)):
        got = hetero.Config.from_deepspeed({"zero_optimization": _nvme_params(tmp_path, max_in_cpu=value)})
        assert got.offload.params_host_bytes == elements * 4, value
    with pytest.raises(ConfigError, match=r"max_in_cpu: expected a number of parameter .*, got 1.5; DeepSpeed refuses"):
        hetero.Config.from_deepspeed({"zero_optimization": _nvme_params(tmp_path, max_in_cpu=1.5)})


def test_zero_keys_are_deepspeeds_own():
    # The keys hetero accepts in zero_optimization and its offload sections are exactly DeepSpeed 0.19.8's (field
    # names and their stage3_ aliases): any other is refused as DeepSpeed refuses it, where hetero warned at most.
    zero = pytest.importorskip("deepspeed.runtime.zero.config")
    from hetero.config_deepspeed_zero import ZERO_KEYS

    fields = zero.DeepSpeedZeroConfig.model_fields
    assert set(fields) | {f.alias for f in fields.values() if f.alias} == ZERO_KEYS
    for key in ZERO_KEYS - {"stage", "offload_param", "offload_optimizer", "cpu_offload", "cpu_offload_param"}:
        with pytest.raises(ConfigError, match=rf"zero_optimization.{key}: \w"):  # named, with what to do instead
            hetero.Config.from_deepspeed({"zero_optimization": {key: 1}}, strict=True)
    with pytest.raises(ConfigError, match=r"overlap_com: not a DeepSpeed 0.19.8 key \(did you mean 'overlap_comm'"):
        hetero.Config.from_deepspeed({"zero_optimization": {"stage": 2, "overlap_com": True}})
    with pytest.raises(ConfigError, match=r"zero_optimization.aio: .*top-level DeepSpeed section"):
        hetero.Config.from_deepspeed({"zero_optimization": {"stage": 3, "aio": {"block_size": 1}}})
    assert _deepspeeds_zero({"stage": 3, "aio": {"block_size": 1}}) is None and _deepspeeds_zero({"x": 1}) is None


def test_offload_sections_keys_as_deepspeeds(tmp_path, caplog):
    offload = pytest.importorskip("deepspeed.runtime.zero.offload_config")
    from hetero.config_deepspeed_zero import translate_zero

    for section, model in (("offload_param", offload.DeepSpeedZeroOffloadParamConfig),
                           ("offload_optimizer", offload.DeepSpeedZeroOffloadOptimizerConfig)):  # fmt: skip
        for key in set(model.model_fields) - {"device", "nvme_path"}:  # each accepted; named where hetero differs
            notes: list[str] = []
            nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
            translate_zero({"stage": 3, section: {**nvme, key: model.model_fields[key].default}}, {}, notes)
            named = any(f"zero_optimization.{section}.{key}:" in n for n in notes)
            # At DeepSpeed's defaults hetero does otherwise only for its swap buffers and unpipelined NVMe states
            assert named == (key in ("buffer_count", "buffer_size", "pipeline_read", "pipeline_write")), (section, key)
        with pytest.raises(ConfigError, match=rf"{section}.bufer_count: not a DeepSpeed 0.19.8 key \(did you mean"):
            hetero.Config.from_deepspeed({"zero_optimization": {"stage": 3, section: {"bufer_count": 4}}})
    # Was dropped without a word: a partial offload keeps part of the states on the device under DeepSpeed.
    with pytest.raises(ConfigError, match=r"offload_optimizer.ratio: hetero offloads every optimizer state"):
        hetero.Config.from_deepspeed(
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, strict=True
        )
    auto = {"stage": 3, "offload_param": {"device": "auto"}}  # DeepSpeed's default device, "none"
    assert hetero.Config.from_deepspeed({"zero_optimization": auto}).offload.params == "device"
    with pytest.raises(ConfigError, match=r"offload_param.device: 'CPU' is not a DeepSpeed offload device"):
        hetero.Config.from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "CPU"}}})


def test_deepspeeds_adam_defaults_in_what_to_build(caplog):
    # DeepSpeed's Adam and AdamW (FusedAdam, DeepSpeedCPUAdam) decay by 0 unless told; torch's AdamW by 0.01, which
    # the suggested AdamW(lr=...) left in place. With torch_adam DeepSpeed builds torch's own, with torch's default.
    with caplog.at_level(logging.WARNING, logger="hetero.config"):
        hetero.Config.from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
        hetero.Config.from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
    assert "torch.optim.AdamW(model.parameters(), lr=0.001, weight_decay=0.0) and pass" in caplog.text
    assert "torch.optim.AdamW(model.parameters(), lr=0.001) and pass" in caplog.text
    with pytest.raises(ConfigError, match=r"bias_correction false has no torch equivalent"):
        hetero.Config.from_deepspeed({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, strict=True)
    with pytest.raises(ConfigError, match=r"optimizer.params.max_grad_norm: DeepSpeed refuses it too; .*gradient_clip"):
        hetero.Config.from_deepspeed({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}})


def test_offload_param_below_stage_3_is_named_not_refused(tmp_path):
    # DeepSpeed hands offload_param to stage 3's optimizer alone (runtime/engine.py) and trains without it below; the
    # translation gave offload.params, which hetero's own check refused naming zero_stage and offload.params.
    ds = {"zero_optimization": {"stage": 2, "cpu_offload_param": True, "offload_optimizer": {"device": "cpu"}}}
    config = hetero.Config.from_deepspeed(ds)
    assert (config.zero_stage, config.offload.params, config.offload.optimizer) == (2, "device", "host")
    with pytest.raises(ConfigError, match=r"offload_param: device 'cpu' not translated: DeepSpeed offloads param"):
        hetero.Config.from_deepspeed(ds, strict=True)
    nvme = {"stage": 1, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 10}}
    assert hetero.Config.from_deepspeed({"zero_optimization": nvme}).offload.params_host_bytes == 0


def test_max_in_cpu_under_hetero_trainer_follows_the_trainers_precision(tmp_path):
    # The path of the mistranslation: fp16/bf16 "auto" in the DeepSpeed config, bf16 from the TrainingArguments.
    transformers = pytest.importorskip("transformers")
    from hetero.integrations.transformers import HeteroTrainer

    ds = {"bf16": {"enabled": "auto"}, "zero_optimization": _nvme_params(tmp_path, max_in_cpu=1000)}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, report_to=[])
    trainer = HeteroTrainer(model=torch.nn.Linear(4, 4), args=args, hetero_config=hetero.Config.from_deepspeed(ds))
    config = trainer.engine_config()
    assert (config.precision, config.offload.params_host_bytes) == ("bf16", 1000 * 2)  # was 4000: fp32's size
