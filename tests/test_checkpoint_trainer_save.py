"""HeteroTrainer.save_model at ZeRO stage 3 gathers from every rank: called on process zero alone (the habit `if
trainer.is_world_process_zero(): trainer.save_model()`), it fails in seconds on that rank with the advice to call it
on every rank, and so does a rank that calls it after that; called on every rank it waits for a process zero that
comes late ([Note: a roll call before save_model] in hetero/integrations/roll_call.py)."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("accelerate")

from tests.dist import ONE_RANK_FAULTS, ranks_apart, run_distributed  # noqa: E402

COMM_TIMEOUT_S = 60.0  # what a rank left alone in a gather would wait: far above the roll call's wait
WAIT_S = 2.0  # process zero's wait for the others (SAVE_MODEL_WAIT_S, shortened for the test)


def _save_alone_then_together(rank: int, world: int, out: str) -> dict:
    import transformers

    import hetero.integrations.transformers as ht
    from hetero.comm.watch import default_store
    from hetero.errors import RankTimeoutError
    from tests.test_trainer import Rows, _args, _model

    ht.SAVE_MODEL_WAIT_S = WAIT_S
    args = _args(out, eval_strategy="no", num_train_epochs=1, gradient_accumulation_steps=1, logging_steps=100)
    config = {"zero_stage": 3, "chunk_size": 4096, "comm_timeout": COMM_TIMEOUT_S}
    trainer = ht.HeteroTrainer(model=_model(), args=args, train_dataset=Rows(16, 0), hetero_config=config)
    trainer.train()
    store = default_store()
    result: dict = {}
    # 1. Process zero alone: it raises within its wait, not comm_timeout; the others go on meanwhile.
    if trainer.is_world_process_zero():
        start = time.monotonic()
        with pytest.raises(RankTimeoutError) as err:
            trainer.save_model(f"{out}/alone")
        result["alone_s"] = time.monotonic() - start
        result["alone"] = str(err.value)
        store.set("test/zero_gave_up", "1")
    else:
        # 2. A rank that calls it after process zero gave up raises as well, at once, instead of waiting alone (the
        # wait is bounded so that without the roll call both ranks meet in the gather and the test fails, not hangs)
        deadline = time.monotonic() + 20
        while not store.check(["test/zero_gave_up"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(RankTimeoutError) as err:
            trainer.save_model(f"{out}/alone")
        result["late_s"] = time.monotonic() - start
        result["late"] = str(err.value)
    # 3. Every rank, process zero later than its own wait: the others wait for it, and the weights are saved.
    if trainer.is_world_process_zero():
        time.sleep(2 * WAIT_S)
    trainer.save_model(f"{out}/together")
    state = trainer.engine.full_state_dict()
    if trainer.is_world_process_zero():
        back = transformers.GPT2LMHeadModel.from_pretrained(f"{out}/together")
        result["equal"] = all(torch.equal(state[n], p) for n, p in back.state_dict().items())
    return result


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(300)
def test_save_model_on_process_zero_alone_fails_fast_with_advice(tmp_path):
    zero, one = run_distributed(_save_alone_then_together, 2, str(tmp_path), timeout=240)
    assert zero["alone_s"] < COMM_TIMEOUT_S / 4, zero
    for message in (zero["alone"], one["late"]):
        assert "call trainer.save_model() on every rank" in message
        assert "is_world_process_zero" in message
    assert "global rank(s) 1 had not called HeteroTrainer.save_model" in zero["alone"]
    assert "global rank 1 called HeteroTrainer.save_model after global rank 0 had given up" in one["late"]
    assert one["late_s"] < COMM_TIMEOUT_S / 4, one
    assert zero["equal"]
