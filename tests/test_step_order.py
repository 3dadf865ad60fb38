"""`engine.step()` without an `engine.backward(loss)` since the last `step()` (or since `initialize`,
`load_checkpoint`) is refused before it counts anything ([Note: a step without its backward] in
hetero/zero/loop_watch.py).

Measured before the refusal, at stage 3: `step(); step()` after initialize left the weights as they were but counted
`global_steps == 2`, halved a StepLR twice (LR 0.0025) and said `was_step_applied()`; the same for a `step()` between
forward and backward and for a second `step()` after one backward. Each wrong order here checks the message and that
global_steps, micro_steps, the scheduler's LR and the weights are exactly as before (nothing ran: equality, not a
tolerance); the legal orders (accumulation, two backwards per step, an fp16 overflow's skipped update,
update_in_backward, the delayed update, train_batch, a pipeline) still step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hetero
from hetero.errors import StepOrderError
from tests.dist import NEEDS_DEGREES, ranks_apart, run_distributed

try:
    from tests import parity, pipe_parity
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]

LR = 1e-2


def _engine(stage: int = 3, **config) -> tuple[hetero.Engine, torch.optim.lr_scheduler.LRScheduler]:
    """The user's report: a small MLP, AdamW and StepLR(1, 0.5), given to initialize."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    return hetero.initialize(model, opt, {"zero_stage": stage, **config}, lr_scheduler=sched), sched


