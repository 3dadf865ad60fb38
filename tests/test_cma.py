"""The cross-memory transport of CPU data collectives ([Note: collectives by cross-memory attach], hetero/comm/cma.py):
it carries every large CPU collective of a gloo group on one host, gives the same results as the local math (every
rank the same bits for an all-reduce), falls back to gloo together when any rank cannot use it, and turns a peer that
died or hangs into the group's errors."""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import gc
import hashlib
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hetero import standin
from hetero.comm import Comm, cma, cma_link, rules
from hetero.errors import CollectiveMismatchError, CommError, RankTimeoutError
from tests.dist import ONE_RANK_FAULTS, ONLY_SEVERAL, ranks_apart, run_distributed

# Under the stand-in the data group takes "device" tensors only and gloo carries them, as NCCL would on a GPU.
pytestmark = pytest.mark.skipif(standin.active(), reason="the stand-in holds data collectives to NCCL's rule")

N = 40_000  # elements a rank: 160 KB of float32, above cma.MIN_BYTES


def _data(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + salt)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 100
    return x.to(dtype) if dtype.is_floating_point else x.round().to(dtype)


def _reduce(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    """Rank order, in the parts' dtype: what every rank must compute."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[op](acc, p)
    return acc / len(parts) if op == "avg" else acc


def _small_only(name: str, real: Any) -> Any:
    """torch's collective `name`, failing for a tensor as large as those the cross-memory transport carries."""

    def call(t: torch.Tensor, *a: Any, **k: Any) -> Any:
        assert t.numel() * t.element_size() < cma.MIN_BYTES, f"{name} carried {t.numel()} elements through gloo"
        return real(t, *a, **k)

    return call


_DATA_OPS = ["all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single"]


def _carry(rank: int, world: int) -> dict[str, Any]:
    comm = Comm.world()
    assert comm.rules.cma
    saved = {n: getattr(dist, n) for n in [*_DATA_OPS, "all_reduce"] if hasattr(dist, n)}
    for name, fn in saved.items():
        setattr(dist, name, _small_only(name, fn))
    ranks = list(range(world))
    digests = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        ops = ("sum", "avg", "max", "min") if dtype.is_floating_point else ("sum", "max", "min")
        # all_gather: blocking, async, 2-D and non-contiguous out, in place (inp is our shard of out).
        want = torch.cat([_data(r, N, dtype) for r in ranks])
        out = torch.empty(world * N, dtype=dtype)
        comm.all_gather(out, _data(rank, N, dtype))
        assert torch.equal(out, want)
        out = torch.full((world * N,), 7, dtype=dtype)
        inp = _data(rank, N, dtype)
        comm.all_gather_async(out, inp).wait()
        assert torch.equal(out, want)
        out_nc = torch.empty(N, world, dtype=dtype).t()
        comm.all_gather(out_nc, _data(rank, N, dtype))
        assert torch.equal(out_nc.reshape(-1), want)
        flat = torch.zeros(world * N, dtype=dtype)
        flat[rank * N : (rank + 1) * N] = _data(rank, N, dtype)
        comm.all_gather(flat, flat[rank * N : (rank + 1) * N])
        assert torch.equal(flat, want)
        for op in ops:
            full = [_data(r, world * N, dtype, salt=1) for r in ranks]
            red = _reduce(full, op)
            mine = red[rank * N : (rank + 1) * N]
            close = (lambda a, b: torch.equal(a, b)) if world == 2 or op in ("max", "min") else torch.allclose
            out = torch.empty(N, dtype=dtype)
            comm.reduce_scatter(out, _data(rank, world * N, dtype, salt=1), op)
            assert close(out, mine), (dtype, op, "reduce_scatter")
            out = torch.empty(N, dtype=dtype)
            comm.reduce_scatter_async(out, _data(rank, world * N, dtype, salt=1), op).wait()
            assert close(out, mine), (dtype, op, "reduce_scatter_async")
            flat = _data(rank, world * N, dtype, salt=1)
            comm.reduce_scatter(flat[rank * N : (rank + 1) * N], flat, op)  # in place, as ZeRO does
            assert close(flat[rank * N : (rank + 1) * N], mine), (dtype, op, "reduce_scatter in place")
            t = _data(rank, world * N, dtype, salt=1)
            comm.all_reduce(t, op)
            assert close(t, red), (dtype, op, "all_reduce")
            t2 = _data(rank, world * N, dtype, salt=1)
            comm.all_reduce_async(t2, op).wait()
            assert torch.equal(t2, t), (dtype, op, "all_reduce_async")
            digests[f"{dtype}-{op}"] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
    # Several in flight at once, waited in reverse: they still run in the order issued, on every rank.
    outs = [torch.empty(world * N) for _ in range(4)]
    handles = [comm.all_gather_async(o, _data(rank, N, torch.float32, salt=i)) for i, o in enumerate(outs)]
    for h in reversed(handles):
        h.wait()
    for i, o in enumerate(outs):
        assert torch.equal(o, torch.cat([_data(r, N, torch.float32, salt=i) for r in ranks]))
    # A subgroup of the world has its own link.
    if world == 4:
        sub = comm.split([[0, 2], [1, 3]])
        members = [rank % 2, rank % 2 + 2]
        out = torch.empty(2 * N)
        sub.all_gather(out, _data(rank, N, torch.float32))
        assert torch.equal(out, torch.cat([_data(r, N, torch.float32) for r in members]))
        assert cma.link_of(sub) is not None and cma.link_of(sub) is not cma.link_of(comm)
    # Small ones still went through gloo.
    t = torch.full((4,), float(rank))
    comm.all_reduce(t)
    assert t.tolist() == [float(sum(ranks))] * 4
    for name, fn in saved.items():
        setattr(dist, name, fn)
    return {"link": cma.link_of(comm) is not None, "digests": digests}


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_large_cpu_collectives_go_by_cross_memory_reads_and_match_the_local_math(world: int) -> None:
    reports = run_distributed(_carry, world, timeout=220)
    assert all(r["link"] for r in reports)
    assert all(r["digests"] == reports[0]["digests"] for r in reports)  # an all-reduce: the same bits everywhere


def _gloo_only(rank: int, world: int) -> dict[str, Any]:
    comm = Comm.world()
    out = torch.empty(world * N)
    comm.all_gather(out, _data(rank, N, torch.float32))
    assert torch.equal(out, torch.cat([_data(r, N, torch.float32) for r in range(world)]))
    return {"link": cma.link_of(comm), "workers": sum(t.name == "hetero-cma" for t in threading.enumerate())}


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(120)
def test_the_gloo_transport_can_be_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETERO_CPU_TRANSPORT", "gloo")
    assert run_distributed(_gloo_only, 2, timeout=100) == [{"link": None, "workers": 0}] * 2


def test_a_bad_transport_name_says_what_to_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETERO_CPU_TRANSPORT", "shm")
    with pytest.raises(ValueError, match="HETERO_CPU_TRANSPORT='shm'.*'cma'.*'gloo'"):
        rules.rules_for("gloo", None)


def test_the_standin_and_nccl_keep_their_own_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not rules.rules_for("nccl", None).cma
    monkeypatch.setenv("HETERO_STANDIN", "1")
    assert not rules.rules_for("gloo", None).cma  # the stand-in holds data to NCCL's rule instead


def _one_cannot_read(rank: int, world: int, why: str) -> dict[str, Any]:
    if rank == 1 and why == "its own setting":
        os.environ["HETERO_CPU_TRANSPORT"] = "gloo"  # launched unlike its peers: they must not wait on it
    elif rank == 1 and why == "weak memory order":
        cma_link.platform.machine = lambda: "aarch64"  # its stores may be seen out of order: `_post` is not safe there
    elif rank == 1:
        real = cma_link._copy

        def refused(pid: int, *a: Any) -> None:
            if pid != os.getpid():
                raise RuntimeError("Operation not permitted")
            real(pid, *a)

        cma_link._copy = refused
    comm = Comm.world()
    out = torch.empty(world * N)
    comm.all_gather(out, _data(rank, N, torch.float32))  # gloo on every rank, or this would hang
    assert torch.equal(out, torch.cat([_data(r, N, torch.float32) for r in range(world)]))
    t = _data(rank, world * N, torch.float32)
    comm.all_reduce(t)
    return {"link": cma.link_of(comm)}


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("why", ["unreadable", "weak memory order", "its own setting"])
def test_ranks_fall_back_to_gloo_together_when_one_cannot_use_the_transport(why: str) -> None:
    assert run_distributed(_one_cannot_read, 2, why, timeout=100) == [{"link": None}] * 2


def _peer_dies(rank: int, world: int, how: str, marker: str) -> float:
    comm = Comm.world().with_timeout(60 if how == "dies" else 3)
    out = torch.empty(world * N)
    comm.all_gather(out, _data(rank, N, torch.float32))  # opens the link
    if rank == 1:
        if how == "dies":
            os._exit(0)
        Path(marker).touch()
        time.sleep(20)  # hangs: never issues the next gather
        return 0.0
    start = time.monotonic()
    with pytest.raises(CommError) as info:
        comm.all_gather(out, _data(rank, N, torch.float32))
    assert "all_gather" in str(info.value)
    assert "1" in str(info.value)  # the rank behind it is named
    return time.monotonic() - start


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
def test_a_peer_that_died_fails_the_collective_at_once(tmp_path: Path) -> None:
    from tests.dist import DistributedTestError, DistributedTimeoutError

    errors: dict[int, str] = {}
    try:
        results = run_distributed(_peer_dies, 2, "dies", str(tmp_path / "m"), timeout=50, report_grace=30)
    except (DistributedTestError, DistributedTimeoutError) as err:
        results, errors = [err.results.get(0)], err.errors
    assert results[0] is not None, f"rank 0 did not report: {errors.get(0)}"
    assert results[0] < 20  # far sooner than the group's 60 s timeout


def _leaves_at_once(rank: int, world: int) -> bool:
    if rank == 0:  # slow to look after saying it is done: rank 1 has finished and gone by then
        real = cma_link.Link._poke

        def slow(self: cma_link.Link) -> None:
            real(self)
            time.sleep(1.0)

        cma_link.Link._poke = slow  # type: ignore[method-assign]
    comm = Comm.world().with_timeout(60)
    out = torch.empty(world * N)
    comm.all_gather(out, _data(rank, N, torch.float32))
    if rank == 1:
        os._exit(0)  # no exit barrier: gone the moment its collective completed
    return torch.equal(out, torch.cat([_data(r, N, torch.float32) for r in range(world)]))


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
def test_a_peer_that_leaves_once_the_collective_is_done_does_not_fail_it() -> None:
    """The last wait of an operation reads our own memory (each peer wrote "done" into it), so it completes even
    when the peer, done too, has already exited; reading the peer's memory there failed (1 run in 7, loaded)."""
    from tests.dist import DistributedTestError

    with pytest.raises(DistributedTestError) as info:  # rank 1 reports nothing: it left with os._exit
        run_distributed(_leaves_at_once, 2, timeout=60, report_grace=30)
    assert info.value.results.get(0) is True, info.value.errors.get(0)


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
def test_a_peer_that_hangs_fails_the_collective_at_the_timeout(tmp_path: Path) -> None:
    from tests.dist import DistributedTimeoutError

    errors: dict[int, str] = {}
    try:
        results = run_distributed(_peer_dies, 2, "hangs", str(tmp_path / "m"), timeout=40)
    except DistributedTimeoutError as err:
        results, errors = [err.results.get(0)], err.errors
    assert results[0] is not None, f"rank 0 did not report: {errors.get(0)}"
    assert 2.5 < results[0] < 20


def test_close_all_stops_the_workers() -> None:
    wake = cma_link._wake_socket()
    link = cma_link.Link(
        rank=0, pids=[os.getpid()], blocks=[0], block=cma_link._block(1), wake=wake, wakes=[wake.getsockname()]
    )
    assert any(t.name == "hetero-cma" for t in threading.enumerate())
    link.close()
    assert not link._thread.is_alive()


def _autograd_modes(rank: int, world: int) -> dict[str, bool]:
    comm = Comm.world()
    ranks = range(world)
    full = [_data(r, world * N, torch.float32) for r in ranks]
    want = _reduce(full, "sum")
    got = {}
    leaf = _data(rank, world * N, torch.float32).requires_grad_()  # a parameter, averaged at init say
    comm.all_reduce(leaf)
    got["leaf all_reduce"] = torch.equal(leaf.detach(), want) and leaf.grad_fn is None
    out = torch.empty(N)
    comm.reduce_scatter_async(out, _data(rank, world * N, torch.float32).requires_grad_()).wait()
    got["reduce_scatter of a tensor that requires grad"] = torch.equal(out, want[rank * N : (rank + 1) * N])
    out = torch.empty(world * N)
    comm.all_gather_async(out, _data(rank, N, torch.float32).requires_grad_()).wait()
    gathered = torch.cat([_data(r, N, torch.float32) for r in ranks])
    got["all_gather records no graph"] = torch.equal(out, gathered) and not out.requires_grad
    with torch.inference_mode():  # tensor-parallel generation, say
        t = _data(rank, world * N, torch.float32)
        comm.all_reduce(t)
        got["inference all_reduce"] = torch.equal(t, want)
        out = torch.empty(world * N)
        comm.all_gather(out, _data(rank, N, torch.float32))
        got["inference all_gather"] = torch.equal(out, gathered)
    got["link"] = cma.link_of(comm) is not None
    return got


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(120)
def test_tensors_that_require_grad_and_inference_tensors_go_as_through_gloo() -> None:
    """The worker's thread records autograd as any fresh thread does, where the caller issued the collective under
    no_grad or inference mode: its `out=` add and in-place copies failed there (and broke the group) or recorded a
    graph onto the caller's output, where gloo takes such tensors as they are."""
    reports = run_distributed(_autograd_modes, 2, timeout=100)
    assert all(all(r.values()) for r in reports), reports


def _own_timeout(rank: int, world: int) -> float:
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=3))
    comm = Comm(group, rules=dataclasses.replace(Comm.world().rules, timeout_s=None))  # the group's own timeout
    assert comm.rules.cma
    out = torch.empty(world * N)
    comm.all_gather(out, _data(rank, N, torch.float32))  # opens the link
    if rank == 1:
        time.sleep(15)  # hangs: never issues the next gather
        return 0.0
    start = time.monotonic()
    # Named as under a timeout of the Comm's own: the rank that did not arrive, and the group's 3 s.
    with pytest.raises(RankTimeoutError, match=r"timed out after 3 s .*rank\(s\) 1 did not arrive") as got:
        comm.all_gather(out, _data(rank, N, torch.float32))
    assert got.value.missing_ranks == [1]
    return time.monotonic() - start


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
def test_a_comm_without_a_timeout_keeps_its_process_groups_own() -> None:
    """`Rules.timeout_s` None means the process group's own timeout, which gloo keeps; the transport waited its
    fixed 30 minutes there instead (a `Comm.world()` after a plain `init_process_group(timeout=...)`)."""
    results = run_distributed(_own_timeout, 2, timeout=100)
    assert 2.5 < results[0] < 12, results


