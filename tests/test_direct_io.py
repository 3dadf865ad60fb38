"""hetero.io.direct, the direct-I/O layer under the NVMe tier and the checkpoint files: full reads and writes over
calls that move fewer bytes than asked, the end of a file, O_DIRECT probes; and how the NVMe swap file is preallocated
([Note: preallocating the swap file])."""

from __future__ import annotations

import ctypes
import errno
import os
import time

import pytest
import torch

from hetero.errors import NvmeSpaceError
from hetero.io import direct
from hetero.memory.nvme import NvmeStore

MiB = 1 << 20


def _views(sizes: list[int]) -> list[memoryview]:
    return [memoryview(bytearray(n)) for n in sizes]


def test_advance_drops_finished_buffers_and_trims_a_partial_one():
    views = _views([10, 20, 30])
    assert direct.advance(views, 0, 15) == 1 and len(views[1]) == 15
    assert direct.advance(views, 1, 15) == 2 and len(views[2]) == 30
    assert direct.advance(views, 2, 30) == 3


@pytest.fixture
def short_calls(monkeypatch):
    """Every pwrite/pwritev/preadv moves at most 1000 bytes, as a signal or a per-call limit can make it do."""
    calls = {"n": 0}
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def cut(bufs: list, limit: int = 1000) -> list:
        out, left = [], limit
        for b in bufs:
            if left <= 0:
                break
            out.append(memoryview(b)[:left])
            left -= len(out[-1])
        return out

    def pwrite(fd, buf, offset):
        calls["n"] += 1
        return real_pwritev(fd, cut([buf]), offset)

    def pwritev(fd, bufs, offset):
        calls["n"] += 1
        return real_pwritev(fd, cut(bufs), offset)

    def preadv(fd, bufs, offset):
        calls["n"] += 1
        return real_preadv(fd, cut(bufs), offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "preadv", preadv)
    return calls


def test_full_write_and_read_go_on_after_short_calls(tmp_path, short_calls):
    data = [os.urandom(n) for n in (1, 999, 2500, 0, 4096, 17)]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert direct.write_full(fd, [memoryview(d) for d in data], 100) == sum(map(len, data))
        assert short_calls["n"] >= sum(map(len, data)) // 1000
        with open(tmp_path / "f", "rb") as f:
            assert f.read() == bytes(100) + b"".join(data)
        outs = _views([len(d) for d in data])
        assert direct.read_full(fd, outs, 100) == sum(map(len, data))
        assert [bytes(o) for o in outs] == data
        one = memoryview(bytearray(3000))
        assert direct.write_full(fd, memoryview(b"x" * 3000), 0) == 3000  # a single buffer: pwrite
        assert direct.read_full(fd, one, 0) == 3000 and bytes(one) == b"x" * 3000
    finally:
        os.close(fd)


def test_read_full_stops_at_the_end_of_the_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"a" * 5000)
    fd = os.open(path, os.O_RDONLY)
    try:
        outs = _views([4096, 4096])
        assert direct.read_full(fd, outs, 0) == 5000
        assert direct.read_full(fd, _views([10]), 6000) == 0
    finally:
        os.close(fd)


def test_read_full_direct_stops_after_an_unaligned_read(tmp_path, monkeypatch):
    """With O_DIRECT a read that ends off ALIGN is the end of the file; a retry would be misaligned."""
    real = os.preadv
    seen = []

    def preadv(fd, bufs, offset):
        seen.append(offset)
        return min(real(fd, bufs, offset), direct.ALIGN + 100)

    path = tmp_path / "f"
    path.write_bytes(bytes(4 * direct.ALIGN))
    fd = os.open(path, os.O_RDONLY)
    monkeypatch.setattr(os, "preadv", preadv)
    try:
        assert direct.read_full(fd, _views([4 * direct.ALIGN]), 0, direct=True) == direct.ALIGN + 100
        assert seen == [0]
        assert direct.read_full(fd, _views([4 * direct.ALIGN]), 0) == 4 * direct.ALIGN  # buffered: goes on
    finally:
        os.close(fd)


def test_calls_are_bounded(tmp_path, monkeypatch):
    sizes = []
    real = os.pwritev

    def pwritev(fd, bufs, offset):
        sizes.append((len(bufs), sum(len(b) for b in bufs)))
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "pwrite", lambda fd, buf, offset: pwritev(fd, [buf], offset))
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        views = [memoryview(bytes(10)) for _ in range(direct.IOV_MAX + 10)]
        assert direct.write_full(fd, views, 0, call_bytes=1 << 20) == 10 * len(views)
        assert sizes[0] == (direct.IOV_MAX, 10 * direct.IOV_MAX)  # no more buffers per call than IOV_MAX
        sizes.clear()
        assert direct.write_full(fd, [memoryview(bytes(100)), memoryview(bytes(100))], 0, call_bytes=64) == 200
        assert all(n <= 64 for _, n in sizes) and sum(n for _, n in sizes) == 200
    finally:
        os.close(fd)


def test_write_that_makes_no_progress_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "pwrite", lambda fd, buf, offset: 0)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError, match="no progress"):
            direct.write_full(fd, memoryview(b"abc"), 0)
    finally:
        os.close(fd)


