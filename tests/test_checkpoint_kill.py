"""A process SIGKILLed in the middle of a save leaves the previous checkpoint intact and `latest` valid; training
resumes from it bit-exactly, and the next save succeeds. So too for a save that replaces the latest checkpoint
(replace=True), killed after setting the old one aside and before the new one took its place."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

try:
    from tests.test_checkpoint import _cfg, make_engine, train
except ImportError:  # tests/ itself on sys.path
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]

N, EXTRA, M = 3, 2, 6  # saved at N; killed while saving at N + EXTRA; resumed from N to M
CONFIG = _cfg(3, optim="nvme", params="nvme")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The job: train, save (committed), train on, then save with the test hook pausing it at `point` (to be killed);
# at "set-aside", that save replaces the first checkpoint under its own tag.
JOB = f"""
import os, sys
sys.path.insert(0, {REPO!r})
from tests.test_checkpoint import _cfg, make_engine, train
root, point, marker = sys.argv[1:4]
e = make_engine(0, {CONFIG!r}, root)
train(e, 0, 1, 0, {N})
e.save_checkpoint(os.path.join(root, "ckpt"), client_state={{"micro": {N}}})
train(e, 0, 1, {N}, {N + EXTRA})
os.environ["HETERO_CHECKPOINT_TEST_PAUSE"] = point + ":" + marker
kw = dict(tag="step-{N:08d}", replace=True) if point == "set-aside" else {{}}
e.save_checkpoint(os.path.join(root, "ckpt"), **kw)
raise SystemExit("the save was not paused")
"""


def _uninterrupted(scratch: str) -> tuple[list[float], dict]:
    e = make_engine(0, CONFIG, scratch)
    losses = train(e, 0, 1, 0, M)
    state = e.full_state_dict()
    e.close()
    return losses[N:], state


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", ["shard-written", "before-latest", "set-aside"])
def test_sigkill_mid_save_keeps_previous_checkpoint(point, tmp_path):
    root, marker = str(tmp_path), str(tmp_path / "paused")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", JOB, root, point, marker], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 200
        while not os.path.exists(marker):
            if proc.poll() is not None:
                pytest.fail(f"the job exited ({proc.returncode}) before pausing: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("the save never reached its pause point")
            time.sleep(0.1)
        ckpt = os.path.join(root, "ckpt")
        if point == "shard-written":  # killed with the new checkpoint only in its temporary directory
            assert glob.glob(os.path.join(ckpt, ".tmp-step-00000005-*", "rank-00000.safetensors"))
        elif point == "before-latest":  # killed after the rename, before `latest` moved
            assert os.path.isfile(os.path.join(ckpt, "step-00000005", "manifest.json"))
        else:  # killed with the checkpoint `latest` names set aside, the new one not yet in its place
            assert not os.path.exists(os.path.join(ckpt, "step-00000003"))
            assert glob.glob(os.path.join(ckpt, ".stale-step-00000003-*", "manifest.json"))
            assert glob.glob(os.path.join(ckpt, ".tmp-step-00000003-*", "manifest.json"))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip() == "step-00000003"

    want_losses, want_state = _uninterrupted(str(tmp_path / "ref"))
    e = make_engine(0, CONFIG, str(tmp_path / "resume"))
    try:
        assert e.load_checkpoint(ckpt) == {"micro": N}
        assert e.global_steps == N
        losses = train(e, 0, 1, N, N + EXTRA)
        e.save_checkpoint(ckpt)  # the same tag as the killed save: a stale directory does not stand in the way
        losses += train(e, 0, 1, N + EXTRA, M)
        state = e.full_state_dict()
    finally:
        e.close()
    assert losses == want_losses
    assert all(torch.equal(state[k], want_state[k]) for k in want_state)
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip() == "step-00000005"
    # Nothing the killed save left: neither a set-aside checkpoint nor its unfinished one (a checkpoint's size).
    assert sorted(os.listdir(ckpt)) == [
        "latest",
        "step-00000003",
        "step-00000005",
    ]
