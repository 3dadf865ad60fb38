"""HeteroTrainer against the plain Trainer over the arguments users vary most: gradient accumulation 1 and 4, the
linear and cosine-with-warmup schedules, clipping, ZeRO stages 1-2 with the optimizer states on the host, and the
Trainer's weight-decay groups (no decay for biases and LayerNorm), which the engine takes as they are.

Tolerances: the logs as in test_trainer.py (the same fp32 operations but for the clipping norm's summation order,
an ulp or two per update: rtol 1e-5). The LayerNorm weights: each Adam update moves an element by at most about lr
(1e-2 here); an ulp-level change of its gradient changes that by ~1e-6 of itself, so ten updates leave them within
~1e-7 of the plain Trainer's (atol 1e-5), where a decayed no-decay group (weight_decay 0.5) moves a weight near 1 by
~lr x 0.5 per update, 5e-2 over ten. Other biases are left out: the attention's key bias gets a zero gradient (the
softmax ignores it) made of rounding noise, which Adam's normalisation blows up to lr-sized differences.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("accelerate")

from hetero.integrations.transformers import HeteroTrainer  # noqa: E402
from tests.test_trainer import Rows, _args, _close, _logs, _model  # noqa: E402

ATOL_LAYERNORM = 1e-5


def _groups(trainer, optimizer) -> list[tuple[float, list[str]]]:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return [(g["weight_decay"], sorted(names[id(p)] for p in g["params"])) for g in optimizer.param_groups]


@pytest.mark.parametrize(
    "stage, accumulation, schedule",
    [(1, 1, {"lr_scheduler_type": "linear", "warmup_steps": 0}), (2, 4, {"lr_scheduler_type": "cosine"})],
)
def test_schedules_accumulation_and_decay_groups(tmp_path, stage, accumulation, schedule):
    args = dict(max_steps=10, eval_strategy="no", gradient_accumulation_steps=accumulation, **schedule)
    args.update(learning_rate=1e-2, weight_decay=0.5, max_grad_norm=0.5)
    plain = transformers.Trainer(model=_model(), args=_args(tmp_path / "a", **args), train_dataset=Rows(48, 1))
    plain.train()
    config = {"zero_stage": stage, "chunk_size": 4096, "offload": {"optimizer": "host"}}
    het = HeteroTrainer(
        model=_model(), args=_args(tmp_path / "b", **args), train_dataset=Rows(48, 1), hetero_config=config
    )
    het.train()
    assert het.engine.global_steps == plain.state.global_step == 10
    _close(_logs(plain), _logs(het))
    groups = _groups(het, het.engine.optimizer)
    assert groups == _groups(plain, plain.optimizer) and [g[0] for g in groups] == [0.5, 0.0]
    assert any(".ln_1." in n for n in groups[1][1])  # LayerNorm in the group without decay
    weights = het.engine.full_state_dict()
    for name, p in plain.model.named_parameters():
        if ".ln_" in name:
            torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=ATOL_LAYERNORM, msg=name)
    het.engine.close()
