"""Edges of hetero.comm that a user hits by mistake: an object that cannot be pickled in an object collective, and
launches that give two processes one RANK or the ranks different WORLD_SIZEs ([Note: the roll call at joining])."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from hetero.comm import Comm, launch
from hetero.errors import CommError
from tests.dist import ONE_RANK_FAULTS, cpu_ranks_env, free_port, ranks_apart, run_distributed

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------ objects
def _unpicklable_on_rank_one(rank: int, world: int, op: str) -> dict[str, Any]:
    comm = Comm.world().with_timeout(20)
    obj = (lambda: 1) if rank == 1 else {"rank": rank}
    try:
        got: Any = comm.all_gather_object(obj) if op == "all_gather" else comm.broadcast_object(obj, src=1)
    except CommError as err:
        got = str(err)
    after = comm.all_gather_object(rank)  # the group stays usable, its ranks matched
    return {"got": got, "after": after}


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["all_gather", "broadcast"])
def test_an_object_that_cannot_be_pickled_fails_every_rank_alike(op: str) -> None:
    """Rank 1's lambda raised on rank 1 alone: rank 0 went on waiting in the sizes' collective, which rank 1's next
    object call completed, so rank 0's all-gather returned [its first object, rank 1's second] without an error (a
    broadcast waited until the timeout)."""
    results = run_distributed(_unpicklable_on_rank_one, 3, op, timeout=100)
    for r in results:
        assert isinstance(r["got"], str), r
        assert "group rank(s) 1 could not be pickled" in r["got"] and "lambda" in r["got"], r
        assert r["after"] == [0, 1, 2]


# ------------------------------------------------------------------------------------------ the roll call
def _call(store_port: int, rank: int, world: int, me: str, out: dict[str, str], timeout_s: float = 10) -> None:
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        launch._roll_call(store, rank, world, timeout_s, "here", me=me)
        out[me] = "joined"
    except CommError as err:
        out[me] = str(err)


def _roll(calls: list[tuple[int, int, str]], timeout_s: float = 10) -> dict[str, str]:
    """Run the roll call of each (rank, world size, process name), each in a thread of its own, against one store;
    the threads of one list start together. Returns each process's outcome."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    out: dict[str, str] = {}
    threads = [threading.Thread(target=_call, args=(port, r, w, me, out, timeout_s)) for r, w, me in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    del server
    return out


def test_the_roll_call_admits_a_whole_world() -> None:
    got = _roll([(0, 3, "a"), (1, 3, "b"), (2, 3, "c")])
    assert got == {"a": "joined", "b": "joined", "c": "joined"}


def test_a_rank_started_twice_is_named_before_the_backend_connects() -> None:
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    out: dict[str, str] = {}
    both = [threading.Thread(target=_call, args=(port, r, 2, me, out)) for r, me in ((0, "a"), (1, "b"))]
    for t in both:
        t.start()
    for t in both:
        t.join(20)
    assert out == {"a": "joined", "b": "joined"}
    start = time.monotonic()
    _call(port, 1, 2, "b again", out)  # after the world formed: only the second process stops
    assert "rank 1 was started twice at here: by b and by b again" in out["b again"]
    assert time.monotonic() - start < 5  # at once, not after the timeout
    _call(port, 1, 2, "b", out)  # the same process joining again (destroy_process_group, then init) holds its claim
    assert out["b"] == "joined"
    del server


def test_a_rank_started_twice_before_the_world_formed_stops_every_rank() -> None:
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    out: dict[str, str] = {}
    first = [threading.Thread(target=_call, args=(port, r, 3, me, out)) for r, me in ((0, "a"), (1, "b"))]
    for t in first:
        t.start()
    time.sleep(0.5)  # both wait for rank 2
    _call(port, 1, 3, "b again", out)
    for t in first:
        t.join(20)
    assert all("rank 1 was started twice" in v for v in out.values()), out
    del server


def test_ranks_with_another_world_size_are_refused_on_every_rank() -> None:
    got = _roll([(0, 2, "a"), (1, 3, "b")])
    for v in got.values():
        assert "the ranks disagree on the world size: rank 0 has WORLD_SIZE 2, rank 1 (b) has 3" in v, got


def test_a_rank_that_never_comes_is_named_at_the_timeout() -> None:
    got = _roll([(0, 3, "a"), (2, 3, "c")], timeout_s=1.5)
    for v in got.values():
        assert "rank(s) 1 did not join at here within 1.5 s" in v, got


_JOIN = """
import sys
from hetero.comm import init_from_env
try:
    comm = init_from_env(timeout_s=40)
    print("joined", comm.rank, comm.size)
except Exception as err:
    print("refused", type(err).__name__, err)
"""


@pytest.mark.timeout(120)
def test_init_from_env_refuses_ranks_launched_with_different_world_sizes() -> None:
    """Rank 1 launched with WORLD_SIZE 3 beside rank 0's 2: rank 0 joined a world of two and its first collective
    timed out (after the whole timeout) saying rank 1 did not arrive; rank 1 hung in the join until the timeout."""
    port = free_port()
    procs = []
    start = time.monotonic()
    for rank, world in ((0, 2), (1, 3)):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable, "-c", _JOIN]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=cpu_ranks_env(env), stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=100)[0] for p in procs]
    for out in outs:
        assert "refused CommError" in out and "disagree on the world size" in out, outs
    assert time.monotonic() - start < 35  # well before the 40 s timeout: imports, then the refusal at once


def test_a_master_port_taken_on_rank_zeros_host_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from hetero.comm import init_from_env

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        start = time.monotonic()
        with pytest.raises(CommError, match=f"MASTER_PORT {port} is taken on this host"):
            init_from_env(backend="gloo", timeout_s=30)
        assert time.monotonic() - start < 10
    assert not dist.is_initialized()