def _init_again(rank: int, world: int) -> dict[str, Any]:
    from tests.dist import free_port

    workers, alive = [], []
    for _ in range(3):
        comm = Comm.world()
        out = torch.empty(world * N)
        comm.all_gather(out, _data(rank, N, torch.float32))
        assert torch.equal(out, torch.cat([_data(r, N, torch.float32) for r in range(world)]))
        old = weakref.ref(comm.group)
        port = [free_port() if rank == 0 else 0]
        dist.broadcast_object_list(port, src=0)
        del comm
        dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(port[0])
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        gc.collect()
        alive.append(old() is not None)
        deadline = time.monotonic() + 10
        while any(t.name == "hetero-cma" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        workers.append(sum(t.name == "hetero-cma" for t in threading.enumerate()))
    return {"groups kept": alive, "workers left": workers}


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(120)
def test_a_destroyed_group_leaves_neither_itself_nor_its_link_behind() -> None:
    """`destroy_process_group`, then init again in the same process: the registry of links held the old group (its
    backend's threads and connections) and its link's worker, one more each time round."""
    expect = {"groups kept": [False] * 3, "workers left": [0] * 3}
    assert run_distributed(_init_again, 2, timeout=100) == [expect] * 2


_PROBE_AT = 0x3A5A_0000_0000  # a page both ranks map: where the same program would have put the probe


def _pid_of_another(rank: int, world: int) -> dict[str, bool]:
    pids = Comm.world().all_gather_object(os.getpid())
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 4]
    assert libc.mmap(_PROBE_AT, 4096, 3, 0x22 | 0x100000, -1, 0) == _PROBE_AT  # private, anonymous, fixed-noreplace

    class Here:  # cma_link's modules, as seen by a rank whose probe lands where its peer's does
        def __init__(self, module: Any, **own: Any) -> None:
            self.module, self.own = module, own

        def __getattr__(self, name: str) -> Any:
            return self.own.get(name) or getattr(self.module, name)

    def probe(init: Any, size: Any = None) -> Any:
        if not isinstance(init, bytes):
            return ctypes.create_string_buffer(init, size)
        buf = (ctypes.c_char * (len(init) + 1)).from_address(_PROBE_AT)
        ctypes.memmove(_PROBE_AT, init, len(init))
        return buf

    cma_link.ctypes = Here(ctypes, create_string_buffer=probe)
    if rank == 1:  # as a rank of another pid namespace whose pid is rank 0's here (each the first of its container)
        cma_link.os = Here(os, getpid=lambda: pids[0])
    comm = Comm.world().with_timeout(20)
    out = torch.empty(world * N)
    comm.all_gather(out, _data(rank, N, torch.float32))
    right = torch.equal(out, torch.cat([_data(r, N, torch.float32) for r in range(world)]))
    return {"link": cma.link_of(comm) is not None, "right": right}


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
def test_a_peer_whose_pid_names_another_process_here_is_not_read() -> None:
    """A pid names a process only within its namespace: a rank whose pid is ours here (containers on one host, each
    rank the first process of its own) passed the probe whenever our own probe lay where its did (1 launch in 4), and
    the link then read our own memory for its: wrong values on one rank, a hang on the other."""
    assert run_distributed(_pid_of_another, 2, timeout=60) == [{"link": False, "right": True}] * 2


