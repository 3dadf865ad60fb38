"""A save stopped by SIGTERM (torchrun's signal to every worker once one failed, or at Ctrl-C) leaves its .tmp-*
staging directory; the next save, or keep_last, removes it once the save's rank 0 is gone, and never the directory of
a save whose rank 0 lives ([Note: staging directories a stopped job left] in hetero/checkpoint/staging.py)."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from hetero.checkpoint import keep_last, staging
from hetero.checkpoint import manifest as mf
from hetero.comm import alive

try:
    from tests.dist import ONE_RANK_FAULTS, DistributedTestError, ranks_apart, run_distributed
    from tests.test_checkpoint import _cfg, make_engine, train
except ImportError:  # tests/ itself on sys.path
    from dist import ONE_RANK_FAULTS, DistributedTestError, ranks_apart, run_distributed  # type: ignore[no-redef]
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]

FIRST, SECOND = "step-00000001", "step-00000002"
LIMIT_S = 120


def _job(rank: int, world: int, root: str, paused: list[int], markers: str) -> None:
    """Save FIRST, train on, then save SECOND with the ranks in `paused` held after writing their file (where the
    test sends them SIGTERM); the others go on to the gather."""
    e = make_engine(rank, _cfg(1))
    train(e, rank, world, 0, 1)
    e.save_checkpoint(root)
    train(e, rank, world, 1, 2)
    if rank in paused:
        os.environ["HETERO_CHECKPOINT_TEST_PAUSE"] = f"shard-written:{os.path.join(markers, f'rank{rank}')}"
    e.save_checkpoint(root)


def _pids(markers: str, ranks: list[int], thread: threading.Thread) -> dict[int, int]:
    """The pids of the paused ranks, once each reached its pause (the test hook writes its marker then)."""
    deadline = time.monotonic() + LIMIT_S
    paths = {r: os.path.join(markers, f"rank{r}") for r in ranks}
    while not all(os.path.exists(p) and os.path.getsize(p) for p in paths.values()):
        assert thread.is_alive(), "the job ended before its save paused"
        assert time.monotonic() < deadline, "the save never paused"
        time.sleep(0.05)
    return {r: int(pathlib.Path(p).read_text()) for r, p in paths.items()}


def _staged(root: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, ".tmp-*")))


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(LIMIT_S + 60)
@pytest.mark.parametrize("killed", ["rank 1", "every rank"])
def test_a_save_stopped_by_sigterm_is_cleaned_by_the_next_save_and_a_live_one_is_kept(killed, tmp_path, caplog):
    root, markers = str(tmp_path / "ckpt"), str(tmp_path / "markers")
    os.makedirs(markers)
    paused = [1] if killed == "rank 1" else [0, 1]
    ended: dict[str, BaseException] = {}

    def job() -> None:
        try:
            run_distributed(_job, 2, root, paused, markers, timeout=LIMIT_S)
        except BaseException as e:  # noqa: BLE001 (read below)
            ended["error"] = e

    thread = threading.Thread(target=job)
    thread.start()
    other, pids = None, {}
    try:
        pids = _pids(markers, paused, thread)
        # Mid-save: rank 1's file (rank 0's too) in the staging directory, beside its owner file.
        (staged,) = [n for n in _staged(root) if not n.endswith(staging.OWNER)]
        assert staged.startswith(f".tmp-{SECOND}-") and _staged(root) == [staged, staged + staging.OWNER]
        assert sorted(os.listdir(os.path.join(root, staged))) == [mf.rank_file(0), mf.rank_file(1)]
        # Another job saving to the same root meanwhile: the live save's directory stays (it was deleted).
        other = make_engine(0, _cfg(1))
        train(other, 0, 1, 0, 1)
        with caplog.at_level(logging.INFO, logger="hetero.checkpoint"):
            other.save_checkpoint(root, tag="other-1")
            keep_last(root, 1)
        assert staged in _staged(root), "a live save's staging directory was removed"
        assert f"kept {staged}: the process of its rank 0 (pid " in caplog.text and "is running" in caplog.text
        # SIGTERM, as torchrun sends it: to rank 1 alone (rank 0 waits for it at the gather), or to every rank.
        for pid in pids.values():
            os.kill(pid, signal.SIGTERM)
        thread.join(LIMIT_S)
        assert not thread.is_alive(), "the job did not end after SIGTERM"
        error = ended.get("error")
        assert isinstance(error, DistributedTestError), error
        for r in paused:
            assert f"process exited with code -{int(signal.SIGTERM)}" in error.errors[r], error.errors[r]
        if killed == "rank 1":  # rank 0 lived to see rank 1 gone, and removed the directory itself
            assert "Checkpoint 'step-00000002' was not committed" in error.errors[0], error.errors[0]
            assert _staged(root) == []
        else:  # what SIGTERM to every rank leaves: both ranks' files, a checkpoint's size
            assert _staged(root) == [staged, staged + staging.OWNER]
            assert sorted(os.listdir(os.path.join(root, staged))) == [mf.rank_file(0), mf.rank_file(1)]
        assert mf.latest_tag(root) == "other-1"
        # The next save removes what the stopped job left, and says what and why.
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hetero.checkpoint"):
            train(other, 0, 1, 1, 2)
            other.save_checkpoint(root, tag="other-2")
        assert _staged(root) == []
        if killed == "every rank":
            said = f"{root}: removed {staged} ("
            assert said in caplog.text and f"the process of its rank 0 (pid {pids[0]} on " in caplog.text
            assert "has ended" in caplog.text, caplog.text
    finally:
        for pid in pids.values():  # a test that failed midway leaves no rank behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        thread.join(LIMIT_S)
        if other is not None:
            other.close()
    assert sorted(os.listdir(root)) == ["latest", "other-1", "other-2", FIRST]
    for tag in (FIRST, "other-1", "other-2"):
        mf.check_files(os.path.join(root, tag), mf.read_manifest(os.path.join(root, tag)))


# ---- the rules, on staging directories made by hand -----------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _stage(root, name: str, owner: dict | None, *, age_s: float = 0.0) -> None:
    """A staging directory holding a rank's file, its owner file `owner` (None: none), all `age_s` old."""
    path = root / name
    path.mkdir()
    (path / mf.rank_file(0)).write_bytes(b"x" * 4096)
    if owner is not None:
        (root / (name + staging.OWNER)).write_text(json.dumps(owner))
    then = time.time() - age_s
    for p in (path / mf.rank_file(0), path, root / (name + staging.OWNER)):
        if p.exists():
            os.utime(p, (then, then))


