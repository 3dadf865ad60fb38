"""keep_last(root, n): the newest n checkpoints of default tags stay, with the one `latest` names; a save in progress,
a tag of the user's own and a kill in the middle of a deletion never lose a checkpoint that is read."""

from __future__ import annotations

import os

import pytest

from hetero.checkpoint import keep_last
from hetero.checkpoint import prune as prune_module
from hetero.errors import CheckpointError

try:
    from tests.test_checkpoint import _cfg, make_engine, train
except ImportError:  # tests/ itself on sys.path
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]


def fake_root(root, tags, latest):
    """Complete checkpoints as far as keep_last looks: a directory holding a manifest.json, and `latest`."""
    for tag in tags:
        os.makedirs(root / tag)
        (root / tag / "manifest.json").write_text("{}")
    (root / "latest").write_text(latest + "\n")


def dirs(root):
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_the_newest_n_stay_in_step_order(tmp_path):
    # step-10 after step-9: by number, not by name (unpadded tags as well as the engine's padded ones).
    fake_root(tmp_path, ["step-9", "step-10", "step-2", "step-00000011"], latest="step-00000011")
    removed = keep_last(tmp_path, 2)
    assert removed == [str(tmp_path / "step-2"), str(tmp_path / "step-9")]
    assert dirs(tmp_path) == ["step-00000011", "step-10"]


def test_micro_steps_order_after_their_update(tmp_path):
    fake_root(tmp_path, ["step-3", "step-3-micro-5", "step-4"], latest="step-4")
    keep_last(tmp_path, 2)
    assert dirs(tmp_path) == ["step-3-micro-5", "step-4"]


def test_latest_is_kept_when_older_by_number(tmp_path):
    """A run resumed from step-2 saves step-3 below the left run's step-8 and step-9: its latest stays."""
    fake_root(tmp_path, ["step-2", "step-3", "step-8", "step-9"], latest="step-3")
    keep_last(tmp_path, 1)
    assert dirs(tmp_path) == ["step-3", "step-9"]


def test_unfinished_saves_and_own_tags_are_left(tmp_path):
    fake_root(tmp_path, ["step-1", "step-2", "best", "step-3"], latest="step-3")
    os.makedirs(tmp_path / ".tmp-step-4-0123abcd")  # a save in progress: no manifest yet
    os.makedirs(tmp_path / "step-5")  # not complete (no manifest): never counted or removed
    keep_last(tmp_path, 1)
    assert dirs(tmp_path) == [".tmp-step-4-0123abcd", "best", "step-3", "step-5"]


def test_a_set_aside_copy_goes_with_its_tag(tmp_path):
    """A replacing save killed between its renames left .stale-step-1-*: the next save would put it back as step-1."""
    fake_root(tmp_path, ["step-1", "step-2"], latest="step-2")
    os.makedirs(tmp_path / ".stale-step-1-0123abcd")
    (tmp_path / ".stale-step-1-0123abcd" / "manifest.json").write_text("{}")
    keep_last(tmp_path, 1)
    assert dirs(tmp_path) == ["step-2"]


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_n_must_be_a_count(tmp_path, n):
    with pytest.raises(ValueError, match="an integer >= 1"):
        keep_last(tmp_path, n)


def test_a_missing_root_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=f"keep_last: {tmp_path / 'absent'} is not a directory"):
        keep_last(tmp_path / "absent", 1)


@pytest.mark.timeout(120)
def test_with_an_engine_and_a_kill_midway(tmp_path, monkeypatch):
    """Saves of a real engine with keep_last(root, 2) after each: two stay, the latest loads. A deletion stopped
    midway (a kill in rmtree, here an error) leaves only a .tmp-* directory, which no reader takes and the next save
    deletes."""
    root = tmp_path / "ckpt"
    engine = make_engine(0, _cfg(2), str(tmp_path))
    try:
        for step in range(3):
            train(engine, 0, 1, step, step + 1)
            engine.save_checkpoint(str(root))
            keep_last(root, 2)
        assert dirs(root) == ["step-00000002", "step-00000003"]

        def killed(path, ignore_errors=False):
            raise KeyboardInterrupt

        train(engine, 0, 1, 3, 4)
        engine.save_checkpoint(str(root))
        monkeypatch.setattr(prune_module.shutil, "rmtree", killed)
        with pytest.raises(KeyboardInterrupt):
            keep_last(root, 2)
        monkeypatch.undo()
        left = dirs(root)
        assert left[0].startswith(".tmp-step-00000002-") and left[1:] == ["step-00000003", "step-00000004"]
        engine.load_checkpoint(str(root))  # latest: step-00000004

        train(engine, 0, 1, 4, 5)
        engine.save_checkpoint(str(root))  # deletes the .tmp-* directory
        keep_last(root, 2)
        assert dirs(root) == ["step-00000004", "step-00000005"]
    finally:
        engine.close()