def _unlike(rank: int, world: int) -> dict[str, str]:
    comm = Comm.world().with_timeout(30)
    got = {}
    for case in ("size", "dtype", "op"):
        sub = comm.split([list(range(world))])  # a group, and a link, of its own: a failed one stays failed
        odd = rank == world - 1
        try:
            if case == "size":
                n = N - 1000 if odd else N
                sub.all_gather(torch.empty(world * n), _data(rank, n, torch.float32))
            elif case == "dtype":
                sub.all_reduce(_data(rank, world * N, torch.int32 if odd else torch.float32))
            else:
                sub.reduce_scatter(torch.empty(N), _data(rank, world * N, torch.float32), "max" if odd else "sum")
            got[case] = "no error"
        except CollectiveMismatchError as err:
            got[case] = str(err)
    return got


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
def test_ranks_that_issue_different_collectives_all_raise_before_reading() -> None:
    """The transport read each peer's input as long as its own: a peer's smaller input gave the memory beyond it as
    data (garbage in `out`, no error anywhere), another dtype or op was reduced as if it were ours. gloo aborted the
    process there; now every rank raises CollectiveMismatchError naming what each posted."""
    results = run_distributed(_unlike, 3, timeout=100)
    last = N * 4
    for rank, got in enumerate(results):
        size = got["size"]
        assert "issued different collectives" in size and f"group rank 2: all_gather of {last - 4000} bytes" in size
        assert f"group rank {rank}: all_gather of {last if rank < 2 else last - 4000} bytes of float32" in size
        assert "all_reduce (sum) of" in got["dtype"] and "of int32" in got["dtype"], got
        assert "reduce_scatter (max)" in got["op"] and "reduce_scatter (sum)" in got["op"], got


