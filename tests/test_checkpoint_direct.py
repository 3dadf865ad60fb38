"""Checkpoint files' aligned layout and O_DIRECT loads: padding tensors keep the files valid safetensors, a load
reads chunks in place with O_DIRECT where it can and through the page cache otherwise (older unpadded files, file
systems that refuse the flag, cached files), with the same bytes and the same checks either way."""

from __future__ import annotations

import errno
import json
import os
import struct

import pytest
import torch

from hetero.checkpoint import format as fmt
from hetero.checkpoint import manifest as mf
from hetero.checkpoint import save as sv
from hetero.errors import CheckpointError

try:
    from tests.test_checkpoint import _cfg, make_engine, train
except ImportError:  # tests/ itself on sys.path
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]

linux_only = pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="needs O_DIRECT (Linux)")
RESIDENT_SHARE = fmt._resident_share


@pytest.fixture
def counted(monkeypatch, cpu_device):
    """Bytes read with O_DIRECT during the test; every stretch of 8 KiB or more is eligible, even when cached (the
    test models' files are small enough for the read-ahead of their headers to cache them whole). On a CPU device:
    chunks in device memory are read in place only there."""
    monkeypatch.setattr(fmt, "_DIRECT_MIN", 2 * fmt.DIRECT_ALIGN)
    monkeypatch.setattr(fmt, "_resident_share", lambda fd, offset, length: 0.0)
    seen = {"direct": 0}
    real = fmt.TensorReader._read_direct

    def read_direct(self, mem, offset, name):
        seen["direct"] += len(mem)
        return real(self, mem, offset, name)

    monkeypatch.setattr(fmt.TensorReader, "_read_direct", read_direct)
    return seen


def _drop_cache(directory: str) -> None:
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _save_and_reload(root: str, stage: int = 0) -> tuple[dict, dict]:
    e = make_engine(0, _cfg(stage))
    train(e, 0, 1, 0, 2)
    path = e.save_checkpoint(root)
    want = e.full_state_dict()
    e.close()
    _drop_cache(path)
    torch.manual_seed(99)
    f = make_engine(0, _cfg(stage))
    try:
        f.load_checkpoint(root)
        return want, f.full_state_dict()
    finally:
        f.close()


