"""The planner checks layouts with the estimator's activation figure ([Note: the planner's activation figure]): a
layout whose saved bytes fit a machine but whose step peak does not is not recommended; an option's activations are
`hetero.estimate`'s for its config, byte for byte; and that figure is what a real step on the CPU holds."""

from __future__ import annotations

import math

import pytest
import torch

import hetero
from hetero.models.gpt import GPT, GPTConfig
from hetero.profiler import Machine, Rates, estimate, plan, planner
from tests.parity import GPT_CFG

NODE = Machine(device_bytes="80GiB", host_bytes="1TiB", nvme_bytes="4TiB", gpus=8)
SEQ = 16  # GPT_CFG's block_size: a longer sequence fails on meta and counts no activations at all
ARGS = dict(rates=Rates.node(), seq_len=SEQ, tensor_modes=("1d",))


def _meta(**overrides) -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(**{**GPT_CFG, "n_head": 4, "n_embd": 64, "n_layer": 4, **overrides}))


def _estimate(model: torch.nn.Module, o, world: int, machine: Machine) -> hetero.profiler.Estimate:
    return estimate(model, o.config, world_size=world, batch_size=o.layout["rows"], seq_len=SEQ, machine=machine)


@pytest.mark.timeout(600)
def test_a_layout_only_the_saved_bytes_fit_is_not_recommended(monkeypatch):
    """The device holds more than what the recommended layout's forward saves but less than its step's peak: the
    saved-bytes planner recommends it, the estimator says it does not fit, and the planner now passes it over."""
    monkeypatch.setattr(planner, "SEQUENCE_FORMS", ())  # the sequence forms' meta steps are the slowest to count
    model, world = _meta(), 2
    kw = dict(ARGS, global_batch=4, schedules=("1f1b",))
    old = plan(model, world, machine=NODE, figure="saved", **kw).best
    need = _estimate(model, old, world, NODE).needed("device")
    assert need > old.needed["device"] + 2  # the gap this test sits in (the step's peak over the saved bytes)
    # Usable device memory (the estimator's 90% of it) halfway between the two figures.
    usable = (old.needed["device"] + need) // 2
    tight = Machine(device_bytes=math.ceil(usable / hetero.profiler.estimator.USABLE["device"]), host_bytes="1TiB",
                    nvme_bytes="4TiB", gpus=8)  # fmt: skip
    walked = plan(model, world, machine=tight, figure="saved", **kw)
    assert walked.best.label() == old.label()  # still the saved-bytes planner's pick
    assert _estimate(model, walked.best, world, tight).fits is False  # which the estimator refuses
    for figure in ("confirm", "step"):
        best = plan(model, world, machine=tight, figure=figure, **kw).best
        assert best is not None and best.label() != old.label(), figure
        est = _estimate(model, best, world, tight)
        assert est.fits and best.figure == "step", figure
        assert best.activations == est.bytes("device", "activations"), figure
        assert best.needed["device"] == est.needed("device"), figure


