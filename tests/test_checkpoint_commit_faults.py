"""Faults at a checkpoint's commit and load that must not lose the user's way. A full disk or a spent quota while rank 0
commits: every rank raises the same error naming the file, the directory, the free space and what to do, nothing
is left behind, and the previous checkpoint and `latest` stand and load ([Note: a commit that fails]). An I/O error
reading a part file: the file, its checkpoint and the checkpoint to load instead are named. A manifest deleted, or
`latest` naming a missing directory: the intact checkpoints are listed with the call that loads one. Faults are
injected by replacing the function the code calls, on one rank where the test is distributed."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

from hetero.checkpoint import format as fmt
from hetero.checkpoint import manifest as mf
from hetero.checkpoint import read_faults
from hetero.errors import CheckpointError, disk_trouble
from tests.dist import ONE_RANK_FAULTS, ranks_apart

try:
    from tests.test_checkpoint import _cfg, make_engine, train
    from tests.two_saves import copy_root, save_two
except ImportError:  # tests/ itself on sys.path
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]
    from two_saves import copy_root, save_two  # type: ignore[no-redef]

OLD, NEW = "step-00000001", "step-00000002"
FULL, QUOTA = os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A root holding step 1 and step 2 (`latest`) of a stage-1 engine, and that engine's state at step 2."""
    root = str(tmp_path_factory.mktemp("ckpt") / "root")
    e = save_two(root)
    state = e.full_state_dict()
    e.close()
    return root, state


def _copy(saved, tmp_path) -> str:
    return copy_root(saved[0], tmp_path)


def _load(path: str, tag: str | None = None) -> tuple[object, dict]:
    e = make_engine(0, _cfg(1))
    try:
        return e.load_checkpoint(path, tag), e.full_state_dict()
    finally:
        e.close()


def _files(root: str) -> dict[str, list[tuple[str, int]]]:
    """Every entry of the root, with its files' names and sizes (a directory's)."""
    out = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        inside = os.listdir(path) if os.path.isdir(path) else []
        out[name] = sorted((f, os.path.getsize(os.path.join(path, f))) for f in inside)
    return out


def _failing_write(target: str, code: int, write=None):
    """mf.write_durable that fails with `code` for a file whose name starts with `target`, after creating it and
    writing a few bytes of it (as a disk filling up midway does)."""
    write = write or mf.write_durable

    def fake(path: str, data: bytes) -> int:
        if not os.path.basename(path).startswith(target):
            return write(path, data)
        with open(path, "wb") as f:
            f.write(data[:3])
        raise OSError(code, os.strerror(code))

    return fake


# ---- 1. rank 0's commit meets a full disk or a spent quota ---------------------------------------------------------
@pytest.mark.parametrize(
    "point, replace",
    [("state.pt", False), ("manifest.json", False), ("rename", False), ("latest", False), ("latest", True)],
)
def test_a_commit_on_a_full_disk_undoes_itself(saved, tmp_path, monkeypatch, point, replace):
    """Each step of the commit failing: the error names the file, the root, its free space and what to do; the new
    checkpoint, its temporary directory and `latest`'s temporary file are gone; `latest` and every checkpoint before
    are as they were and load. With replace=True the checkpoint of the same tag (the latest) is put back whole."""
    root = _copy(saved, tmp_path)
    before = _files(root)
    tag = NEW if replace else "step-00000003"
    if point == "rename":
        rename = os.rename

        def full_rename(src: str, dst: str) -> None:
            if dst == os.path.join(root, tag):
                raise OSError(errno.ENOSPC, FULL)  # a directory entry needs a block too
            rename(src, dst)

        monkeypatch.setattr(os, "rename", full_rename)
        named = os.path.join(root, tag)
    else:
        monkeypatch.setattr(mf, "write_durable", _failing_write(point, errno.ENOSPC))
        named = f"{root}/latest (through its temporary file latest.tmp-" if point == "latest" else f"{os.sep}{point}"
    e = make_engine(0, _cfg(1))
    try:
        with pytest.raises(CheckpointError) as err:
            e.save_checkpoint(root, client_state={"epoch": 3}, tag=tag, replace=replace)
        monkeypatch.undo()
        assert _files(root) == before  # nothing left: no latest.tmp-*, .tmp-*, .stale-* or new checkpoint
        msg = str(err.value)
        for said in (named, f"{FULL} (ENOSPC)", f"the file system holding {root} is full (", "free)", "keep_last"):
            assert said in msg, (said, msg)
        assert f"{root}/latest still names '{NEW}', which loads as before" in msg, msg
        if point == "latest" and not replace:  # the next save, the disk freed, works
            assert e.save_checkpoint(root, client_state={"epoch": 3}, tag=tag) == os.path.join(root, tag)
            assert mf.latest_tag(root) == tag
            mf.replace_atomic(os.path.join(root, "latest"), f"{NEW}\n".encode())  # back, for the load below
    finally:
        e.close()
    cs, state = _load(root)
    assert cs == {"epoch": 2}
    assert all(torch.equal(state[k], saved[1][k]) for k in state)


