"""Checkpoints written while training goes on (`save_checkpoint(..., async_save=True)`, [Note: a save written while
training goes on] in hetero/checkpoint/background.py): the files equal a synchronous save's at the call, though
training went on before the commit; the commit at an update boundary every rank agrees on; waits at load, the next
save and close; a write failing on one rank raised on every rank at the same step; a kill mid-write leaves `latest`
on the previous checkpoint; the host-memory fallback agreed by every rank."""

from __future__ import annotations

import errno
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from hetero.checkpoint import background
from hetero.checkpoint import manifest as mf
from hetero.checkpoint.format import TensorWriter
from hetero.errors import CheckpointError

try:
    from tests.dist import NEEDS_DEGREES, ONE_RANK_FAULTS, ranks_apart, run_distributed
    from tests.test_checkpoint import _cfg, make_engine, train
    from tests.test_checkpoint_parallel import TP2
    from tests.test_checkpoint_parallel import _engine as _tp_engine
    from tests.test_checkpoint_parallel import _local_state as _tp_local_state
    from tests.test_checkpoint_parallel import _train as _tp_train
except ImportError:  # tests/ itself on sys.path
    from dist import NEEDS_DEGREES, ONE_RANK_FAULTS, ranks_apart, run_distributed  # type: ignore[no-redef]
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]
    from test_checkpoint_parallel import TP2  # type: ignore[no-redef]
    from test_checkpoint_parallel import _engine as _tp_engine  # type: ignore[no-redef]
    from test_checkpoint_parallel import _local_state as _tp_local_state  # type: ignore[no-redef]
    from test_checkpoint_parallel import _train as _tp_train  # type: ignore[no-redef]

N, EXTRA = 4, 3  # micro-batches before the save, and trained before the commit is looked at
MORE = 40  # at most this many micro-batches more while the write has not ended (a slow disk), each after a pause
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _latest(ckpt: str) -> str | None:
    return mf.latest_tag(ckpt)


def _train_until_committed(e, rank: int, world: int, start: int) -> int:
    """Micro-batches from `start` until the pending save is committed at a boundary; returns the next one."""
    i = start
    while e.checkpoint_pending and i < start + MORE:
        time.sleep(0.05)  # the writing thread's turn; the commit is decided at the boundary from every rank's state
        train(e, rank, world, i, i + 1)
        i += 1
    return i


# ---- (a) what is committed is the state of the call, bit for bit -------------------------------------------------
def _exact_job(rank: int, world: int, config: dict, root: str, save_at: int) -> dict:
    a = make_engine(rank, config, root)
    train(a, rank, world, 0, save_at)
    # The reference: a synchronous save at the same moment (it changes no state: both saves read the same).
    a.save_checkpoint(os.path.join(root, "sync"), client_state={"micro": save_at})
    # The writing thread is held until EXTRA more micro-batches have changed the chunks it saves.
    gate, open_writer = threading.Event(), background.open_writer
    background.open_writer = lambda path, planned: gate.wait(120) and open_writer(path, planned)
    try:
        got = a.save_checkpoint(os.path.join(root, "async"), client_state={"micro": save_at}, async_save=True)
        pending_at_call = a.checkpoint_pending
        latest_at_call = _latest(os.path.join(root, "async"))
        tail = train(a, rank, world, save_at, save_at + EXTRA)
        held = a.checkpoint_pending  # no rank's write has begun: no boundary commits
    finally:
        gate.set()
        background.open_writer = open_writer
    state_a = a.full_state_dict()
    stop = _train_until_committed(a, rank, world, save_at + EXTRA)
    committed = not a.checkpoint_pending  # at a boundary inside `step`: nothing else commits
    waited = a.wait_checkpoint()  # nothing left pending
    a.close()
    torch.manual_seed(99)  # the load restores the random state
    b = make_engine(rank, config, os.path.join(root, "b"))
    cs = b.load_checkpoint(os.path.join(root, "async"))
    tail_b = train(b, rank, world, save_at, save_at + EXTRA)
    state_b = b.full_state_dict()
    b.close()
    return {
        "got": got,
        "pending_at_call": pending_at_call,
        "held": held,
        "latest_at_call": latest_at_call,
        "committed": committed,
        "steps_to_commit": stop - save_at,
        "waited": waited,
        "cs": cs,
        "same_tail": tail == tail_b,
        "same_weights": sorted(state_a) == sorted(state_b)
        and all(torch.equal(state_a[k], state_b[k]) for k in state_a),
    }


