"""`pipeline_split` "auto" on resume ([Note: the cut a checkpoint records] in hetero/parallel/pipeline/split.py): "auto"
times the units, so a resumed run can cut the stages apart from the run that saved. The timing is stood in for by
costs each run draws (`balance.timed_costs` patched in each rank), one cut before the save and another after. A
checkpoint records its cut; `hetero.initialize(..., pipeline_cut_from=CKPT)` trains on it, bit for bit as the
uninterrupted run, also mid-accumulation; without it a mid-accumulation checkpoint of another cut is refused naming
the saved cut and the `pipeline_split` to set (it was refused as "other chunk sizes", or with chunks of equal sizes
read as a checkpoint with missing files), and one at a step boundary loads with a warning that says so."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch

import hetero
from hetero.comm import Comm
from hetero.device import make_device
from hetero.errors import ConfigError
from hetero.parallel.pipeline import balance
from hetero.parallel.pipeline.split import units_of
from tests.dist import NEEDS_DEGREES, ranks_apart

try:
    from tests import parity
    from tests.dist import run_distributed
    from tests.test_pipeline_audit import build
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]
    from test_pipeline_audit import build  # type: ignore[no-redef]

MODEL = {"n_layer": 3}  # units: embed, layers.0, layers.1, layers.2, head
# Two draws of the warm-up's timings: the slow unit moves the one boundary of two stages.
SAVING = [1.0, 2.0, 1.0, 1.0, 1.0]  # -> stages begin at embed, layers.1
RESUMING = [1.0, 1.0, 1.0, 2.0, 1.0]  # -> stages begin at embed, layers.2


def _timings(costs: list[float]) -> None:
    balance.timed_costs = lambda units, sample, device: list(costs)  # the timing noise of one run


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _engine(config: dict, **kwargs: Any) -> hetero.Engine:
    net = build(**MODEL)
    return hetero.initialize(net, parity.make_optimizer(net), copy.deepcopy(config), **kwargs)


def _train(engine: hetero.Engine, batches: list) -> list[float]:
    return [float(engine.train_batch(x, y)) for x, y in batches]


def _starts(engine: hetero.Engine) -> list[str]:
    cut = engine.stages[0].cut
    return [cut.units[0], *cut.split]


def _resume(rank: int, world: int, config: dict, root: str, saved_batches: int, follow: bool) -> dict:
    """Train `saved_batches` batches on one cut and save, go on (the uninterrupted run); then a run timed to cut
    apart loads the checkpoint (initialized with `pipeline_cut_from` when `follow`) and trains the same batches."""
    torch.set_num_threads(1)
    lines = _Lines()
    logging.getLogger("hetero").addHandler(lines)
    logging.getLogger("hetero").setLevel(logging.INFO)  # the cut's line is an info
    data = parity.batches(saved_batches + 2, 4)
    _timings(SAVING)
    a = _engine(config)
    _train(a, data[:saved_batches])
    directory = a.save_checkpoint(root)
    out: dict[str, Any] = {"saved_cut": _starts(a), "after": _train(a, data[saved_batches:])}
    a.close()
    from hetero.checkpoint.manifest import read_manifest

    out["recorded"] = read_manifest(directory)["layout"]["pipeline_cut"]
    _timings(RESUMING)
    lines.lines.clear()
    b = _engine(config, pipeline_cut_from=root) if follow else _engine(config)
    out["resumed_cut"] = _starts(b)
    try:
        b.load_checkpoint(root)
        out["resumed"] = _train(b, data[saved_batches:])
    except Exception as e:  # noqa: BLE001 (what it raised is what is checked)
        out["resumed"] = f"{type(e).__name__}: {e}"
    b.close()
    out["log"] = list(lines.lines)
    logging.getLogger("hetero").removeHandler(lines)
    return out


def _config(stage: int, accumulation: int, chunk_size: int) -> dict:
    return {
        "zero_stage": stage,
        "chunk_size": chunk_size,
        "grad_accumulation_steps": accumulation,
        "parallel": {"pipeline": 2, "microbatches": 2},  # pipeline_split "auto": timed
    }


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 3])
def test_a_resume_mid_accumulation_trains_on_the_saved_cut(tmp_path, stage):
    """One batch of an accumulation of two, saved with its gradients pending, then resumed by a run whose timings
    cut elsewhere: with pipeline_cut_from it cuts where the checkpoint was cut, says so, and its losses are the
    uninterrupted run's, bit for bit (the same cut, the same reductions in the same order)."""
    config = _config(stage, 2, parity.CHUNK)
    results = run_distributed(_resume, 2, config, str(tmp_path / "ckpt"), 1, True, timeout=240)
    for r in results:
        assert r["saved_cut"] == ["embed", "layers.1"], r
        assert r["recorded"] == {
            "units": ["embed", "layers.0", "layers.1", "layers.2", "head"],
            "split": ["layers.1"],
            "basis": "timed",
            "costs": SAVING,
        }
        assert r["resumed_cut"] == r["saved_cut"], r
        assert r["resumed"] == r["after"], r
    said = [line for line in results[0]["log"] if line.startswith("pipeline cut:")]
    assert said and "saved in" in said[0] and "layers.1" in said[0] and "times" in said[0], results[0]["log"]


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("chunk_size", [parity.CHUNK, 1 << 17], ids=["chunks-apart", "chunks-alike"])
def test_a_mid_accumulation_checkpoint_of_another_cut_names_the_split_to_set(tmp_path, chunk_size):
    """Without pipeline_cut_from the resumed run cuts by its own timings. Its pending gradients cannot load: that
    was refused as "other chunk sizes" (nothing a user can set), and with chunks large enough to be of one size on
    both cuts, as a checkpoint missing files. Now the error names the saved cut and the pipeline_split to set."""
    config = _config(1, 2, chunk_size)
    results = run_distributed(_resume, 2, config, str(tmp_path / "ckpt"), 1, False, timeout=240)
    for r in results:
        assert r["resumed_cut"] == ["embed", "layers.2"], r
        err = r["resumed"]
        assert isinstance(err, str) and err.startswith("CheckpointError"), r
        assert "pipeline_split: ['layers.1']" in err and "pipeline_cut_from" in err, err
        assert "middle of gradient accumulation" in err and "layers.2" in err, err


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_a_step_boundary_checkpoint_of_another_cut_loads_with_a_warning(tmp_path):
    """At a step boundary a checkpoint loads into another cut by name (tests/test_pipeline_audit.py); the load now
    says that it trains on another cut than the saved one and what to set to resume on the saved one."""
    config = _config(1, 1, parity.CHUNK)
    results = run_distributed(_resume, 2, config, str(tmp_path / "ckpt"), 2, False, timeout=240)
    for r in results:
        assert r["resumed_cut"] == ["embed", "layers.2"] and isinstance(r["resumed"], list), r
    warned = [line for line in results[0]["log"] if "was saved on the pipeline cut" in line]
    assert warned and "pipeline_split: ['layers.1']" in warned[0], results[0]["log"]


