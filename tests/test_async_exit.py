"""An async save still pending when the script ends ([Note: an async save at exit] in
hetero/checkpoint/background.py): the exit waits for its write and commits it, on one rank and under torchrun; a write
that stalls is given up within the bound, said, and the previous checkpoint and `latest` stand."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from hetero.checkpoint import manifest as mf

try:
    from tests.dist import run_torchrun, torchrun_failure
    from tests.test_checkpoint import _cfg, make_engine
except ImportError:  # tests/ itself on sys.path
    from dist import run_torchrun, torchrun_failure  # type: ignore[no-redef]
    from test_checkpoint import _cfg, make_engine  # type: ignore[no-redef]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 4  # micro-batches before the first (synchronous) save; one more before the async one
CONFIG = _cfg(3, optim="nvme")
FIRST, SECOND = f"step-{N:08d}", f"step-{N + 1:08d}"
STALL_S = 1.0  # the bound on a write making no progress, shortened for the test (60 s in the library)

# The job: a synchronous save, one more micro-batch, the weights kept for the test, then an async save and the end of
# the script at once (no wait_checkpoint(), no close()). "slow": the write starts a second late, so it is surely
# pending at exit; "stall": the write pauses for an hour once its file is written (the test hook).
JOB = f"""
import os, sys, time
sys.path.insert(0, {REPO!r})
import torch
from hetero.checkpoint import background
from tests.test_checkpoint import make_engine, train
root, mode = sys.argv[1:3]
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
e = make_engine(rank, {CONFIG!r}, os.path.join(root, "swap"))
train(e, rank, world, 0, {N})
e.save_checkpoint(os.path.join(root, "ckpt"))
train(e, rank, world, {N}, {N + 1})
state = e.full_state_dict()
if rank == 0:
    torch.save(state, os.path.join(root, "want.pt"))
if mode == "slow":
    open_writer = background.open_writer
    background.open_writer = lambda path, planned: time.sleep(1.0) or open_writer(path, planned)
else:
    background._EXIT_STALL_S = {STALL_S}
    os.environ["HETERO_CHECKPOINT_TEST_PAUSE"] = "async-written:" + os.path.join(root, f"paused-{{rank}}")
e.save_checkpoint(os.path.join(root, "ckpt"), async_save=True)
print("pending at return:", e.checkpoint_pending, flush=True)
"""


def _script(tmp_path) -> str:
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return str(path)


def _run_one(tmp_path, mode: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, _script(tmp_path), str(tmp_path), mode], env=env, capture_output=True, text=True, timeout=240
    )
    return proc, time.monotonic() - start


def _loaded_equals_the_saved(tmp_path) -> None:
    want = torch.load(tmp_path / "want.pt")
    e = make_engine(0, CONFIG, str(tmp_path / "load"))
    try:
        e.load_checkpoint(str(tmp_path / "ckpt"))
        got = e.full_state_dict()
    finally:
        e.close()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)  # the weights of the save's call, bit for bit


@pytest.mark.timeout(300)
def test_a_save_pending_at_exit_is_waited_for_and_committed(tmp_path):
    proc, _ = _run_one(tmp_path, "slow")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pending at return: True" in proc.stdout
    assert "still being written" in proc.stderr and "waiting for this rank's write" in proc.stderr  # said, and why
    assert f"committed checkpoint {SECOND!r}" in proc.stderr
    ckpt = str(tmp_path / "ckpt")
    assert mf.latest_tag(ckpt) == SECOND
    assert sorted(os.listdir(ckpt)) == ["latest", FIRST, SECOND]  # no .tmp-* left
    _loaded_equals_the_saved(tmp_path)


@pytest.mark.timeout(300)
def test_a_write_stalled_at_exit_is_given_up_and_the_previous_checkpoint_stands(tmp_path):
    proc, seconds = _run_one(tmp_path, "stall")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "paused-0").exists()  # the write did stall, its file written
    assert f"checkpoint {SECOND!r} under {tmp_path / 'ckpt'} was not committed" in proc.stderr
    assert f"no run written for {STALL_S:.0f} s" in proc.stderr
    assert f"`latest` still names {FIRST!r}" in proc.stderr
    ckpt = str(tmp_path / "ckpt")
    assert mf.latest_tag(ckpt) == FIRST
    assert sorted(os.listdir(ckpt)) == ["latest", FIRST]  # the temporary directory dropped
    assert seconds < 120  # bounded: not the hour the write pauses for
    mf.check_files(os.path.join(ckpt, FIRST), mf.read_manifest(os.path.join(ckpt, FIRST)))


@pytest.mark.timeout(400)
def test_a_save_pending_at_exit_under_torchrun_is_committed_by_every_rank(tmp_path):
    proc = run_torchrun([_script(tmp_path), str(tmp_path), "slow"], nproc=2, timeout=300)
    assert proc.returncode == 0, torchrun_failure(proc)
    assert f"committed checkpoint {SECOND!r}" in proc.stderr
    ckpt = str(tmp_path / "ckpt")
    assert mf.latest_tag(ckpt) == SECOND
    assert sorted(os.listdir(ckpt)) == ["latest", FIRST, SECOND]
    files = mf.read_manifest(os.path.join(ckpt, SECOND))["files"]
    assert {"rank-00000.safetensors", "rank-00001.safetensors"} <= set(files)  # both ranks' parts
    _loaded_equals_the_saved(tmp_path)  # resharded onto one rank