def _assert_same(want: dict, got: dict) -> None:
    assert list(want) == list(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_writer_places_tensors_at_their_residues(tmp_path):
    path = str(tmp_path / "a.safetensors")
    plan = [
        ("a", torch.float32, (3,), 0),
        ("b", torch.float32, (5,), 100),  # needs padding before it
        ("c", torch.uint8, (7,), None),  # no wish: right after b
        ("d", torch.float32, (1000,), 4000),
    ]
    values = {n: torch.arange(s[0]).to(d) for n, d, s, _ in plan}
    with fmt.TensorWriter(path, plan, align=fmt.DIRECT_ALIGN) as w:
        w.submit([(n, values[n]) for n, *_ in plan]).result()
    with fmt.TensorReader(path) as r:
        assert (r.entry("a").begin) % fmt.DIRECT_ALIGN == 0, "the data area starts aligned"
        assert r.entry("b").begin % fmt.DIRECT_ALIGN == 100
        assert r.entry("c").begin == r.entry("b").end
        assert r.entry("d").begin % fmt.DIRECT_ALIGN == 4000
        pads = [n for n in r.entries if n.startswith(fmt._PAD_PREFIX)]
        assert len(pads) == 2
        for n in pads:
            assert not r.read(n).any(), "padding is zeros"
        for n, *_ in plan:
            assert torch.equal(r.read(n, crc=w.crcs[n]), values[n])
        # padding between tensors is stepped over by a vectored read of the run
        outs = [(n, torch.empty_like(values[n]), w.crcs[n]) for n, *_ in plan]
        r.read_many(outs)
        for n, out, _ in outs:
            assert torch.equal(out, values[n])
    assert os.path.getsize(path) == w.size


def test_aligned_file_is_valid_safetensors(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    path = str(tmp_path / "a.safetensors")
    plan = [("x", torch.float32, (10,), 12), ("y", torch.bfloat16, (4, 3), 2048)]
    values = {"x": torch.randn(10), "y": torch.randn(4, 3).bfloat16()}
    with fmt.TensorWriter(path, plan, align=fmt.DIRECT_ALIGN) as w:
        for n, *_ in plan:
            w.write(n, values[n])
    with safetensors.safe_open(path, framework="pt") as f:
        names = set(f.keys())
        assert {"x", "y"} <= names and len(names) == 4  # two padding tensors
        for n in ("x", "y"):
            assert torch.equal(f.get_tensor(n), values[n])


@linux_only
def test_load_reads_chunks_with_o_direct(tmp_path, counted):
    want, got = _save_and_reload(str(tmp_path / "root"))
    _assert_same(want, got)
    assert counted["direct"] > 0, "chunks of the saving layout are read in place with O_DIRECT"


@linux_only
@pytest.mark.parametrize("stage", [1, 3])
def test_sharded_stages_load_with_o_direct(tmp_path, counted, stage):
    want, got = _save_and_reload(str(tmp_path / "root"), stage)
    _assert_same(want, got)
    assert counted["direct"] > 0


def test_unpadded_file_still_loads(tmp_path, monkeypatch, counted):
    """A checkpoint written before the aligned layout (data 8-byte aligned, no padding tensors) loads bit-exact."""
    monkeypatch.setattr(sv, "DIRECT_ALIGN", 8)
    monkeypatch.setattr(sv, "residue", lambda it: None)
    root = str(tmp_path / "root")
    want, got = _save_and_reload(root)
    _assert_same(want, got)
    rank = os.path.join(mf.resolve(root), mf.rank_file(0))
    with open(rank, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert not any(k.startswith(fmt._PAD_PREFIX) for k in header)


@linux_only
def test_refused_o_direct_falls_back(tmp_path, monkeypatch, counted):
    """A file system that accepts O_DIRECT at open but refuses the read (EINVAL) is read through the page cache."""

    def refuse(self, mem, offset, name):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(fmt.TensorReader, "_read_direct", refuse)
    want, got = _save_and_reload(str(tmp_path / "root"))
    _assert_same(want, got)


def test_no_o_direct_at_all(tmp_path, monkeypatch, counted):
    monkeypatch.setattr(fmt, "_O_DIRECT", 0)
    want, got = _save_and_reload(str(tmp_path / "root"))
    _assert_same(want, got)
    assert counted["direct"] == 0


@linux_only
def test_tmpfs_refuses_o_direct_at_open():
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    path = f"/dev/shm/hetero-test-{os.getpid()}.safetensors"
    try:
        with fmt.TensorWriter(path, [("t", torch.float32, (1 << 19,), 0)], align=fmt.DIRECT_ALIGN) as w:
            w.write("t", torch.arange(1 << 19, dtype=torch.float32))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            refused = True
        else:
            os.close(fd)
            refused = False
        with fmt.TensorReader(path) as r:
            assert r.direct is not refused
            assert torch.equal(r.read("t", crc=w.crcs["t"]), torch.arange(1 << 19, dtype=torch.float32))
    finally:
        os.unlink(path)


@linux_only
def test_cached_file_is_read_through_the_cache(tmp_path, monkeypatch, counted):
    monkeypatch.setattr(fmt, "_resident_share", RESIDENT_SHARE)
    e = make_engine(0, _cfg(0))
    train(e, 0, 1, 0, 1)
    path = e.save_checkpoint(str(tmp_path / "root"))
    for name in os.listdir(path):  # every page cached: a direct read would go to the disk again
        with open(os.path.join(path, name), "rb") as f:
            f.read()
    try:
        e.load_checkpoint(path)
    finally:
        e.close()
    assert counted["direct"] == 0


@linux_only
def test_corrupt_tensor_is_caught_on_a_direct_read(tmp_path, counted):
    e = make_engine(0, _cfg(0))
    train(e, 0, 1, 0, 1)
    path = e.save_checkpoint(str(tmp_path / "root"))
    rank = os.path.join(path, mf.rank_file(0))
    with fmt.TensorReader(rank) as r:
        entry = max((r.entry(k) for k in r.entries if k.startswith("master:")), key=lambda x: x.nbytes)
    with open(rank, "r+b") as f:
        f.seek((entry.begin + entry.end) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    _drop_cache(path)
    try:
        with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors.*fails its XXH3_64 check"):
            e.load_checkpoint(path)
    finally:
        e.close()
    assert counted["direct"] > 0


@linux_only
def test_resident_share_sees_the_page_cache(tmp_path):
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20))
    _drop_cache(str(tmp_path))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert RESIDENT_SHARE(fd, 0, 1 << 20) < 0.5
        os.pread(fd, 1 << 20, 0)
        assert RESIDENT_SHARE(fd, 4096, (1 << 20) - 8192) == 1.0
    finally:
        os.close(fd)


def test_rank_file_is_valid_safetensors(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    e = make_engine(0, _cfg(1))
    train(e, 0, 1, 0, 1)
    path = e.save_checkpoint(str(tmp_path / "root"))
    e.close()
    rank = os.path.join(path, mf.rank_file(0))
    listed = mf.read_manifest(path)["files"][mf.rank_file(0)]["tensors"]
    with fmt.TensorReader(rank) as r, safetensors.safe_open(rank, framework="pt") as f:
        assert len(r.header_bytes) % fmt.DIRECT_ALIGN == 0
        names = set(f.keys())
        assert names == set(r.entries)
        assert {k for k in names if not k.startswith(fmt._PAD_PREFIX)} == set(listed)
        for k in listed:
            assert torch.equal(f.get_tensor(k).view(-1), r.read(k, crc=listed[k][1]).view(-1)), k