def test_keep_last_removes_what_no_live_save_owns(tmp_path, caplog):
    root = tmp_path
    (root / FIRST).mkdir()
    (root / FIRST / mf.MANIFEST).write_text("{}")
    (root / mf.LATEST).write_text(FIRST + "\n")
    me = alive.identity()
    hour = staging.QUIET_S
    elsewhere = {**me, "boot": "another-machine", "host": "node-7"}
    _stage(root, ".tmp-a-00000001", {**me, "pid": _dead_pid()})  # its rank 0 ended: goes at once
    _stage(root, ".tmp-b-00000002", {**me, "time": time.time()})  # this process: a save in progress, stays
    _stage(root, ".tmp-c-00000003", elsewhere)  # another machine's, written a moment ago: stays
    _stage(root, ".tmp-d-00000004", elsewhere, age_s=hour + 60)  # ... unchanged for an hour: goes
    _stage(root, ".tmp-e-00000005", None)  # no owner file (an earlier hetero's), fresh: stays
    _stage(root, ".tmp-f-00000006", None, age_s=hour + 60)  # ... unchanged for an hour: goes
    _stage(root, ".tmp-g-00000007", {"doomed": True})  # keep_last's own deletion, stopped midway: goes
    (root / (".tmp-h-00000008" + staging.OWNER)).write_text(json.dumps({**me, "pid": _dead_pid()}))  # file alone
    with caplog.at_level(logging.INFO, logger="hetero.checkpoint"):
        assert keep_last(root, 1) == []  # no checkpoint removed: only staging directories
    left = sorted(p.name for p in root.iterdir())
    assert left == [
        ".tmp-b-00000002",
        ".tmp-b-00000002.owner",
        ".tmp-c-00000003",
        ".tmp-c-00000003.owner",
        ".tmp-e-00000005",
        "latest",
        FIRST,
    ]
    for name in ("a-00000001", "d-00000004", "f-00000006", "g-00000007", "h-00000008"):
        assert f"removed .tmp-{name} (" in caplog.text, (name, caplog.text)
    assert "written from node-7 (pid" in caplog.text and "unchanged for 1.0 h" in caplog.text
    assert "keep_last was deleting it" in caplog.text and "with no owner file" in caplog.text


@pytest.mark.timeout(120)
def test_keep_last_keeps_the_directory_of_an_async_save_still_written(tmp_path, monkeypatch):
    from hetero.checkpoint import background

    root = str(tmp_path / "ckpt")
    e = make_engine(0, _cfg(1))
    try:
        train(e, 0, 1, 0, 1)
        e.save_checkpoint(root)
        train(e, 0, 1, 1, 2)
        gate = threading.Event()
        open_writer = background.open_writer
        monkeypatch.setattr(
            background, "open_writer", lambda path, planned: gate.wait(30) and open_writer(path, planned)
        )
        e.save_checkpoint(root, async_save=True)
        (staged,) = [n for n in _staged(root) if not n.endswith(staging.OWNER)]
        keep_last(root, 1)
        assert staged in _staged(root)
        gate.set()
        e.wait_checkpoint()
    finally:
        e.close()
    assert sorted(os.listdir(root)) == ["latest", FIRST, SECOND]
