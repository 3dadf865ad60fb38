"""Leaving the job's process groups when the process exits, without aborting after a correct run.

[Note: letting the groups go]
A gloo group runs each collective on a worker thread of its own (named "pt_gloo_runloop"). Once a collective's
result is ready the caller returns from its wait, while that worker may not yet have dropped its own reference to
the collective: in the window between the two, on a loaded machine, the caller's reference can go first, so the
worker's is the last one and dropping it frees the tensors, which needs the interpreter (a tensor made in Python
releases its Python object). A worker that asks for the interpreter once it is shutting down is ended by the
interpreter with a forced unwind, and that unwind through torch's non-throwing destructors aborts the process:
"terminate called without an active exception", after a script that printed the right results. Measured on the
2-core VM, both ranks on one core with busy processes, the group still referenced at exit: plain torch (300
all-reduces, no barrier at exit) aborted on 26 of 30 launches, hetero's test script without this fix on 1 of 15 (its
barrier at exit narrows the window); the suite's torchrun test aborted so once in about thirty CI runs.

The backend's own destructor is what waits for its workers: it lets the queued collectives finish and joins the
threads. It runs when the last reference to the group goes, and torch's `destroy_process_group` drops only torch's
references; every `Comm` holds its group as long as the Comm lives, which for a script's module-level engine is
until the interpreter's teardown, too late. So at exit (an `atexit` hook, while the interpreter still runs) every
Comm lets go of its group (`release`) and the control groups are forgotten, before `destroy_process_group` when
hetero joined the group itself (init_from_env), so that the groups are destroyed, and their workers joined, right
there. A group someone else still holds (the user's own, or one torch keeps) cannot be destroyed by us: for those
the hook waits, briefly and bounded, until every gloo worker thread is asleep (`_quiet_workers`), which leaves the
window closed in practice, though it cannot prove it as the destructor does (a script also holding the world group
itself, on one core with two busy processes: 3 of 30 launches aborted without the wait, 0 of 30 with it). Only a
clean exit lets go (`_at_exit`), and only on a torch whose group destructor releases the interpreter
(`_destroyed_without_the_interpreter`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from hetero.comm import cma, interrupt, watch
from hetero.comm.rules import CONTROL_OF, FAILED

logger = logging.getLogger("hetero.comm")

_LEAVE_BARRIER_S = 30.0  # how long a rank that ends cleanly waits for the others before leaving anyway
_TOLD_S = 3.0  # how long an interrupted rank waits for the others to say they stopped (they look every watch.POLL_S)
_OUTLIVE_S = 15.0  # how long a rank stopped by a peer's interrupt waits for that peer's process to end, at exit
_QUIET_LIMIT_S = 2.0  # how long exit waits for gloo workers of groups still held elsewhere to fall asleep
_WORKER_NAME = "pt_gloo_runloop"  # torch's name for a gloo group's worker threads

# Every object holding a process group (a Comm), so that the exit hook can make it let go: see `hold`.
_HOLDERS: weakref.WeakSet[Any] = weakref.WeakSet()
_STATE: dict[str, Any] = {"hooked": False, "joined": False, "pid": os.getpid()}
_LOCK = threading.Lock()


class LeftGroup:
    """What a Comm holds in place of its group once the process has left it at exit: using it is an error."""

    def __repr__(self) -> str:
        return "<process group left at exit>"

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"hetero's process group was destroyed when the process exited (asked for {name!r}): "
            "no collective can run in an atexit hook that runs after hetero's"
        )


LEFT = LeftGroup()


def hold(holder: Any) -> None:
    """Register `holder` (an object with a `.group` attribute holding a process group) to let go of it at exit."""
    with _LOCK:
        _hook()
        _HOLDERS.add(holder)


def joined() -> None:
    """Called by init_from_env: hetero joined the job's group itself, so it also leaves it ([Note: leaving
    together])."""
    with _LOCK:
        _hook()
        _STATE["joined"] = True


def _hook() -> None:
    # Per process: a child forked from a process that had registered inherits the registration, which must not
    # touch the parent's groups (its copies), and registers its own when it makes groups.
    if _STATE["pid"] != os.getpid():
        _STATE.update(hooked=False, joined=False, pid=os.getpid())
        _HOLDERS.clear()
    if not _STATE["hooked"]:
        _STATE["hooked"] = True
        atexit.register(_at_exit)


def release() -> None:
    """Every holder lets go of its group, and the control groups are forgotten: [Note: letting the groups go]."""
    with _LOCK:
        holders = list(_HOLDERS)
        _HOLDERS.clear()
    for h in holders:
        if h.group is not None:
            h.group = LEFT
    CONTROL_OF.clear()


def _at_exit() -> None:
    # After an exception ended the script, or a collective failed, a collective may still be waiting for a rank that
    # is gone; a group's destructor would wait for it, up to the group's timeout. Exiting at once matters more then,
    # so the groups are left alive as before (the abort this avoids changes only how a failed run ends).
    if os.getpid() != _STATE["pid"]:
        return  # a forked child ending through the interpreter, with its parent's registration: see `_hook`
    error = getattr(sys, "last_value", None)  # set for an uncaught exception
    stop = interrupt.interrupted()  # Ctrl-C, caught or not: [Note: an interrupted rank] in interrupt.py
    clean = error is None and not FAILED and stop is None
    ours = _STATE["joined"] and dist.is_available() and dist.is_initialized()
    if stop is not None:
        _told_the_others(ours)
    elif error is not None:  # the others stop at once, told why ([Note: a rank's failure told to the others])
        watch.post_failure(error)
    if stop is None and ours:
        interrupt.outlive(_OUTLIVE_S)
    if ours and clean:
        _barrier()
    cma.close_all()  # its workers hold no collective now (or one a failed peer left: bounded)
    if clean and _destroyed_without_the_interpreter():
        release()
    if ours:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    if clean or stop is None and watch.stopped() is not None:
        left = _quiet_workers(_QUIET_LIMIT_S)
        if left:
            logger.debug("%d gloo worker thread(s) of groups held outside hetero were still busy at exit", left)


def _told_the_others(ours: bool) -> None:
    """An interrupted rank leaves once its post is made and the others said they stopped (bounded): a launcher ends
    them once this one exits, before they could say why ([Note: an interrupted rank] in interrupt.py)."""
    interrupt.posted(_TOLD_S)
    if not ours:
        return
    with contextlib.suppress(Exception):
        left = interrupt.acknowledged(list(range(dist.get_world_size())), me=dist.get_rank(), limit_s=_TOLD_S)
        if left:
            logger.debug("global rank(s) %s had not stopped when this interrupted rank left", left)


def _destroyed_without_the_interpreter() -> bool:
    """Whether a process group dropped from Python is destroyed with the interpreter released (torch 2.8 on). Before,
    its destructor waited for gloo's workers while holding the interpreter, and a worker that needed it to free a
    collective's tensors never finished: torch 2.6 hung at exit on one launch in six here. There hetero keeps its
    groups to the end as before, and only `_quiet_workers` narrows the window."""
    return torch.__version__ >= "2.8"


def _barrier() -> None:
    """[Note: leaving together]
    A rank that leaves the group closes its connections; a peer still inside the backend (its last collective not
    yet returned on this side, a gloo work not yet reaped) can then take the closed connection as a fatal error and
    abort after its script finished correctly. So a rank that ends without an exception first meets the others in
    a barrier, bounded so a peer that failed or exited early costs at most `_LEAVE_BARRIER_S`; a rank unwinding an
    exception leaves at once, having posted it (the others stop on the post, or on their connection to this rank
    closing, and name the exception: [Note: a rank's failure told to the others] in `watch.py`)."""
    # On gloo the world itself; else the gloo control group made when the world was first wrapped (never made here:
    # making a group is itself a collective). A monitored barrier is the one with its own timeout.
    group = dist.group.WORLD if dist.get_backend() == "gloo" else CONTROL_OF.get(dist.group.WORLD)
    if group is not None:
        with contextlib.suppress(Exception):
            timeout = datetime.timedelta(seconds=_LEAVE_BARRIER_S)
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)


def _worker_states() -> list[str]:
    """The scheduler state ("R" running or runnable, "S" asleep, ...) of each gloo worker thread of this process;
    empty where /proc does not tell (not Linux) or no gloo group is alive."""
    out = []
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() != _WORKER_NAME:
                        continue
                with open(f"/proc/self/task/{tid}/stat") as f:
                    out.append(f.read().rsplit(")", 1)[1].split()[0])
    return out


def _quiet_workers(limit_s: float) -> int:
    """Wait until every remaining gloo worker thread was seen asleep twice in a row, the interpreter free between
    the looks (a worker waiting for it wakes up then); at most `limit_s`. Returns how many were still awake."""
    deadline = time.monotonic() + limit_s
    quiet = 0
    while True:
        states = _worker_states()
        if not states:
            return 0
        awake = sum(s != "S" for s in states)
        quiet = quiet + 1 if awake == 0 else 0
        if quiet >= 2 or time.monotonic() > deadline:
            return awake
        time.sleep(0.002)
