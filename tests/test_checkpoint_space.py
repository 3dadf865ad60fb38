"""A spent disk quota seen before a save writes anything ([Note: a quota seen before the save] in
hetero/checkpoint/space.py): the file system's free space does not show a quota, so each rank reserves its part of
the checkpoint's bytes with fallocate and frees them; a refusal (injected here as EDQUOT) is the save's error before
any byte is written, worded as a quota, and nothing is left behind."""

from __future__ import annotations

import errno
import os

import pytest

from hetero.checkpoint import manifest as mf
from hetero.checkpoint import space
from hetero.errors import CheckpointError
from hetero.io import direct

try:
    from tests.test_checkpoint import _cfg, make_engine, train
except ImportError:  # tests/ itself on sys.path
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]

QUOTA = f"{os.strerror(errno.EDQUOT)} (EDQUOT)"


def test_a_spent_quota_stops_the_save_before_anything_is_written(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    e = make_engine(0, _cfg(1))
    try:
        train(e, 0, 1, 0, 1)
        e.save_checkpoint(root)
        before = sorted(os.listdir(root))
        asked: list[int] = []
        writes: list[str] = []
        real_write = mf.write_durable

        def over_quota(fd: int, offset: int, length: int) -> bool:
            asked.append(length)
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

        monkeypatch.setattr(direct, "fallocate", over_quota)
        monkeypatch.setattr(mf, "write_durable", lambda path, data: writes.append(path) or real_write(path, data))
        train(e, 0, 1, 1, 2)
        with pytest.raises(CheckpointError) as err:
            e.save_checkpoint(root)
        monkeypatch.undo()
        msg = str(err.value)
        assert f"cannot write under {root} (the checkpoint needs about" in msg, msg
        assert f"{QUOTA}: your disk quota" in msg and "quota -s" in msg and "Nothing was written" in msg, msg
        planned = os.path.getsize(os.path.join(root, before[-1], mf.rank_file(0)))
        assert len(asked) == 1 and asked[0] >= planned, (asked, planned)  # the whole checkpoint, asked once
        assert writes == [] and sorted(os.listdir(root)) == before  # nothing written, no .tmp-* left
        assert e.save_checkpoint(root).endswith("step-00000002")  # the quota back: the same save goes through
        assert sorted(os.listdir(root)) == ["latest", "step-00000001", "step-00000002"]  # no probe file left
    finally:
        e.close()


def reserve_and_free(tmp: str, nbytes: int) -> str:
    """A rank's reservation, freed at once; why it is short ("" where it fits)."""
    held = space.reserve(tmp, nbytes, rank=0, root=tmp)
    space.release(held)
    return held.short


def test_the_reservation_is_skipped_where_it_would_take_memory_or_proves_nothing(tmp_path, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(direct, "fallocate", lambda fd, offset, length: calls.append(length) or True)
    monkeypatch.setattr(direct, "memory_file_system", lambda path: "tmpfs")
    assert reserve_and_free(str(tmp_path), 1 << 30) == ""
    assert calls == []
    monkeypatch.setattr(direct, "memory_file_system", lambda path: None)
    assert reserve_and_free(str(tmp_path), 1 << 30) == ""
    assert calls == [1 << 30] and os.listdir(tmp_path) == []

    def too_big(fd: int, offset: int, length: int) -> bool:  # the whole checkpoint in one file: no word on room
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(direct, "fallocate", too_big)
    assert reserve_and_free(str(tmp_path), 1 << 30) == ""
    assert os.listdir(tmp_path) == []
