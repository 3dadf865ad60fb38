"""The engine's loop API: an LR scheduler stepped once per real update, the accumulation boundary, metrics() and
its sinks, and the inference engine (optimizer=None).

Parity: the scheduled run is compared with a plain PyTorch loop that steps the same scheduler after each
optimizer.step(); both do the same fp32 operations in the same order, so the losses agree to fp32 rounding of the
reductions (rtol 1e-5 leaves two orders of magnitude of room over a handful of steps).
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import hetero
from hetero.errors import ConfigError
from tests import parity

ACCUM = 4


def _sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _reference(steps: int) -> tuple[list[float], list[float]]:
    model = parity.build()
    opt = parity.make_optimizer(model)
    sched = _sched(opt)
    data = parity.batches(steps * ACCUM, 4)
    losses, lrs = [], []
    for step in range(steps):
        total = 0.0
        for micro in range(ACCUM):
            x, y = data[step * ACCUM + micro]
            loss = model(x, labels=y).loss
            (loss / ACCUM).backward()
            total += loss.item() / ACCUM
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(total)
        lrs.append(opt.param_groups[0]["lr"])
    return losses, lrs


def _engine(stage: int = 2, **extra) -> tuple[hetero.Engine, torch.optim.lr_scheduler.LRScheduler]:
    model = parity.build()
    opt = parity.make_optimizer(model)
    sched = _sched(opt)
    config = {"zero_stage": stage, "grad_accumulation_steps": ACCUM, "chunk_size": parity.CHUNK, **extra}
    return hetero.initialize(model, opt, config, lr_scheduler=sched), sched


def test_scheduler_steps_once_per_update_and_matches_plain_loop():
    """README's loop: 8 micro-batches with accumulation 4 give 2 updates and 2 scheduler steps, no torch warning."""
    steps = 3
    ref_losses, ref_lrs = _reference(steps)
    engine, sched = _engine()
    data = parity.batches(steps * ACCUM, 4)
    losses, lrs, boundaries = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would fail the test
        for step in range(steps):
            total = 0.0
            for micro in range(ACCUM):
                x, y = data[step * ACCUM + micro]
                boundaries.append(engine.is_gradient_accumulation_boundary())
                loss = engine(x, labels=y).loss
                engine.backward(loss)
                engine.step()
                total += loss.item() / ACCUM
            losses.append(total)
            lrs.append(engine.optimizer.param_groups[0]["lr"])
    assert boundaries == [False, False, False, True] * steps
    assert sched.last_epoch == steps and engine.global_steps == steps
    assert lrs == pytest.approx(ref_lrs, rel=1e-12)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    engine.close()


def test_boundary_override_ends_a_short_accumulation():
    engine, sched = _engine()
    x, y = parity.batches(1, 4)[0]
    engine.backward(engine(x, labels=y).loss)
    engine.set_gradient_accumulation_boundary(True)  # an epoch's last accumulation of one micro-batch
    assert engine.is_gradient_accumulation_boundary()
    engine.step()
    engine.set_gradient_accumulation_boundary(None)
    assert engine.global_steps == 1 and engine.accumulated == 0 and sched.last_epoch == 1
    assert not engine.is_gradient_accumulation_boundary()  # counting starts again: 3 more before the next
    engine.close()


def test_scheduler_in_checkpoints_without_passing_it(tmp_path):
    engine, sched = _engine()
    for x, y in parity.batches(2 * ACCUM, 4):
        engine.backward(engine(x, labels=y).loss)
        engine.step()
    engine.save_checkpoint(tmp_path)  # no lr_scheduler= : the engine's own is saved
    saved_lr = engine.optimizer.param_groups[0]["lr"]
    engine.close()
    fresh, fresh_sched = _engine()
    fresh.load_checkpoint(tmp_path)  # ... and restored
    assert fresh_sched.last_epoch == 2 and fresh_sched.get_last_lr()[0] == pytest.approx(saved_lr)
    fresh.close()


def test_fp16_overflow_does_not_advance_the_schedule():
    engine, sched = _engine(precision="fp16")
    engine.scaler.scale = 2.0**120  # every gradient overflows fp16
    for x, y in parity.batches(ACCUM, 4):
        engine.backward(engine(x, labels=y).loss)
        engine.step()
    assert engine.last_update_skipped and engine.skipped_steps == 1
    assert sched.last_epoch == 0  # a skipped update is no optimizer step
    assert engine.metrics()["skipped_steps"] == 1 and engine.metrics()["loss_scale"] == 2.0**119
    engine.close()


def test_scheduler_checks():
    model = parity.build()
    opt = parity.make_optimizer(model)
    other = parity.make_optimizer(parity.build())
    with pytest.raises(ConfigError, match="another optimizer"):
        hetero.initialize(model, opt, {}, lr_scheduler=_sched(other))
    with pytest.raises(ConfigError, match="ReduceLROnPlateau"):
        hetero.initialize(model, opt, {}, lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))


