"""Tests of hetero.comm: collectives against local math at world sizes 1, 2 and 4; subgroups; env; timeouts.

Spawning ranks costs seconds, so each distributed test runs one function that checks many things at once.
"""

from __future__ import annotations

import inspect
import os
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

from hetero.comm import Comm, init_from_env, local_rank
from hetero.errors import CommError, RankTimeoutError

try:
    from tests import dist as _dist
except ImportError:  # tests/ itself on sys.path (pytest's rootdir-less import mode)
    import dist as _dist  # type: ignore[no-redef]

ONE_RANK_FAULTS, ONLY_SEVERAL, ranks_apart = _dist.ONE_RANK_FAULTS, _dist.ONLY_SEVERAL, _dist.ranks_apart
DistributedTestError, DistributedTimeoutError = _dist.DistributedTestError, _dist.DistributedTimeoutError
run_distributed = _dist.run_distributed

DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int64)


def _data(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank-specific small integers: exact in every dtype tested (bf16 included), so sums compare exactly."""
    return ((torch.arange(n) * (rank + 1) + 3 * rank + salt) % 23 - 7).to(dtype)


def _reduce_local(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    s = torch.stack([x.double() for x in xs])
    out = {"sum": s.sum(0), "avg": s.sum(0) / len(xs), "max": s.max(0).values, "min": s.min(0).values}[op]
    return out.to(xs[0].dtype)


def _check_collectives(comm: Comm, ranks_of: list[int]) -> int:
    """Check every collective of ``comm`` against local math; ``ranks_of`` are its members' global ranks.

    Data depend on the *global* rank, so a wrong rank translation shows up as a wrong result. Returns the
    number of checks made.
    """
    me, size, checks = comm.rank, comm.size, 0
    assert comm.global_ranks == ranks_of, (comm.global_ranks, ranks_of)
    g = ranks_of[me]
    # all_reduce: every op and dtype, contiguous and not.
    for dtype in DTYPES:
        for op in ("sum", "avg", "max", "min"):
            if op == "avg" and not dtype.is_floating_point:
                continue
            t = _data(g, 37, dtype)
            comm.all_reduce(t, op)
            want = _reduce_local([_data(r, 37, dtype) for r in ranks_of], op)
            torch.testing.assert_close(t, want, msg=lambda m, d=dtype, o=op: f"all_reduce {o} {d}: {m}")
            checks += 1
    base = _data(g, 24, torch.float32).view(4, 6)
    t = base.t()  # not contiguous
    comm.all_reduce(t, "sum")
    want = _reduce_local([_data(r, 24, torch.float32).view(4, 6) for r in ranks_of], "sum")
    torch.testing.assert_close(t, want.t())
    checks += 1

    # all_reduce_bucketed: mixed dtypes and shapes, a non-contiguous tensor, one tensor above the bucket size.
    def bucket_inputs(r: int) -> list[torch.Tensor]:
        return [
            _data(r, 10, torch.float32),
            _data(r, 6, torch.bfloat16, 1).view(2, 3),
            _data(r, 12, torch.float32, 2).view(3, 4).t(),
            _data(r, 100, torch.float32, 3),  # 400 bytes > bucket_bytes: alone
            _data(r, 5, torch.float64, 4),
            _data(r, 3, torch.float32, 5),
        ]

    for op in ("sum", "avg", "max"):
        ts = bucket_inputs(g)
        comm.all_reduce_bucketed(ts, op=op, bucket_bytes=64)
        for i, t in enumerate(ts):
            want = _reduce_local([bucket_inputs(r)[i] for r in ranks_of], op)
            torch.testing.assert_close(t, want, msg=lambda m, i=i, o=op: f"bucketed {o} tensor {i}: {m}")
        checks += 1
    # One collective per bucket of 64 B: fp32 [10] (40 B), [12] (48 B) does not fit with it, [100] (400 B) is
    # alone, [3] does not fit after it; bf16 and fp64 one bucket each -> 6 collectives.
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]  # type: ignore[assignment]
    try:
        comm.all_reduce_coalesced(bucket_inputs(g), bucket_bytes=64)
    finally:
        dist.all_reduce = real  # type: ignore[assignment]
    assert len(calls) == 6, f"expected 6 bucket collectives, got {len(calls)}"

    # reduce_scatter, native and with the all_reduce fallback.
    n = 5
    for native in (None, False):
        comm._native_rs = native
        for op in ("sum", "avg", "min"):
            out = torch.zeros(n)
            comm.reduce_scatter(out, _data(g, size * n, torch.float32), op)
            want = _reduce_local([_data(r, size * n, torch.float32) for r in ranks_of], op)
            want = want[me * n : (me + 1) * n]
            torch.testing.assert_close(
                out, want, msg=lambda m, o=op, nat=native: f"reduce_scatter {o} native={nat}: {m}"
            )
            checks += 1
    out2 = torch.zeros(3, 2).t()  # non-contiguous out
    comm.reduce_scatter(out2, _data(g, size * 6, torch.bfloat16).float())
    want = _reduce_local([_data(r, size * 6, torch.bfloat16).float() for r in ranks_of], "sum")
    want = want[me * 6 : me * 6 + 6]
    torch.testing.assert_close(out2, want.view(2, 3))  # out in its logical (row-major) order

    # In place, as ZeRO does: out is this rank's shard of inp (reduce_scatter) / inp of out (all_gather).
    flat = _data(g, size * n, torch.float32)
    comm.reduce_scatter(flat[me * n : (me + 1) * n], flat)
    want = _reduce_local([_data(r, size * n, torch.float32) for r in ranks_of], "sum")[me * n : (me + 1) * n]
    torch.testing.assert_close(flat[me * n : (me + 1) * n], want)
    flat = torch.zeros(size * n)
    flat[me * n : (me + 1) * n] = _data(g, n, torch.float32)
    comm.all_gather(flat, flat[me * n : (me + 1) * n])
    torch.testing.assert_close(flat, torch.cat([_data(r, n, torch.float32) for r in ranks_of]))
    checks += 2

    # all_gather, native and with the list fallback; 2-D out.
    for native in (None, False):
        comm._native_ag = native
        out = torch.zeros(size, 7, dtype=torch.bfloat16)
        comm.all_gather(out, _data(g, 7, torch.bfloat16))
        torch.testing.assert_close(out, torch.stack([_data(r, 7, torch.bfloat16) for r in ranks_of]))
        checks += 1

    # broadcast from every source, contiguous and not.
    for src in range(size):
        t = torch.full((3,), float(g))
        comm.broadcast(t, src)
        assert t.tolist() == [float(ranks_of[src])] * 3
        nc = torch.full((2, 3), float(g)).t()
        comm.broadcast(nc, src)
        assert (nc == ranks_of[src]).all()
        checks += 1
    assert comm.broadcast_object({"from": g}, src=size - 1) == {"from": ranks_of[-1]}
    assert comm.all_gather_object(("r", g)) == [("r", r) for r in ranks_of]
    comm.barrier()
    comm.barrier(timeout=30)
    checks += 1

    # Point-to-point around the ring, in group ranks; parity ordering keeps blocking send/recv from deadlock.
    right, left = (me + 1) % size, (me - 1) % size
    got = torch.zeros(4)
    if me % 2 == 0:
        comm.send(torch.full((4,), float(g)), right)
        comm.recv(got, left)
    else:
        comm.recv(got, left)
        comm.send(torch.full((4,), float(g)), right)
    assert got.tolist() == [float(ranks_of[left])] * 4
    got_nc = torch.zeros(2, 2).t()
    handles = [comm.irecv(got_nc, left), comm.isend(torch.full((2, 2), float(g) + 0.5).t(), right)]
    for h in handles:
        h.wait()
    assert (got_nc == ranks_of[left] + 0.5).all()
    checks += 1

    # Local validation, identical on every rank, so no rank is left in a collective.
    with pytest.raises(ValueError, match="unknown reduce op"):
        comm.all_reduce(torch.zeros(1), "prod")
    with pytest.raises(ValueError, match="floating point"):
        comm.all_reduce(torch.zeros(1, dtype=torch.int64), "avg")
    with pytest.raises(ValueError, match="group size"):
        comm.reduce_scatter(torch.zeros(2), torch.zeros(2 * size + 1))
    with pytest.raises(ValueError, match="group size"):
        comm.all_gather(torch.zeros(2 * size + 1), torch.zeros(2))
    with pytest.raises(ValueError, match="this rank itself"):
        comm.send(torch.zeros(1), me)
    with pytest.raises(ValueError, match="not a rank"):
        comm.broadcast(torch.zeros(1), size)
    return checks + 1


def _world_checks(rank: int, world_size: int) -> dict[str, Any]:
    comm = Comm.world()
    assert (comm.rank, comm.size, comm.backend) == (rank, world_size, "gloo")
    assert init_from_env().global_ranks == comm.global_ranks  # already initialised: the same world
    assert local_rank() == rank
    report: dict[str, Any] = {"world": _check_collectives(comm, list(range(world_size)))}

    with pytest.raises(ValueError, match="missing"):
        comm.split([[r] for r in range(world_size - 1)])
    with pytest.raises(ValueError, match="must not overlap"):
        comm.split([[0], [0, *range(1, world_size)]])

    if world_size == 2:
        solo = comm.split([[0], [1]])
        assert (solo.size, solo.rank, solo.global_ranks) == (1, 0, [rank])
        t = torch.ones(3)
        solo.all_reduce(t)
        assert t.tolist() == [1.0] * 3
        report["split"] = True
    if world_size == 4:
        # Consecutive halves, then interleaved halves whose group ranks differ from the global ones.
        for parts in ([[0, 1], [2, 3]], [[3, 0], [1, 2]]):
            sub = comm.split(parts)
            members = sorted(next(p for p in parts if rank in p))
            assert sub.size == 2 and sub.rank == members.index(rank)
            report[f"split{parts}"] = _check_collectives(sub, members)
            # A split of a proper subgroup: only its members take part.
            pair = sub.split([[1, 0]])
            assert pair.global_ranks == members and pair.rank == sub.rank
            t = torch.full((2,), float(rank))
            pair.all_reduce(t)
            assert t.tolist() == [float(sum(members))] * 2
            solo = sub.split([[0], [1]])
            assert solo.size == 1 and solo.global_ranks == [rank]
            solo.barrier(timeout=1)
    comm.barrier(timeout=30)
    return report


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_match_local_math(world_size: int, cpu_device) -> None:
    reports = run_distributed(_world_checks, world_size, timeout=110)
    assert len(reports) == world_size
    for report in reports:
        assert report["world"] > 20
        if world_size == 4:
            assert report["split[[0, 1], [2, 3]]"] > 20 and report["split[[3, 0], [1, 2]]"] > 20


# ---------------------------------------------------------------------------------------------- world size 1
@pytest.fixture
def no_dist(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every torch.distributed function raise, so any call from hetero fails the test."""

    def forbidden(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"torch.distributed.{name} was called in a world of size 1")

        return call

    for name, obj in list(vars(dist).items()):
        # reduce_op is a deprecated alias that warns when touched.
        if name.startswith("__") or name == "reduce_op":
            continue
        if inspect.isfunction(obj) or inspect.isbuiltin(obj):
            monkeypatch.setattr(dist, name, forbidden(name))


def test_world_size_one_makes_no_distributed_calls(no_dist: None) -> None:
    comm = Comm()
    assert (comm.rank, comm.size, comm.global_ranks, comm.backend) == (0, 1, [0], "none")
    t = torch.arange(6.0)
    for op in ("sum", "avg", "max", "min"):
        comm.all_reduce(t, op)
    assert t.tolist() == list(range(6))
    ts = [torch.ones(3), torch.zeros(2, dtype=torch.bfloat16)]
    comm.all_reduce_bucketed(ts, op="avg", bucket_bytes=4)
    assert ts[0].tolist() == [1.0] * 3 and ts[1].tolist() == [0.0] * 2
    out = torch.zeros(2, 3)
    comm.reduce_scatter(out, torch.arange(6.0))
    assert out.flatten().tolist() == list(range(6))
    out = torch.zeros(4)
    comm.all_gather(out, torch.arange(4.0).view(2, 2))
    assert out.tolist() == list(range(4))
    comm.broadcast(t, 0)
    assert comm.broadcast_object({"a": 1}) == {"a": 1}
    assert comm.all_gather_object(5) == [5]
    comm.barrier()
    comm.barrier(timeout=1)
    assert comm.split([[0]]) is comm
    with pytest.raises(CommError, match="size 1 has no other rank"):
        comm.send(t, 0)
    with pytest.raises(CommError, match="size 1"):
        comm.irecv(t, 0)
    with pytest.raises(ValueError, match="group size"):
        comm.all_gather(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="not a rank"):
        comm.broadcast(t, 1)


def test_world_without_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    assert Comm.world().size == 1
    for var in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("init_process_group must not be called for a world of size 1")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    assert init_from_env().size == 1
    monkeypatch.setenv("WORLD_SIZE", "1")
    comm = init_from_env()
    assert comm.size == 1 and comm.group is None
    assert local_rank() == 0


# ------------------------------------------------------------------------------------------ init_from_env env
_GOOD_ENV = {
    "WORLD_SIZE": "2",
    "RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "LOCAL_RANK": "1",
}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"RANK": None}, "RANK is not set"),
        ({"RANK": "one"}, "RANK = 'one' is not an integer"),
        ({"RANK": "2"}, r"RANK = 2 must lie in \[0, WORLD_SIZE = 2\)"),
        ({"RANK": "-1"}, "RANK = -1 must lie"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE = 'two' is not an integer"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE = 0 must be >= 1"),
        ({"MASTER_ADDR": None}, "MASTER_ADDR is not set"),
        ({"MASTER_ADDR": " "}, "MASTER_ADDR is not set"),
        ({"MASTER_PORT": None}, "MASTER_PORT is not set"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT = 'http' is not an integer"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT = 70000 is not a TCP port"),
        ({"LOCAL_RANK": "-3"}, "LOCAL_RANK = -3 must be >= 0"),
        ({"LOCAL_RANK": "x"}, "LOCAL_RANK = 'x' is not an integer"),
    ],
)
def test_init_from_env_bad_env(monkeypatch: pytest.MonkeyPatch, change: dict[str, Any], match: str) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("init_process_group must not be reached with a bad environment")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    for k, v in {**_GOOD_ENV, **change}.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    with pytest.raises(CommError, match=match):
        init_from_env(backend="gloo")