LAYOUTS = [  # tensor, pipeline, schedule, ZeRO stage
    (1, 1, "1f1b", 1),
    (1, 1, "1f1b", 3),
    (2, 1, "1f1b", 1),
    (1, 2, "1f1b", 1),
    (1, 2, "gpipe", 3),
    (2, 2, "1f1b", 1),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_every_options_activations_are_the_estimators(checkpointing, monkeypatch):
    """With figure="step" each option's activations and device bytes are the estimator's for its config (ZeRO 1
    and 3, tensor 2, pipeline 2 under two schedules, both together), above the saved-bytes walk's."""
    monkeypatch.setattr(planner, "SEQUENCE_FORMS", ())  # layouts without a sequence form only: half the meta steps
    model = _meta()
    kw = dict(
        ARGS, global_batch=4, checkpointing=checkpointing, schedules=("1f1b", "gpipe"), machine=NODE, max_tensor=2
    )
    step = plan(model, 4, figure="step", **kw)
    saved = {o.label(): o for o in plan(model, 4, figure="saved", **kw).options}
    for t, p, sched, stage in LAYOUTS:
        o = next(o for o in step.options if (o.layout["tensor"], o.layout["pipeline"], o.layout["schedule"],
                                              o.zero_stage) == (t, p, sched, stage) and not o.layout["sequence"]
                 and o.offload == {"params": "device", "optimizer": "device"})  # fmt: skip
        est = _estimate(model, o, 4, NODE)
        assert o.figure == "step" and o.activations == est.bytes("device", "activations"), o.label()
        assert o.needed["device"] == est.needed("device"), o.label()
        assert o.activations > saved[o.label()].activations, o.label()  # the gap the saved figure left


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_the_planners_figure_is_what_a_real_step_holds(checkpointing):
    """On the CPU, in fp32 (no LayerNorm statistics to tell apart: [Note: counting saved activations]), the
    activations the planner counts for a world-1 layout are the most a real step through the engine held, to the
    byte (tests/test_estimator.py's count); the saved-bytes figure is below."""
    from tests.test_estimator import BATCH, _gpt, _measure
    from tests.test_estimator import SEQ as REAL_SEQ

    kw = dict(ARGS, seq_len=REAL_SEQ, global_batch=BATCH, precision="fp32", checkpointing=checkpointing, machine=NODE)
    figures = {
        f: next(o for o in plan(_gpt(meta=True), 1, figure=f, **kw).options if o.layout["microbatches"] == 1)
        for f in ("step", "saved")
    }
    real = _measure(_gpt(meta=False), {"chunk_size": 4096, "activation_checkpointing": checkpointing})
    assert figures["step"].activations == real["step_peak"]
    assert figures["saved"].activations < real["step_peak"]


def test_the_plan_says_which_figure_it_used():
    model, kw = _meta(), dict(ARGS, global_batch=4, machine=NODE)
    confirmed = plan(model, 2, confirm=3, **kw)
    fitting = [o for o in confirmed.options if o.fits]
    assert [o.figure for o in fitting[:3]] == ["step"] * 3 and "saved" in {o.figure for o in fitting}
    text = confirmed.table(3)
    assert "the first 3 fitting layouts confirmed with the estimator's step peak" in text
    assert text.count("step figure") == 3
    assert confirmed.to_dict()["activations"] == "confirm" and confirmed.to_dict()["planning_seconds"] > 0
    assert "saved bytes walked over the schedule, every layout" in plan(model, 2, figure="saved", **kw).table()
    with pytest.raises(hetero.ConfigError, match=r"figure: unknown 'peak'; choose from 'step', 'saved', 'confirm'"):
        plan(model, 2, figure="peak", **kw)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("figure", ["saved", "step"])
def test_a_forward_that_fails_on_meta_is_said_not_counted(figure, caplog):
    """A sequence past the model's context fails its forward on meta, so no activation is counted: every option's
    device figure leaves them out. The plan says so (its notes, the table, the JSON, one warning) instead of ranking
    on zeros in silence."""
    kw = dict(ARGS, seq_len=2 * SEQ, global_batch=4, schedules=("1f1b",), max_tensor=1)
    with caplog.at_level("WARNING", logger="hetero.profiler"):
        result = plan(_meta(), 1, machine=NODE, figure=figure, **kw)
    assert result.options and all(o.activations == 0 for o in result.options)
    assert len(result.notes) == 1 and "forward on meta failed" in result.notes[0], result.notes
    assert f"note: {result.notes[0]}" in result.table() and result.to_dict()["notes"] == result.notes
    assert caplog.text.count("forward on meta failed") == 1
    fine = plan(_meta(), 1, machine=NODE, figure=figure, **{**kw, "seq_len": SEQ})
    assert fine.notes == [] and all(o.activations > 0 for o in fine.options)