def test_metrics_before_and_after_steps():
    engine, _ = _engine(stage=3)
    m = engine.metrics()
    assert m["last_grad_norm"] is None and m["step"] == 0 and m["tokens_per_s"] is None  # no raise before a step
    for x, y in parity.batches(ACCUM, 4):
        engine.backward(engine(x, labels=y).loss)
        engine.step(tokens=x.numel())
    m = engine.metrics()
    assert m["step"] == 1 and m["micro_step"] == ACCUM and m["skipped_steps"] == 0 and m["loss_scale"] == 1.0
    assert m["last_grad_norm"] > 0 and m["loss"] > 0 and m["tokens_per_s"] > 0
    assert m["lr"] == [g["lr"] for g in engine.optimizer.param_groups]
    assert set(m["memory"]) == {"device", "host", "nvme"} and m["memory"]["device"]["peak"] > 0
    assert isinstance(m["moved"], dict)
    engine.close()


def test_tensorboard_sink(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine, _ = _engine(log={"tensorboard": str(tmp_path / "tb")})
    for x, y in parity.batches(2 * ACCUM, 4):
        engine.backward(engine(x, labels=y).loss)
        engine.step()
    grad_norm = engine.last_grad_norm
    engine.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/last_grad_norm", "train/lr", "memory/device_peak_bytes"} <= set(tags)
    norms = events.Scalars("train/last_grad_norm")
    assert [e.step for e in norms] == [1, 2] and norms[-1].value == pytest.approx(grad_norm, rel=1e-6)


def test_wandb_sink_needs_wandb(monkeypatch):
    try:
        import wandb  # noqa: F401

        pytest.skip("wandb is installed: its sink would start a run")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="wandb"):
        _engine(log={"wandb": "my-project"})


def test_wandb_sink_logs_each_update(monkeypatch):
    """With wandb importable (a stand-in module recording calls: the real one would start a run), rank 0 starts a
    run in the configured project and logs the scalar metrics at every update's step."""
    import types

    calls: dict[str, list] = {"init": [], "log": []}

    class Run:
        def log(self, values: dict, step: int) -> None:
            calls["log"].append((step, dict(values)))

    fake = types.ModuleType("wandb")
    fake.run = None
    fake.init = lambda project, config: calls["init"].append((project, config)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    engine, _ = _engine(log={"wandb": "my-project"})
    for x, y in parity.batches(2 * ACCUM, 4):
        engine.backward(engine(x, labels=y).loss)
        engine.step()
    grad_norm = engine.last_grad_norm
    engine.close()
    assert [p for p, _ in calls["init"]] == ["my-project"] and calls["init"][0][1]["zero_stage"] == 2
    assert [step for step, _ in calls["log"]] == [1, 2]
    last = calls["log"][-1][1]
    assert last["train/last_grad_norm"] == pytest.approx(grad_norm, rel=1e-6) and last["train/loss"] > 0


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_inference_engine(tmp_path, offload):
    """optimizer=None: forward only, parameters offloaded (stage 3) and, from NVMe through a host budget of a few
    shards, prefetched along the recorded trace."""
    model = parity.build()
    ref = parity.build()
    x, _ = parity.batches(1, 4)[0]
    config = {
        "zero_stage": 3,
        "chunk_size": parity.CHUNK,
        "offload": {"params": offload},
        "memory": {
            "nvme_dir": str(tmp_path),
            "device_budget": 3 * parity.CHUNK * 4,
            "host_budget": 4 * parity.CHUNK * 4,
        },
    }
    engine = hetero.initialize(model, None, config)
    assert engine.optimizer is None and all(zc.optim is None and zc.grad is None for zc in engine.chunks)
    # The reference runs where the engine computes (cuda:0 on a GPU machine, where its outputs come back): the same
    # kernels, so the tolerance stays that of fp32 rounding, and assert_close compares tensors on one device.
    device = engine.device.torch_device
    with torch.no_grad():
        expected = ref.to(device)(x.to(device)).logits
    for _ in range(3):  # the first forward records the access trace; later ones prefetch along it
        out = engine(x).logits  # no torch.no_grad needed
        assert not out.requires_grad
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    stats = engine.memory_stats()
    if offload == "nvme":  # shards are read back from NVMe every forward, ahead of use
        assert stats["counters"].get("prefetch_hits", 0) > 0 and stats["moved"]["nvme->host"] > 0
    with pytest.raises(RuntimeError, match="inference"):
        engine.backward(out.sum())
    with pytest.raises(RuntimeError, match="inference"):
        engine.step()
    engine.close()
