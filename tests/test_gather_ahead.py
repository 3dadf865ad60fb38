"""Stage 3 gathers the next unit as a unit starts ([Note: gathering ahead] in hetero/zero/gathers.py): the gathers are
issued ahead, in the same order on every rank, completed before their first use, counted by the estimator, and
training is bit for bit what it is without them."""

from __future__ import annotations

import pytest
import torch

import hetero
from hetero.profiler.gathered import gathered_bytes
from hetero.zero import param_gather
from hetero.zero.gathers import Gathers
from hetero.zero.zero_chunk import ZeroChunk
from tests.dist import ONLY_SEVERAL, ranks_apart

try:
    from tests import parity
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

CFG = {"zero_stage": 3, "chunk_size": parity.CHUNK}


def _record(rank: int, world: int, ahead: bool) -> dict:
    """Two steps; the second's events: units entered (forward / backward), gathers issued ahead and completed,
    blocking gathers, and the most parameter bytes gathered at once."""
    torch.set_num_threads(1)
    events: list[tuple] = []
    engine: list = []
    peak = [0]

    def gathered_now() -> int:
        if not engine or (events and events[-1] == ("end",)):
            return 0
        return sum(zc.full.nbytes for zc in engine[0].chunks if zc.gathered)

    enter, start, finish = Gathers.enter_unit, ZeroChunk.start_gather, ZeroChunk._finish_gather

    def spy_enter(self, unit, **kw):
        events.append(("enter", unit.index, torch._C._current_graph_task_id() != -1))
        enter(self, unit, **kw)
        peak[0] = max(peak[0], gathered_now())

    def spy_start(self, *, wait=False):
        if not self.gathered and events[-1:] != [("end",)]:
            events.append(("gather" if wait else "ahead", self.spec.index))
        start(self, wait=wait)
        peak[0] = max(peak[0], gathered_now())

    def spy_finish(self):
        if events[-1:] != [("end",)]:
            events.append(("done", self.spec.index))
        finish(self)

    Gathers.enter_unit, ZeroChunk.start_gather, ZeroChunk._finish_gather = spy_enter, spy_start, spy_finish
    model = parity.build(n_layer=6)  # more blocks than the units kept after forward and the one running
    config = {**CFG, "gather_ahead": ahead}
    eng = hetero.initialize(model, parity.make_optimizer(model), config)
    engine.append(eng)
    losses = []
    for i, (x, y) in enumerate(parity.batches(2, 4)):
        if i == 1:
            events.clear()
            peak[0] = 0
        loss = eng(x[rank * 2 : rank * 2 + 2], labels=y[rank * 2 : rank * 2 + 2]).loss
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    events.append(("end",))  # what follows (the state's gathers) is not the step's
    estimate = gathered_bytes(model, [zc.spec for zc in eng.chunks], torch.float32, None, ahead=ahead)
    units = [[zc.spec.index for zc in u.chunks] for u in eng.units]
    state = eng.full_state_dict()
    eng.close()
    return {"events": events, "units": units, "losses": losses, "state": state, "peak": peak[0], "estimate": estimate}


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(300)
def test_each_unit_start_issues_the_next_units_gathers_and_training_is_unchanged():
    on = run_distributed(_record, 2, True, timeout=200)
    off = run_distributed(_record, 2, False, timeout=200)
    assert on[0]["events"] == on[1]["events"]  # every rank issues the same gathers in the same order
    events, units = on[0]["events"], on[0]["units"]
    assert not [e for e in off[0]["events"] if e[0] == "ahead"]
    issued_ahead = [e[1] for e in events if e[0] == "ahead"]
    assert len(issued_ahead) >= len(units) - 1, events  # forward and backward, at most one unit ahead each
    # A chunk issued ahead is issued at a unit's start, for the unit after it in this direction, and completed
    # before anything else uses it.
    current = None
    for n, ev in enumerate(events):
        if ev[0] == "enter":
            current = ev
        elif ev[0] == "ahead":
            _, unit, backward = current
            after = unit - 1 if backward else unit + 1
            assert ev[1] in units[after], (n, ev, current)
            assert events[n - 1][0] in ("enter", "ahead"), (n, events[n - 3 : n + 1])
            done = next(k for k in range(n + 1, len(events)) if events[k] == ("done", ev[1]))
            entered = [e[1] for e in events[n:done] if e[0] == "enter"]
            assert entered == [] or entered[-1] == after, (n, ev, entered)  # done before any later unit's start
    # The same training, bit for bit, and the plain reference.
    for r in range(2):
        assert on[r]["losses"] == off[r]["losses"]
        for k, v in off[r]["state"].items():
            assert torch.equal(on[r]["state"][k], v), k
    # Gathering ahead holds more at once, and the estimator counts it as the engine holds it.
    assert on[0]["peak"] > off[0]["peak"]
    for r in (on[0], off[0]):
        assert r["peak"] == r["estimate"], (r["peak"], r["estimate"])


