"""Who writes each .tmp-* staging directory of a checkpoint root, and removing those whose writer is gone.

[Note: staging directories a stopped job left]
A save writes its checkpoint into ROOT/.tmp-<tag>-<nonce>/ and renames it at the commit ([Note: an atomic save] in
save.py). A job stopped while it writes (SIGKILL; or torchrun's SIGTERM to every worker once one failed, or at
Ctrl-C, whose default action runs no `finally`: hetero handles SIGTERM only to remove NVMe swap files, in
hetero/memory/swap_sigterm.py) leaves that directory behind, up to a checkpoint's size, at each interrupted save.
The next save deleted every .tmp-* directory under its root, on the assumption that no other save writes there: a
second job saving to the same root (a run started twice by mistake, a job started while the one it replaces still
saves) deleted the first one's files midway; and `keep_last` left them all.
So rank 0 writes an owner file before it makes the directory, ROOT/.tmp-<tag>-<nonce>.owner: its process
(`alive.identity`: host, boot id, pid namespace, pid, start time) and the time. The next save (rank 0, before it
makes its own) and `keep_last` remove a directory, owner file included, where
 - its owner is a process the kernel here can be asked about (the same boot id and pid namespace) and that
   process has ended: no such pid, a zombie, the pid reused ([Note: a dead peer on this host] in hetero/comm/alive.py).
   A job restarted on the same node (torchrun's restarts, a resubmitted job) removes what its predecessor left at its
   first save;
 - its owner is out of sight (another node or container) and nothing in the directory changed for QUIET_S (an hour): the
   ranks of a save write their files without pause, so a live save is never that quiet, and a hung one whose files
   go fails its commit cleanly (`latest` stays);
 - it has no readable owner file (an earlier hetero's, or a crash as the file was written) and is as quiet;
 - its owner file says `keep_last` was deleting it: a checkpoint renamed out of readers' reach, never read again.
The process of rank 0 stands for the whole save: only rank 0 commits, so a save whose rank 0 is dead can never be
committed, even while another rank still writes its file there. The save sweeps on rank 0 among its checks, whose
outcome is broadcast: no other rank acts on these directories, so there is nothing for the ranks to agree on. A
directory whose owner lives stays (the log says whose). Each removal is logged, with what it freed and why. The
owner file stays beside the directory, never in it, so a committed checkpoint holds only its own files; the commit
removes it once `latest` has moved.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from typing import Any

from hetero.checkpoint import manifest as mf
from hetero.comm import alive

log = logging.getLogger("hetero.checkpoint")

OWNER = ".owner"  # ROOT/.tmp-<tag>-<nonce>.owner beside ROOT/.tmp-<tag>-<nonce>/
QUIET_S = 3600.0  # how long a directory whose owner cannot be asked must go unchanged to be taken for abandoned
_DOOMED = "doomed"  # the owner file's key for a checkpoint keep_last is deleting


def claim(path: str, *, doomed: bool = False) -> None:
    """Write the owner file of the staging directory `path`, before the directory is made (or renamed) there, so
    that no directory of this hetero is ever without one. doomed: keep_last's, deleted by anyone at any time."""
    data = {_DOOMED: True} if doomed else {**alive.identity(), "time": time.time()}
    with open(path + OWNER, "w") as f:
        f.write(json.dumps(data))


def release(path: str) -> None:
    """Remove the owner file of `path` (its directory committed, renamed away or removed)."""
    with contextlib.suppress(OSError):
        os.remove(path + OWNER)


def remove(path: str) -> None:
    """Remove the staging directory `path`, then its owner file: one stopped midway keeps the file that says whose
    the rest is."""
    shutil.rmtree(path, ignore_errors=True)
    release(path)


def sweep(root: str) -> list[str]:
    """Remove the staging directories under `root` that no live save owns; returns their paths. Errors are ignored:
    housekeeping, which the next call does again. [Note: staging directories a stopped job left]"""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    bases = {n[: -len(OWNER)] if n.endswith(OWNER) else n for n in names if n.startswith(mf.UNFINISHED)}
    mine, now = alive.identity(), time.time()
    removed = []
    for base in sorted(bases):
        path = os.path.join(root, base)
        if os.path.lexists(path) and not os.path.isdir(path):
            continue  # a file of that name is no save's
        why, kept = _verdict(path, mine, now)
        if why is None:
            log.info("%s: kept %s: %s", root, base, kept)
            continue
        freed = _bytes_in(path)
        remove(path)
        removed.append(path)
        log.warning(
            "%s: removed %s (%s), left by a save that did not finish: %s",
            root,
            base,
            f"{freed / 2**30:.2f} GiB" if freed >= 2**30 else f"{freed / 2**20:.1f} MiB",
            why,
            extra={"all_ranks": True},  # whichever rank sweeps (keep_last runs on any one) says it
        )
    return removed


def _verdict(path: str, mine: dict[str, Any], now: float) -> tuple[str | None, str]:
    """(why `path` goes, or None; why it stays)."""
    owner = _owner(path)
    if owner is not None and owner.get(_DOOMED):
        return "keep_last was deleting it", ""
    if owner is not None and alive.askable(owner, mine):
        who = f"pid {owner['pid']} on {owner.get('host', '?')}"
        if alive.gone(owner):
            return f"the process of its rank 0 ({who}) has ended", ""
        return None, f"the process of its rank 0 ({who}) is running"
    whose = f"written from {owner.get('host', '?')} (pid {owner['pid']})" if owner else "with no owner file"
    quiet = now - _last_change(path)
    if quiet >= QUIET_S:
        return f"{whose}, unchanged for {quiet / 3600:.1f} h", ""
    return None, f"{whose}, changed {quiet:.0f} s ago (taken for abandoned after {QUIET_S:.0f} s unchanged)"


def _owner(path: str) -> dict[str, Any] | None:
    """The owner file's contents where readable and whole, else None."""
    try:
        with open(path + OWNER) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if data.get(_DOOMED) or all(k in data for k in ("boot", "pidns", "pid", "start")):
        return data
    return None


def _last_change(path: str) -> float:
    """The latest modification time of the directory, its files and its owner file (0 where none exists)."""
    times = [0.0]
    for p in (path, path + OWNER):
        with contextlib.suppress(OSError):
            times.append(os.stat(p).st_mtime)
    for top, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                times.append(os.stat(os.path.join(top, name)).st_mtime)
        with contextlib.suppress(OSError):
            times.append(os.stat(top).st_mtime)
    return max(times)


def _bytes_in(path: str) -> int:
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(top, name)).st_blocks * 512
    return total