def test_a_spent_quota_is_not_called_a_full_disk(saved, tmp_path, monkeypatch):
    """EDQUOT at the commit and in a rank's own write: the error says the quota is spent, where to see it and whom
    to ask, not that the disk is full (df shows free space there)."""
    root = _copy(saved, tmp_path)
    before = _files(root)
    e = make_engine(0, _cfg(1))
    try:
        monkeypatch.setattr(mf, "write_durable", _failing_write("manifest.json", errno.EDQUOT))
        with pytest.raises(CheckpointError) as at_commit:
            e.save_checkpoint(root, tag="step-00000003")
        monkeypatch.undo()

        def over_quota(self, entries, views):
            raise OSError(errno.EDQUOT, QUOTA)

        monkeypatch.setattr(fmt.TensorWriter, "_write_run", over_quota)
        with pytest.raises(CheckpointError) as in_write:
            e.save_checkpoint(root, tag="step-00000003")
        monkeypatch.undo()
    finally:
        e.close()
    for err in (at_commit, in_write):
        msg = str(err.value)
        assert f"{QUOTA} (EDQUOT)" in msg and "disk quota" in msg and "quota -s" in msg, msg
        assert "administrator" in msg and "is full" not in msg, msg
    assert "rank 0 could not write" in str(in_write.value) and "rank-00000.safetensors" in str(in_write.value)
    assert _files(root) == before
    assert _load(root)[0] == {"epoch": 2}
    full = disk_trouble(OSError(errno.ENOSPC, FULL), root)
    assert "is full" in full and "quota -s" not in full, full


# ---- 2. an I/O error reading a part file ---------------------------------------------------------------------------
def _eio(fd, views, offset, **kwargs):
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def _eio_open(path, *args, **kwargs):
    """`open` for read_faults, failing for a state.pt."""
    if os.path.basename(path) == mf.STATE_FILE:
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    return open(path, *args, **kwargs)


def test_an_io_error_reading_a_part_file_names_it_and_the_checkpoint_to_load(saved, tmp_path, monkeypatch, capsys):
    from hetero.checkpoint.__main__ import main

    root = _copy(saved, tmp_path)
    monkeypatch.setattr(fmt, "read_full", _eio)
    with pytest.raises(CheckpointError) as err:
        _load(root)
    capsys.readouterr()
    assert main(["verify", root]) == 1
    printed = capsys.readouterr().err
    monkeypatch.undo()
    for msg in (str(err.value), printed):
        part = os.path.join(root, NEW, "rank-00000.safetensors")
        assert f"{part}: cannot be read, so checkpoint {os.path.join(root, NEW)} cannot be loaded" in msg, msg
        assert f"{os.strerror(errno.EIO)} (EIO)" in msg and "dmesg" in msg, msg
        assert f"the newest intact one before {NEW} is {os.path.join(root, OLD)}" in msg, msg
        assert f"engine.load_checkpoint({root!r}, tag={OLD!r})" in msg, msg
    assert _load(root, OLD)[0] == {"epoch": 1}  # what it names loads


