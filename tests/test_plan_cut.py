"""The planner's pasted config names the pipeline cut its figures were computed for ([Note: the cut a plan pastes] in
hetero/profiler/planner.py): `hetero.initialize` with it on the same model cuts where the plan measured, where a
pasted "auto" let the run balance its own costs and cut elsewhere."""

from __future__ import annotations

import pytest
import torch

import hetero
from hetero.comm.group import Comm
from hetero.device import make_device
from hetero.errors import ConfigError
from hetero.models.gpt import GPT, GPTConfig
from hetero.models.gpt_pipe import GPTPipe
from hetero.parallel.pipeline.balance import choose_cut
from hetero.parallel.pipeline.split import boundaries, units_of
from hetero.profiler import Machine, Rates, estimate, plan
from hetero.profiler.parallel_layout import Layout, as_chain, pipeline_units, stage_starts

NODE = Machine(device_bytes="80GiB", host_bytes="1TiB", nvme_bytes="4TiB", gpus=8)
# A vocabulary large next to the blocks: the embedding and the head hold as many parameters as two blocks and more,
# while the head costs far more FLOPs than the embedding, so a cut by parameters and one by cost fall apart.
GPT_SMALL = dict(vocab_size=4096, n_layer=4, n_head=4, n_embd=64, block_size=16, bias=False)
ARGS = dict(machine=NODE, rates=Rates.node(), seq_len=16, tensor_modes=("1d",), figure="saved")


def _gpt() -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(**GPT_SMALL))


def _engine_cut(model: torch.nn.Module, config: dict) -> list[str]:
    """Where `hetero.initialize` with `config` begins the stages of `model`: the engine's own steps (parallel/setup.py:
    `choose_cut`, then `boundaries`), without training. On a meta model "auto" counts the units' FLOPs, as a run
    times them: deterministic here."""
    par = hetero.Config.from_dict(config).parallel
    units = units_of(model)
    stages = par.pipeline * par.virtual_stages
    split, costs, _, _ = choose_cut(model, units, split=par.pipeline_split, given=par.pipeline_costs, stages=stages,
                                    world=Comm(), device=make_device("cpu"))  # fmt: skip
    return [units[i][0] for i in boundaries(units, stages, split, costs)[1:]]


def test_pasted_config_cuts_where_the_plan_measured():
    model = _gpt()
    # Tensor layouts keep the units' names (the engine cuts the whole model first); planning them costs 5 s more.
    p = plan(model, 4, global_batch=8, max_tensor=1, schedules=("1f1b", "interleaved_1f1b", "chimera"), **ARGS)
    pipes = [o for o in p.options if o.layout["pipeline"] > 1]
    assert {(o.layout["pipeline"], o.layout["schedule"]) for o in pipes} == {
        (2, "1f1b"), (2, "interleaved_1f1b"), (4, "1f1b"), (2, "chimera"), (4, "chimera")
    }  # fmt: skip
    units, _ = pipeline_units(as_chain(model))
    names = [u.name for u in units]
    engine = GPTPipe(gpt=_gpt())  # what a user pipelines (initialize refuses the plain GPT)
    elsewhere, cuts = 0, {}
    for o in pipes:
        lay = o.layout
        cell = (lay["pipeline"], lay["virtual_stages"], lay["schedule"] == "chimera")
        if cell not in cuts:  # the placements and micro-batch counts of a layout share its cut
            # what the planner measured: its own arithmetic, on the whole model (its copy without a tensor layout)
            at = Layout(pipeline=lay["pipeline"], virtual=lay["virtual_stages"], schedule=lay["schedule"],
                        split="params")  # fmt: skip
            cuts[cell] = measured = [names[i] for i in stage_starts(units, at, {})[1:]]
            assert _engine_cut(engine, o.config) == measured  # the engine's units, cut where the plan measured
            auto = {**o.config, "parallel": {**o.config["parallel"], "pipeline_split": "auto"}}
            elsewhere += _engine_cut(engine, auto) != measured
        assert o.config["parallel"]["pipeline_split"] == lay["pipeline_split"] == cuts[cell]
        assert f"cut at {','.join(cuts[cell])}" in o.label()
    assert elsewhere  # what a pasted "auto" did: on this model the engine's own balance cuts elsewhere
    assert "cut at layers." in p.table(50)


