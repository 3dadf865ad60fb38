"""Checksums by name ([Note: checksum algorithms]): NVMe swap blocks and checkpoint tensors use XXH3 by default, what is
written records its algorithm, and checkpoints written before (CRC32, nothing recorded) load and are checked as
before."""

from __future__ import annotations

import json
import os
import struct
import zlib

import pytest
import torch

from hetero.checkpoint import format as fmt
from hetero.checkpoint import manifest as mf
from hetero.errors import CheckpointError, NvmeCorruptError
from hetero.io import checksum
from hetero.memory.nvme import NvmeStore

try:
    from tests.test_checkpoint import _cfg, make_engine, train
except ImportError:  # tests/ itself on sys.path
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]

KNOWN = {  # published check values of b"123456789"
    "crc32": 0xCBF43926,
    "crc32c": 0xE3069283,
    "xxh3_64": 0x72DCB18B67A17DFF,
}


@pytest.mark.parametrize("name", checksum.ALGORITHMS)
def test_known_values(name):
    if name == "crc32c":
        pytest.importorskip("crc32c")
    assert checksum.checksum_fn(name)(memoryview(b"123456789")) == KNOWN[name]


def test_default_is_xxh3_and_unknown_names_are_refused():
    assert checksum.DEFAULT == "xxh3_64" and checksum.LEGACY == "crc32"
    with pytest.raises(ValueError, match="unknown checksum 'md5'.*xxh3_64"):
        checksum.checksum_fn("md5")


# ---- NVMe -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", checksum.ALGORITHMS)
def test_nvme_store_checks_with_its_algorithm(tmp_path, name):
    if name == "crc32c":
        pytest.importorskip("crc32c")
    block = 64 << 10
    with NvmeStore(tmp_path, block_bytes=block, checksum=name) as s:
        assert s.checksum == name
        t = torch.randint(0, 256, (3 * block + 5,), dtype=torch.uint8)
        s.write(0, t).result()
        out = torch.empty_like(t)
        s.read(0, out).result()
        assert torch.equal(out, t)
        with open(s.path, "r+b") as f:
            f.seek(block + 99)
            byte = f.read(1)[0]
            f.seek(block + 99)
            f.write(bytes([byte ^ 1]))
        with pytest.raises(NvmeCorruptError, match=f"checksum mismatch .*\\({name} "):
            s.read(0, out).result(timeout=10)


def test_nvme_store_refuses_an_unknown_checksum(tmp_path):
    with pytest.raises(ValueError, match="unknown checksum"):
        NvmeStore(tmp_path, checksum="sha1")


# ---- checkpoint files -------------------------------------------------------------------------------------------
def test_writer_records_its_checksum(tmp_path):
    path = str(tmp_path / "a.safetensors")
    t = torch.arange(1000, dtype=torch.float32)
    with fmt.TensorWriter(path, [("t", torch.float32, (1000,))], metadata={"format": "pt"}) as w:
        w.write("t", t)
    assert w.checksum == "xxh3_64"
    assert w.crcs["t"] == checksum.checksum_fn("xxh3_64")(fmt.as_bytes(t))
    with fmt.TensorReader(path) as r:
        assert r.metadata == {"format": "pt", fmt.CHECKSUM_KEY: "xxh3_64"}
        assert r.checksum == "xxh3_64"
        assert torch.equal(r.read("t", crc=w.crcs["t"]), t)
        with pytest.raises(CheckpointError, match="fails its XXH3_64 check"):
            r.read("t", crc=w.crcs["t"] ^ 1)


def _as_written_before(path: str) -> None:
    """Rewrite a rank file's header as hetero wrote it before checksums were named: no metadata (the same length,
    padded with spaces, so every tensor stays where it is)."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        assert header.pop("__metadata__") == {fmt.CHECKSUM_KEY: "xxh3_64"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        f.seek(8)
        f.write(raw + b" " * (n - len(raw)))


def test_checkpoint_written_with_crc32_loads(tmp_path):
    """An old checkpoint: CRC32 of every tensor in the manifest, nothing recorded in the files. It loads to the same
    state, and a flipped byte is caught by CRC32."""
    e = make_engine(0, _cfg(1))
    train(e, 0, 1, 0, 2)
    path = e.save_checkpoint(str(tmp_path / "root"))
    want = e.full_state_dict()
    e.close()
    manifest = mf.read_manifest(path)
    for fname, info in manifest["files"].items():
        if "tensors" not in info:
            continue
        fpath = os.path.join(path, fname)
        _as_written_before(fpath)
        with fmt.TensorReader(fpath) as r:
            assert r.checksum == "crc32"
            for k in info["tensors"]:
                info["tensors"][k][1] = zlib.crc32(fmt.as_bytes(r.read(k)))
            info["header_crc32"] = zlib.crc32(r.header_bytes)
    with open(os.path.join(path, mf.MANIFEST), "wb") as f:
        f.write(mf.dumps(manifest))

    f = make_engine(0, _cfg(1))
    try:
        f.load_checkpoint(str(tmp_path / "root"))
        got = f.full_state_dict()
    finally:
        f.close()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)

    rank = os.path.join(path, mf.rank_file(0))
    with fmt.TensorReader(rank) as r:
        entry = max((r.entry(k) for k in r.entries if k.startswith("master:")), key=lambda x: x.nbytes)
    with open(rank, "r+b") as fh:
        fh.seek(entry.begin + 5)
        byte = fh.read(1)[0]
        fh.seek(entry.begin + 5)
        fh.write(bytes([byte ^ 0x10]))
    g = make_engine(0, _cfg(1))
    try:
        with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors: tensor .* fails its CRC32 check"):
            g.load_checkpoint(str(tmp_path / "root"))
    finally:
        g.close()
