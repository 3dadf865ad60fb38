"""Zip64 torch files read tensor by tensor ([Note: reading torch's zip format without torch.load]), built small.

A .bin over 4 GiB (or over 65535 members) keeps its sizes and offsets in zip64 records (APPNOTE 4.3.14-4.3.15,
4.5.3): a zip64 end of central directory record and its locator, and zip64 extra fields in the central directory
holding only the values whose 32-bit field is 0xFFFFFFFF, in the order uncompressed size, compressed size, local
header offset, disk. torch's writer (miniz) puts a zip64 extra field and then an "FB" padding field (data aligned to
64 bytes) in each local header, so a local header's extra length differs from its central directory entry's. Writing
4 GiB is too slow for a test, so these files put small values in the zip64 places: the members of a real torch.save
file rewritten, by Python's zipfile (`force_zip64`) or by the few struct.pack calls below, into zip64 containers. That
torch.load reads each rewritten file proves it is a valid archive; the reader must then give torch.load's tensors.
"""

from __future__ import annotations

import logging
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from hetero.errors import WeightsError
from hetero.zero.torch_zip_file import NotServed, TorchZipFile
from hetero.zero.weights import WeightSource

_MAX32, _MAX16 = 0xFFFFFFFF, 0xFFFF
_FIELDS = ("size", "compressed", "offset", "disk")  # a zip64 extra field's values, in the spec's order (4.5.3)


def _bits(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _saved(tmp_path: Path) -> tuple[Path, list[tuple[str, bytes]]]:
    """A real torch.save file of a state_dict and its members, in order."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g)
    w[0, 0], w[0, 1] = float("nan"), -0.0
    shared = torch.randn(40, generator=g).to(torch.float16)
    state = {
        "fp32": w,
        "bf16": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "fp16": shared,
        "fp16.view": shared[8:20].view(3, 4),  # an offset into a shared storage
        "transposed": w.t(),  # not contiguous
        "int64": torch.arange(-5, 11, dtype=torch.int64).reshape(4, 4),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    path = tmp_path / "saved.bin"
    torch.save(state, path)
    with zipfile.ZipFile(path) as z:
        return path, [(i.filename, z.read(i)) for i in z.infolist()]


def _same_as_torch_load(path: Path) -> None:
    """torch.load reads the file (so it is a valid archive) and the reader gives the same tensors, bit for bit."""
    ref = torch.load(path, weights_only=True)
    f = TorchZipFile(path)
    try:
        assert f.names() == list(ref)
        for k, want in ref.items():
            got = f.read(k)
            assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), k
            assert _bits(got) == _bits(want), k
            n = want.numel()
            assert _bits(f.read_elements(k, n // 3, n)) == _bits(want.reshape(-1)[n // 3 : n]), k
    finally:
        f.close()


def _extra(tag: int, body: bytes) -> bytes:
    return struct.pack("<HH", tag, len(body)) + body


def _padding(at: int, before: int) -> bytes:
    """torch's "FB" extra field: the bytes that start a member's data at a multiple of 64 (caffe2's getPadding)."""
    n = -(at + before + 4) % 64
    return struct.pack("<2sH", b"FB", n) + b"Z" * n


def _zip64_file(
    path: Path,
    members: list[tuple[str, bytes]],
    *,
    central: tuple[str, ...] = _FIELDS[:3],
    pad: str = "after",
    central_pad: str = "none",
    central_extra: str = "whole",
    extensible: bytes = b"",
    more: int = 0,
) -> dict[str, int]:
    """Writes members (stored) into a zip64 archive, as miniz writes a file over 4 GiB; returns where its end records
    are. `central`: the values each central directory entry keeps in its zip64 extra field (their own fields hold
    0xFFFFFFFF, 0xFFFF for the disk); `pad`, `central_pad`: where an "FB" padding field goes beside the local header's
    (central directory entry's) zip64 field: "before", "after" or "none"; `central_extra`: "whole", "none" (the marks
    without the field) or "short" (the field cut to its first value); `extensible`: a zip64 extensible data sector;
    `more`: that many empty members more, so that the member count needs zip64 too."""
    out, directory = bytearray(), bytearray()
    members = members + [(f"{members[0][0].split('/')[0]}/extra/{i}", b"") for i in range(more)]
    for name, data in members:
        raw, crc, offset = name.encode(), zlib.crc32(data), len(out)
        zip64 = _extra(1, struct.pack("<QQ", len(data), len(data)))  # a local header's holds both sizes (4.5.3)
        head = 30 + len(raw)
        local = {
            "before": _padding(offset, head + len(zip64)) + zip64,
            "after": zip64 + _padding(offset, head + len(zip64)),
            "none": zip64,
        }[pad]
        out += struct.pack("<4s5H3L2H", b"PK\x03\x04", 45, 0, 0, 0, 0x21, crc, _MAX32, _MAX32, len(raw), len(local))
        out += raw + local + data
        values = {"size": ("Q", len(data)), "compressed": ("Q", len(data)), "offset": ("Q", offset), "disk": ("L", 0)}
        body = b"".join(struct.pack("<" + values[k][0], values[k][1]) for k in _FIELDS if k in central)
        zip64 = {"whole": _extra(1, body), "none": b"", "short": _extra(1, body[:8])}[central_extra] if central else b""
        extra = {"before": _padding(0, 0) + zip64, "after": zip64 + _padding(0, 0), "none": zip64}[central_pad]
        fields = {k: (_MAX16 if k == "disk" else _MAX32) if k in central else values[k][1] for k in _FIELDS}
        directory += struct.pack(
            "<4s6H3L5H2L",
            *(b"PK\x01\x02", 45, 45, 0, 0, 0, 0x21, crc, fields["compressed"], fields["size"], len(raw)),
            *(len(extra), 0, fields["disk"], 0, 0, fields["offset"]),
        )
        directory += raw + extra
    start, n = len(out), len(members)
    out += directory
    record = len(out)
    out += struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44 + len(extensible), 45, 45, 0, 0, n, n, len(directory), start)
    out += extensible
    locator = len(out)
    out += struct.pack("<4sLQL", b"PK\x06\x07", 0, record, 1)
    end = len(out)
    out += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, _MAX16, _MAX16, _MAX32, _MAX32, 0)
    path.write_bytes(out)
    return {"record": record, "locator": locator, "end": end}


