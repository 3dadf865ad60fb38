"""[Note: patient meetings]: a rank still writing (or reading) its part of a checkpoint long after the others, and past
comm_timeout, is waited for, and the save (load) succeeds bit-exactly; a rank that stops while writing is named
within about comm_timeout by every other rank, and the previous checkpoint stands; with checkpoint_patience, a rank
alive but late past it is named by every rank, itself included, and the previous checkpoint stands."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from hetero.errors import RankTimeoutError
from tests.dist import ONE_RANK_FAULTS, ranks_apart

try:
    from tests.dist import DistributedTestError, run_distributed
    from tests.test_checkpoint import _cfg, make_engine, train
except ImportError:  # tests/ itself on sys.path
    from dist import DistributedTestError, run_distributed  # type: ignore[no-redef]
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]

T = 3.0  # comm_timeout: every collective gives up after T seconds
SLOW = 3.5 * T  # how much longer than the others the slow rank writes or reads
CONFIG = {**_cfg(1), "comm_timeout": T}


def _slowed(fn, seconds: float):
    def slow(*args, **kwargs):
        time.sleep(seconds)  # a slow disk: the process is alive, its main thread waits
        return fn(*args, **kwargs)

    return slow


def _frozen_after(fn, seconds: float):
    def freeze(*args, **kwargs):
        time.sleep(seconds)  # alive and slow first, then stopped as a hung or dead process is
        os.kill(os.getpid(), signal.SIGSTOP)
        return fn(*args, **kwargs)

    return freeze


def _failing_save(e, ckpt: str, t0: float, out: dict) -> None:
    """Save, expecting an error: its type, message and missing ranks, the time taken and what the root holds."""
    try:
        e.save_checkpoint(ckpt)
        out["error"] = None
    except Exception as err:  # noqa: BLE001 (the type is part of what is checked)
        out["error"] = (type(err).__name__, str(err), getattr(err, "missing_ranks", None))
    out["seconds"] = time.monotonic() - t0
    out["dirs"] = sorted(os.listdir(ckpt))
    with open(os.path.join(ckpt, "latest")) as f:
        out["latest"] = f.read().strip()


def _job(rank: int, world: int, root: str, mode: str) -> dict:
    from hetero.checkpoint import load as load_mod
    from hetero.checkpoint import save as save_mod
    from hetero.comm.patience import default_store

    torch.set_num_threads(1)
    ckpt = os.path.join(root, "ckpt")
    e = make_engine(rank, {**CONFIG, "checkpoint_patience": T} if mode == "late-save" else CONFIG, root)
    pids = e.comm.all_gather_object(os.getpid())
    train(e, rank, world, 0, 1)
    e.save_checkpoint(ckpt)  # step 1: the checkpoint before
    out: dict = {"before": e.full_state_dict()}
    train(e, rank, world, 1, 2)
    out["after"] = e.full_state_dict()
    store = default_store()
    keys = store.num_keys()
    t0 = time.monotonic()
    if mode == "slow-save":
        if rank == 1:
            save_mod._write_rank = _slowed(save_mod._write_rank, SLOW)
        e.save_checkpoint(ckpt)  # step 2
        out["seconds"] = time.monotonic() - t0
        out["keys"] = (keys, store.num_keys())  # the meeting's keys are gone once the save returns
    elif mode == "slow-load":
        e.save_checkpoint(ckpt)  # step 2
        train(e, rank, world, 2, 3)
        if rank == 1:
            load_mod._fill_buffers = _slowed(load_mod._fill_buffers, SLOW)
        t0 = time.monotonic()
        e.load_checkpoint(ckpt)
        out["seconds"] = time.monotonic() - t0
        out["loaded"] = e.full_state_dict()
    elif mode == "late-save":  # alive all along, but later than checkpoint_patience allows
        if rank == 1:
            save_mod._write_rank = _slowed(save_mod._write_rank, SLOW)
        _failing_save(e, ckpt, t0, out)
    elif mode == "frozen-save":
        if rank == 1:
            save_mod._write_rank = _frozen_after(save_mod._write_rank, 2 * T)
        _failing_save(e, ckpt, t0, out)
        os.kill(pids[1], signal.SIGKILL)  # rank 0: the stopped rank would never leave
        return out
    e.close()
    return out


def _world1_state(ckpt: str, scratch: str) -> dict:
    e = make_engine(0, {**CONFIG, "comm_timeout": 600}, scratch)
    try:
        e.load_checkpoint(ckpt)
        return e.full_state_dict()
    finally:
        e.close()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(180)
def test_a_rank_writing_long_after_the_others_is_waited_for(tmp_path):
    r0, r1 = run_distributed(_job, 2, str(tmp_path), "slow-save", timeout=150)
    assert r1["seconds"] > SLOW and r0["seconds"] > SLOW - T  # rank 0 waited for rank 1, well past comm_timeout
    assert r0["keys"][1] == r0["keys"][0], r0["keys"]
    ckpt = os.path.join(tmp_path, "ckpt")
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip() == "step-00000002"
    assert _same(_world1_state(ckpt, str(tmp_path / "w1")), r0["after"])


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(180)
def test_a_rank_reading_long_after_the_others_is_waited_for(tmp_path):
    for r in run_distributed(_job, 2, str(tmp_path), "slow-load", timeout=150):
        assert r["seconds"] > SLOW - T, r["seconds"]
        assert _same(r["loaded"], r["after"])


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(180)
def test_a_rank_that_stops_while_writing_is_named_and_the_previous_checkpoint_stands(tmp_path):
    with pytest.raises(DistributedTestError) as caught:  # rank 1, stopped, is killed by rank 0 in the end
        run_distributed(_job, 2, str(tmp_path), "frozen-save", timeout=150, report_grace=30)
    assert set(caught.value.errors) == {1}, caught.value.errors
    r0 = caught.value.results[0]
    kind, message, missing = r0["error"]
    assert kind == RankTimeoutError.__name__, message
    assert missing == [1] and "global rank(s) 1 stood still" in message, message
    assert "was not committed" in message, message
    # It waited while rank 1 was alive (2 T), then named it about T after it stopped.
    assert 2 * T < r0["seconds"] < 2 * T + 3 * T, r0["seconds"]
    assert r0["latest"] == "step-00000001" and r0["dirs"] == ["latest", "step-00000001"], r0
    ckpt = os.path.join(tmp_path, "ckpt")
    assert _same(_world1_state(ckpt, str(tmp_path / "w1")), r0["before"])


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(180)
def test_a_rank_late_past_checkpoint_patience_is_named_and_the_previous_checkpoint_stands(tmp_path):
    """Without the limit this rank would be waited for (test above): with it, rank 0 gives up T after finishing its
    own part, and rank 1, whose write returns later, raises the same error instead of going on to the gather."""
    r0, r1 = run_distributed(_job, 2, str(tmp_path), "late-save", timeout=150)
    for r in (r0, r1):
        kind, message, missing = r["error"]
        assert kind == RankTimeoutError.__name__, message
        assert missing == [1] and "Global rank(s) 1 were still at it 3 s (checkpoint_patience)" in message, message
        assert "was not committed" in message, message
    assert T <= r0["seconds"] < SLOW, r0["seconds"]  # rank 0 did not wait for rank 1's write to end
    assert r1["seconds"] >= SLOW, r1["seconds"]
    assert r0["latest"] == "step-00000001" and r0["dirs"] == ["latest", "step-00000001"], r0
    ckpt = os.path.join(tmp_path, "ckpt")
    assert sorted(os.listdir(ckpt)) == ["latest", "step-00000001"]  # once rank 1's late write has returned too
    assert _same(_world1_state(ckpt, str(tmp_path / "w1")), r0["before"])
