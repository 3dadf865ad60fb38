"""fp16's loss scale ([Note: the fp16 loss scale] in hetero/zero/precision.py): a translated DeepSpeed fp16 section
scales and skips as DeepSpeed's own scaler does, step for step; hetero's defaults are the scale it always had; the
scaler's state goes through checkpoints whole; hysteresis holds the scale through a first overflow in training."""

from __future__ import annotations

import json
import random
import types

import pytest

import hetero
from hetero.config import Config, LossScaleConfig
from hetero.zero.precision import LossScaler

try:
    from tests import parity
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]


def _deepspeed_scalers(fp16: dict, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """DeepSpeed's scaler for an fp16 section, made as its ZeRO optimizers make it (CreateLossScaler with the config's
    dynamic_loss_scale_args), and the same DynamicLossScaler keeping the minimum scale where that one stops the run
    (raise_error_at_min_scale=False), as hetero's does. Its update_scale asks deepspeed.comm for the rank, which
    needs a process group: rank 0 of one, stubbed."""
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    precision_config = pytest.importorskip("deepspeed.runtime.precision_config")
    import torch

    monkeypatch.setattr(loss_scaler, "dist", types.SimpleNamespace(get_rank=lambda: 0))
    cfg = precision_config.DeepSpeedFP16Config(**fp16)
    args = cfg.dynamic_loss_scale_args()
    zeros = loss_scaler.CreateLossScaler(
        dtype=torch.half, static_loss_scale=cfg.loss_scale, dynamic_scaling=cfg.loss_scale == 0, dynamic_loss_args=args
    )
    if not zeros.dynamic:
        return zeros, zeros
    return zeros, loss_scaler.DynamicLossScaler(**args, raise_error_at_min_scale=False)


def _sequence(seed: int, n: int, p: float) -> list[bool]:
    """Overflows (True) and clean steps, runs of each included."""
    rng = random.Random(seed)
    out: list[bool] = []
    while len(out) < n:
        out += [rng.random() < p] * rng.choice((1, 1, 1, 2, 3, 7))
    return out[:n]


FP16_SECTIONS = [
    {},  # DeepSpeed's defaults: hysteresis 2, a window of 1000
    {"loss_scale_window": 3, "hysteresis": 1},
    {"loss_scale_window": 3, "hysteresis": 2},
    {"loss_scale_window": 4, "hysteresis": 3, "consecutive_hysteresis": True},
    {"loss_scale_window": 5, "hysteresis": 2, "consecutive_hysteresis": True, "initial_scale_power": 12},
    {"loss_scale_window": 2, "hysteresis": 2, "initial_scale_power": 4, "min_loss_scale": 2},  # reaches the minimum
    {"loss_scale": 1024, "hysteresis": 3},  # static: the dynamic settings unread
]


@pytest.mark.parametrize("section", FP16_SECTIONS)
@pytest.mark.parametrize(("seed", "p"), [(0, 0.05), (1, 0.3), (2, 0.6), (3, 0.002)])
def test_translated_fp16_scales_and_skips_as_deepspeeds_scaler(section, seed, p, monkeypatch):
    fp16 = {"enabled": True, **section}
    ours = LossScaler.configured(Config.from_deepspeed({"fp16": fp16}, strict=True).loss_scale)
    zeros, theirs = _deepspeed_scalers(fp16, monkeypatch)
    skipped, stopped = 0, False
    for i, overflow in enumerate(_sequence(seed, 2500 if not section else 400, p)):
        before = ours.scale
        ours.update(overflow)
        theirs.update_scale(overflow)
        skipped += overflow  # every overflowing step is skipped by DeepSpeed's ZeRO optimizers, static scale or not
        assert (ours.scale, ours.skipped_steps) == (theirs.cur_scale, skipped), (i, overflow)
        if theirs.dynamic:
            assert ours.hysteresis_left == theirs.cur_hysteresis, i
        if stopped or zeros is theirs:
            continue
        try:
            zeros.update_scale(overflow)
        except Exception as e:  # DeepSpeed raises a bare Exception
            # ZeRO's scaler stops the run at an overflow that would halve the minimum; hetero's keeps the minimum.
            assert "minimum" in str(e) and before == ours.scale == ours.min_scale, (i, e)
            stopped = True


def test_the_sequences_reach_what_they_test(monkeypatch):
    # The comparison above means something only if scales grow, hysteresis holds some overflows and the minimum is met.
    scales = []
    for section in FP16_SECTIONS[2], FP16_SECTIONS[5]:
        s = LossScaler.configured(Config.from_deepspeed({"fp16": {"enabled": True, **section}}).loss_scale)
        held = 0
        for overflow in _sequence(1, 400, 0.3):
            before = s.scale
            s.update(overflow)
            held += overflow and s.scale == before
            scales.append(s.scale / before)
        assert held > 0
    assert 2.0 in scales and 0.5 in scales
    zeros, theirs = _deepspeed_scalers({"enabled": True}, monkeypatch)
    assert zeros.cur_hysteresis == theirs.cur_hysteresis == 2  # the stub drives the real class


def _old_update(state: dict, overflow: bool) -> None:
    """hetero's scaler before the loss_scale section, verbatim: its defaults must keep this behaviour."""
    if overflow:
        state["scale"] = max(1.0, state["scale"] * 0.5)
        state["good_steps"] = 0
        state["skipped_steps"] += 1
        return
    state["good_steps"] += 1
    if state["good_steps"] >= 2000:
        state["scale"] *= 2.0
        state["good_steps"] = 0


def test_defaults_are_the_scale_hetero_always_had():
    assert LossScaler.configured(LossScaleConfig()) == LossScaler()
    assert Config().loss_scale == LossScaleConfig() == Config.from_dict({"loss_scale": {}}).loss_scale
    ours, old = LossScaler(), {"scale": 2.0**16, "good_steps": 0, "skipped_steps": 0}
    steps = [False] * 4100 + [True] * 3 + [False] * 2100 + [True, False] * 5 + [False] * 1999 + [True] * 20
    for i, overflow in enumerate(steps):
        ours.update(overflow)
        _old_update(old, overflow)
        assert (ours.scale, ours.skipped_steps) == (old["scale"], old["skipped_steps"]), i
    assert ours.scale == 1.0  # the sequence grew, halved, and reached the minimum


def test_scaler_state_round_trips_and_older_states_load():
    cfg = LossScaleConfig(initial_scale=512, growth_interval=3, hysteresis=3, deepspeed_window=True, min_scale=2)
    a = LossScaler.configured(cfg)
    for overflow in (True, False, False, False, False, True, False):
        a.update(overflow)
    assert (a.hysteresis_left, a.good_steps, a.skipped_steps, a.scale) == (2, 1, 2, 1024)  # not a fresh scaler's
    b = LossScaler.configured(cfg)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # as a checkpoint's manifest holds it
    assert b == a
    # A checkpoint from before hysteresis: its fields load, the new ones keep the configured scaler's.
    old = {"scale": 8192.0, "growth_interval": 2000, "growth_factor": 2.0, "backoff_factor": 0.5, "min_scale": 1.0,
           "good_steps": 17, "skipped_steps": 4}  # fmt: skip
    c = LossScaler.configured(LossScaleConfig(hysteresis=2))
    c.load_state_dict(old)
    assert (c.scale, c.good_steps, c.skipped_steps, c.hysteresis_left, c.hysteresis) == (8192.0, 17, 4, 2, 2)
    d = LossScaler()
    d.load_state_dict(old)
    assert d == LossScaler(scale=8192.0, good_steps=17, skipped_steps=4)
    # The settings are the config's; a static scale too.
    e = LossScaler.configured(LossScaleConfig(static=64))
    e.load_state_dict(a.state_dict())
    assert (e.scale, e.static, e.skipped_steps) == (64.0, True, 2)


def _engine(loss_scale: dict) -> hetero.Engine:
    model = parity.build()
    config = {"zero_stage": 2, "chunk_size": parity.CHUNK, "precision": "fp16", "loss_scale": loss_scale}
    return hetero.initialize(model, parity.make_optimizer(model), config)


def _train(engine: hetero.Engine, overflows: list[bool]) -> list[float]:
    """One update per step; a step marked True overflows fp16 (its loss times 1e6, as tests/test_deepspeed_compat.py
    forces one); the scale after each."""
    scales = []
    for (x, y), overflow in zip(parity.batches(len(overflows), 2), overflows):
        loss = engine(x, labels=y).loss
        engine.backward(loss * 1e6 if overflow else loss)
        engine.step()
        assert engine.was_step_applied() == (not overflow)
        scales.append(engine.scaler.scale)
    return scales


def test_hysteresis_holds_the_scale_through_the_first_overflow():
    engine = _engine({"hysteresis": 2})
    before = engine.full_state_dict()
    scales = _train(engine, [True, False, True, True])
    assert scales == [2.0**16, 2.0**16, 2.0**15, 2.0**14]  # the first overflow let through, the later ones halve
    assert engine.skipped_steps == 3 and engine.global_steps == 1
    assert engine.metrics()["loss_scale"] == 2.0**14
    after = engine.full_state_dict()
    assert any(not (before[k] == after[k]).all() for k in before)  # the clean step updated
    engine.close()
    static = _engine({"static": 2.0**12})
    assert _train(static, [False, True, False]) == [2.0**12] * 3 and static.skipped_steps == 1
    static.close()


def test_scaler_state_round_trips_through_a_checkpoint(tmp_path):
    settings = {"growth_interval": 3, "hysteresis": 3, "deepspeed_window": True, "min_scale": 4}
    engine = _engine(settings)
    _train(engine, [False, True, True, False])
    state = engine.scaler.state_dict()
    assert (state["hysteresis_left"], state["good_steps"], state["skipped_steps"]) == (1, 1, 2)
    saved = engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    fresh = _engine(settings)
    assert fresh.scaler.state_dict() != state
    fresh.load_checkpoint(saved)
    assert fresh.scaler.state_dict() == state
    fresh.close()