def _loss(engine: hetero.Engine, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
    return nn.functional.mse_loss(engine(x), y)


def _state(engine: hetero.Engine, sched: torch.optim.lr_scheduler.LRScheduler) -> dict:
    weights = {k: v.clone() for k, v in engine.full_state_dict().items()}
    return {"steps": engine.global_steps, "micro": engine.micro_steps, "lr": sched.get_last_lr(), "weights": weights}


def _refused(engine: hetero.Engine, sched, match: str) -> None:
    """engine.step() raises StepOrderError matching `match` and the fix, and changes nothing."""
    before = _state(engine, sched)
    with pytest.raises(StepOrderError, match=match) as info:
        engine.step()
    assert "Call engine.backward(loss) before engine.step()" in str(info.value) or "Skip step()" in str(info.value)
    after = _state(engine, sched)
    assert after["steps"] == before["steps"] and after["micro"] == before["micro"] and after["lr"] == before["lr"]
    assert all(torch.equal(before["weights"][k], after["weights"][k]) for k in before["weights"])


class _Boom(Exception):
    pass


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise _Boom("out of memory in backward (simulated)")


@pytest.mark.parametrize("stage", [0, 3])
def test_every_wrong_order_is_refused_and_changes_nothing(stage):
    engine, sched = _engine(stage)
    # After initialize: twice, as the report had it.
    _refused(engine, sched, r"no engine\.backward\(loss\) since hetero\.initialize: no micro-batch's gradient")
    _refused(engine, sched, r"since hetero\.initialize")
    # Between forward and backward: that order trains one update late; the backward and step after it still work.
    loss = _loss(engine)
    _refused(engine, sched, r"a forward ran and its engine\.backward\(loss\) has not yet.*one update late")
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1 and sched.get_last_lr() == [LR / 2]
    # A second step() after one backward.
    _refused(engine, sched, r"since the last engine\.step\(\)")
    # A backward that raised: its gradients were dropped, and the loop skips step() for it.
    with pytest.raises(_Boom):
        engine.backward(_FailingBackward.apply(_loss(engine, 1)))
    _refused(engine, sched, r"the last engine\.backward raised.*Skip step\(\) for that batch")
    # A forward that raised (a bad batch): the loop skips that batch, its step() included.
    with pytest.raises(RuntimeError):
        engine(torch.randn(8, 3))
    _refused(engine, sched, r"the last forward raised.*Skip step\(\) for that batch as well as its backward")
    engine.backward(_loss(engine, 2))
    engine.step()
    assert engine.global_steps == 2 and sched.get_last_lr() == [LR / 4]
    engine.close()


def test_after_load_checkpoint_the_next_step_needs_its_own_backward(tmp_path):
    engine, sched = _engine(3)
    engine.backward(_loss(engine))
    engine.save_checkpoint(tmp_path)  # between backward and step: the resumed loop starts with a forward
    engine.step()
    engine.load_checkpoint(tmp_path)
    assert engine.global_steps == 0
    _refused(engine, sched, r"since load_checkpoint")
    engine.close()


def test_accumulation_steps_once_per_micro_batch_and_updates_at_the_boundary():
    """k = 2: backward, step, backward, step updates once; a step() with no backward of its micro-batch is refused
    inside an accumulation too (it would count a micro-batch that has no gradient)."""
    engine, sched = _engine(3, grad_accumulation_steps=2)
    first = _state(engine, sched)["weights"]
    engine.backward(_loss(engine, 0))
    engine.step()
    assert engine.global_steps == 0 and engine.micro_steps == 1 and sched.get_last_lr() == [LR]
    _refused(engine, sched, r"since the last engine\.step\(\).*grad_accumulation_steps 2 the update .* every 2nd step")
    engine.backward(_loss(engine, 1))
    engine.step()
    assert engine.global_steps == 1 and engine.micro_steps == 2 and sched.get_last_lr() == [LR / 2]
    after = _state(engine, sched)["weights"]
    assert any(not torch.equal(first[k], after[k]) for k in first)
    # Two backwards summed into one micro-batch (two tasks), then one step(): legal.
    engine.backward(_loss(engine, 2))
    with pytest.warns(UserWarning, match="Several pairs per micro-batch by design"):  # LoopWatch's, which it allows
        engine.backward(_loss(engine, 3))
    engine.step()
    assert engine.micro_steps == 3
    engine.close()


def test_engine_optimizer_step_called_by_the_loop_is_refused_and_changes_nothing():
    """[Note: the update is engine.step()'s]: `engine.backward(loss); engine.optimizer.step()` used to update on
    every call, with grad_accumulation_steps 2 as well, and never step the scheduler given to initialize."""
    engine, sched = _engine(3, grad_accumulation_steps=2)
    engine.backward(_loss(engine))
    before = _state(engine, sched)
    with pytest.raises(hetero.HeteroError, match=r"engine\.optimizer\.step\(\) was called directly.*Call engine\.step"):
        engine.optimizer.step()
    after = _state(engine, sched)
    assert after["steps"] == before["steps"] == 0 and after["lr"] == before["lr"] == [LR]
    assert all(torch.equal(before["weights"][k], after["weights"][k]) for k in before["weights"])
    engine.step()  # the loop as it should be: the backward above still counts
    engine.backward(_loss(engine, 1))
    engine.step()
    assert engine.global_steps == 1 and sched.get_last_lr() == [LR / 2]
    engine.close()


@pytest.mark.parametrize(
    "config",
    [
        {"precision": "fp16", "zero_stage": 2},
        {"update_in_backward": True},
        {"delayed_param_update": True, "offload": {"optimizer": "host"}},
    ],
    ids=["fp16-overflow", "update_in_backward", "delayed"],
)
def test_the_other_update_paths_step_after_a_backward_and_refuse_without(config):
    engine, sched = _engine(**config)
    if engine.scaler is not None:
        engine.scaler.scale = 2.0**120  # every gradient overflows: the update is skipped, after its backward
    engine.backward(_loss(engine))
    engine.step()
    assert engine.micro_steps == 1
    if engine.scaler is not None:
        assert engine.last_update_skipped and engine.global_steps == 0
    else:
        assert engine.global_steps == 1
    _refused(engine, sched, r"since the last engine\.step\(\)")
    engine.close()


def test_train_batch_steps_and_a_step_after_it_is_refused():
    """train_batch's own backward counts (the plain path and the micro-batched one, which runs its backward
    without engine.backward)."""
    x, y = parity.batches(1, 4)[0]
    for parallel in ({}, {"microbatches": 2}):
        model = parity.build()
        engine = hetero.initialize(
            model, parity.make_optimizer(model), {"zero_stage": 3, "chunk_size": parity.CHUNK, "parallel": parallel}
        )
        engine.train_batch(x, y)
        engine.train_batch(x, y)
        assert engine.global_steps == 2
        with pytest.raises(StepOrderError, match=r"since the last engine\.step\(\)"):
            engine.step()
        assert engine.global_steps == 2
        engine.close()


def _pipeline(rank: int, world: int) -> tuple[int, str, int]:
    torch.set_num_threads(1)
    model = pipe_parity.build()
    config = {"zero_stage": 1, "chunk_size": parity.CHUNK, "comm_timeout": 30}
    engine = hetero.initialize(model, parity.make_optimizer(model), {**config, "parallel": {"pipeline": 2}})
    x, y = parity.batches(1, 4)[0]
    engine.train_batch(x, y)
    steps = engine.global_steps
    try:
        engine.step()  # every stage refuses alike, before any collective
        refused = ""
    except StepOrderError as e:
        refused = str(e)
    engine.train_batch(x, y)  # and the pipeline goes on: no collective was left half done
    out = (steps, refused, engine.global_steps)
    engine.close()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(90)
def test_a_pipeline_steps_in_train_batch_and_refuses_a_step_on_every_stage():
    for steps, refused, after in run_distributed(_pipeline, 2, timeout=75):
        assert steps == 1 and after == 2
        assert "since the last engine.step()" in refused, refused
