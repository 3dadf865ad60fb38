"""A DeepSpeed JSON given to HeteroTrainer through TrainingArguments(deepspeed=...): refused (DeepSpeed would train
the model) with where each part of the JSON goes instead; following that advice trains with the JSON's ZeRO stage
and offload and the TrainingArguments' accumulation, clipping and schedule, logging what the plain Trainer logs
(tolerance as in test_trainer.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("accelerate")

import hetero  # noqa: E402
from hetero.integrations.transformers import HeteroTrainer  # noqa: E402
from tests.test_trainer import Rows, _args, _close, _logs, _model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Hugging Face's usual DeepSpeed JSON: "auto" wherever the Trainer fills the value from its arguments.
DS = {
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}},
}

# In a process of its own: TrainingArguments(deepspeed=...) and the Trainer leave DeepSpeed in transformers' and
# accelerate's process-wide state, which would reach the tests after this one.
_REFUSED = """
import json, sys
from hetero.errors import ConfigError
from hetero.integrations.transformers import HeteroTrainer
from tests.test_trainer import Rows, _args, _model
try:
    args = _args(sys.argv[1], deepspeed=json.loads(sys.argv[2]), eval_strategy="no")
    HeteroTrainer(model=_model(), args=args, train_dataset=Rows(8, 1))
except ConfigError as e:
    print("REFUSED", e)
"""


@pytest.mark.timeout(180)
def test_deepspeed_argument_is_refused_saying_where_the_json_goes(tmp_path):
    pytest.importorskip("deepspeed")  # TrainingArguments(deepspeed=...) needs it installed
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", _REFUSED, str(tmp_path), json.dumps(DS)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert refused, proc.stdout + proc.stderr[-3000:]
    assert "hetero_config=hetero.Config.from_deepspeed(" in refused[0]
    assert "optim, learning_rate, weight_decay, lr_scheduler_type and warmup_steps" in refused[0]


def test_the_same_json_as_hetero_config(tmp_path):
    args = {"max_steps": 4, "eval_strategy": "no", "gradient_accumulation_steps": 2}
    plain = transformers.Trainer(model=_model(), args=_args(tmp_path / "a", **args), train_dataset=Rows(26, 1))
    plain.train()
    config = hetero.Config.from_deepspeed(DS)
    het = HeteroTrainer(
        model=_model(), args=_args(tmp_path / "b", **args), train_dataset=Rows(26, 1), hetero_config=config
    )
    het.train()
    used = het.engine.config
    assert (used.zero_stage, used.offload.optimizer) == (3, "host")  # the JSON's
    assert (used.grad_accumulation_steps, used.grad_clip_norm) == (2, 1.0)  # the TrainingArguments'
    _close(_logs(plain), _logs(het))
    het.engine.close()