def test_init_from_env_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in _GOOD_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CommError, match="nccl' needs CUDA"):
        init_from_env(backend="nccl")
    with pytest.raises(ValueError, match="timeout_s"):
        init_from_env(timeout_s=0)


# ------------------------------------------------------------------------------------- the harness itself
def _probe_env(rank: int, world_size: int) -> tuple[str | None, str]:
    return os.environ.get("HETERO_TEST_PROBE"), os.getcwd()


@pytest.mark.timeout(120)
def test_ranks_start_with_the_test_processs_environment_and_directory(monkeypatch, tmp_path) -> None:
    """[Note: ranks forked from a server] (tests/dist.py): ranks forked from a server started earlier still see the
    environment and working directory of the test process when it starts them, as spawned ranks did. The first
    call starts the server (if no earlier test did) before the variable is set."""
    monkeypatch.delenv("HETERO_TEST_PROBE", raising=False)
    assert run_distributed(_probe_env, 2, timeout=100)[0][0] is None
    monkeypatch.setenv("HETERO_TEST_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    assert run_distributed(_probe_env, 2, timeout=100) == [("set after the server started", str(tmp_path))] * 2
    monkeypatch.delenv("HETERO_TEST_PROBE")
    assert run_distributed(_probe_env, 2, timeout=100)[1][0] is None


# ------------------------------------------------------------------------------------- failures and timeouts
def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("boom from rank one")
    return rank


def _barrier_with_hung_rank(rank: int, world_size: int, flag_dir: str) -> dict[str, Any]:
    comm = Comm.world()
    if rank == world_size - 1:
        # Hung as far as the others can tell: it never reaches the barrier. It leaves once they have their
        # errors, so this test need not wait for the harness timeout (test_harness_timeout covers that).
        while len(os.listdir(flag_dir)) < world_size - 1:
            time.sleep(0.05)
        return {"hung": True}
    t0 = time.monotonic()
    try:
        comm.barrier(timeout=2)
        return {"missing": "no error"}
    except RankTimeoutError as err:
        return {"missing": err.missing_ranks, "message": str(err), "elapsed": time.monotonic() - t0}
    finally:
        open(os.path.join(flag_dir, f"rank{rank}"), "w").close()


def _sleep_forever_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        while True:
            time.sleep(60)
    return rank


def _children() -> list[psutil.Process]:
    """Live child processes of this test process, but multiprocessing's long-lived resource tracker and fork server
    (tests/dist.py, [Note: ranks forked from a server]; the ranks it forks carry its command line, and count)."""
    from multiprocessing import forkserver

    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    kids = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in cmd and p.pid != server:
                kids.append(p)
        except psutil.NoSuchProcess:
            pass
    return kids


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
def test_rank_error_reraised_with_traceback() -> None:
    with pytest.raises(DistributedTestError, match="rank 1 raised") as info:
        run_distributed(_raise_on_rank_one, 2, timeout=100)
    assert "boom from rank one" in str(info.value) and "Traceback" in str(info.value)
    assert info.value.results == {0: 0}
    assert _children() == []
    with pytest.raises(TypeError, match="picklable"):
        run_distributed(lambda r, w: r, 1)


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
def test_hung_rank_makes_timed_barrier_raise(tmp_path: Path) -> None:
    results = run_distributed(_barrier_with_hung_rank, 3, str(tmp_path), timeout=100)
    assert results[2] == {"hung": True}
    # Group rank 0 monitors the barrier and names the missing rank; the others are told to look at rank 0.
    monitor, other = results[0], results[1]
    assert monitor["missing"] == [2], monitor
    assert "global rank(s) 2 did not arrive" in monitor["message"]
    assert monitor["elapsed"] < 15
    assert other["missing"] is None and "Global rank 0" in other["message"], other
    assert _children() == []


def _object_collective_with_absent_rank(rank: int, world_size: int, flag_dir: str, op: str) -> dict[str, Any]:
    if rank == 1:  # never arrives; leaves once rank 0 has its error
        while not os.listdir(flag_dir):
            time.sleep(0.05)
        return {}
    comm = Comm.world().with_timeout(2)  # the group itself waits as long as the harness: 100 s
    t0 = time.monotonic()
    try:
        if op == "broadcast":
            comm.broadcast_object({"x": 1}, src=0)
        else:
            comm.all_gather_object({"x": 1})
        return {"missing": "no error"}
    except RankTimeoutError as err:
        return {"missing": err.missing_ranks, "message": str(err), "elapsed": time.monotonic() - t0}
    finally:
        open(os.path.join(flag_dir, "done"), "w").close()


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["broadcast", "all_gather"])
def test_object_collectives_give_up_after_the_comms_own_timeout(tmp_path: Path, op: str) -> None:
    # torch's object collectives wait as long as the process group was made to wait, not `with_timeout`'s.
    got = run_distributed(_object_collective_with_absent_rank, 2, str(tmp_path), op, timeout=100)[0]
    assert got["missing"] == [1], got
    assert f"{op}_object" in got["message"] and "did not arrive" in got["message"], got
    assert got["elapsed"] < 15, got


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
def test_harness_timeout_kills_hung_rank() -> None:
    t0 = time.monotonic()
    with pytest.raises(DistributedTimeoutError, match=r"ranks still running: \[(0, )?1\]") as info:
        run_distributed(_sleep_forever_on_rank_one, 2, timeout=6)
    assert 6 <= time.monotonic() - t0 < 25
    assert isinstance(info.value, TimeoutError)
    assert info.value.running in ([1], [0, 1])  # [0, 1] only if spawning alone took the whole 6 s
    if info.value.running == [1]:
        assert info.value.results == {0: 0}
    assert _children() == []


