"""What a user sees after a collective failed: the error says to restart every rank, and a later collective, or a new
engine, on that group raises `GroupUnusableError` at once, where before the new engine's first collective met one a
rank had queued before the failure and gloo ended the process natively ("Received data size doesn't match", SIGABRT,
no Python error): [Note: a group no collective may use after a failure] in hetero/comm/rules.py.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

try:
    from tests.dist import ONE_RANK_FAULTS, RANKS_DIFFER, ranks_apart, run_distributed
    from tests.test_diverging_paths import CONFIG, GOOD_STEPS, Net
except ImportError:  # tests/ itself on sys.path
    from dist import ONE_RANK_FAULTS, RANKS_DIFFER, ranks_apart, run_distributed  # type: ignore[no-redef]
    from test_diverging_paths import CONFIG, GOOD_STEPS, Net  # type: ignore[no-redef]

# A refused call issues nothing and waits for no peer; one that reached the group would wait for the absent or
# diverged peer until its timeout. So a call that ends within this timeout was refused, not timed out.
RETRY_TIMEOUT_S = 20.0
SHORT_TIMEOUT_S = 2.0  # the timed-out collective's own timeout


def _engine(config: dict):
    import hetero

    torch.manual_seed(0)
    model = Net()
    return hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


def _timed(fn) -> tuple[str | None, str, float]:
    """fn's error (type, message) and how long it took."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as err:  # noqa: BLE001 -- the test reports whatever it is
        return type(err).__name__, str(err), time.monotonic() - t0
    return None, "", time.monotonic() - t0


def _mismatch_then_retry(rank: int, world: int) -> dict:
    import hetero
    from hetero.comm import Comm

    engine = _engine(dict(CONFIG))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))
    first = None
    try:
        for i in range(GOOD_STEPS + 1):
            # At GOOD_STEPS rank 1 skips `extra`, whose gather rank 0 issues: a gather of another size stays queued.
            engine.backward(engine(ids, skip=i == GOOD_STEPS and rank == 1))
            engine.step()
    except hetero.errors.CollectiveMismatchError as err:
        first = str(err)
    finally:
        engine.close()
    # What a notebook or a retry loop does next: a new engine on the same (default) group, then a collective.
    config = {**CONFIG, "comm_timeout": RETRY_TIMEOUT_S}
    again = _timed(lambda: _engine(config))
    reduce = _timed(lambda: Comm.world().all_reduce(torch.ones(3)))
    return {"first": first, "again": again, "reduce": reduce}


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("standin", [False, True], ids=["gloo", "standin"])
def test_a_new_engine_after_a_mismatch_raises_at_once_instead_of_ending_the_process(monkeypatch, standin):
    if standin:
        monkeypatch.setenv("HETERO_STANDIN", "1")
    else:
        monkeypatch.delenv("HETERO_STANDIN", raising=False)
    results = run_distributed(_mismatch_then_retry, 2, timeout=200)
    for rank, r in enumerate(results):
        assert r["first"] is not None and "different collectives" in r["first"], r
        assert "Restart every rank" in r["first"] and "last committed checkpoint is intact" in r["first"], r
        for kind, message, took in (r["again"], r["reduce"]):
            assert kind == "GroupUnusableError", (rank, kind, message)
            assert "was refused" in message and "Restart every rank" in message, message
            assert took < RETRY_TIMEOUT_S, (rank, took)


def _timeout_then_retry(rank: int, world: int, flag_dir: str) -> dict:
    from hetero.comm import Comm

    # Host tensors through the host-side groups (under the stand-in the data groups take device tensors only).
    world_comm = Comm.world()
    other = world_comm.split([[0, 1]]).control  # a group made before the failure: it queued nothing of it
    if rank == 1:  # away from the first collective until rank 0 has its error and has tried again
        while not os.listdir(flag_dir):
            time.sleep(0.05)
        data = torch.full((2,), 2.0)
        other.all_reduce(data)
        return {"other": data.tolist()}
    comm = world_comm.with_timeout(SHORT_TIMEOUT_S).control
    try:
        comm.all_reduce(torch.ones(1000))
        notes: list[str] = []
        kind = None
    except Exception as err:  # noqa: BLE001
        kind, notes = type(err).__name__, [str(err), *getattr(err, "__notes__", [])]
    again = _timed(lambda: comm.all_reduce(torch.ones(1000)))
    barrier = _timed(lambda: comm.barrier())
    engine = _timed(lambda: _engine({**CONFIG, "comm_timeout": SHORT_TIMEOUT_S}))
    open(os.path.join(flag_dir, "done"), "w").close()
    data = torch.full((2,), 1.0)
    other.all_reduce(data)
    return {"kind": kind, "notes": notes, "again": again, "barrier": barrier, "engine": engine, "other": data.tolist()}


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(180)
def test_a_timed_out_collective_says_to_restart_and_refuses_its_group_only(tmp_path):
    r0, r1 = run_distributed(_timeout_then_retry, 2, str(tmp_path), timeout=150)
    assert r0["kind"] == "RankTimeoutError", r0
    assert any("Restart every rank" in n for n in r0["notes"]), r0
    for kind, message, took in (r0["again"], r0["barrier"], r0["engine"]):
        assert kind == "GroupUnusableError" and "Restart every rank" in message, (kind, message)
        # Under the timeout the failed collective waited: only a refusal, which waits for no one, ends sooner.
        assert took < SHORT_TIMEOUT_S, (kind, message, took)
    # The record is the group's: a group that existed beside it still works (a pipeline's own group does so).
    assert r0["other"] == r1["other"] == [3.0, 3.0], (r0, r1)
