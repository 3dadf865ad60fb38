"""Resuming HeteroTrainer from a checkpoint without hetero's states (saved with save_only_model=True, or by the
plain Trainer): refused before the first update, saying what to do to start from its weights instead."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("accelerate")

from hetero.errors import ConfigError  # noqa: E402
from hetero.integrations.transformers import HeteroTrainer  # noqa: E402
from tests.test_trainer import Rows, _args, _model  # noqa: E402


def test_resume_from_a_checkpoint_without_hetero_states(tmp_path):
    args = {"max_steps": 2, "eval_strategy": "no", "save_strategy": "steps", "save_steps": 2, "save_only_model": True}
    config = {"zero_stage": 3, "chunk_size": 4096}
    first = HeteroTrainer(model=_model(), args=_args(tmp_path, **args), train_dataset=Rows(16, 1), hetero_config=config)
    first.train()
    first.engine.close()
    again = HeteroTrainer(model=_model(), args=_args(tmp_path, **args), train_dataset=Rows(16, 1), hetero_config=config)
    with pytest.raises(ConfigError, match=r"save_only_model=True.*from_pretrained\(checkpoint\) and train without"):
        again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert again.engine.global_steps == 0  # refused before any update
