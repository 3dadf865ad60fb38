"""The planner: every layout of a world checked against a machine with the estimator's arithmetic and ranked by the
stated cost model; its options' bytes are the estimator's, its configs are valid, its terms follow the layout."""

from __future__ import annotations

import json

import pytest
import torch

import hetero
from hetero.models.gpt import GPT, GPTConfig
from hetero.profiler import Machine, Rates, estimate, plan
from hetero.profiler.planner import available_modes
from tests.parity import GPT_CFG

NODE = Machine(device_bytes="80GiB", host_bytes="1TiB", nvme_bytes="4TiB", gpus=8)


def _meta(**overrides) -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(**{**GPT_CFG, "n_head": 4, "n_embd": 64, "n_layer": 4, **overrides}))


def test_plan_covers_the_layouts_and_ranks_them():
    # Six blocks: a pipeline cuts hetero's GPT as GPTPipe (embeddings, blocks, head: 8 units), and interleaving at
    # pipeline 4 needs 8 stages.
    p = plan(_meta(n_layer=6), 4, machine=NODE, rates=Rates.node(), global_batch=8, seq_len=16, tensor_modes=("1d",),
             figure="saved")  # the figure's own tests: tests/test_planner_exact.py  # fmt: skip
    assert p.considered == len(p.options) > 100
    layouts = {(o.layout["tensor"], o.layout["pipeline"], o.layout["schedule"]) for o in p.options}
    for want in [(1, 1, "1f1b"), (2, 1, "1f1b"), (4, 1, "1f1b"), (1, 2, "chimera"), (1, 4, "interleaved_1f1b"),
                 (2, 2, "gpipe"), (1, 4, "chimera")]:  # fmt: skip
        assert want in layouts, want
    # every sequence form composes with a pipeline (each stage splits the sequence over the same group)
    assert {o.layout["sequence"] for o in p.options if o.layout["pipeline"] > 1} >= {"megatron", "ulysses", "ring"}
    assert {(o.zero_stage, o.offload["params"], o.offload["optimizer"]) for o in p.options} >= {
        (0, "device", "device"), (3, "nvme", "nvme"), (1, "device", "host")
    }  # fmt: skip
    fitting = [round(o.seconds, 9) for o in p.options if o.fits]  # the ranking's own key: a nanosecond is a tie
    assert fitting == sorted(fitting) and p.best is p.options[0] and p.best.fits
    for o in p.options:
        t = o.terms
        assert t["compute"] == pytest.approx(p.options[0].terms["compute"])  # the same work however it is laid out
        assert (t["bubble"] > 0) == (o.layout["pipeline"] > 1 and not (o.layout["schedule"] == "chimera"
                                                                         and o.layout["pipeline"] == 2))  # fmt: skip
        assert (t["tensor"] > 0) == (o.layout["tensor"] > 1)
        assert o.layout["data"] * o.layout["microbatches"] * o.layout["rows"] == 8
        hetero.Config.from_dict(o.config)  # every config pastes
    text = p.table(5)
    assert "config to paste" in text and json.loads(json.dumps(p.to_dict()))["best"]["seconds"] == p.best.seconds


def test_plan_bytes_are_the_estimators(monkeypatch):
    """An option's device bytes are what hetero.estimate gives for the same layout (its busiest pipeline rank), with
    the activations the planner counts with figure="saved": the saved bytes its schedule keeps (`walk`). The
    estimator's own step peak lies above that (a step's transients: the gradients in flight, the recomputation),
    and is what the planner confirms its first options with (tests/test_planner_exact.py)."""
    model = _meta()
    p = plan(model, 4, machine=NODE, rates=Rates.node(), global_batch=8, seq_len=16, tensor_modes=("1d",),
             figure="saved")  # fmt: skip
    picks = [o for o in p.options if o.layout["pipeline"] == 2 and o.layout["schedule"] == "1f1b"
             and o.layout["tensor"] == 2 and o.zero_stage == 1 and o.offload["optimizer"] == "host"]  # fmt: skip
    o = picks[0]
    cfg = {**o.config, "parallel": {**o.config["parallel"], "pipeline_split": "params"}}
    est = estimate(model, cfg, world_size=4, batch_size=o.layout["rows"], seq_len=16, machine=NODE)
    assert est.needed("device") > o.needed["device"]  # (its busiest rank may be the other, with its host bytes)

    def no_program(*args, **kwargs):
        raise RuntimeError("the planner's count")  # the estimator falls back to the schedule's saved bytes

    monkeypatch.setattr("hetero.profiler.pipeline_peak.schedule_peak", no_program)
    walked = estimate(model, cfg, world_size=4, batch_size=o.layout["rows"], seq_len=16, machine=NODE)
    assert o.needed["device"] == walked.needed("device") and o.needed["host"] == walked.needed("host")


def test_plan_respects_the_machine_and_the_modes():
    model = _meta()
    tiny = Machine(device_bytes="64KiB", host_bytes="1MiB", nvme_bytes=0, gpus=4)
    none = plan(model, 4, machine=tiny, rates=Rates.node(), global_batch=8, seq_len=16, tensor_modes=("1d",),
                figure="saved")  # fmt: skip
    assert none.best is None and "nothing fits" in none.table()
    assert all(o.offload["optimizer"] != "nvme" for o in none.options)  # no NVMe: not considered
    assert available_modes()[0] == "1d"
    modes = plan(_meta(n_head=8), 8, machine=NODE, rates=Rates.node(), global_batch=8, seq_len=16,
                 tensor_modes=("1d", "2d", "2.5d", "3d"), figure="saved")  # fmt: skip
    seen = {(o.layout["tensor"], o.layout["tensor_mode"]) for o in modes.options}
    assert {(4, "2d"), (8, "2.5d"), (8, "3d"), (8, "1d")} <= seen and (2, "2d") not in seen
    # the papers' tables: at t = 8, 3D moves less per layer than 1D, and 1D's is 2 (t - 1) / t
    three = next(o for o in modes.options if o.layout["tensor_mode"] == "3d")
    one = next(o for o in modes.options if o.layout["tensor_mode"] == "1d" and o.layout["tensor"] == 8
               and o.layout["microbatches"] == three.layout["microbatches"] and not o.layout["sequence"])  # fmt: skip
    assert three.terms["tensor"] < one.terms["tensor"]


