"""A checkpoint's small files (`latest`, state.pt) read so that a failing disk reads as one.

[Note: a disk error reading a checkpoint]
A load reads four kinds of file: `latest`, manifest.json, state.pt and the rank files (their headers, then their
tensors, through the page cache or O_DIRECT); `verify` and `consolidate` read the same. Each read that the system
fails (EIO from a failing disk, EACCES) raises a CheckpointError that names the file, says what the errno means
(`errors.disk_trouble`: `dmesg` for an I/O error) and what to load instead: the newest intact checkpoint before it
(`earlier.unreadable`), or where `latest` itself cannot be read, the intact checkpoints of the root
(`earlier.choices`). On several ranks the load's agreement ([Note: a load every rank agrees on] in agree.py) raises
it on the rank that failed and names it, with its message, on every other. `latest` was read bare (its OSError
escaped unworded). state.pt is read here into memory and handed to `torch.load` as bytes: torch reads a file
through its own zip reader, which calls back into Python for each read, and what a failure there becomes is
torch's business (torch 2.13 passes the OSError through, measured at each of a state.pt's reads; a short read there
is "PytorchStreamReader failed reading zip archive", a RuntimeError that was worded as contents unsafe to load).
Read here, the OSError is ours to word whatever torch's version, and the file (param groups, client_state, the LR
scheduler's state) is small.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from hetero.checkpoint.earlier import choices, unreadable
from hetero.errors import CheckpointError, disk_trouble


def read_state(path: str) -> dict[str, Any]:
    """state.pt at `path`, loaded with weights_only=True (never unpickling arbitrary objects): its read failing is a
    CheckpointError naming the file and the checkpoint to load instead ([Note: a disk error reading a checkpoint])."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:  # the system failed to read it (an I/O error): not its contents' fault
        raise unreadable(path, e) from None
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{path}: cannot be read safely ({type(e).__name__}: {e}). client_state must hold only tensors, "
            "numbers, strings, lists, tuples and dicts"
        ) from None


def read_latest(path: str) -> str:
    """The tag the `latest` file at `path` names. Its read failing is a CheckpointError naming it, what the errno
    means, and the intact checkpoints of its root with how to load one: which checkpoint it named is unknown."""
    root = os.path.dirname(path) or os.curdir
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        raise CheckpointError(
            f"{path}: cannot be read, so the checkpoint it names is unknown: {disk_trouble(e, root)}. {choices(root)}"
        ) from None