def _same_checkpoints(sync_dir: str, async_dir: str) -> None:
    assert sorted(os.listdir(sync_dir)) == sorted(os.listdir(async_dir))
    for name in os.listdir(sync_dir):
        if name == mf.MANIFEST:
            continue
        with open(os.path.join(sync_dir, name), "rb") as f, open(os.path.join(async_dir, name), "rb") as g:
            assert f.read() == g.read(), f"{name} differs from the synchronous save's"
    want, got = mf.read_manifest(sync_dir), mf.read_manifest(async_dir)
    want.pop("created")
    got.pop("created")
    assert got == want  # counters, random states, every tensor's checksum


CASES = [  # (world, config, save after micro-batch): stages 1 and 3, states on the host and on NVMe
    (1, _cfg(1, optim="host"), N),
    (1, _cfg(3, optim="nvme", params="nvme"), N),
    (2, _cfg(1, optim="nvme"), N),
    (2, _cfg(3, optim="host", params="host", accum=2), 2 * N - 1),  # mid-accumulation: its gradients too
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("world", "config", "save_at"), CASES, ids=["w1-s1-host", "w1-s3-nvme", "w2-s1-nvme", "w2-s3-host"]
)
def test_async_save_commits_the_state_of_its_call(world, config, save_at, tmp_path):
    root = str(tmp_path)
    results = run_distributed(_exact_job, world, config, root, save_at, timeout=360)
    tag = os.path.basename(results[0]["got"])
    for r in results:
        assert r["pending_at_call"] and r["latest_at_call"] is None  # returned before the commit
        assert r["held"]
        assert r["committed"] and r["waited"] is None  # committed at a boundary of the loop
        assert r["cs"] == {"micro": save_at}
        assert r["same_tail"] and r["same_weights"]  # the resumed run is the uninterrupted one, bit for bit
    assert len({r["steps_to_commit"] for r in results}) == 1  # every rank committed at the same step
    _same_checkpoints(os.path.join(root, "sync", tag), os.path.join(root, "async", tag))
    assert _latest(os.path.join(root, "async")) == tag


# ---- (b) load, the next save and close wait for the pending save -------------------------------------------------
def _waits_job(rank: int, world: int, root: str) -> dict:
    ckpt = os.path.join(root, "ckpt")
    e = make_engine(rank, _cfg(3, optim="nvme"), root)
    train(e, rank, world, 0, N)
    first = e.save_checkpoint(ckpt, client_state={"micro": N}, async_save=True)
    cs = e.load_checkpoint(ckpt)  # commits the pending save, then loads it
    after_load = (e.checkpoint_pending, _latest(ckpt), cs)
    train(e, rank, world, N, N + 1)
    second = e.save_checkpoint(ckpt, async_save=True, tag="second")
    third = e.save_checkpoint(ckpt, async_save=True, tag="third")  # the second is committed first
    after_save = (_latest(ckpt), os.path.isfile(os.path.join(second, mf.MANIFEST)))
    e.close()  # commits the third
    return {"dirs": [first, second, third], "after_load": after_load, "after_save": after_save}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_load_save_and_close_wait_for_the_pending_save(world, tmp_path):
    root = str(tmp_path)
    results = run_distributed(_waits_job, world, root, timeout=240)
    ckpt = os.path.join(root, "ckpt")
    for r in results:
        first = os.path.basename(r["dirs"][0])
        assert r["after_load"] == (False, first, {"micro": N})
        assert r["after_save"] == ("second", True)
    assert _latest(ckpt) == "third"
    assert sorted(os.listdir(ckpt)) == sorted(["latest", first, "second", "third"])  # no .tmp-* left
    for tag in (first, "second", "third"):
        mf.check_files(os.path.join(ckpt, tag), mf.read_manifest(os.path.join(ckpt, tag)))


