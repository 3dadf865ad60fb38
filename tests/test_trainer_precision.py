"""HeteroTrainer and the TrainingArguments that cast the model for evaluation (bf16_full_eval, fp16_full_eval).

The Trainer casts the wrapped model to that dtype before an evaluation outside train() (the evaluate() after
training, predict()). hetero computes in one precision, the one it trains in: in that precision the cast changes
nothing and evaluation runs as the flag asks; in another, hetero's guard refused the cast with an error about
`.to()` the user never called, and only at that last evaluate(), after the whole run had trained. It is refused
before the first update now, naming the arguments to change.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("accelerate")

from hetero.errors import ConfigError  # noqa: E402
from hetero.integrations.transformers import HeteroTrainer  # noqa: E402
from tests.test_trainer import Rows, _args, _model  # noqa: E402


def _trainer(out, **kw) -> HeteroTrainer:
    args = _args(out, max_steps=2, eval_strategy="no", gradient_accumulation_steps=1, **kw)
    config = {"zero_stage": 3, "chunk_size": 4096}
    return HeteroTrainer(
        model=_model(), args=args, train_dataset=Rows(8, 1), eval_dataset=Rows(8, 2), hetero_config=config
    )


@pytest.mark.parametrize(
    "flags, wanted, trained",
    [({"bf16_full_eval": True}, "bf16", "fp32"), ({"fp16_full_eval": True, "bf16": True}, "fp16", "bf16")],
)
def test_full_eval_in_another_precision_is_refused_before_training(tmp_path, flags, wanted, trained):
    trainer = _trainer(tmp_path, **flags)
    with pytest.raises(ConfigError, match=rf"{wanted}_full_eval .*\({trained} here\): set {wanted}=True"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_full_eval_in_the_training_precision(tmp_path):
    """bf16=True with bf16_full_eval: the engine already computes in bf16, so the Trainer's cast changes nothing and
    evaluate() gives exactly what it gives without the flag (the same bf16 weights, the same kernels)."""
    trainer = _trainer(tmp_path, bf16=True, bf16_full_eval=True)
    trainer.train()
    cast = trainer.evaluate()["eval_loss"]
    trainer.args.bf16_full_eval = False
    assert trainer.evaluate()["eval_loss"] == cast
    trainer.engine.close()
