"""benchmarks/nvme_bandwidth.py runs end to end on a tiny size: with fio (huge pages when they can be had) and, when
fio is missing, with a clear warning and the Python raw loop."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "nvme_bandwidth.py")
TINY = ["--size", "16MiB", "--chunk", "4MiB", "--block", "1MiB", "--repeat", "1", "--json"]


def _run(tmp_path, extra: list[str], path: str | None = None) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    if path is not None:
        env["PATH"] = path
    out = subprocess.run(
        [sys.executable, SCRIPT, "--dir", str(tmp_path), *TINY, *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.timeout(150)
def test_without_fio_it_warns_and_uses_the_python_loop(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    r, err = _run(tmp_path, [], path=str(empty))
    assert "fio is not installed" in err and "apt-get install fio" in err
    assert any("fio is not installed" in w for w in r["warnings"])
    assert r["raw_method"].startswith("python pwrite/preadv")
    assert r["verify"] and r["tier_write_GBps"] > 0 and r["raw_read_GBps"] > 0
    assert r["write_ratio"] == r["tier_write_GBps"] / r["raw_write_GBps"]
    assert r["tier_huge_pages"]["buffers"] >= 1 and "before" in r["loadavg"]
    assert any("both ways at once needs fio" in w for w in r["warnings"]) and "mixed_ratio" not in r
    assert os.listdir(tmp_path) == ["bin"]  # no swap or raw file left behind


@pytest.mark.timeout(150)
@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_with_fio(tmp_path):
    r, err = _run(tmp_path, [])
    assert "iodepth=8" in r["raw_method"] and "bs=1048576" in r["raw_method"]
    huge = "iomem=mmaphuge" in r["raw_method"]
    # Either fio read from huge pages, or the benchmark said why not.
    assert huge or any("without huge pages" in w for w in r["warnings"])
    assert r["raw_4k_write_GBps"] > 0 and r["raw_4k_read_GBps"] > 0  # the 4 KiB-page figure, for information
    assert r["read_ratio"] == r["tier_read_GBps"] / r["raw_read_GBps"]
    # Both ways at once: the tier's half read back while half is written, against fio's two jobs at once.
    assert r["tier_mixed_GBps"] > 0 and r["raw_mixed_GBps"] > 0
    assert r["mixed_ratio"] == r["tier_mixed_GBps"] / r["raw_mixed_GBps"]
    assert set(r["runs"][0]) >= {"tier_mixed_GBps", "raw_mixed_GBps"}
    assert os.listdir(tmp_path) == []  # neither fio's files nor the swap file left behind


def test_overlapping_huge_page_reservations_keep_each_others_pages():
    """Two benchmarks on one machine (two test suites at once) reserve huge pages for their fio runs: the first to
    finish must take away its own pages only. It once set the pool back to its old size, and the other's fio, in
    mid-run, failed to map its buffers."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import nvme_bandwidth as nb

    path = "/proc/sys/vm/nr_hugepages"
    if not os.access(path, os.W_OK) or "Hugepagesize" not in nb._meminfo():
        pytest.skip("needs a writable /proc/sys/vm/nr_hugepages (root) and huge pages")
    with open(path) as f:
        start = int(f.read())
    nbytes = 4 << 20
    need = -(-nbytes // (nb._meminfo()["Hugepagesize"] << 10)) + 4
    first, second = nb.huge_pages_for(nbytes), nb.huge_pages_for(nbytes)
    got = (first.__enter__(), second.__enter__())
    first.__exit__(None, None, None)  # the first to come leaves while the second's fio would still run
    left = nb._meminfo()["HugePages_Free"]
    second.__exit__(None, None, None)
    if got != (None, None):
        pytest.skip(f"the kernel gave too few huge pages: {got}")
    assert left >= need  # the second's pages are all still there
    with open(path) as f:
        assert int(f.read()) == start
