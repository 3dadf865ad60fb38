"""Every rank reserves the room its own part of a checkpoint needs before anything is written ([Note: each rank's
room] in hetero/checkpoint/space.py): a disk full on rank 1 alone (its reservation refused with ENOSPC, as
tests/test_checkpoint_space.py injects a quota) stops the save on both ranks with the same error naming rank 1, the
directory, the bytes needed and free; nothing saved is lost, nothing is left behind, and training goes on."""

from __future__ import annotations

import errno
import os

import pytest

from hetero.checkpoint import manifest as mf
from hetero.errors import CheckpointError
from hetero.io import direct

try:
    from tests.dist import RANKS_DIFFER, ranks_apart, run_distributed
    from tests.test_checkpoint import _cfg, make_engine, train
except ImportError:  # tests/ itself on sys.path
    from dist import RANKS_DIFFER, ranks_apart, run_distributed  # type: ignore[no-redef]
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]

FIRST, SECOND, THIRD = "step-00000001", "step-00000002", "step-00000003"


def _job(rank: int, world: int, root: str) -> dict:
    e = make_engine(rank, _cfg(1))
    try:
        train(e, rank, world, 0, 1)
        e.save_checkpoint(root)
        planned = os.path.getsize(os.path.join(root, FIRST, mf.rank_file(rank)))  # this rank's part, as saved
        asked: list[int] = []
        fallocate = direct.fallocate

        def full(fd: int, offset: int, length: int) -> bool:  # rank 1's disk is full
            asked.append(length)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def counted(fd: int, offset: int, length: int) -> bool:
            asked.append(length)
            return fallocate(fd, offset, length)

        direct.fallocate = full if rank == 1 else counted
        train(e, rank, world, 1, 2)
        try:
            e.save_checkpoint(root)
            error = ""
        except CheckpointError as err:
            error = str(err)
        finally:
            direct.fallocate = fallocate
        left = sorted(os.listdir(root))
        train(e, rank, world, 2, 3)  # training goes on, and the next save, with room, goes through
        e.save_checkpoint(root)
        return {"error": error, "left": left, "asked": asked, "planned": planned}
    finally:
        e.close()


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(180)
def test_a_full_disk_on_one_rank_stops_the_save_on_every_rank_before_anything_is_written(tmp_path):
    root = str(tmp_path / "ckpt")
    r0, r1 = run_distributed(_job, 2, root, timeout=150)
    msg = r0["error"]
    assert msg and r1["error"] == msg, (r0["error"], r1["error"])  # the same error on both ranks
    assert f"rank 1 cannot write under {root} (the checkpoint needs about " in msg, msg
    assert "there for this rank's part, " in msg and " bytes) free): " in msg, msg
    assert f"{os.strerror(errno.ENOSPC)} (ENOSPC): the file system holding {root} is full" in msg, msg
    assert "rank 0 cannot" not in msg and "Nothing was written" in msg and "training can go on" in msg, msg
    # Each rank asked the file system for its own part, once, rank 1 too (before: rank 0 alone, for the whole).
    assert len(r1["asked"]) == 1 and r1["asked"][0] >= r1["planned"], r1
    assert len(r0["asked"]) == 1 and r0["asked"][0] >= r0["planned"], r0
    assert r0["left"] == ["latest", FIRST], r0["left"]  # nothing written, no staging directory left (rank 0's)
    assert sorted(os.listdir(root)) == ["latest", FIRST, THIRD]
    for tag in (FIRST, THIRD):
        mf.check_files(os.path.join(root, tag), mf.read_manifest(os.path.join(root, tag)))


def test_a_rank_short_of_free_space_says_so_without_reserving(tmp_path, monkeypatch):
    """Free space below the part (statvfs): short at once, nothing reserved, the amounts named."""
    from collections import namedtuple

    from hetero.checkpoint import space

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: Usage(8 << 30, 8 << 30, 3 << 20))
    monkeypatch.setattr(direct, "fallocate", lambda fd, offset, length: pytest.fail("reserved while short"))
    held = space.reserve(str(tmp_path), 5 << 30, rank=3, root="/ckpt")
    space.release(held)
    assert held.path is None and os.listdir(tmp_path) == []
    assert held.short == (
        "rank 3 cannot write under /ckpt (the checkpoint needs about 5.00 GiB (5368709120 bytes) there for this "
        "rank's part, 3.0 MiB (3145728 bytes) free): not enough disk space. Free space, delete old checkpoints, or "
        "save elsewhere"
    )
