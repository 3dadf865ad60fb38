"""Exceptions raised by hetero.

Every error says what was wrong and, where there is one, what to do about it.
"""

from __future__ import annotations

import errno
import os
import shutil


class HeteroError(Exception):
    """Base class of every error hetero raises on purpose."""


class ConfigError(HeteroError, ValueError):
    """A configuration key or value is invalid."""


class IllegalTransitionError(HeteroError, RuntimeError):
    """A tensor or chunk was asked to make a state change its state machine forbids."""


class TierOutOfMemoryError(HeteroError, MemoryError):
    """A tier's budget cannot hold what is asked of it, even after evicting everything movable."""

    def __init__(self, message: str, *, tier: str, needed: int, held: int, budget: int) -> None:
        super().__init__(message)
        self.tier = tier  # the tier that ran out (e.g. "device")
        self.needed = needed  # bytes the failed request needed
        self.held = held  # bytes held on the tier when it failed
        self.budget = budget  # the tier's budget in bytes


class NvmeError(HeteroError, RuntimeError):
    """The NVMe swap tier could not do what was asked (base class)."""


class NvmeUnavailableError(NvmeError):
    """The NVMe directory is missing, not a directory, or not writable."""


class NvmeSpaceError(NvmeError):
    """The NVMe directory's file system lacks the free space, or the tier's budget is spent."""


class NvmeCorruptError(NvmeError):
    """A swap file is truncated or its contents fail their checksum."""


class CommError(HeteroError, RuntimeError):
    """Joining or using the process group failed (bad launcher environment, unusable backend, bad ranks)."""


class RankTimeoutError(CommError, TimeoutError):
    """Some ranks did not reach a collective in time: they are hung, dead, or running different code."""

    def __init__(self, message: str, *, missing_ranks: list[int] | None, timeout_s: float) -> None:
        super().__init__(message)
        # Global ranks that did not arrive; None where this rank cannot know (only the monitoring rank does).
        self.missing_ranks = missing_ranks
        self.timeout_s = timeout_s  # the timeout that ran out, in seconds


class RankFailedError(CommError):
    """Another rank stopped with an error of its own (its NVMe tier failed, ...) and will not come to the collectives
    this rank waits in: raised on the ranks that wait for it, naming it and its error ([Note: a rank's failure told
    to the others] in hetero/comm/watch.py)."""

    def __init__(self, message: str, *, failed_rank: int, cause: str) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank  # the global rank whose own error it was
        self.cause = cause  # that error, as "Type: message"


class CheckpointError(HeteroError, RuntimeError):
    """A checkpoint cannot be written or read: missing, truncated or corrupt files, an incompatible model, no disk
    space, a path that is not writable."""


class WeightsError(HeteroError, ValueError):
    """A model's first values could not be made: a meta-device model its initialiser leaves incomplete, or weight
    files that do not match the model."""


class StepOrderError(HeteroError, RuntimeError):
    """The training loop called the engine out of order: `engine.step()` with no `engine.backward(loss)` since the
    last `step()` (or since `initialize` / `load_checkpoint`). Raised before anything is counted or updated."""


class ReleasedParameterError(HeteroError, RuntimeError):
    """A ZeRO-3 parameter's values were read while only a shard of them is on this rank."""


# What to do after a collective failed (ranks disagreed, one timed out or died): said by every such error.
RESTART = (
    "This process group cannot be used again in this process: collectives issued before the failure may still be "
    "queued in it, and any later one would pair with them (gloo ends the process natively on that). Restart every "
    "rank of the job (all its processes, not only this one; in a notebook, the kernel of every rank) and resume from "
    "the last checkpoint: a failed collective writes nothing to disk, and a save it interrupted was not committed, so "
    "the last committed checkpoint is intact."
)


class CollectiveMismatchError(CommError):
    """The ranks of a group were about to run different collectives (different chunks, units or operations): the
    program took a different path on some rank, which would hang or corrupt the exchange. The group is unusable
    after it (`RESTART`, said by the message)."""

    def __init__(self, message: str) -> None:
        super().__init__(message if RESTART in message else f"{message}\n{RESTART}")