# ---- 3. no checkpoint where the user looked ------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["manifest", "directory", "tag"])
def test_a_missing_checkpoint_lists_the_intact_ones(saved, tmp_path, capsys, damage):
    """`latest` naming a tag whose manifest was deleted or whose directory is gone, or a tag directory without its
    manifest passed by tag=: the error lists the checkpoints whose manifests verify (not one whose manifest fails its
    checksum) and how to load one, and that one loads."""
    from hetero.checkpoint.__main__ import main

    root = _copy(saved, tmp_path)
    bad = os.path.join(root, "step-00000000")  # a complete-looking checkpoint whose manifest is corrupt: not offered
    shutil.copytree(os.path.join(root, OLD), bad)
    with open(os.path.join(bad, mf.MANIFEST), "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0x01]))
    if damage == "directory":
        shutil.rmtree(os.path.join(root, NEW))
    else:
        os.remove(os.path.join(root, NEW, mf.MANIFEST))
    with pytest.raises(CheckpointError) as err:
        _load(root, NEW if damage == "tag" else None)
    capsys.readouterr()
    assert main(["verify", os.path.join(root, NEW) if damage == "tag" else root]) == 1
    for msg in (str(err.value), capsys.readouterr().err):
        if damage == "tag":
            assert f"{os.path.join(root, NEW)}: holds no manifest.json" in msg, msg
        else:
            gone = "its manifest was deleted" if damage == "manifest" else "the directory is missing"
            assert f"latest names '{NEW}', but {os.path.join(root, NEW)} holds no manifest.json ({gone})" in msg, msg
        assert f"The intact checkpoints under {root}: {OLD}. Load one by its tag" in msg, msg
        assert f"engine.load_checkpoint({root!r}, tag={OLD!r})" in msg and f"--resume {root}/{OLD}" in msg, msg
    assert _load(root, OLD)[0] == {"epoch": 1}


# ---- 4. two ranks: rank 0's commit fails, then rank 1's read --------------------------------------------------------
def _two_ranks(rank: int, world: int, root: str) -> dict:
    torch.set_num_threads(1)
    ckpt = os.path.join(root, "ckpt")
    e = make_engine(rank, {**_cfg(2), "comm_timeout": 60}, root)
    out: dict = {}

    def attempt(name: str, call) -> None:
        try:
            call()
            out[name] = ("ok", "")
        except Exception as err:  # noqa: BLE001 (the type is part of what is checked)
            out[name] = (type(err).__name__, str(err))

    train(e, rank, world, 0, 1)
    e.save_checkpoint(ckpt, client_state={"epoch": 1})
    train(e, rank, world, 1, 2)
    write = mf.write_durable
    if rank == 0:  # only rank 0 writes `latest`; the fault is its alone
        mf.write_durable = _failing_write("latest", errno.ENOSPC, write)
    attempt("commit", lambda: e.save_checkpoint(ckpt, client_state={"epoch": 2}))
    mf.write_durable = write
    out["after_commit"] = (sorted(os.listdir(ckpt)), mf.latest_tag(ckpt))
    attempt("retry", lambda: e.save_checkpoint(ckpt, client_state={"epoch": 2}))
    read_full = fmt.read_full
    if rank == 1:
        fmt.read_full = _eio
    attempt("read", lambda: e.load_checkpoint(ckpt))
    fmt.read_full = read_full
    if rank == 1:  # its state.pt read fails: [Note: a disk error reading a checkpoint]
        read_faults.open = _eio_open
    attempt("state", lambda: e.load_checkpoint(ckpt))
    vars(read_faults).pop("open", None)
    out["good"] = e.load_checkpoint(ckpt)
    e.close()
    return out


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(300)
def test_a_failure_on_one_rank_is_raised_the_same_on_every_rank(tmp_path):
    try:
        from tests.dist import run_distributed
    except ImportError:
        from dist import run_distributed  # type: ignore[no-redef]

    results = run_distributed(_two_ranks, 2, str(tmp_path), timeout=240)
    ckpt = os.path.join(str(tmp_path), "ckpt")
    commit = results[0]["commit"]
    assert commit[0] == "CheckpointError" and results[1]["commit"] == commit, results
    assert f"{ckpt}/latest (through its temporary file latest.tmp-" in commit[1] and f"{FULL} (ENOSPC)" in commit[1], (
        commit
    )
    assert f"{ckpt}/latest still names '{OLD}'" in commit[1], commit
    for out in results:
        assert out["after_commit"] == (["latest", OLD], OLD), out["after_commit"]
        assert out["retry"] == ("ok", ""), out["retry"]
        assert out["good"] == {"epoch": 2}
    part = os.path.join(ckpt, NEW, "rank-0000")
    kind, mine = results[1]["read"]
    assert kind == "CheckpointError" and part in mine and f"{os.strerror(errno.EIO)} (EIO)" in mine, mine
    assert f"engine.load_checkpoint({ckpt!r}, tag={OLD!r})" in mine, mine
    kind, theirs = results[0]["read"]
    assert kind == "CheckpointError" and "rank(s) 1" in theirs and part in theirs, theirs
    state = os.path.join(ckpt, NEW, mf.STATE_FILE)
    for rank, (kind, msg) in enumerate(r["state"] for r in results):  # rank 1's error, and rank 0's naming it
        assert kind == "CheckpointError" and f"{state}: cannot be read" in msg, (rank, msg)
        assert f"{os.strerror(errno.EIO)} (EIO)" in msg and f"tag={OLD!r}" in msg, (rank, msg)
    assert "rank(s) 1" in results[0]["state"][1], results[0]["state"]
