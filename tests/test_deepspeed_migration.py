"""Moving a DeepSpeed project over without silent changes: "auto" values nothing filled are named, a DeepSpeed JSON
that disagrees with the TrainingArguments is refused, deepspeed.initialize's calling style and checkpoint keywords
get messages of their own, disabled sections ask for nothing, and the untranslated keys are listed one a line."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import hetero
from hetero.errors import ConfigError

# Hugging Face's usual ZeRO-3 JSON: "auto" wherever its Trainer fills the value from TrainingArguments.
HF_ZERO3 = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_prefetch_bucket_size": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}
AUTO_WARNING = "outside a Trainer nothing fills them"


def _engine(config):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return model, hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


# ---- 1: "auto" values nothing filled -----------------------------------------------------------------------
def test_unfilled_auto_values_are_named_once_at_initialize(caplog):
    config = hetero.Config.from_deepspeed(HF_ZERO3)
    with caplog.at_level(logging.WARNING, logger="hetero.config"):
        _, engine = _engine(config)
        engine.close()
        _, engine = _engine(config)  # the same config again: said once
        engine.close()
    said = [r.getMessage() for r in caplog.records if AUTO_WARNING in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert 'gradient_clipping: "auto" became grad_clip_norm None' in said[0]
    assert "bf16.enabled: \"auto\" became precision 'fp32'" in said[0]
    assert 'gradient_accumulation_steps: "auto" became grad_accumulation_steps 1' in said[0]


def test_a_config_the_trainer_filled_is_not_warned_about(caplog):
    # HeteroTrainer builds its engine from dataclasses.replace(config, ...) with the TrainingArguments' values.
    filled = dataclasses.replace(hetero.Config.from_deepspeed(HF_ZERO3), precision="fp32", grad_clip_norm=1.0)
    with caplog.at_level(logging.WARNING, logger="hetero.config"):
        _engine(filled)[1].close()
        _engine(hetero.Config.from_deepspeed({"gradient_clipping": 1.0, "bf16": {"enabled": False}}))[1].close()
    assert AUTO_WARNING not in caplog.text


# ---- 2: HeteroTrainer refuses a JSON that disagrees with TrainingArguments --------------------------------------
def _trainer(tmp_path, ds, **kw):
    pytest.importorskip("transformers", minversion="5.0")
    pytest.importorskip("accelerate")
    from hetero.integrations.transformers import HeteroTrainer
    from tests.test_trainer import Rows, _args, _model

    args = _args(tmp_path, eval_strategy="no", **kw)
    return HeteroTrainer(model=_model(), args=args, train_dataset=Rows(8, 1), hetero_config=ds)


@pytest.mark.parametrize(
    ("ds", "kw", "named"),
    [
        ({"train_micro_batch_size_per_gpu": 4}, {"per_device_train_batch_size": 2}, "train_micro_batch_size_per_gpu"),
        ({"bf16": {"enabled": True}}, {"bf16": False}, "bf16.enabled"),
        ({"gradient_accumulation_steps": 1}, {"gradient_accumulation_steps": 2}, "gradient_accumulation_steps"),
        ({"gradient_clipping": 0.5}, {"max_grad_norm": 1.0}, "gradient_clipping"),
    ],
)
def test_trainer_refuses_a_json_that_disagrees(tmp_path, ds, kw, named):
    trainer = _trainer(tmp_path, hetero.Config.from_deepspeed(ds), **kw)
    said = f'{named} is .* in the DeepSpeed config(.|\n)*to "auto" in the DeepSpeed JSON'
    with pytest.raises(ConfigError, match=said):
        trainer.engine_config()


def test_trainer_fills_auto_and_takes_agreeing_values(tmp_path, caplog):
    ds = {**HF_ZERO3, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5}
    trainer = _trainer(tmp_path, hetero.Config.from_deepspeed(ds), per_device_train_batch_size=2, max_grad_norm=0.5)
    used = trainer.engine_config()
    assert (used.grad_accumulation_steps, used.grad_clip_norm, used.precision) == (3, 0.5, "fp32")


# ---- 3: deepspeed.initialize's calling style ------------------------------------------------------------------
def test_deepspeed_calling_style_is_named():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(TypeError, match="model_parameters: build the optimizer on them(.|\n)*torch.optim.AdamW"):
        hetero.initialize(model=model, model_parameters=model.parameters(), config={})
    with pytest.raises(TypeError, match="the optimizer is a generator, not a torch optimizer"):
        hetero.initialize(model, model.parameters(), {})
    with pytest.raises(TypeError, match="the optimizer is a list, not a torch optimizer"):
        hetero.initialize(model, [{"params": list(model.parameters())}], {})
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    with pytest.raises(TypeError, match="returns the engine alone"):
        engine, _opt, _, _ = engine
    engine.close()


# ---- 4: disabled sections ----------------------------------------------------------------------------------
def test_disabled_sections_ask_for_nothing(caplog):
    ds = {
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 1.0,
        "amp": {"enabled": False},
        "elasticity": {"enabled": False},
        "flops_profiler": {"enabled": False},
        "sparse_gradients": False,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": False,
    }
    with caplog.at_level(logging.WARNING, logger="hetero.config"):
        assert hetero.Config.from_deepspeed(ds, strict=True).zero_stage == 2
    assert "not translated" not in caplog.text
    with pytest.raises(ConfigError, match="amp: use precision"):  # switched on, it still asks for something
        hetero.Config.from_deepspeed({**ds, "amp": {"enabled": True}}, strict=True)


# ---- 5: DeepSpeed's checkpoint keywords at their defaults, save_16bit_model, local_rank --------------------------
def test_checkpoint_keywords_at_deepspeed_defaults(tmp_path, monkeypatch):
    model, engine = _engine({})
    engine.save_checkpoint(tmp_path, tag="t", save_latest=True, exclude_frozen_parameters=False)
    engine.load_checkpoint(
        tmp_path, "t", load_optimizer_states=True, load_lr_scheduler_states=True, load_module_strict=True
    )
    with pytest.raises(TypeError, match="load_optimizer_states=False .* is not available"):
        engine.load_checkpoint(tmp_path, "t", load_optimizer_states=False)
    assert engine.save_16bit_model(tmp_path / "out") is True
    saved = torch.load(tmp_path / "out" / "pytorch_model.bin")
    assert saved.keys() == model.state_dict().keys()
    for name, value in engine.full_state_dict().items():
        assert torch.equal(saved[name], value)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert engine.local_rank == 3
    engine.close()


# ---- 6: the untranslated keys, one a line ---------------------------------------------------------------------
def test_untranslated_keys_one_a_line(caplog):
    ds = {"gradient_clipping": 1.0, "steps_per_print": 10, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with caplog.at_level(logging.WARNING, logger="hetero.config"):
        hetero.Config.from_deepspeed(ds)
    said = [r.getMessage() for r in caplog.records if "not translated" in r.getMessage()]
    lines = said[0].splitlines()
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["steps_per_print", "optimizer"]


# ---- 7: pipeline schedule names ------------------------------------------------------------------------------
def test_schedule_names_case_insensitively():
    assert hetero.Config.from_dict({"parallel": {"schedule": "1F1B"}}).parallel.schedule == "1f1b"
    with pytest.raises(ConfigError, match=r"is not a schedule \(did you mean '1f1b'\?\)\. Choose one of"):
        hetero.Config.from_dict({"parallel": {"schedule": "1F1C"}})
