"""Overlap: stage 0-1 gradients reduced during backward ([Note: reducing during backward at stages 0-1])."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import hetero
from hetero.profiler.overlap import intersection, overlap, union
from tests.dist import ONLY_SEVERAL, ranks_apart

try:
    from tests import parity
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

CONFIGS = {
    "z0-device": {"zero_stage": 0},
    "z1-device": {"zero_stage": 1},
    "z0-host-accum2": {"zero_stage": 0, "offload": {"optimizer": "host"}, "grad_accumulation_steps": 2},
    "z1-host-clip": {"zero_stage": 1, "offload": {"optimizer": "host"}, "grad_clip_norm": 0.05},
}


def _reduced_after_backward(rank: int, world: int, cfg: dict) -> list[tuple[bool, int]]:
    """For each micro-batch, right after its backward (before engine.step): whether every rank holds the same
    gradient in the range rank 0 updates, and how many collectives backward issued per trainable chunk."""
    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {**cfg, "chunk_size": parity.CHUNK})
    accum = cfg.get("grad_accumulation_steps", 1)
    out = []
    for x, y in parity.batches(2 * accum, 4):
        loss = engine(x[rank * 2 : rank * 2 + 2], labels=y[rank * 2 : rank * 2 + 2]).loss
        before = engine.check.seq
        engine.backward(loss)
        issued = engine.check.seq - before
        same = True
        for zc in engine.updater.chunks:
            g = zc.grad_buffer().clone()
            both = torch.empty(world * g.numel())
            engine.comm.control.all_gather(both, g)
            lo, hi = (0, g.numel()) if zc.stage == 0 else (0, g.numel() // world)  # rank 0's range
            a, b = both.view(world, -1)[:, lo:hi]
            # Stage 1: only rank 0 holds the mean of its range; rank 1 keeps its local values there.
            same &= bool(torch.equal(a, b)) if zc.stage == 0 else not torch.equal(a, b)
        out.append((same, issued / len(engine.updater.chunks)))
        engine.step()
    engine.close()
    return out


def _run(rank: int, world: int, names: list[str]) -> dict:
    torch.set_num_threads(1)
    out = {name: parity.run_hetero(rank, world, steps=6, rows=4, config=CONFIGS[name]) for name in names}
    out["probe-z0"] = _reduced_after_backward(rank, world, CONFIGS["z0-host-accum2"])
    out["probe-z1"] = _reduced_after_backward(rank, world, {"zero_stage": 1})
    return out


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("standin", [False, True], ids=["cpu", "standin"])
def test_stage01_gradients_are_reduced_during_backward_and_match_plain_pytorch(monkeypatch, standin):
    if standin:
        monkeypatch.setenv("HETERO_STANDIN", "1")
    # Under the stand-in (NCCL's rules: the host gradients go through device copies) the host-offload cases only.
    names = [n for n in CONFIGS if "host" in n] if standin else list(CONFIGS)
    results = run_distributed(_run, 2, names, timeout=240)[0]
    for name in names:
        cfg = CONFIGS[name]
        parity.check(
            results[name],
            "fp32",
            steps=6,
            rows=4,
            accum=cfg.get("grad_accumulation_steps", 1),
            clip=cfg.get("grad_clip_norm"),
        )
    # The first micro-batch of two leaves its gradient local (ranks differ, no collective); the last one's backward
    # reduces every chunk (stage 0: equal everywhere; stage 1: rank 0's range reduced on rank 0 only).
    assert results["probe-z0"] == [(False, 0), (True, 1), (False, 0), (True, 1)]
    assert results["probe-z1"] == [(True, 1), (True, 1)]


def test_interval_arithmetic_of_the_overlap_figures():
    assert union([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert intersection([(0, 2), (3, 4)], [(1, 3.5)]) == 1.5
    assert intersection([(0, 1)], [(1, 2)]) == 0.0


def test_work_waited_for_is_not_hidden_although_it_lies_inside_backward():
    # A reduce issued at 0 and waited for from 3 to 4 (end of backward): 3 of its 4 seconds cost the step nothing.
    # A move from 4 to 6 is measured against compute: backward ends at 4, the delayed update's math runs 5-7.
    prof = SimpleNamespace(
        moves=[SimpleNamespace(src="host", dst="nvme", start=4.0, end=6.0)],
        spans=[
            ("collectives", "r", 0.0, 4.0),
            ("collectives waited", "r", 3.0, 4.0),
            ("optimizer", "s", 5.0, 7.0),
            ("optimizer waited", "s", 6.5, 7.0),
        ],
        phases=[("forward", -2.0, 0.0), ("backward", 0.0, 4.0)],
    )
    o = overlap(prof)
    assert set(o) == {"collectives", "optimizer", "move host->nvme"}
    assert o["collectives"]["hidden_s"] == 3.0 and o["collectives"]["hidden_fraction"] == 0.75
    assert o["optimizer"]["hidden_s"] == 1.5
    assert o["move host->nvme"]["hidden_s"] == 1.0


def test_the_profile_shows_collectives_and_the_delayed_update_beside_compute(tmp_path):
    torch.set_num_threads(1)
    model = parity.build()
    cfg = {
        "zero_stage": 1,
        "offload": {"optimizer": "nvme"},
        "memory": {"nvme_dir": str(tmp_path)},
        "delayed_param_update": True,
        "delayed_param_update_warmup": 0,
        "chunk_size": parity.CHUNK,
    }
    engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
    with hetero.profile(engine, tmp_path / "prof", plot=False):
        for x, y in parity.batches(3, 2):
            engine.backward(engine(x, labels=y).loss)
            engine.step()
    engine.close()
    summary = json.loads((tmp_path / "prof" / "summary.json").read_text())
    o = summary["overlap"]
    # The delayed update's math ran while forward and backward did; the reduces were timed during backward.
    assert o["optimizer"]["hidden_s"] > 0
    assert o["collectives"]["busy_s"] > 0
    assert o["move host->nvme"]["busy_s"] > 0 and o["move nvme->host"]["busy_s"] > 0
    assert "overlap with compute" in (tmp_path / "prof" / "summary.txt").read_text()
    trace = json.loads((tmp_path / "prof" / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"collectives", "optimizer", "host->nvme"} <= tracks
