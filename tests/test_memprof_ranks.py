"""The profiler's outputs say where in the mesh each rank sits (summary header, summary.json, the trace's process
name), and name an async save's host copy ([Note: the checkpoint copy's memory] in hetero/checkpoint/host_copy.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

import hetero
from hetero.checkpoint import background

try:
    from tests.dist import NEEDS_DEGREES, ranks_apart, run_distributed
    from tests.test_checkpoint import _cfg, make_engine, train
    from tests.test_checkpoint_parallel import TP2
    from tests.test_checkpoint_parallel import _engine as _tp_engine
    from tests.test_checkpoint_parallel import _train as _tp_train
except ImportError:  # tests/ itself on sys.path
    from dist import NEEDS_DEGREES, ranks_apart, run_distributed  # type: ignore[no-redef]
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]
    from test_checkpoint_parallel import TP2  # type: ignore[no-redef]
    from test_checkpoint_parallel import _engine as _tp_engine  # type: ignore[no-redef]
    from test_checkpoint_parallel import _train as _tp_train  # type: ignore[no-redef]


def _outputs(out_dir: Path) -> tuple[dict, str, dict]:
    summary = json.loads((out_dir / "summary.json").read_text())
    text = (out_dir / "summary.txt").read_text()
    trace = json.loads((out_dir / "trace.json").read_text())
    return summary, text, trace


def _mesh_job(rank: int, world: int, root: str) -> dict:
    engine = _tp_engine({**TP2, "zero_stage": 2})
    with hetero.profile(engine, Path(root) / "prof", plot=False) as prof:
        _tp_train(engine, 0, 1)
    mesh = (engine.mesh.tp_rank, engine.mesh.dp_rank)
    engine.close()
    summary, text, trace = _outputs(prof.out_dir)
    names = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"]
    return {
        "mesh": mesh,
        "coords": summary["coordinates"],
        "header": text.splitlines()[0],
        "names": names,
        "other": trace["otherData"]["coordinates"],
    }


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_each_ranks_profile_names_its_coordinates(tmp_path):
    results = run_distributed(_mesh_job, 4, str(tmp_path), timeout=240)  # tp 2 x dp 2
    assert sorted(r["mesh"] for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, r in enumerate(results):
        tp, dp = r["mesh"]
        assert r["coords"] == r["other"] == {"dp": [dp, 2], "tp": [tp, 2]}
        assert r["header"].endswith(f"(rank {rank} of 4) at dp {dp}/2, tp {tp}/2"), r["header"]
        assert r["names"] == [f"hetero rank {rank} (dp {dp}/2, tp {tp}/2)"]


def test_a_single_rank_profile_names_no_coordinates(tmp_path):
    engine = make_engine(0, _cfg(1), str(tmp_path))
    with hetero.profile(engine, tmp_path / "prof", plot=False) as prof:
        train(engine, 0, 1, 0, 1)
    engine.close()
    summary, text, trace = _outputs(prof.out_dir)
    assert summary["coordinates"] == {} and text.splitlines()[0].endswith("(rank 0 of 1)")
    assert [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"] == ["hetero rank 0"]


@pytest.mark.timeout(200)
def test_the_profile_names_an_async_saves_host_copy(tmp_path):
    engine = make_engine(0, _cfg(3, optim="nvme", params="nvme"), str(tmp_path))
    train(engine, 0, 1, 0, 2)
    gate, open_writer = threading.Event(), background.open_writer
    background.open_writer = lambda path, planned: gate.wait(120) and open_writer(path, planned)
    try:
        with hetero.profile(engine, tmp_path / "prof", plot=False) as prof:
            engine.save_checkpoint(str(tmp_path / "ckpt"), async_save=True)
            held = engine.memory_stats()["host"]["checkpoint_copy"]["current"]
            train(engine, 0, 1, 2, 3)
            gate.set()
            engine.wait_checkpoint()
            train(engine, 0, 1, 3, 4)
    finally:
        gate.set()
        background.open_writer = open_writer
    engine.close()
    summary, text, trace = _outputs(prof.out_dir)
    assert held > 0
    assert summary["checkpoint_copy"]["peak_bytes"] == held
    assert "checkpoint copy" in text and "an async save's copy in host memory" in text
    counter = [e["args"]["bytes"] for e in trace["traceEvents"] if e.get("name") == "checkpoint copy"]
    assert max(counter) == held and counter[-1] == 0  # held while written, then given back
    rss = summary["process_rss"]
    if rss is not None:  # named at the RSS peak where it was held then (else 0), and not counted as unaccounted
        assert "checkpoint_copy_at_peak" in rss
        held_at_peak = rss["checkpoint_copy_at_peak"]
        assert rss["unaccounted_at_peak"] == (
            rss["peak_bytes"]
            - rss["ledgers_at_peak"]
            - rss["activations_at_peak"]
            - rss["outside_ledgers_before"]
            - held_at_peak
        )


def test_no_copy_line_without_an_async_save(tmp_path):
    engine = make_engine(0, _cfg(1), str(tmp_path))
    with hetero.profile(engine, tmp_path / "prof", plot=False) as prof:
        train(engine, 0, 1, 0, 1)
    engine.close()
    summary, text, trace = _outputs(prof.out_dir)
    assert summary["checkpoint_copy"] is None and "checkpoint copy" not in text
    assert not [e for e in trace["traceEvents"] if e.get("name") == "checkpoint copy"]