def test_zip64_extra_fields_in_local_headers_only(tmp_path):
    """Python's zipfile with force_zip64 gives each local header a zip64 extra field (0xFFFFFFFF sizes), which the
    central directory entries do not have: each member's data starts after its local header's own extra field."""
    _, members = _saved(tmp_path)
    path = tmp_path / "local64.bin"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            with z.open(name, "w", force_zip64=True) as out:
                out.write(data)
    with zipfile.ZipFile(path) as z:
        info = z.infolist()[-1]
    head = path.read_bytes()[info.header_offset : info.header_offset + 30]
    assert struct.unpack_from("<LL", head, 18) == (_MAX32, _MAX32) and struct.unpack_from("<H", head, 28)[0] == 20
    assert info.extra == b""  # the case: the central directory's extra length (0) is not the local header's (20)
    _same_as_torch_load(path)


@pytest.mark.parametrize(
    "case",
    [
        {},  # as torch's writer (miniz) writes a member past 4 GiB: zip64 field, then padding, in the local header
        {"pad": "before"},
        {"pad": "none", "central_pad": "before"},
        {"central_pad": "after"},
        {"central": ("offset",)},  # only what does not fit in 32 bits is in the field, in the spec's order
        {"central": ("size", "compressed")},
        {"central": ()},  # the end records in zip64, no member needing it
        {"more": 70000},  # over 65535 members: the count is in the zip64 end record only
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "miniz",
)
def test_zip64_archives_read_as_torch_load_reads_them(tmp_path, case):
    _, members = _saved(tmp_path)
    path = tmp_path / "zip64.bin"
    _zip64_file(path, members, **case)
    assert path.read_bytes()[-22:][8:20] == struct.pack("<HHLL", _MAX16, _MAX16, _MAX32, _MAX32)
    _same_as_torch_load(path)


def test_a_disk_number_in_the_zip64_extra_field(tmp_path):
    """The fourth value a zip64 extra field can hold. torch.load (miniz) refuses disk 0xFFFF as a split archive, so
    the tensors are compared with torch.load's of the file the members came from."""
    saved, members = _saved(tmp_path)
    path = tmp_path / "disk.bin"
    _zip64_file(path, members, central=_FIELDS)
    ref = torch.load(saved, weights_only=True)
    f = TorchZipFile(path)
    try:
        assert {k: _bits(f.read(k)) for k in f.names()} == {k: _bits(v) for k, v in ref.items()}
    finally:
        f.close()


def test_an_extensible_data_sector_goes_to_torch_load(tmp_path, caplog):
    """zipfile looks for the zip64 end record only in the 56 bytes before its locator; with an extensible data
    sector it is further back (where the locator says): torch.load reads it, so the file goes there, saying why."""
    saved, members = _saved(tmp_path)
    path = tmp_path / "ext.bin"
    _zip64_file(path, members, extensible=b"\x00\x99\x08\x00" + bytes(8))
    with pytest.raises(NotServed, match="12 bytes of extensible data"):
        TorchZipFile(path)
    ref = torch.load(saved, weights_only=True)
    with caplog.at_level(logging.WARNING, logger="hetero.zero"), WeightSource([path]) as source:
        assert source.keys() == list(ref)
        assert {k: _bits(source.read(k)) for k in ref} == {k: _bits(v) for k, v in ref.items()}
    assert any("extensible data" in r.getMessage() for r in caplog.records)


def _patched(path: Path, at: int, fmt: str, *values: object) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, *values)
    path.write_bytes(data)


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda p, e: _patched(p, e["locator"], "<4s", b"\0" * 4), "no zip64 locator precedes it"),
        (lambda p, e: _patched(p, e["record"], "<4s", b"PK\0\0"), "no zip64 end record at byte"),
        (lambda p, e: _patched(p, e["record"] + 4, "<Q", 52), "zip64 end record at byte .* is damaged"),
        (lambda p, e: _patched(p, e["record"] + 40, "<Q", 1 << 40), "zip64 end record at byte .* is damaged"),
        (lambda p, e: _patched(p, e["record"] + 32, "<Q", 5), "end records count 5 members"),
        (lambda p, e: _patched(p, e["locator"] + 16, "<L", 2), "one part of a split archive"),
        (lambda p, e: p.write_bytes(p.read_bytes()[: e["locator"]] + p.read_bytes()[e["end"] :]), "no zip64 locator"),
    ],
    ids=["locator", "record", "record-length", "directory-size", "count", "disks", "cut"],
)
def test_a_damaged_zip64_end_record_is_named(tmp_path, damage, why):
    _, members = _saved(tmp_path)
    path = tmp_path / "bad.bin"
    damage(path, _zip64_file(path, members))
    with pytest.raises(WeightsError, match=rf"bad\.bin.*{why}.*damaged or was not fully written.*fetch it again"):
        TorchZipFile(path)
    with pytest.raises(WeightsError, match=why):
        WeightSource([path])  # not handed to torch.load


@pytest.mark.parametrize(
    "central_extra, why",
    [("none", "keeps its size and compressed size and offset in a zip64 extra field"), ("short", "Corrupt zip64")],
)
def test_a_missing_or_short_zip64_extra_field_is_named(tmp_path, central_extra, why):
    _, members = _saved(tmp_path)
    path = tmp_path / "bad.bin"
    _zip64_file(path, members, central_extra=central_extra)
    with pytest.raises(WeightsError, match=rf"bad\.bin.*{why}.*damaged or was not fully written"):
        TorchZipFile(path)