# ---- (c) a write failing on one rank: every rank raises the same error at the same step ----------------------------
def _full_disk(self, entries, views):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _failure_job(rank: int, world: int, root: str) -> dict:
    ckpt = os.path.join(root, "ckpt")
    e = make_engine(rank, _cfg(2, optim="host"), root)
    train(e, rank, world, 0, N)
    e.save_checkpoint(ckpt, client_state={"micro": N})
    train(e, rank, world, N, N + 1)
    write_run = TensorWriter._write_run
    if rank == 1:
        TensorWriter._write_run = _full_disk  # this rank's disk is full
    try:
        e.save_checkpoint(ckpt, async_save=True)
        raised, i = None, N + 1
        while raised is None and i < N + 1 + MORE:
            time.sleep(0.05)
            try:
                train(e, rank, world, i, i + 1)
            except CheckpointError as err:
                raised = (i, str(err))
            i += 1
    finally:
        TensorWriter._write_run = write_run
    state = {"pending": e.checkpoint_pending, "latest": _latest(ckpt)}
    if rank == 0:
        state["listing"] = sorted(os.listdir(ckpt))
    train(e, rank, world, i, i + 2)  # training goes on
    later = e.save_checkpoint(ckpt, async_save=True, tag="later")
    later_committed = e.wait_checkpoint()
    e.close()
    return {"raised": raised, **state, "later": later, "later_committed": later_committed}


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(300)
def test_a_write_failing_on_one_rank_is_raised_on_every_rank(tmp_path):
    root = str(tmp_path)
    results = run_distributed(_failure_job, 2, root, timeout=240)
    first = f"step-{N:08d}"
    assert results[0]["raised"] is not None
    assert results[0]["raised"] == results[1]["raised"]  # the same error, at the same micro-batch
    message = results[0]["raised"][1]
    assert "rank 1 could not write" in message and os.strerror(errno.ENOSPC) in message
    for r in results:
        assert not r["pending"] and r["latest"] == first
        assert r["later"] == r["later_committed"] == os.path.join(root, "ckpt", "later")
    assert results[0]["listing"] == ["latest", first]  # the failed save's temporary directory dropped
    assert _latest(os.path.join(root, "ckpt")) == "later"


# ---- (d) a kill during the background write ----------------------------------------------------------------------
KILL_CONFIG = _cfg(3, optim="nvme", params="nvme")
KILL_JOB = f"""
import os, sys
sys.path.insert(0, {REPO!r})
from tests.test_checkpoint import _cfg, make_engine, train
root, marker, trained = sys.argv[1:4]
e = make_engine(0, {KILL_CONFIG!r}, root)
train(e, 0, 1, 0, {N})
e.save_checkpoint(os.path.join(root, "ckpt"), client_state={{"micro": {N}}})
train(e, 0, 1, {N}, {N + EXTRA})
os.environ["HETERO_CHECKPOINT_TEST_PAUSE"] = "async-written:" + marker
e.save_checkpoint(os.path.join(root, "ckpt"), async_save=True)
train(e, 0, 1, {N + EXTRA}, {N + EXTRA + 2})  # training goes on while the write is held
open(trained, "w").close()
e.wait_checkpoint()
raise SystemExit("the write was not paused")
"""


