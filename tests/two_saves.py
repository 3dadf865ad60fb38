"""The root the checkpoint error and fault tests start from: step 1 and step 2 (`latest`) of a stage-1 engine."""

from __future__ import annotations

import shutil
from pathlib import Path

try:
    from tests.test_checkpoint import _cfg, make_engine, train
except ImportError:  # tests/ itself on sys.path
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]


def save_two(root: str) -> object:
    """Save step 1 and step 2 of a stage-1 engine under `root`; the engine, at step 2, is returned open."""
    e = make_engine(0, _cfg(1))
    train(e, 0, 1, 0, 1)
    e.save_checkpoint(root, client_state={"epoch": 1})
    train(e, 0, 1, 1, 2)
    e.save_checkpoint(root, client_state={"epoch": 2})
    return e


def copy_root(root: str, tmp_path: Path) -> str:
    """A copy of `root` to damage."""
    dst = str(tmp_path / "root")
    shutil.copytree(root, dst)
    return dst
