"""[Note: a dead peer on this host] in hetero/comm/alive.py: a rank SIGKILLed while writing its part of a checkpoint
is named by the others within a second or two, not after comm_timeout, every rank raising the same error and the
previous checkpoint standing; the kernel's view of a posted process (alive, a zombie, reaped, its pid reused)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hetero.comm import alive
from hetero.errors import RankFailedError

try:
    from tests.dist import ONE_RANK_FAULTS, DistributedTestError, ranks_apart, run_distributed
    from tests.test_checkpoint import _cfg, make_engine, train
except ImportError:  # tests/ itself on sys.path
    from dist import ONE_RANK_FAULTS, DistributedTestError, ranks_apart, run_distributed  # type: ignore[no-redef]
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]

T = 60.0  # comm_timeout: before the fix the others named the killed rank only this long after its last beat
WRITING_S = 1.0  # how long the killed rank writes before it dies: its heartbeat has started
SEEN_S = 5.0  # the others must name it within this of its death (polls every 0.5 s; a loaded 2-core machine)


def _killed_while_writing(fn):
    def write(*args, **kwargs):
        time.sleep(WRITING_S)  # inside the meeting, its heartbeat posted
        with open(os.environ["KILLED_AT"], "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)

    return write


def _job(rank: int, world: int, root: str) -> dict:
    import torch

    from hetero.checkpoint import save as save_mod

    torch.set_num_threads(1)
    os.environ["KILLED_AT"] = os.path.join(root, "killed_at")
    ckpt = os.path.join(root, "ckpt")
    e = make_engine(rank, {**_cfg(1), "comm_timeout": T}, root)
    train(e, rank, world, 0, 1)
    e.save_checkpoint(ckpt)  # the checkpoint before
    train(e, rank, world, 1, 2)
    if rank == 1:
        save_mod._write_rank = _killed_while_writing(save_mod._write_rank)
    out: dict = {}
    try:
        e.save_checkpoint(ckpt)
        out["error"] = None
    except Exception as err:  # noqa: BLE001 (the type is part of what is checked)
        out["error"] = (type(err).__name__, str(err), getattr(err, "failed_rank", None))
    out["at"] = time.time()
    with open(os.path.join(ckpt, "latest")) as f:
        out["latest"] = f.read().strip()
    out["dirs"] = sorted(os.listdir(ckpt))
    return out


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(240)
def test_a_rank_killed_while_writing_is_named_within_seconds_not_comm_timeout(tmp_path):
    with pytest.raises(DistributedTestError) as caught:  # rank 1 reports nothing: it was killed
        run_distributed(_job, 2, str(tmp_path), timeout=200, report_grace=2 * T)
    assert set(caught.value.errors) == {1}, caught.value.errors
    assert "without reporting" in caught.value.errors[1], caught.value.errors[1]
    r0 = caught.value.results[0]
    kind, message, failed_rank = r0["error"]
    assert kind == RankFailedError.__name__ and failed_rank == 1, message
    assert "The process of global rank 1 (pid " in message and "has ended before it finished" in message, message
    assert "was not committed" in message, message
    with open(tmp_path / "killed_at") as f:
        killed_at = float(f.read())
    assert r0["at"] - killed_at < SEEN_S, (r0["at"] - killed_at, message)
    assert r0["latest"] == "step-00000001" and r0["dirs"] == ["latest", "step-00000001"], r0


def test_the_kernel_says_whether_a_posted_process_still_exists():
    me = alive.identity()
    assert alive.askable(me, me) and not alive.gone(me)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        who = {**me, "pid": child.pid, "start": alive._start_time(child.pid)}
        assert who["start"] and not alive.gone(who)
        assert alive.gone({**who, "start": str(int(who["start"]) + 1)})  # its pid, another process's start time
        child.kill()
        deadline = time.monotonic() + 10
        while alive._state(child.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert alive.gone(who)  # dead, not yet reaped: a zombie, as a rank whose launcher has not waited for it
    finally:
        child.kill()
        child.wait()
    assert alive.gone(who)  # reaped: no such pid
    assert not alive.askable({**who, "pidns": "pid:[1]"}, me)  # another pid namespace: its pids are not ours
    assert not alive.askable({**who, "boot": "another-host"}, me)
