"""The NVMe tier when the disk misbehaves under a run: full in the middle of it, the swap directory deleted, a file
system turned read-only, a swap file changed by someone else, and swap directories that a killed process left
behind ([Note: swap directories left by a killed process] in hetero/memory/swap_file.py)."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hetero.errors import NvmeCorruptError, NvmeError
from hetero.memory import Tier
from hetero.memory.nvme import NvmeStore
from hetero.memory.swap_file import ORPHAN_AGE_S, PREFIX

try:
    from tests.test_manager import _bits, _filled_chunk
except ImportError:  # tests/ itself on sys.path
    from test_manager import _bits, _filled_chunk  # type: ignore[no-redef]

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _swap_dirs(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(PREFIX))


def _full(monkeypatch) -> None:
    """Every file system reports no free space from now on (what a full disk says to statvfs)."""
    for name in ("statvfs", "fstatvfs"):
        real = getattr(os, name)

        def empty(arg, real=real):
            st = list(real(arg))
            st[3] = st[4] = 0  # f_bfree, f_bavail
            return os.statvfs_result(st)

        monkeypatch.setattr(os, name, empty)


def test_a_full_disk_does_not_refuse_space_the_file_already_reserved(tmp_path, monkeypatch):
    """Each growth of a preallocated swap file reserves ahead; writes into that reservation need no free space. They
    were refused as soon as something else filled the disk, so a run failed with space in its own file."""
    with NvmeStore(tmp_path, block_bytes=MIB) as s:
        for key in range(5):
            s.write(key, torch.ones(MIB // 4)).result()
        if s.file_bytes < s.used_bytes + MIB:
            pytest.skip(f"no preallocation ahead on {tmp_path}'s file system")
        _full(monkeypatch)
        t = torch.arange(MIB // 4, dtype=torch.float32)
        s.write(5, t).result()  # inside the reservation
        out = torch.empty_like(t)
        s.read(5, out).result()
        assert torch.equal(out, t)


def test_a_deleted_swap_directory_leaves_the_run_going(tmp_path):
    """The open file outlives its deleted directory (a /tmp cleaner, a user's rm -rf): what was stored stays readable
    and the file still grows. Growing it asked its directory's free space and raised FileNotFoundError."""
    with NvmeStore(tmp_path, block_bytes=MIB) as s:
        a = torch.randn(MIB // 4)
        s.write(0, a).result()
        shutil.rmtree(s.directory)
        b = torch.randn(3 * MIB)  # beyond any reservation: the file must grow
        s.write(1, b).result()
        for key, want in ((0, a), (1, b)):
            out = torch.empty_like(want)
            s.read(key, out).result()
            assert torch.equal(out, want)
    assert _swap_dirs(tmp_path) == []


def test_a_read_only_file_system_says_so_and_what_to_do(tmp_path, monkeypatch):
    with NvmeStore(tmp_path, direct=False) as s:

        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(os, "pwrite", read_only)
        with pytest.raises(NvmeError, match="became read-only.*dmesg.*writable drive") as info:
            s.write(0, torch.ones(1000)).result(timeout=10)
        assert s.path in str(info.value)


def test_a_corrupt_swap_file_names_the_chunk_and_the_file(make_manager):
    """The store speaks of keys; the manager's error names the chunk and the tensors in it, the file, and that the
    values are lost."""
    m = make_manager(nvme=True)
    c, s, bits = _filled_chunk(m, tier=Tier.NVME)
    keep, ks, kbits = _filled_chunk(m, tier=Tier.NVME)
    path = m.storage.store.path
    with open(path, "r+b") as f:  # the first chunk's slot is the file's first
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 0xFF]))
    with pytest.raises(NvmeCorruptError) as info:
        m.access(c, Tier.HOST)
    msg = str(info.value)
    assert c.describe() in msg and s.name in msg and path in msg and "checksum mismatch" in msg
    assert "restart from the last checkpoint" in msg
    assert c.tier is Tier.NVME  # no half-read chunk passes as valid
    m.access(keep, Tier.HOST)  # another chunk is intact
    assert torch.equal(_bits(keep, ks), kbits)


def test_a_truncated_swap_file_names_the_chunk(make_manager):
    m = make_manager(nvme=True)
    c, _, _ = _filled_chunk(m, tier=Tier.NVME)
    os.truncate(m.storage.store.path, 0)
    with pytest.raises(NvmeCorruptError, match=r"moving chunk \d+ \[param.*truncated.*restart from the last"):
        m.access(c, Tier.HOST)


_KILLED = """
import os, signal, sys, torch
from hetero.memory.nvme import NvmeStore
s = NvmeStore(sys.argv[1], block_bytes=1 << 20)
s.write(0, torch.ones(1 << 20)).result()
print(s.directory, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_store(parent) -> str:
    """The directory of a store whose process was SIGKILLed (no close, no finalizer), aged past the grace period."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED), str(parent)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    directory = proc.stdout.strip()
    assert os.path.getsize(os.path.join(directory, "swap")) >= 4 << 20
    old = time.time() - 2 * ORPHAN_AGE_S
    os.utime(directory, (old, old))
    return directory


def test_a_killed_process_leaves_nothing_behind_the_next_store(tmp_path):
    """SIGKILL runs no cleanup: each killed run left its swap file, and a crash loop filled the disk. The next store
    in the same directory removes what no live store holds, and nothing a live one holds, however old."""
    live = NvmeStore(tmp_path)
    try:
        t = torch.randn(1000)
        live.write(0, t).result()
        old = time.time() - 2 * ORPHAN_AGE_S
        os.utime(live.directory, (old, old))
        dead = [_killed_store(tmp_path) for _ in range(2)]
        young = os.path.join(tmp_path, PREFIX + "being-made")  # a store just made, its file not locked yet
        os.mkdir(young)
        with NvmeStore(tmp_path) as fresh:
            assert _swap_dirs(tmp_path) == sorted(os.path.basename(d) for d in (live.directory, fresh.directory, young))
        assert not any(os.path.exists(d) for d in dead)
        out = torch.empty_like(t)
        live.read(0, out).result()
        assert torch.equal(out, t)
    finally:
        live.close()
