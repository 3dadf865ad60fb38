"""Whether another rank's process still exists, where this process can tell: the same host and pid namespace.

[Note: a dead peer on this host]
A store-only wait (a patient meeting, `patience.py`) sees no closed connection: a rank killed outright (SIGKILL, the
out-of-memory killer) only stops beating, and was named after comm_timeout. A rank on the same machine can do better:
each rank posts who it is (`identity`: the boot id, its pid namespace, pid and start time), and a waiting rank asks
the kernel about peers whose boot id and pid namespace are its own (`gone`): no such pid, a zombie (dead, not yet
reaped by its launcher), or a pid now held by a process started at another time (reused) is a dead rank, seen within
a poll. Peers on other hosts, or in another pid namespace (containers sharing a host name), cannot be asked and keep
the heartbeat's timeout. Reading /proc costs a few microseconds and no store request.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any


def _read(path: str) -> str:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read().strip()
    return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat), "" where unknown."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat.rsplit(")", 1)[1].split() if ")" in stat else []
    return fields[19] if len(fields) > 19 else ""


def _state(pid: int) -> str:
    stat = _read(f"/proc/{pid}/stat")
    fields = stat.rsplit(")", 1)[1].split() if ")" in stat else []
    return fields[0] if fields else ""


def _pid_namespace() -> str:
    with contextlib.suppress(OSError):
        return os.readlink("/proc/self/ns/pid")
    return ""


def identity() -> dict[str, Any]:
    """Who this process is, for a peer to ask the kernel about it ([Note: a dead peer on this host])."""
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "boot": _read("/proc/sys/kernel/random/boot_id"),
        "pidns": _pid_namespace(),
        "pid": pid,
        "start": _start_time(pid),
    }


def askable(who: dict[str, Any], mine: dict[str, Any]) -> bool:
    """Whether the process `mine` (this one's `identity()`) can see `who`'s: the same machine (boot id) and pid
    namespace, both known."""
    here = (mine["boot"], mine["pidns"])
    return all(here) and (who.get("boot"), who.get("pidns")) == here


def gone(who: dict[str, Any]) -> bool:
    """Whether the process `who` (an `identity()` posted by a peer that is `askable`) has ended: no such pid, a
    zombie, or the pid taken by a process started later."""
    pid = int(who["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, owned by another user: a pid reused, unless its start time says otherwise
        pass
    if _state(pid) in ("Z", "X"):
        return True
    start = _start_time(pid)
    return bool(start and who.get("start") and start != who["start"])