@pytest.mark.skipif(not direct.O_DIRECT, reason="needs O_DIRECT (Linux)")
def test_open_direct_probe(tmp_path, monkeypatch):
    fd = direct.open_direct(str(tmp_path / "ok"), os.O_RDWR | os.O_CREAT, probe=True)
    try:
        assert os.fstat(fd).st_size == direct.ALIGN  # the probe block
        assert direct.probe_mem_align(fd) in (64, 512, 4096)
    finally:
        os.close(fd)
    closed = []
    real_close = os.close
    monkeypatch.setattr(os, "close", lambda fd: (closed.append(fd), real_close(fd)))

    def refuse(*args):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "pwrite", refuse)  # accepted at open, refused on the first request
    with pytest.raises(OSError, match="Invalid argument"):
        direct.open_direct(str(tmp_path / "refused"), os.O_RDWR | os.O_CREAT, probe=True)
    assert len(closed) == 1, "the refused descriptor is closed"
    monkeypatch.setattr(direct, "O_DIRECT", 0)
    with pytest.raises(OSError, match="no O_DIRECT"):
        direct.open_direct(str(tmp_path / "none"), os.O_RDWR | os.O_CREAT)


# ---- preallocating the swap file ([Note: preallocating the swap file]) ------------------------------------------
@pytest.fixture
def fallocates(monkeypatch):
    """Calls of fallocate(2), each delayed (as a busy file system delays them); `result` can make them fail."""
    if direct._FALLOCATE is None:
        pytest.skip("no fallocate(2) here")
    real = direct._FALLOCATE
    seen = {"calls": [], "errno": 0}

    def slow(fd, mode, offset, length):
        seen["calls"].append((offset, length))
        time.sleep(0.05)
        if seen["errno"]:
            ctypes.set_errno(seen["errno"])
            return -1
        return real(fd, mode, offset, length)

    monkeypatch.setattr(direct, "_FALLOCATE", slow)
    return seen


def _round_trips(s: NvmeStore, n: int) -> None:
    for i in range(n):
        t = torch.randint(0, 256, (MiB + 3 * i,), dtype=torch.uint8)
        s.write(i, t).result()
        out = torch.empty_like(t)
        s.read(i, out).result()
        assert torch.equal(out, t)


def test_slow_preallocation_stays_on(tmp_path, fallocates):
    """A fallocate that took 50 ms (a busy disk) once turned preallocation off for good, and appending writes then
    cost a quarter of the write bandwidth: what a file system is decides, not how long a call took."""
    if direct.memory_file_system(str(tmp_path)):
        pytest.skip(f"{tmp_path} is in RAM")
    with NvmeStore(tmp_path) as s:
        _round_trips(s, 3)
        assert s._file.prealloc
        # Each growth reserves as much again as the file holds: the third reserves a slot more than it needs
        assert [n for _, n in fallocates["calls"]] == [MiB, MiB + 4096, 2 * MiB + 4096]


def test_growth_reserves_ahead_and_falls_back_to_what_it_needs(tmp_path, fallocates, monkeypatch):
    """ext4's fallocate waits for the file's direct writes in flight: a growth reserves ahead so that the next ones
    need no call; with no room for the reservation, the growth alone is preallocated."""
    if direct.memory_file_system(str(tmp_path)):
        pytest.skip(f"{tmp_path} is in RAM")
    slow = direct._FALLOCATE

    def no_room_ahead(fd, mode, offset, length):
        if length > 2 * MiB:  # the reservation; the growth alone fits
            fallocates["calls"].append((offset, length, "refused"))
            ctypes.set_errno(errno.ENOSPC)
            return -1
        return slow(fd, mode, offset, length)

    monkeypatch.setattr(direct, "_FALLOCATE", no_room_ahead)
    with NvmeStore(tmp_path) as s:
        _round_trips(s, 3)
        assert fallocates["calls"][-2:] == [(2 * MiB + 4096, 2 * MiB + 4096, "refused"), (2 * MiB + 4096, MiB + 4096)]
        assert s._file.prealloc and s.file_bytes == 3 * MiB + 2 * 4096
    fallocates["calls"].clear()
    monkeypatch.setattr(direct, "_FALLOCATE", slow)
    (tmp_path / "ahead").mkdir()
    with NvmeStore(tmp_path / "ahead") as s:
        _round_trips(s, 3)
        size = s.file_bytes
        s.write(3, torch.ones(MiB, dtype=torch.uint8)).result()  # inside the third growth's reservation
        assert len(fallocates["calls"]) == 3 and s.file_bytes == size


def test_no_preallocation_in_ram(fallocates):
    if direct.memory_file_system("/dev/shm") is None:
        pytest.skip("no tmpfs at /dev/shm")
    with NvmeStore("/dev/shm") as s:
        _round_trips(s, 2)
        assert not s._file.prealloc and fallocates["calls"] == []


def test_unsupported_preallocation_falls_back_to_appending(tmp_path, fallocates):
    fallocates["errno"] = errno.EOPNOTSUPP
    with NvmeStore(tmp_path) as s:
        _round_trips(s, 3)
        assert not s._file.prealloc and len(fallocates["calls"]) == 1  # asked once, then the file grows by writing


def test_full_disk_while_preallocating(tmp_path, fallocates):
    fallocates["errno"] = errno.ENOSPC
    if direct.memory_file_system(str(tmp_path)):
        pytest.skip(f"{tmp_path} is in RAM")
    with NvmeStore(tmp_path) as s:
        with pytest.raises(NvmeSpaceError, match="preallocating"):
            s.write(0, torch.ones(MiB, dtype=torch.uint8))
        assert 0 not in s and s.used_bytes == 0
        fallocates["errno"] = 0
        _round_trips(s, 1)
        assert fallocates["calls"][-1] == (0, MiB)  # the refused slot was given back and is taken again