def _resident_pages(address: int, nbytes: int) -> int:
    """How many of the 4 KiB pages of [address, address + nbytes) are resident (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = nbytes // 4096
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec.raw)


def _fresh_destinations(rank: int, world: int) -> dict[str, Any]:
    import mmap

    comm = Comm.world()
    real, reads = cma_link._copy, []

    def watched(pid: int, remote: int, local: int, nbytes: int, *, write: bool = False) -> None:
        if not write and nbytes >= 1 << 16:  # a collective's payload, not a block's fields
            lo, hi = local & ~4095, (local + nbytes + 4095) & ~4095
            reads.append(_resident_pages(lo, hi - lo) == (hi - lo) // 4096)
        real(pid, remote, local, nbytes, write=write)

    def fresh(numel: int) -> torch.Tensor:  # anonymous pages no one has touched yet, as a pool's fresh buffer
        return torch.frombuffer(mmap.mmap(-1, numel * 4), dtype=torch.float32)

    cma_link._copy = watched
    try:
        out = fresh(world * N)
        comm.all_gather(out, _data(rank, N, torch.float32))
        assert torch.equal(out, torch.cat([_data(r, N, torch.float32) for r in range(world)]))
        out = fresh(N)
        comm.reduce_scatter(out, _data(rank, world * N, torch.float32, salt=1), "sum")
        full = _reduce([_data(r, world * N, torch.float32, salt=1) for r in range(world)], "sum")
        assert torch.equal(out, full[rank * N : (rank + 1) * N])
    finally:
        cma_link._copy = real
    return {"reads": len(reads), "all_resident": all(reads)}


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(120)
def test_a_cross_memory_read_finds_its_destination_faulted_in() -> None:
    """[Note: faulting a read's destination in first]: into fresh buffers, every payload read finds its destination's
    pages resident already (touched from user space), instead of `process_vm_readv` faulting them in under the
    memory-map lock; and the results are still the collectives' (the touch is overwritten whole)."""
    reports = run_distributed(_fresh_destinations, 2, timeout=100)
    assert all(r["reads"] >= 2 for r in reports), reports  # the gather's and the reduction's reads were seen
    assert all(r["all_resident"] for r in reports), reports
