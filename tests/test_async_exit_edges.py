"""Two ends of a script with an async save pending that tests/test_async_exit.py does not cover ([Note: an async save
at exit], [Note: an engine dropped with a save pending] in hetero/checkpoint/background.py):
- a job of two ranks ending on an uncaught exception on one rank: neither rank commits nor hangs, each says on its
  own log that the save was dropped, `latest` still names the previous checkpoint and no temporary directory stays
  behind. The ranks are two plain processes (not torchrun, which would end rank 0 with SIGTERM once rank 1 failed:
  both exits are under test here);
- an engine dropped (`del engine`, no close) with the save pending: kept alive, garbage collection or not, and the
  save committed at exit and said so; its swap files removed then."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hetero.checkpoint import manifest as mf

try:
    from tests.dist import ONE_RANK_FAULTS, cpu_ranks_env, free_port, ranks_apart
    from tests.test_checkpoint import _cfg
except ImportError:  # tests/ itself on sys.path
    from dist import ONE_RANK_FAULTS, cpu_ranks_env, free_port, ranks_apart  # type: ignore[no-redef]
    from test_checkpoint import _cfg  # type: ignore[no-redef]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST, SECOND = "step-00000001", "step-00000002"
LIMIT_S = 200  # the whole job, imports included, on a loaded 2-core machine; a hang would be the comm timeout's 600

# A synchronous save, one more micro-batch, an async save whose write starts a second late (surely pending), then
# rank 1 raises while rank 0 trains on: its next collective meets rank 1's failure.
JOB = f"""
import os, sys, time
sys.path.insert(0, {REPO!r})
from hetero.checkpoint import background
from tests.test_checkpoint import make_engine, train
root = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
e = make_engine(rank, {_cfg(1)!r})
train(e, rank, world, 0, 1)
e.save_checkpoint(os.path.join(root, "ckpt"))
train(e, rank, world, 1, 2)
open_writer = background.open_writer
background.open_writer = lambda path, planned: time.sleep(1.0) or open_writer(path, planned)
e.save_checkpoint(os.path.join(root, "ckpt"), async_save=True)
print("pending:", e.checkpoint_pending, flush=True)
if rank == 1:
    raise ValueError("rank 1 fails with its save pending")
train(e, rank, world, 2, 6)
print("rank 0 trained on alone", flush=True)
"""


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(LIMIT_S + 60)
def test_an_uncaught_exception_on_one_rank_drops_the_pending_save_on_every_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=REPO)
        cmd = [sys.executable, str(script), str(tmp_path)]
        procs.append(
            subprocess.Popen(
                cmd, cwd=REPO, env=cpu_ranks_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    start = time.monotonic()
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, LIMIT_S - (time.monotonic() - start))))
    finally:
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert not hung, f"rank(s) {hung} still running after {LIMIT_S} s"
    (out0, err0), (out1, err1) = outs
    assert "pending: True" in out0 and "pending: True" in out1, (out0, out1)
    assert procs[1].returncode != 0 and "ValueError: rank 1 fails with its save pending" in err1, err1[-3000:]
    assert procs[0].returncode != 0 and "trained on alone" not in out0, err0[-3000:]  # it stopped, told why
    ckpt = str(tmp_path / "ckpt")
    for rank, err in enumerate((err0, err1)):
        said = f"checkpoint {SECOND!r} under {ckpt} was not committed"
        assert said in err and f"`latest` still names {FIRST!r}" in err, (rank, err[-3000:])
    assert "the script ended on an error while it was written" in err1, err1[-3000:]
    assert mf.latest_tag(ckpt) == FIRST
    assert sorted(os.listdir(ckpt)) == ["latest", FIRST]  # no .tmp-* left
    mf.check_files(os.path.join(ckpt, FIRST), mf.read_manifest(os.path.join(ckpt, FIRST)))


# One process: the engine is dropped with its save pending, the write ends, the collector runs; the script ends.
DROPPED = f"""
import gc, os, sys, time, weakref
sys.path.insert(0, {REPO!r})
from hetero.checkpoint import background
from hetero.checkpoint import manifest as mf
from tests.test_checkpoint import make_engine, train
root = sys.argv[1]
e = make_engine(0, {_cfg(1, optim="nvme")!r}, os.path.join(root, "swap"))
train(e, 0, 1, 0, 1)
e.save_checkpoint(os.path.join(root, "ckpt"))
train(e, 0, 1, 1, 2)
open_writer = background.open_writer
background.open_writer = lambda path, planned: time.sleep(0.5) or open_writer(path, planned)
e.save_checkpoint(os.path.join(root, "ckpt"), async_save=True)
alive = weakref.ref(e)
del e
gc.collect()
time.sleep(1.0)
while any(t.name == "hetero-ckpt-async" for t in __import__("threading").enumerate()):
    time.sleep(0.05)  # the write ended: nothing but the collector could take the engine now
gc.collect()
print("alive:", alive() is not None, "latest:", mf.latest_tag(os.path.join(root, "ckpt")), flush=True)
"""


@pytest.mark.timeout(LIMIT_S + 60)
def test_an_engine_dropped_with_a_save_pending_is_kept_and_the_save_committed_at_exit(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(DROPPED)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=LIMIT_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Kept, its save not committed by a finalizer at some allocation (before: collected, committed, said nothing).
    assert f"alive: True latest: {FIRST}" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    assert "or its engine dropped before it was committed" in proc.stderr, proc.stderr[-3000:]
    ckpt = str(tmp_path / "ckpt")
    assert f"committed checkpoint {SECOND!r} under {ckpt} at exit" in proc.stderr, proc.stderr[-3000:]
    assert mf.latest_tag(ckpt) == SECOND and sorted(os.listdir(ckpt)) == ["latest", FIRST, SECOND]
    mf.check_files(os.path.join(ckpt, SECOND), mf.read_manifest(os.path.join(ckpt, SECOND)))
    swap = tmp_path / "swap" / "swap-rank0"
    assert list(swap.iterdir()) == []  # the swap files went at exit