def _tool():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "estimate.py"
    spec = importlib.util.spec_from_file_location("estimate_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_estimate_tool_takes_the_layout_flags_and_recommends(capsys, monkeypatch):
    """tools/estimate.py: --tensor, --tensor-mode, --pipeline, --microbatches and --sequence (bare: Megatron's) give
    hetero.estimate's bytes for that layout; --recommend prints the ranked table and a config that pastes."""
    from hetero.profiler import planner

    monkeypatch.setattr(planner, "SEQUENCE_FORMS", ())  # --recommend's flags are the test, not the sequence forms
    tool = _tool()
    machine = ["--device-memory", "80GiB", "--host-memory", "1TiB", "--nvme-space", "4TiB"]
    flags = ["--params", "5e7", "--world-size", "8", "--tensor", "2", "--tensor-mode", "1d", "--pipeline", "2",
             "--microbatches", "4", "--batch-size", "2", "--seq-len", "64", "--zero-stage", "3"]  # fmt: skip
    assert tool.main([*flags, "--sequence", *machine, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = estimate(5e7, {"zero_stage": 3}, world_size=8, batch_size=2, seq_len=64, tensor=2, tensor_mode="1d",
                    pipeline=2, microbatches=4, sequence="megatron",
                    machine=Machine(device_bytes="80GiB", host_bytes="1TiB", nvme_bytes="4TiB", gpus=8))  # fmt: skip
    assert got == json.loads(json.dumps(want.to_dict()))
    assert got["layout"]["pipeline"] == 2 and got["layout"]["sequence"] == "megatron"
    assert tool.main([*flags[:2], "--world-size", "4", "--recommend", "--global-batch", "8", "--seq-len", "64",
                      "--tensor-modes", "1d", "--top", "3", "--confirm", "1", *machine]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "config to paste" in text and " 1. " in text and " 4. " not in text
    assert "the first 1 fitting layouts confirmed" in text  # --figure's default, with --confirm's count
    pasted = json.loads(text[text.index("config to paste") :].split("\n", 1)[1])
    hetero.Config.from_dict(pasted)
    assert tool.main([*flags[:2], "--world-size", "4", "--recommend", "--global-batch", "8", "--seq-len", "64",
                      "--tensor-modes", "1d", "--top", "3", "--figure", "saved", *machine]) == 0  # fmt: skip
    assert "the saved bytes walked over the schedule, every layout" in capsys.readouterr().out


def test_plan_shows_its_progress_and_refuses_unknown_modes(monkeypatch, capsys):
    """A 70B model's layouts take a minute to rank: a bar ticks once per layout (where progress bars show:
    hetero/progress.py). A tensor mode it does not know is a ConfigError naming the valid ones, not a KeyError."""
    from hetero.profiler import planner

    args = dict(machine=NODE, rates=Rates.node(), global_batch=4, seq_len=16, tensor_modes=("1d",), figure="saved")
    bars = []

    class Recording:
        def __init__(self, total, desc, **kwargs):
            self.total, self.desc, self.ticks, self.closed = total, desc, 0, False
            bars.append(self)

        def update(self, n=1):
            self.ticks += n

        def close(self):
            self.closed = True

    with monkeypatch.context() as m:
        m.setattr(planner, "make_bar", Recording)
        plan(_meta(), 2, **args)
    grid = list(planner._grid(planner.shape_of(_meta()), 2, 8, None, ("1d",), planner.SCHEDULES))
    assert len(bars) == 1 and bars[0].total == bars[0].ticks == len(grid) > 1 and bars[0].closed
    monkeypatch.setenv("HETERO_PROGRESS", "0")
    plan(_meta(), 2, **args)
    assert capsys.readouterr().err == ""  # switched off: quiet
    monkeypatch.setenv("HETERO_PROGRESS", "1")
    plan(_meta(), 2, **args)
    assert "hetero: ranking layouts" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")  # another rank of a torchrun job: quiet
    plan(_meta(), 2, **args)
    assert capsys.readouterr().err == ""
    with pytest.raises(hetero.ConfigError, match=r"tensor_modes: unknown '4d'; choose from '1d', '2d', '2.5d', '3d'"):
        plan(_meta(), 2, **{**args, "tensor_modes": ("1d", "4d")})


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("global_batch", 0, r"global_batch: expected an integer >= 1 \(sequences per step"),
        ("seq_len", -3, r"seq_len: expected an integer >= 1 \(tokens per sequence\), got -3"),
        ("precision", "fp8", r"precision: unknown 'fp8'; choose from 'fp32', 'bf16', 'fp16'"),
    ],
)
def test_plan_checks_its_arguments_first(key, value, message):
    """A bad batch, sequence length or precision is named before any layout is ranked (a torch error from deep in
    the meta forward, or a KeyError, before)."""
    args = dict(machine=NODE, rates=Rates.node(), global_batch=4, seq_len=16, tensor_modes=("1d",))
    with pytest.raises(hetero.ConfigError, match=message):
        plan(_meta(), 2, **{**args, key: value})
