"""Huge host pages: the host tier's buffers ask for transparent huge pages, and a fallback to 4 KiB pages is seen and
reported (memory_stats and one log warning), not silent."""

from __future__ import annotations

import logging
import mmap
import sys

import pytest
import torch

from hetero.device import Device
from hetero.io import hugepages
from hetero.memory import Tier

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")
MiB = 1 << 20


@pytest.fixture
def fresh(monkeypatch):
    """Only the buffers this test tracks, and the once-per-process warning not yet given."""
    monkeypatch.setattr(hugepages, "_tracked", {})
    monkeypatch.setattr(hugepages, "_warned", False)


def _nohuge_buffer(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Anonymous memory the kernel must back with 4 KiB pages: what a THP fallback looks like."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_NOHUGEPAGE)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t.fill_(1)  # resident
    return buf, t


def test_smaps_parsing():
    text = (
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n"
        "Size:               4096 kB\nRss:                4096 kB\nAnonHugePages:      2048 kB\n"
        "7f0000400000-7f0000401000 r--p 00000000 08:01 12 /usr/lib/x.so\n"
        "Size:                  4 kB\nRss:                   4 kB\nAnonHugePages:         0 kB\n"
    )
    assert hugepages._mappings(text) == [
        (0x7F0000000000, 0x7F0000400000, 4096 << 10, 2048 << 10),
        (0x7F0000400000, 0x7F0000401000, 4 << 10, 0),
    ]


def test_thp_mode_reads_the_selected_setting(tmp_path):
    p = tmp_path / "enabled"
    p.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(str(p)) == "madvise"
    assert hugepages.thp_mode(str(tmp_path / "missing")) is None


@linux_only
def test_fallback_to_small_pages_is_reported_once(fresh, caplog):
    buf, t = _nohuge_buffer(8 * MiB)
    hugepages.track(buf, t.data_ptr(), t.numel())
    with caplog.at_level(logging.WARNING, logger="hetero.io.hugepages"):
        r = hugepages.report()
        again = hugepages.report()
    assert r["buffers"] == 1 and r["resident_bytes"] >= 8 * MiB
    assert r["huge_bytes"] == 0 and r["huge_share"] == 0.0
    assert again["huge_share"] == 0.0
    warnings = [rec for rec in caplog.records if "transparent huge pages" in rec.getMessage()]
    assert len(warnings) == 1, "one warning per process, not one per report"


@linux_only
def test_host_buffers_get_huge_pages(fresh, caplog):
    if hugepages.thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {hugepages.thp_mode()!r} on this kernel")
    t = Device("cpu").empty_host(16 * MiB)
    t.fill_(1)
    with caplog.at_level(logging.WARNING, logger="hetero.io.hugepages"):
        r = hugepages.report()
    assert r["buffers"] == 1 and r["resident_bytes"] >= 16 * MiB
    if r["huge_share"] < hugepages.MIN_SHARE:  # the kernel had no free 2 MiB pages: then it must have said so
        assert any("transparent huge pages" in rec.getMessage() for rec in caplog.records)
        pytest.skip("no huge pages free on this machine right now (the fallback was reported)")
    assert r["huge_bytes"] >= 8 * MiB
    del t
    import gc

    gc.collect()
    assert hugepages.report()["buffers"] == 0, "a freed buffer is no longer tracked"


@linux_only
def test_memory_stats_reports_huge_pages(fresh, make_manager):
    m = make_manager()
    c = m.new_chunk(dtype=torch.float32, capacity=1 << 20)  # 4 MiB: asks for huge pages
    c.add_tensor("t", (1 << 20,))
    m.access(c, Tier.HOST)
    c.payload.fill_(1)
    hp = m.memory_stats()["host"]["huge_pages"]
    assert hp["buffers"] >= 1 and hp["resident_bytes"] >= 4 * MiB
    assert hp["thp"] == hugepages.thp_mode()
    buf, t = _nohuge_buffer(64 * MiB)  # a fallen-back buffer outweighs the chunk: the share shows it
    hugepages.track(buf, t.data_ptr(), t.numel())
    assert m.memory_stats()["host"]["huge_pages"]["huge_share"] < hugepages.MIN_SHARE