def test_batch_p2p_gives_one_handle_per_operation_when_the_backend_coalesces(monkeypatch: pytest.MonkeyPatch) -> None:
    # NCCL returns one work for a whole batched group; the pipeline waits on the handle of each receive it needs.
    comm = Comm()
    comm.rank, comm.size, comm._global_ranks = 0, 2, [0, 1]
    waited = []

    class Work:
        def wait(self) -> bool:
            waited.append(1)
            return True

    monkeypatch.setattr(dist, "P2POp", lambda *args: args)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [Work()])
    t = torch.zeros(2)
    handles = comm.batch_p2p([("send", t, 1, 0), ("recv", torch.zeros(2), 1, 1), ("recv", torch.zeros(2), 1, 2)])
    assert len(handles) == 3
    handles[2].wait()
    assert waited == [1]
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [Work() for _ in ops])  # gloo: one work per operation
    assert len(comm.batch_p2p([("send", t, 1, 0), ("recv", torch.zeros(2), 1, 1)])) == 2


_LEAVER = """
import atexit, os, sys, time
out = sys.argv[1]
atexit.register(lambda: open(out, "w").write(repr(time.monotonic())))  # runs after hetero's own exit hook (LIFO)
from hetero.comm import init_from_env
init_from_env(backend="gloo", timeout_s=60)
if os.environ["RANK"] == "0":
    time.sleep(float(sys.argv[2]))
elif sys.argv[3] == "raise":
    raise SystemError("rank 1 fails")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["clean", "raise"])
def test_ranks_leave_the_group_together(tmp_path: Path, ending: str) -> None:
    """[Note: leaving together] A rank that finishes cleanly waits for the others before it closes its connections
    (rank 1 ends after rank 0's late finish); a rank that ends in an exception leaves at once."""
    import subprocess
    import sys

    from tests.dist import cpu_ranks_env, free_port

    script = tmp_path / "leave.py"
    script.write_text(_LEAVER)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    late = 4.0
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / f"end{r}"), str(late), ending],
            env=cpu_ranks_env({**env, "RANK": str(r), "LOCAL_RANK": str(r)}),
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    errs = [p.communicate(timeout=100)[1] for p in procs]
    assert procs[0].returncode == 0, errs[0]
    ends = [float((tmp_path / f"end{r}").read_text()) for r in range(2)]
    if ending == "clean":
        assert procs[1].returncode == 0, errs[1]
        assert ends[1] >= ends[0] - 1.0  # rank 1 waited for rank 0's late end before leaving
    else:
        assert procs[1].returncode != 0 and "rank 1 fails" in errs[1]
        assert ends[1] < ends[0] - late / 2  # an exception leaves without waiting