@pytest.mark.timeout(300)
def test_sigkill_during_the_background_write_keeps_the_previous_checkpoint(tmp_path):
    root, marker, trained = str(tmp_path), str(tmp_path / "paused"), str(tmp_path / "trained")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", KILL_JOB, root, marker, trained], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 200
        while not (os.path.exists(marker) and os.path.exists(trained)):
            if proc.poll() is not None:
                pytest.fail(f"the job exited ({proc.returncode}) before pausing: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("the background write never reached its pause point")
            time.sleep(0.1)
        ckpt = os.path.join(root, "ckpt")
        killed = f"step-{N + EXTRA:08d}"
        assert glob.glob(os.path.join(ckpt, f".tmp-{killed}-*", "rank-00000.safetensors"))  # written, not committed
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert _latest(ckpt) == f"step-{N:08d}"

    ref = make_engine(0, KILL_CONFIG, str(tmp_path / "ref"))
    want = train(ref, 0, 1, 0, N + EXTRA)[N:]
    want_state = ref.full_state_dict()
    ref.close()
    e = make_engine(0, KILL_CONFIG, str(tmp_path / "resume"))
    try:
        assert e.load_checkpoint(ckpt) == {"micro": N}
        assert train(e, 0, 1, N, N + EXTRA) == want
        state = e.full_state_dict()
        e.save_checkpoint(ckpt, async_save=True)  # the killed save's tag: its temporary directory is dropped
        e.wait_checkpoint()
    finally:
        e.close()
    assert all(torch.equal(state[k], want_state[k]) for k in want_state)
    assert _latest(ckpt) == killed
    assert sorted(os.listdir(ckpt)) == ["latest", f"step-{N:08d}", killed]


# ---- (e) the host-memory fallback, agreed --------------------------------------------------------------------------
def _fallback_job(rank: int, world: int, root: str) -> dict:
    ckpt = os.path.join(root, "ckpt")
    e = make_engine(rank, _cfg(3, optim="host"), root)
    train(e, rank, world, 0, N)
    if rank == 1:
        background.host_room = lambda nbytes: False  # this rank's host memory is short
    got = e.save_checkpoint(ckpt, async_save=True)
    state = {"pending": e.checkpoint_pending, "latest": _latest(ckpt), "got": got}
    train(e, rank, world, N, N + 2)
    e.close()
    return state


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(200)
def test_the_host_memory_fallback_is_every_ranks(tmp_path):
    root = str(tmp_path)
    results = run_distributed(_fallback_job, 2, root, timeout=150)
    tag = f"step-{N:08d}"
    for r in results:  # both saved synchronously: committed when the call returned
        assert r == {"pending": False, "latest": tag, "got": os.path.join(root, "ckpt", tag)}


# ---- (f) the copy's host memory is counted while it lives ---------------------------------------------------------
def _tensor_bytes(directory: str) -> int:
    """Bytes of the tensors in a checkpoint's rank files, from the files' own safetensors headers (padding left out)."""
    total = 0
    for path in glob.glob(os.path.join(directory, "rank-*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, entry in header.items():
            if key != "__metadata__" and not key.startswith("__padding__"):
                begin, end = entry["data_offsets"]
                total += end - begin
    return total


@pytest.mark.timeout(200)
@pytest.mark.parametrize("config", [_cfg(1, optim="host"), _cfg(3, optim="nvme", params="nvme")], ids=["s1", "s3"])
def test_the_copys_host_memory_is_counted_until_written(config, tmp_path):
    e = make_engine(0, config, str(tmp_path))
    try:
        train(e, 0, 1, 0, N)
        assert e.memory_stats()["host"]["checkpoint_copy"] == {"current": 0, "peak": 0}
        gate, open_writer = threading.Event(), background.open_writer
        background.open_writer = lambda path, planned: gate.wait(120) and open_writer(path, planned)
        try:
            got = e.save_checkpoint(str(tmp_path / "ckpt"), async_save=True)
            held = e.memory_stats()["host"]["checkpoint_copy"]  # captured, not a byte written yet
            train(e, 0, 1, N, N + 1)  # training goes on: the copy stays counted
            held_later = e.memory_stats()["host"]["checkpoint_copy"]["current"]
        finally:
            gate.set()
            background.open_writer = open_writer
        e.wait_checkpoint()
        after = e.memory_stats()["host"]["checkpoint_copy"]
    finally:
        e.close()
    want = _tensor_bytes(got)  # what was copied is what was written
    assert want > 0
    assert held == {"current": want, "peak": want}
    assert held_later == want
    assert after == {"current": 0, "peak": want}  # given back once written


# ---- (g) under tensor parallelism (x data parallelism) -----------------------------------------------------------
def _tensor_parallel_job(rank: int, world: int, config: dict, root: str) -> dict:
    torch.set_num_threads(1)
    a = _tp_engine(config)
    _tp_train(a, 0, N)
    saved = _tp_local_state(a)
    gate, open_writer = threading.Event(), background.open_writer
    background.open_writer = lambda path, planned: gate.wait(120) and open_writer(path, planned)
    try:
        a.save_checkpoint(root, client_state={"batches": N}, async_save=True)
        _tp_train(a, N, N + EXTRA)  # the weights move on while nothing is written yet
        pending = a.checkpoint_pending
    finally:
        gate.set()
        background.open_writer = open_writer
    moved = _tp_local_state(a)
    a.wait_checkpoint()
    a.close()
    b = _tp_engine(config, seed=7)
    client = b.load_checkpoint(root)
    loaded = _tp_local_state(b)
    coords = (b.mesh.tp_rank, b.mesh.dp_rank)
    b.close()
    return {
        "pending": pending,
        "client": client,
        "coords": coords,
        "moved": any(not torch.equal(saved[k], moved[k]) for k in saved),
        "keys": sorted(saved) == sorted(loaded),
        "equal": [k for k in saved if k in loaded and not torch.equal(saved[k], loaded[k])],
    }


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(400)
def test_async_save_under_tensor_and_data_parallelism_loads_the_weights_of_its_call(tmp_path):
    config = {**TP2, "zero_stage": 3, "offload": {"optimizer": "host"}}
    results = run_distributed(_tensor_parallel_job, 4, config, str(tmp_path / "ckpt"), timeout=360)
    assert sorted(r["coords"] for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # tp 2 x dp 2
    for r in results:
        assert r["pending"] and r["moved"]  # trained on past the save before its write began
        assert r["client"] == {"batches": N}
        assert r["keys"] and r["equal"] == [], f"rank {r['coords']}: loaded weights differ: {r['equal'][:5]}"
