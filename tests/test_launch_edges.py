"""Launch mistakes that hung or misled at joining: ranks launched with different (or invalid) HETERO_CPU_TRANSPORT
values ([Note: the roll call at joining]), a MASTER_PORT held by a program that listens and never speaks ([Note: a
port held by something else]), and `sbatch` running the script without `srun` ([Note: launchers])."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from hetero.comm import init_from_env, launch
from hetero.comm.launchers import adopt_launcher_env
from hetero.errors import CommError
from tests.dist import cpu_ranks_env, free_port

ROOT = Path(__file__).resolve().parent.parent
JOIN_S = 40.0  # the ranks' join timeout; a refusal must come well before it, not at it


# ------------------------------------------------------------------------------------------ shared launch settings
def _roll(settings: list[dict[str, str]], timeout_s: float = 10) -> dict[int, str]:
    """The roll call of a world of len(settings) ranks, each in a thread with its own settings, against one store."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    out: dict[int, str] = {}

    def call(rank: int) -> None:
        td = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=td)
        try:
            launch._roll_call(store, rank, len(settings), timeout_s, "here", me=f"p{rank}", settings=settings[rank])
            out[rank] = "joined"
        except CommError as err:
            out[rank] = str(err)

    threads = [threading.Thread(target=call, args=(r,)) for r in range(len(settings))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    del server
    assert sorted(out) == list(range(len(settings))), out  # every rank came back, joined or refused
    return out


def test_launch_settings_are_read_for_gloo_only() -> None:
    assert launch.launch_settings("gloo", {}) == {"HETERO_CPU_TRANSPORT": "cma"}  # unset is the default
    assert launch.launch_settings("gloo", {"HETERO_CPU_TRANSPORT": " GLOO "}) == {"HETERO_CPU_TRANSPORT": "gloo"}
    assert launch.launch_settings("nccl", {"HETERO_CPU_TRANSPORT": "gloo"}) == {}  # NCCL groups move no CPU data


def test_ranks_with_the_same_transport_join() -> None:
    same = {"HETERO_CPU_TRANSPORT": "gloo"}
    assert _roll([same, same, same]) == {0: "joined", 1: "joined", 2: "joined"}


def test_ranks_with_different_transports_are_refused_on_every_rank_naming_each_rank() -> None:
    cma, gloo = {"HETERO_CPU_TRANSPORT": "cma"}, {"HETERO_CPU_TRANSPORT": "gloo"}
    start = time.monotonic()
    got = _roll([cma, gloo, cma])
    assert time.monotonic() - start < 5  # at once, not at the 10 s timeout
    for v in got.values():
        assert "HETERO_CPU_TRANSPORT is 'cma' on ranks 0, 2 and 'gloo' on rank 1" in v, got


def test_an_invalid_transport_on_one_rank_is_refused_on_every_rank() -> None:
    cma = {"HETERO_CPU_TRANSPORT": "cma"}
    start = time.monotonic()
    got = _roll([cma, {"HETERO_CPU_TRANSPORT": "shm"}, cma])
    assert time.monotonic() - start < 5
    for v in got.values():
        assert "HETERO_CPU_TRANSPORT='shm' on rank 1 (p1) is not one of 'cma', 'gloo'" in v, got


_JOIN = """
from hetero.comm import init_from_env
try:
    comm = init_from_env(backend="gloo", timeout_s=float(__import__("sys").argv[1]))
    print("joined", comm.rank, comm.size)
except Exception as err:
    print("refused", type(err).__name__, err)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("other", ["gloo", "shm"])
def test_init_from_env_refuses_ranks_launched_with_another_transport(other: str) -> None:
    """Rank 1 on `other` beside rank 0 on cma: with gloo, both joined and `Link.open` fell back to gloo for both
    without a word; with an invalid value, rank 1 raised after the backend joined and rank 0 went on alone to wait at
    its first collective for the whole timeout."""
    port = free_port()
    procs = []
    start = time.monotonic()
    for rank, transport in ((0, "cma"), (1, other)):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HETERO_CPU_TRANSPORT=transport)
        cmd = [sys.executable, "-c", _JOIN, str(JOIN_S)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=cpu_ranks_env(env), stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=100)[0] for p in procs]
    for out in outs:
        assert "refused CommError" in out and "HETERO_CPU_TRANSPORT" in out and "rank 1" in out, outs
        assert repr(other) in out, outs
    assert time.monotonic() - start < JOIN_S - 5  # imports, then the refusal at once


# ------------------------------------------------------------------------------------------ a silent listener
@pytest.mark.timeout(60)
def test_a_master_port_held_by_a_silent_listener_fails_within_the_join_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.13's store client waits for the answer to its ping without a bound: rank 1 hung for ever."""
    timeout_s = 2.0
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts connections (the kernel does) and never says a word
        port = silent.getsockname()[1]
        env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        start = time.monotonic()
        held = "held by another program \\(not a torch store\\).*Choose a free MASTER_PORT"
        with pytest.raises(CommError, match=held):
            init_from_env(backend="gloo", timeout_s=timeout_s)
        took = time.monotonic() - start
    assert timeout_s <= took < timeout_s + launch._STORE_GRACE_S + 5
    # Closing the listener ends the abandoned store client's wait (torch retries the closed port until its own
    # timeout, then raises into the thread): no thread left behind for the next test.
    for thread in [t for t in threading.enumerate() if t.name == "hetero-rendezvous"]:
        thread.join(timeout_s + launch._STORE_GRACE_S)
        assert not thread.is_alive()
    assert not dist.is_initialized()


# ------------------------------------------------------------------------------------------ sbatch without srun
_BATCH_STEP = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


def test_sbatch_without_srun_is_told_to_start_the_tasks() -> None:
    """The batch script of `sbatch --ntasks=4` has SLURM_NTASKS=4 and SLURM_PROCID=0 but no step: it became rank 0
    of 4 and waited the whole join timeout for three ranks nobody started."""
    with pytest.raises(CommError, match="batch script.*not a task started by srun.*srun python.*WORLD_SIZE=1"):
        adopt_launcher_env(dict(_BATCH_STEP, MASTER_ADDR="n1", MASTER_PORT="29500"))
    with pytest.raises(CommError, match="batch script"):  # without a rendezvous too: srun is the fix, not the address
        adopt_launcher_env(dict(_BATCH_STEP))
    srun_task = dict(_BATCH_STEP, SLURM_STEP_NUM_TASKS="4", SLURM_STEP_ID="0", MASTER_ADDR="n1", MASTER_PORT="1")
    assert adopt_launcher_env(srun_task) == "SLURM" and srun_task["WORLD_SIZE"] == "4"
    alone = dict(_BATCH_STEP, WORLD_SIZE="1")  # one process on purpose
    assert adopt_launcher_env(alone) is None


@pytest.mark.timeout(60)
def test_init_from_env_in_a_batch_script_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID", "SLURM_STEPID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in dict(_BATCH_STEP, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    start = time.monotonic()
    with pytest.raises(CommError, match="batch script"):
        init_from_env(backend="gloo", timeout_s=20)
    assert time.monotonic() - start < 5  # not after the 20 s join timeout
    assert not dist.is_initialized()