class _Store:
    """The part of a torch.distributed store that `diagnose` uses, in a dict."""

    def __init__(self, posts: dict[str, str]) -> None:
        self.data = {k: v.encode() for k, v in posts.items()}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]


def test_a_timeout_diagnosis_ignores_what_a_rank_posted_after_an_earlier_timeout() -> None:
    from hetero.comm.watch import diagnose

    now = time.time()
    store = _Store({"hetero/waiting/1": f"{now - 3600:.3f} barrier on group [0, 1]", "hetero/waiting/2": "junk"})
    store.data["hetero/waiting/3"] = f"{now:.3f} all_gather of x on group [0, 1, 2, 3]".encode()
    err = diagnose(
        store,
        me=0,
        members=[0, 1, 2, 3],
        what="all_gather of x on group [0, 1, 2, 3]",
        timeout_s=0.3,
        err=RuntimeError("timed out"),
    )
    assert isinstance(err, RankTimeoutError)
    assert err.missing_ranks == [1, 2], str(err)  # rank 1's post is an hour old: it did not arrive in this one
    assert "different operation" not in str(err)
    assert store.data["hetero/waiting/0"].decode().endswith(" all_gather of x on group [0, 1, 2, 3]")


def _late_sends(rank: int, world_size: int) -> list[list[float]]:
    from hetero.comm import watch

    comm = Comm.world()
    got = []
    for i in range(2):  # the second transfer between the pair proves the first wait left it whole
        if rank == 0:
            time.sleep(2.5 * watch.POLL_S)  # the receiver's wait outlasts several looks at the failure board
            comm.send(torch.full((3,), float(i)), 1)
            handles = comm.batch_p2p([("send", torch.full((2,), i + 0.5), 1, 0)])
        else:
            t = torch.zeros(3)
            comm.recv(t, 0)
            u = torch.zeros(2)
            handles = comm.batch_p2p([("recv", u, 0, 0)])
        for h in handles:
            h.wait()
        if rank == 1:
            got.append(t.tolist() + u.tolist())
    return got


@pytest.mark.timeout(120)
def test_a_transfer_waited_for_longer_than_a_look_arrives_whole(cpu_device: str) -> None:  # gloo, CPU tensors
    """A receive waited for longer than the failure board's look (watch.POLL_S) arrives, and the pair keeps working:
    gloo closes the pair of a send or receive whose wait timed out, so transfers are waited for in one piece (they
    were waited for in looks of a second, and a pipeline stage whose peer computed for longer failed every transfer
    after it: "Application timeout caused pair closure")."""
    got = run_distributed(_late_sends, 2, timeout=100)[1]
    assert got == [[0.0, 0.0, 0.0, 0.5, 0.5], [1.0, 1.0, 1.0, 1.5, 1.5]]