def test_pasted_config_names_a_hugging_face_decoders_units():
    """A Hugging Face decoder's units are the engine's (`hf_units`: embeddings, the layers by their FQNs, head)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=32)  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    p = plan(model, 2, global_batch=2, max_tensor=1, schedules=("1f1b",), **ARGS)
    pipes = [o for o in p.options if o.layout["pipeline"] == 2]
    assert pipes
    with torch.device("meta"):
        engine = transformers.LlamaForCausalLM(cfg)
    for o in pipes:
        split = o.config["parallel"]["pipeline_split"]
        assert isinstance(split, list) and split[0] in {n for n, _ in units_of(engine)}
        assert _engine_cut(engine, o.config) == split


def test_the_pasted_split_is_validated_by_the_config():
    p = plan(_gpt(), 2, global_batch=4, max_tensor=1, schedules=("1f1b",), **ARGS)
    o = next(o for o in p.options if o.layout["pipeline"] == 2)
    split = o.config["parallel"]["pipeline_split"]
    assert hetero.Config.from_dict(o.config).parallel.pipeline_split == tuple(split)
    four = {**o.config, "parallel": {**o.config["parallel"], "pipeline": 4}}  # one FQN: the cut of two stages
    with pytest.raises(ConfigError, match="names 1 FQNs; 4 stages"):
        hetero.Config.from_dict(four)
    with pytest.raises(ConfigError, match="expected a list of FQNs"):
        hetero.Config.from_dict({**o.config, "parallel": {**o.config["parallel"], "pipeline_split": [2]}})
    typo = {**o.config, "parallel": {**o.config["parallel"], "pipeline_split": ["layer.2"]}}
    with pytest.raises(ConfigError, match="did you mean 'layers.2'"):  # a unit the engine does not have
        _engine_cut(GPTPipe(gpt=_gpt()), typo)


def test_plan_keeps_an_explicit_split(monkeypatch):
    """pipeline_split "auto" stays "auto" in the configs (a note says the figures may not be the run's, the layout
    names their cut); a list is planned and pasted as given, for its stage count only; a wrong one is refused."""
    model = _gpt()
    kept = plan(model, 2, global_batch=4, max_tensor=1, schedules=("1f1b",), pipeline_split="auto", **ARGS)
    pipes = [o for o in kept.options if o.layout["pipeline"] == 2]
    assert pipes and all(o.config["parallel"]["pipeline_split"] == "auto" for o in pipes)
    assert all(o.layout["pipeline_split"] for o in pipes) and any("kept in the configs" in n for n in kept.notes)
    given = plan(model, 4, global_batch=8, max_tensor=1, schedules=("1f1b", "interleaved_1f1b"),
                 pipeline_split=["layers.1"], **ARGS)  # fmt: skip
    pipes = [o for o in given.options if o.layout["pipeline"] > 1]
    assert pipes and {(o.layout["pipeline"], o.layout["virtual_stages"]) for o in pipes} == {(2, 1)}
    assert all(o.config["parallel"]["pipeline_split"] == ["layers.1"] == o.layout["pipeline_split"] for o in pipes)
    # its figures are that cut's: hetero.estimate's for the pasted config, with the same (walked) activation figure
    monkeypatch.setattr("hetero.profiler.pipeline_peak.schedule_peak", lambda *a, **k: 1 / 0)
    o = next(o for o in pipes if o.zero_stage == 1 and o.offload["optimizer"] == "host")
    est = estimate(model, o.config, world_size=4, batch_size=o.layout["rows"], seq_len=16, machine=NODE)
    assert est.per_pipeline_rank[1]["units"][0] == "layers.1" and o.needed["device"] == est.needed("device")
    for bad, match in ((["layer.1"], "did you mean 'layers.1'"), (["layers.2", "layers.1"], "must come after"),
                       ("timed", "expected \"auto\", \"params\""), ([], "non-empty list")):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            plan(model, 4, global_batch=8, pipeline_split=bad, **ARGS)


def test_the_estimate_tool_passes_its_pipeline_split_flag(monkeypatch):
    """tools/estimate.py --recommend --pipeline-split: "auto" stays "auto" in the pasted configs (the run balances),
    a comma-separated list reaches the plan as FQNs, no flag leaves the plan's default (the measured cut)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "estimate.py"
    spec = importlib.util.spec_from_file_location("estimate_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    calls = []

    def recording_plan(*args, **kwargs):
        calls.append(kwargs["pipeline_split"])
        raise ConfigError("stop here")

    monkeypatch.setattr(hetero, "plan", recording_plan)
    common = [
        "--params",
        "5e7",
        "--world-size",
        "4",
        "--recommend",
        "--device-memory",
        "80GiB",
        "--host-memory",
        "1TiB",
    ]
    assert tool.main([*common, "--pipeline-split", "auto"]) == 2
    assert tool.main([*common, "--pipeline-split", "h.2, h.4"]) == 2
    assert tool.main(common) == 2
    assert calls == ["auto", ["h.2", "h.4"], None]
