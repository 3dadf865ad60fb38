"""[Note: the overflow check on the device]: with fp16 and every chunk stepping on the device, the fused kernels skip
an overflowed update themselves and the host reads the flag once the update is queued, so the step makes no wait;
the run trains to the same bits, counters, scale and schedule as the host-side check (forced, for the reference, on
the same device). The device is the GPU where there is one, else the stand-in (a device with memory of its own);
the plain CPU, whose memory is the host's, takes the host-side check."""

from __future__ import annotations

import os

import pytest
import torch

import hetero
import hetero.zero.overflow as overflow
import hetero.zero.update as update
from tests import parity
from tests.dist import RANKS_DIFFER, ranks_apart, run_distributed

STEPS = 6
BOOSTED = (1, 4)  # micro-batches whose loss is multiplied by 2**40: their fp16 gradients overflow


def _run(
    rank: int, world: int, stage: int, clip: float | None, boost_ranks: tuple[int, ...], *, host_check: bool = False
) -> dict:
    """Train the parity model in fp16 with a schedule; the steps in BOOSTED overflow on `boost_ranks`. host_check:
    the host-side check wherever the chunks step."""
    real = update.Updater._checks_on_device
    if host_check:
        update.Updater._checks_on_device = lambda self: False
    try:
        return _train(rank, world, stage, clip, boost_ranks)
    finally:
        update.Updater._checks_on_device = real


def _train(rank: int, world: int, stage: int, clip: float | None, boost_ranks: tuple[int, ...]) -> dict:
    model = parity.build()
    opt = parity.make_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    config = {"zero_stage": stage, "precision": "fp16", "chunk_size": parity.CHUNK}
    if clip is not None:
        config["grad_clip_norm"] = clip
    engine = hetero.initialize(model, opt, config, lr_scheduler=sched)
    engine.scaler.scale = 2.0**10
    log = []
    for k, (x, y) in enumerate(parity.batches(STEPS, 4 * world)):
        rows = slice(rank * 4, rank * 4 + 4)
        loss = engine(x[rows], labels=y[rows]).loss
        engine.backward(loss * (2.0**40 if k in BOOSTED and rank in boost_ranks else 1.0))
        engine.step()
        row = (engine.global_steps, engine.skipped_steps, engine.last_update_skipped, engine.scaler.scale)
        log.append((*row, sched.last_epoch, sched.get_last_lr()[0], engine.last_grad_norm))
    waits = list(engine.device.standin.waits) if os.environ.get("HETERO_STANDIN") else []
    state = engine.full_state_dict()
    engine.close()
    return {"log": log, "state": state, "waits": waits}


def _same(a: dict, b: dict) -> None:
    assert a["log"] == b["log"]
    assert set(a["state"]) == set(b["state"])
    assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage, clip", [(0, None), (2, 0.05), (3, None), (3, 0.05)])
def test_checked_on_the_device_trains_as_the_host_check(monkeypatch, stage, clip):
    """Two of six updates overflow: skipped (weights, moments and step counts as they were), the scale halved, the
    schedule not stepped, the norm the last applied update's; the same bits as the host-side check, with no wait."""
    _on_a_device(monkeypatch)
    host = _run(0, 1, stage, clip, (0,), host_check=True)
    assert [row[1] for row in host["log"]] == [0, 1, 1, 1, 2, 2]  # the boosted updates were skipped
    checks = []
    real = overflow.DeviceCheck.check
    monkeypatch.setattr(overflow.DeviceCheck, "check", lambda self, *a, **k: checks.append(1) or real(self, *a, **k))
    device = _run(0, 1, stage, clip, (0,))
    assert len(checks) == STEPS  # every update checked on the device
    assert device["waits"] == []
    _same(device, host)


def _on_a_device(monkeypatch) -> None:
    if not torch.cuda.is_available():
        monkeypatch.setenv("HETERO_STANDIN", "1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's memory is the host's only where no GPU is")
def test_without_the_stand_in_the_host_checks(monkeypatch):
    """On a device sharing the host's memory (the CPU) reading the flag costs nothing: the host-side check stays."""
    monkeypatch.delenv("HETERO_STANDIN", raising=False)  # the whole suite may run under it
    checks = []
    monkeypatch.setattr(overflow.DeviceCheck, "check", lambda self, *a, **k: checks.append(1))
    _run(0, 1, 3, None, (0,))
    assert checks == []


def test_the_flag_is_copied_before_the_update_and_read_after_it(monkeypatch):
    """On a GPU the host waits for the flag's copy, which follows the check on the compute stream: queued before the
    first chunk's kernels and read after the last chunk's, the device has the whole update to run meanwhile. Read
    before the chunks were queued, that wait would drain the device's queue as the host-side check did."""
    events: list[str] = []
    check, take, step = overflow.DeviceCheck.check, overflow.DeviceCheck.take, update.step_chunk
    monkeypatch.setattr(overflow.DeviceCheck, "check", lambda s, *a, **k: events.append("check") or check(s, *a, **k))
    monkeypatch.setattr(
        overflow.DeviceCheck, "take", lambda s: events.append("take" if s.pending else "none") or take(s)
    )
    monkeypatch.setattr(update, "step_chunk", lambda *a, **k: events.append("step") or step(*a, **k))
    _on_a_device(monkeypatch)
    _run(0, 1, 3, None, (0,))
    updates = " ".join(e for e in events if e != "none").split("take")[:-1]
    assert len(updates) == STEPS
    for u in updates:
        words = u.split()
        assert words[0] == "check" and words.count("check") == 1 and words.count("step") >= 2, words


def _ranks(rank: int, world: int, host_check: bool) -> dict:
    return _run(rank, world, 3, 0.05, (1,), host_check=host_check)


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(300)
def test_an_overflow_on_one_rank_skips_the_update_on_every_rank(monkeypatch):
    """Stage 3 over two ranks, the gradient overflowing on rank 1 alone: the flag comes from the all-reduced sum, so
    both ranks skip the same updates, checked on the device as on the host, to the same bits."""
    monkeypatch.setenv("HETERO_STANDIN", "1")  # gloo ranks: the stand-in is their device
    host = run_distributed(_ranks, 2, True, timeout=250)
    device = run_distributed(_ranks, 2, False, timeout=250)
    for r in range(2):
        assert [row[1] for row in host[r]["log"]] == [0, 1, 1, 1, 2, 2]
        # The collective schedule's checks read their rows back (check_collectives; [Note: host waits] counts a step on
        # one rank); none of the update's own is among the waits
        assert not [w for w in device[r]["waits"] if "protocol.py" not in w[1]], device[r]["waits"]
        _same(device[r], host[r])
