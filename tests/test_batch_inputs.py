"""`train_batch` and `eval_batch` without a pipeline on a tokenizer's batch: a mapping of `input_ids` and
`attention_mask` (a plain dict or transformers' BatchEncoding), as a loop writes `model(**batch)`."""

from __future__ import annotations

import pytest
import torch

import hetero
from tests import tolerance

transformers = pytest.importorskip("transformers")

ROWS, SEQ, STEPS = 4, 8, 3


def _model() -> torch.nn.Module:
    from tests.test_unmodified_models import TINY_DECODER

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_DECODER))


def _batches() -> list[dict[str, torch.Tensor]]:
    """Left-padded batches: the mask matters."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (ROWS, SEQ), generator=g)
        mask = torch.ones(ROWS, SEQ, dtype=torch.long)
        mask[0, :3] = 0
        mask[2, :1] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _plain(dtype: torch.dtype) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """Two micro-batches a step, each loss the model's own mean, the step's loss their mean (train_batch's)."""
    model = _model().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in _batches():
        total = 0.0
        for half in (slice(0, ROWS // 2), slice(ROWS // 2, ROWS)):
            part = {k: v[half] for k, v in batch.items()}
            labels = part["input_ids"].masked_fill(part["attention_mask"] == 0, -100)
            loss = model(**part, labels=labels).loss
            (loss / 2).backward()
            total += loss.item() / 2
        opt.step()
        opt.zero_grad()
        losses.append(total)
    with torch.no_grad():
        batch = _batches()[0]
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        halves = [
            model(**{k: v[h] for k, v in batch.items()}, labels=labels[h]).loss.item()
            for h in (slice(0, 2), slice(2, 4))
        ]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, sum(halves) / 2


@pytest.mark.parametrize("encoding", [False, True], ids=["dict", "BatchEncoding"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_tokenizers_batch_trains_and_evaluates_without_a_pipeline(stage, encoding):
    """Before: the mapping went to the model as its one positional input ('embedding(): argument indices must be
    Tensor, not dict'), and a BatchEncoding could not be split into micro-batches nor moved to the device."""
    model = _model()
    engine = hetero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": stage, "parallel": {"microbatches": 2}}
    )
    wrap = transformers.BatchEncoding if encoding else dict
    losses = []
    for batch in _batches():
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        losses.append(float(engine.train_batch(wrap(batch), labels)))
    batch = _batches()[0]
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    evaluated = float(engine.eval_batch(wrap(batch), labels))
    logits = engine.eval_batch(wrap(batch)).logits
    state = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    (exact_losses, exact, exact_eval), (plain_losses, plain, plain_eval) = _plain(torch.float64), _plain(torch.float32)
    tolerance.assert_losses(losses, exact_losses, plain_losses, dtype=torch.float32)
    tolerance.assert_losses([evaluated], [exact_eval], [plain_eval], dtype=torch.float32)
    tolerance.assert_weights(state, exact, plain, dtype=torch.float32)
    assert logits.shape == (ROWS, SEQ, model.config.vocab_size)