def _forgot_to_wait(rank: int, world: int) -> list[float]:
    """Training with the bug put back: a gather issued ahead is used without waiting for it."""
    complete, dropped = param_gather.complete, []

    def no_wait(zc, pending):
        dropped.append(pending.handle)  # alive, never waited for
        complete(zc, pending._replace(handle=None))

    param_gather.complete = no_wait
    torch.set_num_threads(1)
    return parity.run_hetero(rank, world, steps=2, rows=4, config=CFG)["losses"]


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(300)
def test_the_standin_fails_a_gather_ahead_used_before_it_completes(monkeypatch):
    """On a GPU the compute stream would read the buffer before (or while) NCCL fills it, and train on wrong values
    without a word; the stand-in gives NaN until the wait, every time. (Without the stand-in the same bug crashes the
    ranks here: gloo writes a buffer the chunk has already handed back.)"""
    monkeypatch.setenv("HETERO_STANDIN", "1")
    losses = run_distributed(_forgot_to_wait, 2, timeout=200)[0]
    assert any(loss != loss for loss in losses), losses


def _one_rank_host_params(rank: int, world: int, bug: bool) -> dict:
    """Stage 3 on one rank with the parameters in host memory, under the stand-in (set by the caller); bug: the
    compute does not wait for the copy."""
    from hetero.device import StandinDevice

    copies = []
    copy_later = StandinDevice.copy_later

    def spy(self, dst, src, *, after):
        copies.append(dst.numel())
        return copy_later(self, dst, src, after=after)

    StandinDevice.copy_later = spy
    if bug:
        StandinDevice.compute_waits = lambda self, handle: None
    config = {**CFG, "offload": {"params": "host", "optimizer": "host"}}
    out = parity.run_hetero(rank, world, steps=2, rows=4, config=config, device="cpu")
    return {"losses": out["losses"], "state": out["state"], "copies": len(copies)}


@pytest.mark.timeout(300)
def test_one_rank_copies_the_next_units_host_shards_on_the_copy_stream(monkeypatch):
    """One rank "gathers" a host shard with a copy: ahead of its unit, on the copy stream, which the compute stream
    waits for at the first use (`Device.compute_waits`). Under the stand-in the copy lands after a random delay, so
    with that wait taken out (the bug put back) the compute reads the buffer before the copy has filled it (NaN, or
    a crash where the copy lands in memory handed back meanwhile); on a GPU it would train on wrong values."""
    monkeypatch.delenv("HETERO_STANDIN", raising=False)  # the whole suite may run under it
    plain = run_distributed(_one_rank_host_params, 1, False, timeout=200)[0]
    assert plain["copies"] == 0  # no stand-in: the CPU device copies nothing ahead
    monkeypatch.setenv("HETERO_STANDIN", "1")
    strict = run_distributed(_one_rank_host_params, 1, False, timeout=200)[0]
    assert strict["copies"] > 0  # the shards went up on the copy stream
    assert strict["losses"] == plain["losses"]
    for k, v in plain["state"].items():
        assert torch.equal(strict["state"][k], v), k
    try:
        broken = run_distributed(_one_rank_host_params, 1, True, timeout=200)[0]
    except Exception as err:  # the ranks' crash or error
        assert "rank 0" in str(err), err
    else:
        assert broken["losses"] != plain["losses"], broken["losses"]