class GroupUnusableError(CommError):
    """A collective, a transfer or a new engine was asked of a process group on which an earlier collective of this
    process failed ([Note: a group no collective may use after a failure] in hetero/comm/rules.py): raised before
    anything is issued, where issuing it could end the process natively."""

    def __init__(self, message: str, *, failed: str) -> None:
        super().__init__(message)
        self.failed = failed  # the operation whose wait failed first on that group


class BatchMismatchError(HeteroError, ValueError):
    """The ranks of a tensor- or sequence-parallel group were given batches that differ (in shapes, or in values
    where they are compared), which would hang or corrupt their collectives; raised on every rank of the group."""

    def __init__(self, message: str, *, shapes: list[list[str]] | None) -> None:
        super().__init__(message)
        # Each rank's batch, one line per leaf (a tensor's place, dtype and shape), in the rank order of the group
        # that agrees on it (`Mesh.batch_group`); None when the shapes agreed and the values did not.
        self.shapes = shapes


def add_note(error: BaseException, text: str) -> None:
    """Add `text` to the error's report: a note (Python 3.11+, shown below its message in the traceback), or where
    notes do not exist (3.10) its last argument, so that the text is never lost."""
    if hasattr(error, "add_note"):
        error.add_note(text)
    elif error.args and isinstance(error.args[-1], str):
        error.args = (*error.args[:-1], f"{error.args[-1]}\n{text}")
    else:
        error.args = (*error.args, text)


# [Note: what a failed disk operation means]
# An OSError's text ("[Errno 28] No space left on device") names neither the place nor what to do, and a quota spent
# reads like a full disk: `df` then shows free space, and freeing some elsewhere helps nothing. So hetero words the
# errno: a full file system with its free space, a quota (`quota -s`, or the administrator), an I/O error (`dmesg`), a
# read-only remount, a permission; each caller adds what its own files are (a checkpoint, a swap file, an export).
_QUOTA = getattr(errno, "EDQUOT", None)  # absent on some platforms
_MEANING = {
    errno.EIO: "the drive reported an I/O error: the disk or its connection is failing (see `dmesg`)",
    errno.EROFS: "the file system is read-only (after a disk error ext4 remounts so: see `dmesg`)",
    errno.EACCES: "permission denied: fix the directory's permissions or use another one",
    errno.EPERM: "operation not permitted: fix the directory's permissions or use another one",
    errno.EFBIG: "the file exceeds the largest file the file system (or `ulimit -f`) allows",
}


def disk_trouble(error: OSError, directory: str) -> str:
    """What `error`, raised reading or writing a file under `directory`, means and what to do about it, for a message
    ([Note: what a failed disk operation means]). Starts with the errno's own words and name."""
    code = error.errno
    head = f"{error.strerror or error} ({errno.errorcode.get(code, code)})" if code else str(error)
    if code == errno.ENOSPC:
        return (
            f"{head}: the file system holding {directory} is full ({free_space(directory)} free). Free space on it, "
            "or use a directory on another file system"
        )
    if code is not None and code == _QUOTA:
        return (
            f"{head}: your disk quota on the file system holding {directory} is spent; the disk itself may have room "
            f"({free_space(directory)} free), but the quota counts your own files. See your usage and limits with "
            "`quota -s`, delete files of yours there, ask the administrator for a larger quota, or use a directory "
            "on another file system"
        )
    meaning = _MEANING.get(code)
    return f"{head}: {meaning}" if meaning else head


def free_space(directory: str) -> str:
    """The free space of the file system holding `directory` (or the nearest existing directory above it), in words."""
    where = os.path.abspath(directory)
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return "an unknown amount"
    return f"{free / 2**30:.2f} GiB" if free >= 2**30 else f"{free / 2**20:.1f} MiB"
