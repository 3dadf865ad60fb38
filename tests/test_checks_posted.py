"""The collective schedule's checks are posted, not waited for where they are made, and verified before any
collective issued after them is used ([Note: checks posted, verified at the wait] in hetero/zero/protocol.py).

A rank makes its check and issues its collective while the other rank is still away; the collective's wait is where
the ranks meet, and where ranks that disagree both stop with the error naming every rank's collective and the units
each started last. Under the stand-in (separate data and control groups) the same holds.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.dist import ONE_RANK_FAULTS, RANKS_DIFFER, ranks_apart

try:
    from tests import branchy
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import branchy  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

LATE_S = 1.5  # how long rank 1 stays away before its check


def _checker(comm):
    from types import SimpleNamespace

    from hetero.zero.protocol import Checker

    return Checker(comm, enabled=True, units=[SimpleNamespace(name="blocks.0")], chunks=[])


def _run_posted(rank: int, world: int) -> dict:
    from hetero.comm import Comm
    from hetero.zero.protocol import GATHER

    comm = Comm.world()
    check = _checker(comm)
    for _ in range(2):
        # On gloo a check the ranks do not all expect next is verified before its collective ([Note: a check
        # verified before a collective of another size] in hetero/zero/protocol.py): teach it this one first.
        check(GATHER, chunk=3)
        comm.all_reduce_async(torch.zeros(4)).wait()
    comm.barrier()
    if rank == 1:
        time.sleep(LATE_S)
    t0 = time.monotonic()
    check(GATHER, chunk=3)
    data = torch.full((4,), float(rank + 1))
    handle = comm.all_reduce_async(data)
    issued = time.monotonic() - t0
    handle.wait()
    waited = time.monotonic() - t0
    return {"issued": issued, "waited": waited, "data": data.tolist(), "posted_left": check.mark()}


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
def test_a_check_is_not_a_rendezvous_and_the_wait_verifies_it(monkeypatch):
    monkeypatch.delenv("HETERO_STANDIN", raising=False)  # host tensors on the data group
    results = run_distributed(_run_posted, 2, timeout=100)
    early = results[0]
    # Rank 0 checked and issued its all-reduce without waiting for rank 1, then met it at the wait.
    assert early["issued"] < LATE_S / 3, early
    assert early["waited"] >= LATE_S * 0.8, early
    for r in results:
        assert r["data"] == [3.0] * 4, r


def _run_apart(rank: int, world: int, blocking: bool) -> str:
    import hetero
    from hetero.comm import Comm
    from hetero.zero.protocol import GATHER, REDUCE

    comm = Comm.world()
    check = _checker(comm)
    for _ in range(2):  # rank 0's next check is the one the ranks expect: it is posted, and verified at the wait
        check(GATHER, chunk=2)
        comm.all_reduce_async(torch.zeros(4)).wait()
    check.started.append((0, 1))
    # Rank 1 took another path: it is about to reduce chunk 5 where rank 0 gathers chunk 2. The collectives have
    # the same size, so without the check they would pair up and mix the data silently. Rank 1's check is not the
    # one expected, so it verifies it before its collective ([Note: a check verified before a collective of another
    # size] in hetero/zero/protocol.py).
    data = torch.full((4,), float(rank + 1))
    try:
        check(GATHER, chunk=2) if rank == 0 else check(REDUCE, chunk=5)
        if blocking:
            comm.all_reduce(data)
        else:
            comm.all_reduce_async(data).wait()
    except hetero.errors.CollectiveMismatchError as err:
        return str(err)
    return "no error"


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(120)
def test_ranks_apart_both_stop_at_the_wait_naming_every_rank(monkeypatch):
    monkeypatch.delenv("HETERO_STANDIN", raising=False)  # host tensors on the data group
    results = run_distributed(_run_apart, 2, False, timeout=100)
    for message in results:
        assert "different collectives" in message, message
        assert "rank 0: collective #3, gather" in message and "rank 1: collective #3, reduce-scatter" in message
        # The units started last came in the check's row: no second exchange.
        assert "started, last: 'blocks.0' (forward)" in message, message


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(120)
def test_a_blocking_collective_after_a_check_verifies_it_first(monkeypatch):
    monkeypatch.delenv("HETERO_STANDIN", raising=False)  # host tensors on the data group
    for message in run_distributed(_run_apart, 2, True, timeout=100):
        assert "different collectives" in message, message


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(120)
def test_under_the_standin_a_skipped_module_stops_both_ranks(monkeypatch):
    """The stand-in's control group is a group of its own, as on a GPU node (gloo beside NCCL): the checks and the
    collectives no longer share one queue, and both ranks still stop with the error."""
    monkeypatch.setenv("HETERO_STANDIN", "1")
    for r in run_distributed(branchy.run_skipped_module, 2, timeout=100):
        seconds, _, message = r.partition("|")
        assert message and float(seconds) < 10, r
        assert "'extra'" in message and "move it into a block" in message, message
