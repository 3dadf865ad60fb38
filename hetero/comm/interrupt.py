"""Ctrl-C on one rank of a job: that rank stops with KeyboardInterrupt, and the others are told, at once.

[Note: an interrupted rank]
SIGINT sent to one rank (a terminal's Ctrl-C reaching one process, `kill -INT`, a notebook kernel's interrupt) raised
KeyboardInterrupt wherever that rank's main thread was, often inside a forward. The engine took it for a failed
forward the ranks must agree on and sent the collective schedule's check for it, which met the others' next gather:
every rank reported a collective mismatch, the interrupted one too (its KeyboardInterrupt became a CommError, exit
status 2 where 130 was due), and at exit a rank that had caught the interrupt counted as a clean one and waited 30 s
for the others in the exit barrier. An interrupt is not a batch the ranks could skip together: the user stopped this
process. So, in a job hetero joined (`init_from_env`, more than one rank), SIGINT goes through `_on_sigint`, over
Python's default handler (a program's own handler, or SIGINT ignored, is left alone, as for SIGTERM in
hetero/memory/swap_sigterm.py):
 - it records the interrupt (`rules.INTERRUPTED`): from then on every operation a Comm issues, and every wait, raises
   KeyboardInterrupt again, so the rank sends nothing more for a peer's collective to pair with (a size mismatch
   there ends gloo natively) and waits for nobody while it unwinds (`rules.group_failed`, `watch.wait`);
 - it hands the post to a thread of its own (`_poster`): the other ranks read "global rank r was interrupted" on the
   failure board ([Note: a rank's failure told to the others] in watch.py) within about a second and stop with
   RankFailedError saying so. A thread, because the handler runs between two bytecodes of the main thread, which may
   hold the board's lock; `SimpleQueue.put` is safe there;
 - then Python's own handler raises KeyboardInterrupt, which the program sees as without hetero.
At exit the rank leaves at once, skipping the exit barrier, after its post is made and the others have said they
stopped, a few seconds at most (`leaving.py`): torchrun sends SIGTERM to the other ranks a tenth of a second after one
exits, which cut their reports short.
A Python handler runs only between bytecodes: a main thread blocked in a C call that signals do not interrupt (a
point-to-point wait in one piece) runs it when the call returns, as without hetero.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import threading
import time
from types import FrameType
from typing import Any

from hetero.comm import alive, watch
from hetero.comm.rules import INTERRUPTED

log = logging.getLogger("hetero.comm")

_STATE: dict[str, Any] = {"pid": None, "rank": None}  # the process that installed the handler, and its global rank
_POSTS: queue.SimpleQueue[str] = queue.SimpleQueue()  # interrupts for the poster thread to post
_POSTED = threading.Event()  # set once the poster made (or gave up on) its post
_CLOSED_S = 0.5  # after the peer's end, for gloo's workers here to see its connections closed (a loaded machine)
_WHO = "hetero/interrupted/{rank}"  # the interrupted rank's process, for peers on its host to see it gone


def install(rank: int) -> None:
    """In a job of several ranks, on the main thread: SIGINT posts its interrupt for the others ([Note: an
    interrupted rank]). A no-op where SIGINT has a handler of the program's own, or is ignored."""
    if threading.current_thread() is not threading.main_thread():
        return
    if _STATE["pid"] != os.getpid():  # a process forked from one that installed it has no poster thread
        _STATE.update(pid=os.getpid(), rank=rank)
        INTERRUPTED.clear()
        _POSTED.clear()
        threading.Thread(target=_poster, name="hetero-interrupt", daemon=True).start()
    _STATE["rank"] = rank
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if os.getpid() == _STATE["pid"] and not INTERRUPTED:
        what = f"interrupted (Ctrl-C) on global rank {_STATE['rank']}"
        INTERRUPTED.append(what)
        _POSTS.put(what)
    signal.default_int_handler(signum, frame)


def _poster() -> None:
    what = _POSTS.get()
    try:
        store = watch.default_store()
        if store is not None:
            store.set(_WHO.format(rank=_STATE["rank"]), json.dumps(alive.identity()))
        watch.post_failure(KeyboardInterrupt(what), me=_STATE["rank"])
    except Exception as e:  # the store is gone: the others learn of it from the closed connections
        log.debug("could not post the interrupt of this rank: %s", e)
    finally:
        _POSTED.set()


def interrupted() -> str | None:
    """What interrupted this process ("interrupted (Ctrl-C) on global rank r"), or None."""
    return INTERRUPTED[0] if INTERRUPTED and _STATE["pid"] == os.getpid() else None


def posted(limit_s: float) -> bool:
    """Wait, at most `limit_s`, until the interrupt's post is made; whether it was."""
    return _POSTED.wait(limit_s)


def outlive(limit_s: float) -> None:
    """A rank that stopped because a peer was interrupted, at exit: wait, at most `limit_s`, until that peer's process
    is gone where this host can see it ([Note: a dead peer on this host] in alive.py), so that the interrupted rank
    exits first (its status, 130, is the one a launcher reports) and its closed connections fail this rank's pending
    collectives while the interpreter still runs, not during its teardown ([Note: letting the groups go] in
    leaving.py)."""
    own = watch.stopped()
    if own is None or own.origin == own.rank or not own.cause.startswith(KeyboardInterrupt.__name__):
        return
    try:
        store = watch.default_store()
        key = _WHO.format(rank=own.origin)
        who = json.loads(store.get(key)) if store is not None and store.check([key]) else None
    except Exception:  # the store lived with the interrupted rank's launcher, gone with it
        return
    if who is None or not alive.askable(who, alive.identity()):
        return
    deadline = time.monotonic() + limit_s
    while not alive.gone(who) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(_CLOSED_S)


def acknowledged(members: list[int], *, me: int, limit_s: float, store: Any = None) -> list[int]:
    """After this rank posted that it stopped for good: wait, at most `limit_s`, until every other member of
    `members` (global ranks) has posted that it stopped too; returns those that did not (all, without a store)."""
    store = store if store is not None else watch.default_store()
    others = [r for r in members if r != me]
    if store is None:
        return others
    deadline = time.monotonic() + limit_s
    while True:
        try:
            told = {f.rank for f in watch.failures(store, members, me)}
        except Exception as e:  # the store is gone (rank 0's process with it): nobody to wait for
            log.debug("could not read the failure board: %s", e)
            return others
        left = [r for r in others if r not in told]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)
