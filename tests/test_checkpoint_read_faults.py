"""A disk that fails while a checkpoint is read ([Note: a disk error reading a checkpoint] in
hetero/checkpoint/read_faults.py): each read of a load, `verify` and `consolidate` (`latest`, manifest.json, state.pt,
a rank file's opening, header and tensors) hit by EIO raises a CheckpointError that names the file, says what the
errno means (`dmesg`) and what to load instead, never torch's or the system's bare error. Faults are injected by
replacing `open`, `os.open`, `os.pread` or `os.preadv` for one file only, so that the checkpoint offered instead reads
as it is."""

from __future__ import annotations

import builtins
import errno
import os

import pytest

from hetero.checkpoint.__main__ import main
from hetero.errors import CheckpointError

try:
    from tests.two_saves import save_two
except ImportError:  # tests/ itself on sys.path
    from two_saves import save_two  # type: ignore[no-redef]

OLD, NEW = "step-00000001", "step-00000002"
EIO = f"{os.strerror(errno.EIO)} (EIO)"
GOOD_BYTES = 64  # a file read with a bad sector: its first bytes come back (at most half of it), then EIO


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A root holding step 1 and step 2 (`latest`) of a stage-1 engine, and an engine to load into."""
    root = str(tmp_path_factory.mktemp("ckpt") / "root")
    e = save_two(root)
    yield root, e
    e.close()


def _eio() -> OSError:
    return OSError(errno.EIO, os.strerror(errno.EIO))


class _BadSector:
    """A file object whose first bytes (GOOD_BYTES, at most half of it) read back; a read reaching past them fails
    with EIO, as the system's read of a bad sector does."""

    def __init__(self, f) -> None:
        self._f, self._left = f, min(GOOD_BYTES, os.fstat(f.fileno()).st_size // 2)

    def read(self, n: int = -1):
        if n is None or n < 0 or n > self._left:  # the request reaches the bad sector: the system's read fails
            raise _eio()
        data = self._f.read(n)
        self._left -= len(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    readline = read

    def __iter__(self):
        raise _eio()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def __getattr__(self, name: str):
        return getattr(self._f, name)


def _path_of(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _inject(monkeypatch, target: str, how: str) -> None:
    """EIO for the file `target` alone: "open" (builtins.open fails), "read" (reads through builtins.open fail after
    GOOD_BYTES), "reread" (the same from its second opening on: the first was the size and CRC check), "os.open",
    "pread" (the header's) or "preadv" (the tensors')."""
    if how in ("open", "read", "reread"):
        real, opened = builtins.open, [0]

        def fake(file, *args, **kwargs):
            if not isinstance(file, (str, os.PathLike)) or os.path.abspath(file) != target:
                return real(file, *args, **kwargs)
            opened[0] += 1
            if how == "open":
                raise _eio()
            f = real(file, *args, **kwargs)
            return f if how == "reread" and opened[0] == 1 else _BadSector(f)

        monkeypatch.setattr(builtins, "open", fake)
    elif how == "os.open":
        real_open = os.open

        def fake_open(path, *args, **kwargs):
            if os.path.abspath(path) == target:
                raise _eio()
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", fake_open)
    else:
        real_read = getattr(os, how)

        def fake_read(fd, *args, **kwargs):
            if _path_of(fd) == target:
                raise _eio()
            return real_read(fd, *args, **kwargs)

        monkeypatch.setattr(os, how, fake_read)


# (file, fault, which of load / verify / consolidate read it so)
CASES = [
    ("latest", "read", ("load", "verify", "consolidate")),
    ("manifest.json", "open", ("load", "verify", "consolidate")),
    ("manifest.json", "read", ("load", "verify", "consolidate")),
    ("state.pt", "read", ("load", "verify")),  # its size and CRC check (consolidate reads no state.pt)
    ("state.pt", "reread", ("load",)),  # the read its contents are loaded from (hetero reads it for torch.load)
    ("rank-00000.safetensors", "read", ("load", "verify", "consolidate")),  # its header's CRC check
    ("rank-00000.safetensors", "os.open", ("load", "verify", "consolidate")),
    ("rank-00000.safetensors", "pread", ("load", "verify", "consolidate")),
    ("rank-00000.safetensors", "preadv", ("load", "verify", "consolidate")),
]


@pytest.mark.parametrize("name, how, readers", CASES, ids=[f"{n}-{h}" for n, h, _ in CASES])
def test_an_io_error_reading_a_checkpoint_names_the_file_and_what_to_load(
    setup, tmp_path, monkeypatch, capsys, name, how, readers
):
    root, engine = setup
    new = os.path.join(root, NEW)
    target = os.path.join(root, name) if name == "latest" else os.path.join(new, name)
    out = str(tmp_path / "out.safetensors")
    msgs = {}
    _inject(monkeypatch, target, how)
    try:
        if "load" in readers:
            with pytest.raises(CheckpointError) as err:
                engine.load_checkpoint(root)
            msgs["load"] = str(err.value)
        capsys.readouterr()
        for tool in ("verify", "consolidate"):
            if tool in readers:
                assert main([tool, root] + ([out] if tool == "consolidate" else [])) == 1, tool
                msgs[tool] = capsys.readouterr().err
    finally:
        monkeypatch.undo()
    assert set(msgs) == set(readers)
    for tool, msg in msgs.items():
        assert f"{EIO}: the drive reported an I/O error" in msg and "dmesg" in msg, (tool, msg)
        if name == "latest":
            assert f"{target}: cannot be read, so the checkpoint it names is unknown" in msg, (tool, msg)
            assert f"The intact checkpoints under {root}: {OLD}, {NEW}. Load one by its tag" in msg, (tool, msg)
        else:
            assert f"{target}: cannot be read, so checkpoint {new} cannot be loaded" in msg, (tool, msg)
            assert f"the newest intact one before {NEW} is {os.path.join(root, OLD)}" in msg, (tool, msg)
            assert f"engine.load_checkpoint({root!r}, tag={OLD!r})" in msg, (tool, msg)
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")
    assert engine.load_checkpoint(root) == {"epoch": 2}  # the disk back: the same checkpoint loads
