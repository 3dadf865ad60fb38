"""Ranks whose placements differ (`offload` is each rank's own: [Note: one config for every rank]) run the same
collectives: the decisions that follow from a placement are agreed ([Note: the host's part of gathering ahead,
agreed] in hetero/zero/unit_rules.py, [Note: the norm on the device, agreed] in hetero/zero/grad_norm.py). Each
run trains as plain PyTorch does (float64 as the exact run, plain fp32's distance from it as the scale:
tests/tolerance.py).
"""

from __future__ import annotations

import pytest
import torch

from tests import parity
from tests.dist import RANKS_DIFFER, ranks_apart, run_distributed

STEPS, ROWS = 3, 4
# At world 2 the tiny GPT's shards take 64 KiB in all, its largest unit's (layers.0) 40 KiB: a host budget of 96 KiB
# holds every shard but not the three of the largest unit that gathering ahead through the host needs.
HOST_PARAMS = {"offload": {"params": "host"}, "memory": {"host_budget": "96KiB"}}


def _ahead_of(seen: list[bool]) -> object:
    def on_step(engine: object, step: int) -> None:
        seen.append(engine.gathers.ahead)

    return on_step


def _gathers(rank: int, world: int, checks: bool) -> dict:
    torch.set_num_threads(1)
    own = HOST_PARAMS if rank == 0 else {}  # rank 1: parameters on the device, whose budget holds a unit ahead
    config = {"zero_stage": 3, "comm_timeout": 30, "check_collectives": checks, **own}
    seen: list[bool] = []
    out = parity.run_hetero(rank, world, steps=STEPS, rows=ROWS, config=config, on_step=_ahead_of(seen))
    return {**out, "ahead": seen[0]}


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("checks", [True, False])
def test_gathering_ahead_is_agreed_where_one_ranks_host_cannot_hold_it(checks):
    """Rank 0 reads its shards through a host too small to gather ahead; rank 1's parameters are on the device.
    Before, rank 1 gathered ahead and rank 0 did not: at the first forward rank 0 gathered chunk 0 while rank 1
    gathered chunk 1 (a CollectiveMismatchError with the checks on; with them off both ranks waited in the first
    backward's reduce-scatter until comm_timeout)."""
    r0, r1 = run_distributed(_gathers, 2, checks, timeout=200)
    assert r0["ahead"] is r1["ahead"] is False  # rank 0's host decides for both
    parity.check(r0, steps=STEPS, rows=ROWS)
    assert r1["losses"] == r0["losses"]


def _clipped(rank: int, world: int, stage: int) -> dict:
    torch.set_num_threads(1)
    own = {"offload": {"optimizer": "host"}} if rank == 0 else {}  # rank 1 steps on the device
    config = {"zero_stage": stage, "comm_timeout": 15, "grad_clip_norm": 1.0, **own}
    return parity.run_hetero(rank, world, steps=STEPS, rows=ROWS, config=config)


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 3])
def test_the_clipped_norm_goes_one_way_where_optimizer_placements_differ(monkeypatch, stage):
    """Under the stand-in (a device with memory of its own, as a GPU): rank 0 steps its optimizer on the host, rank
    1 on the device. Before, rank 1 all-reduced the norm on the data group and rank 0 on the control group, and
    both waited for comm_timeout at the first update."""
    monkeypatch.setenv("HETERO_STANDIN", "1")
    r0, r1 = run_distributed(_clipped, 2, stage, timeout=200)
    parity.check(r0, steps=STEPS, rows=ROWS, clip=1.0)
    assert r1["losses"] == r0["losses"] and r1["grad_norm"] == r0["grad_norm"]