# ---- a saved cut this run cannot train on (one process: choose_cut alone) -------------------------------------------
def _saved(split: list[str], units: list[str] | None = None) -> dict:
    units = units or ["embed", "layers.0", "layers.1", "layers.2", "head"]
    return {"source": "ckpt/step-1", "cut": {"units": units, "split": split, "basis": "timed", "costs": None}}


def _choose(split: Any, saved: dict, stages: int = 2) -> tuple:
    net = build(**MODEL)
    how = dict(split=split, given=None, stages=stages, saved=saved)
    return balance.choose_cut(net, units_of(net), world=Comm(), device=make_device("cpu"), **how)


def test_a_saved_cut_replaces_the_timing():
    _timings(RESUMING)
    assert _choose("auto", _saved(["layers.1"]))[:3] == (("layers.1",), None, "timed")


@pytest.mark.parametrize(
    "split, saved, stages, says",
    [
        ("auto", _saved(["layers.1"]), 4, "this run has 4 stages"),
        ("auto", _saved(["layers.1"], ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]), 2, "another model"),
        (("layers.2",), _saved(["layers.1"]), 2, "Set pipeline_split to ['layers.1']"),
        ("params", _saved(["layers.0"]), 2, "Set pipeline_split to ['layers.0']"),
    ],
    ids=["stages", "units", "split-given", "params"],
)
def test_a_saved_cut_that_cannot_apply_is_refused_naming_it(split, saved, stages, says):
    with pytest.raises(ConfigError) as e:
        _choose(split, saved, stages)
    assert says in str(e.value) and "ckpt/step-1" in str(e.value) and "stages begin at embed" in str(e.value)


def test_an_unreadable_checkpoint_is_refused_naming_it(tmp_path):
    from hetero.checkpoint.describe import read_cut

    with pytest.raises(ConfigError, match="cannot be read"):
        _choose("auto", read_cut(tmp_path / "none"))
