"""What a rank does when a collective does not complete in time: find out who is missing, and say so.

[Note: naming the rank that did not arrive]
A timed-out collective only tells this rank that the group did not complete; it does not say who is missing. No
bookkeeping is paid for while things go well: on expiry, this rank posts what it was waiting for in the job's
key-value store (the one torch.distributed rendezvoused through) and reads, for a few seconds, what the other members
of the group post when their own waits expire. A member that posts a different operation is alive but ran a
different sequence of collectives (the ranks diverged); a member that posts nothing is dead, hung, or busy outside
any collective. Either way the error names it, in global ranks, with what this rank was doing. A post carries the
time it was made: one older than this wait is what a member posted after an earlier timeout (a caller that caught
that error and went on), not where it is now, and is read as no post.

[Note: a rank's failure told to the others]
A rank whose NVMe tier fails (a full disk, an I/O error) raises at once, but with data-parallel ranks the others were
already waiting in their next collective, for a rank that will never come: they waited comm_timeout (ten minutes by
default), then reported a timeout naming the rank, not the disk; if its process ended meanwhile they reported that a
peer closed its connection. So a rank that stops posts its error in the job's key-value store (`post_failure`: the
n-th post under hetero/failed/<n>, n taken from the counter hetero/failed/count, so that a reader learns of every
post with one request), and a wait longer than POLL_S reads the counter every POLL_S (`wait`): a post by a member of
the group it waits on ends the wait with RankFailedError, naming that rank and its error, within about POLL_S. A rank
that stops so posts too, naming the rank whose error it was, so that ranks waiting for it (a pipeline or tensor peer
that shares no group with the first) stop as well. Waits that complete within POLL_S, nearly all of them, never ask
the store; a failure read once ends the next wait on that group at once, with no store request. The timeout's and a
closed connection's diagnosis read the posts first (`diagnose`), and so do patient meetings (`patience.py`). Sends
and receives are waited for in one piece (`look=False`): gloo closes the pair of a transfer whose wait expired, and
every later transfer between the two ranks failed; a failed peer reaches them through its closed connection, whose
diagnosis reads the posts. Besides
the NVMe tier's failures (the engine hands `post_failure` to its store), a rank whose script ends in an uncaught
exception posts that exception as it exits (`leaving.py`). A rank that posted for good (`stopped`) issues no further
collective through the engine: its peers' queues hold operations it will never join, which its next ones would pair
with (garbage, or gloo aborting the process on mismatched sizes).

[Note: failures scoped to a point]
A post for good would stop a job whose ranks all caught the same failure and mean to go on together (a forward that
raises on every rank with check_collectives off). So a post may name a scope (what it concerns: "forward/<group>/<n>",
the n-th forward of an engine's data-parallel group) and a mark (where in it: the collective schedule's count). A
process that holds that scope registers a judge (`judge`), which a reader asks whether the post stops it: not when
it failed at the same scope and mark itself, nor while it has not passed that point; yes once it ran a collective
the poster never will. The posters meet in the store (`agree`): every member posted the same scope and mark, and
each withdraws its post (`retract`: an entry that strikes it from every reader's board); else one stops, posts for
good, and the rest stop with it. A post without a judge in this process (an engine closed meanwhile) stops, as one
for good does: a rank that really died is seen within POLL_S as before.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hetero.comm.rules import raise_if_interrupted
from hetero.errors import RankFailedError, RankTimeoutError

log = logging.getLogger("hetero.comm")

_GRACE_S = 10.0  # at most this long to hear from the other ranks once our own wait expired
_KEY = "hetero/waiting/{rank}"
_SKEW_S = 5.0  # hosts' clocks may differ by this much; a post older than this wait by more is from an earlier one
POLL_S = 1.0  # how often a long wait asks the store whether another rank failed (see the note above)
_FAILED = "hetero/failed/"  # the failures' keys: "count", then one per post, "1", "2", ...


def default_store() -> Any:
    """The job's key-value store (torch.distributed's rendezvous), or None outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a group made without one
        return None


@dataclass(frozen=True)
class Failure:
    """A post on the failure board: global rank `rank` stopped, for an error of global rank `origin` (its own or
    one it learned of), `cause` ("Type: message")."""

    rank: int
    origin: int
    cause: str
    scope: str = ""  # "": for good; else what it concerns ([Note: failures scoped to a point])
    mark: int = 0  # where in its scope the poster stopped
    number: int = 0  # its place on the board (1, 2, ...), for a retraction


class _Board:
    """What this process knows of one store's failure board."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.posted: Failure | None = None  # this process's own post for good: once is enough
        self.known: list[Failure] = []  # the posts read so far, in post order
        self.retracted: set[int] = set()  # the numbers of posts withdrawn
        self.reading = threading.Lock()  # held by the one thread reading new posts


_BOARD: list[_Board] = []  # the board of the store in use (a new job's store starts a new one)
_LOCK = threading.Lock()  # posts come from the NVMe tier's I/O threads too
# Scope prefix -> whether a post of that scope stops this process ([Note: failures scoped to a point]).
_JUDGES: dict[str, Callable[[Failure], bool]] = {}


def _board(store: Any) -> _Board:
    if not _BOARD or _BOARD[0].store is not store:
        _BOARD[:] = [_Board(store)]
    return _BOARD[0]


def post_failure(
    err: BaseException,
    *,
    store: Any = None,
    me: int | None = None,
    origin: Failure | None = None,
    scope: str = "",
    mark: int = 0,
    why: str = "",
) -> int | None:
    """Tell the other ranks of the job that this one (global rank `me`, default this process's) stopped with `err`,
    or, with `origin`, for another rank's failure: [Note: a rank's failure told to the others]. Once per process and
    job for good; with `scope`, a post about that scope only ([Note: failures scoped to a point]), as often as asked.
    `why` is added to the cause. Returns the post's number, None if none was made; best effort (a store that cannot
    be reached is only logged: the others then see a timeout as before)."""
    store = store if store is not None else default_store()
    if store is None:
        return None
    try:
        me = dist.get_rank() if me is None else me
        cause = f"{type(err).__name__}: {err}" + (f" ({why})" if why else "")
        post = Failure(me, origin.origin, origin.cause) if origin else Failure(me, me, cause, scope, mark)
        with _LOCK:
            board = _board(store)
            if not scope:
                if board.posted is not None:
                    return None
                board.posted = post
        n = store.add(_FAILED + "count", 1)
        store.set(f"{_FAILED}{n}", json.dumps({k: v for k, v in post.__dict__.items() if k != "number"}))
        return n
    except Exception as e:
        log.debug("could not post the failure of this rank (%s) to the rendezvous store: %s", err, e)
        return None


def retract(number: int, *, store: Any = None) -> None:
    """Withdraw this process's scoped post `number` (its scope's failure was agreed and the ranks go on)."""
    store = store if store is not None else default_store()
    if store is None:
        return
    try:
        n = store.add(_FAILED + "count", 1)
        store.set(f"{_FAILED}{n}", json.dumps({"retract": number}))
    except Exception as e:
        log.debug("could not withdraw failure post %d: %s", number, e)


def stopped(store: Any = None) -> Failure | None:
    """This process's own post for good on the job's board, if it made one: it takes part in no more collectives."""
    store = store if store is not None else default_store()
    with _LOCK:
        return _BOARD[0].posted if _BOARD and _BOARD[0].store is store else None


def judge(prefix: str, stops: Callable[[Failure], bool] | None) -> None:
    """Let `stops` decide whether a post whose scope starts with `prefix` stops this process (None: no longer)."""
    if stops is None:
        _JUDGES.pop(prefix, None)
    else:
        _JUDGES[prefix] = stops


def _stops(f: Failure) -> bool:
    if not f.scope:
        return True
    stops = next((j for p, j in list(_JUDGES.items()) if f.scope.startswith(p)), None)
    return True if stops is None else stops(f)


def failures(store: Any, members: list[int], me: int, *, ask: bool = True) -> list[Failure]:
    """The failures posted by members of a group other than `me` (global ranks); with `ask`, the posts not read yet
    are read first (one request to the store when there are none)."""
    with _LOCK:
        board = _board(store)
    # Whether the counter exists is asked first: adding 0 would create it, a key every long wait left in the job's
    # store (a meeting's keys are all gone once it ends: tests/test_checkpoint_patience.py counts them).
    if ask and store.check([_FAILED + "count"]):
        with board.reading:  # the store's requests outside _LOCK: a post from an I/O thread never waits for them
            count = store.add(_FAILED + "count", 0)
            while len(board.known) < count:
                key = f"{_FAILED}{len(board.known) + 1}"
                if not store.check([key]):
                    break  # counted, not written yet: read at the next look
                post = json.loads(store.get(key))
                if "retract" in post:
                    board.retracted.add(post["retract"])
                    post = {"rank": -1, "origin": -1, "cause": "", "scope": "retraction"}  # a place, never a member
                board.known.append(Failure(**post, number=len(board.known) + 1))
    known = [f for f in list(board.known) if f.rank in members and f.rank != me and f.number not in board.retracted]
    return [f for f in known if _stops(f)]


def agree(store: Any, *, members: list[int], me: int, scope: str, mark: int, timeout_s: float) -> list[Failure]:
    """After this rank posted a failure of `scope` at `mark`: wait until every member of the group posted the same
    (returns [], the ranks go on together) or a post that stops this rank is read (returned):
    [Note: failures scoped to a point]. RankTimeoutError after `timeout_s`."""
    key = f"hetero/agree/{scope}/{mark}"
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    pause = 0.002
    while True:
        if store.add(key, 0) >= len(members):
            return []
        failed = failures(store, members, me)
        if failed:
            return failed
        if time.monotonic() > deadline:
            missing = [r for r in members if r != me]
            raise RankTimeoutError(
                f"global rank {me} raised in {scope} and waited {timeout_s:g} s (comm_timeout) for the others of "
                f"group {members} to say whether they raised at the same point; none did, and none stopped. Check "
                "their logs (a rank that left the loop, or hangs outside hetero's collectives)",
                missing_ranks=missing,
                timeout_s=timeout_s,
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def failed_error(failed: list[Failure], *, me: int, what: str, store: Any = None) -> RankFailedError:
    """The error for `what` on global rank `me` after ranks of its group posted `failed`; this rank posts that it
    stopped too, so that ranks waiting for it stop."""
    first = next((f for f in failed if f.rank == f.origin), failed[0])
    post_failure(RuntimeError(first.cause), store=store, me=me, origin=first)
    via = sorted({f.rank for f in failed if f.rank != first.origin})
    interrupt = first.cause.startswith(KeyboardInterrupt.__name__)  # [Note: an interrupted rank] in interrupt.py
    done = "was interrupted (Ctrl-C)" if interrupt else f"failed with {first.cause}"
    msg = f"{what} on global rank {me} stopped: global rank {first.origin} {done}"
    if via:
        msg += f" (global rank(s) {', '.join(map(str, via))} stopped for it)"
    msg += ". It will not come to this collective, so every rank of the job stops instead of waiting for comm_timeout. "
    if interrupt:
        msg += "Resume from the last checkpoint when you mean to go on (interrupt every rank to stop a job together)."
    else:
        msg += f"Fix the cause on global rank {first.origin} (its log says more), then resume from the last checkpoint."
    return RankFailedError(msg, failed_rank=first.origin, cause=first.cause)


def wait(
    work: Any,
    *,
    timeout_s: float | None,
    members: list[int],
    me: int,
    what: str,
    store: Any = None,
    look: bool = True,
) -> Any:
    """Wait for a backend's `work` at most `timeout_s` seconds (None: the backend's own limit), and return what its
    wait returns; RankFailedError as soon as another member posted a failure in `store` (default: the job's), as
    [Note: a rank's failure told to the others] says. The backend's own error (a peer gone, the time up) is raised
    as it is, for the caller to diagnose. `look` False: one wait, after the failures already read, for work that a
    wait's expiry would break: gloo closes the pair of a send or receive whose wait timed out, and every later
    transfer between the two ranks fails ("Application timeout caused pair closure"), where a collective's wait
    expires harmlessly."""
    raise_if_interrupted()  # [Note: an interrupted rank] in interrupt.py: it waits for nobody
    store = store if store is not None else default_store()
    if store is not None:
        failed = failures(store, members, me, ask=False)  # read already: no request to the store
        if failed:
            raise failed_error(failed, me=me, what=f"{what} on group {members}", store=store)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    finished = _finished(work) if store is not None and look else None
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if store is None or not look or (left is not None and left <= POLL_S):  # the rest of the wait in one piece
            if finished is not None and not finished.wait(left):
                raise RuntimeError(f"{what}: the wait timed out")
            return work.wait() if left is None or finished is not None else work.wait(timeout=_seconds(left))
        start = time.monotonic()
        if finished is not None:
            ok = work.wait() if finished.wait(POLL_S) else False
        else:
            try:
                ok = work.wait(timeout=_seconds(POLL_S))
            except RuntimeError:
                if time.monotonic() - start < 0.9 * POLL_S:  # the work's own error, not this look's expiry
                    raise
                ok = False
        if ok is not False:
            return ok
        try:
            failed = failures(store, members, me)
        except Exception as e:  # the store is gone (rank 0's process with it): wait as the backend does
            log.debug("could not read the failures of other ranks from the rendezvous store: %s", e)
            store = None
            continue
        if failed:
            raise failed_error(failed, me=me, what=f"{what} on group {members}", store=store)


class _Waiter:
    """A thread that waits for one backend work at a time, without a timeout, and sets an event when it completes.
    Some works ignore a wait's timeout (gloo's reduce_scatter_single blocks until it completes or the process group
    times out), which left a wait on them blind to the failure board; an event's wait keeps its timeout."""

    def __init__(self) -> None:
        self.todo: queue.SimpleQueue[tuple[Any, threading.Event]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="hetero-wait", daemon=True).start()

    def _run(self) -> None:
        while True:
            work, done = self.todo.get()
            with contextlib.suppress(Exception):  # the caller's own wait() raises it again
                work.wait()
            # Let go of the work (and the tensors it holds) and be idle again before the caller goes on: kept until
            # the next job, what it held was freed at a time of this thread's making, and a caller quick to wait
            # again found no idle waiter and started another thread.
            del work
            with _LOCK:
                _WAITERS.append(self)
            done.set()
            del done


_WAITERS: list[_Waiter] = []  # idle waiters (one stays busy as long as a work abandoned after an error)


def _finished(work: Any) -> threading.Event | None:
    """An event set when `work` completes, for works that say whether they did (None: the work's own timed wait)."""
    completed = getattr(work, "is_completed", None)
    if completed is None:
        return None
    done = threading.Event()
    if completed():
        done.set()
        return done
    with _LOCK:
        waiter = _WAITERS.pop() if _WAITERS else None
    (waiter or _Waiter()).todo.put((work, done))
    return done


def _seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(s, 0.001))


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("-inf")  # not a post of this format: as old as can be


# [Note: diagnosing a transfer]
# A collective's ranks all take part, so one waiting in another operation ran another sequence of collectives. A
# point-to-point transfer (the pipeline's) takes two, and in a chain of stages a rank waits on its peer while the peer
# waits on its own: when stage 2 of 4 died, stage 0 (receiving from 1) called stages 1 and 3 "a different operation",
# a divergence that was none, and stages 1 and 3 named stage 0, which was no party to their transfers and had not yet
# reported, as not arrived beside the dead one. So for a transfer, only its peers are asked about: a peer that did
# not report is the one that did not arrive; a peer waiting on its own transfer is said to be (where that leads); and
# only when every peer reported are the group's other silent ranks named, since the chain of waits leads there.
def diagnose(
    store: Any,
    *,
    me: int,
    members: list[int],
    what: str,
    timeout_s: float,
    err: BaseException,
    peers: list[int] | None = None,
) -> Exception:
    """The error to raise after `what` timed out on global rank `me` in a group of global `members`. `peers`: the
    global ranks a point-to-point transfer waits on ([Note: diagnosing a transfer]), None for a collective."""
    posted: dict[int, str] = {}
    since = time.time() - timeout_s - _SKEW_S  # when this wait began (the others' began near it)
    if store is not None:
        try:
            failed = failures(store, members, me)
        except Exception:  # a store without the board's operations, or one gone: the posts below say what they can
            failed = []
        if failed:  # [Note: a rank's failure told to the others]: the cause, at once
            return failed_error(failed, me=me, what=what, store=store)
        try:
            store.set(_KEY.format(rank=me), f"{time.time():.3f} {what}")
            deadline = time.monotonic() + min(_GRACE_S, timeout_s)
            others = [r for r in members if r != me]
            while True:
                for r in others:
                    if r not in posted and store.check([_KEY.format(rank=r)]):
                        at, _, doing = store.get(_KEY.format(rank=r)).decode(errors="replace").partition(" ")
                        if _float(at) >= since:
                            posted[r] = doing
                if len(posted) == len(others) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        except Exception as e:  # the store lives on rank 0's host: if it is gone, so probably is rank 0
            log.debug("could not reach the rendezvous store after a timeout: %s", e)
            store = None
    missing = [r for r in members if r != me and r not in posted]
    elsewhere = {r: w for r, w in posted.items() if w != what}
    if peers is not None:  # [Note: diagnosing a transfer]
        missing = [r for r in missing if r in peers] or missing
        elsewhere = {}
        waiting = {r: w for r, w in posted.items() if r in peers}
    gone = "timed out" not in str(err).lower() and "timeout" not in str(err).lower()
    if gone:
        lines = [f"{what} failed on global rank {me}: a peer closed its connection."]
    else:
        lines = [f"{what} timed out after {timeout_s:g} s (comm_timeout) on global rank {me}."]
    if missing:
        lines.append(
            f"Global rank(s) {', '.join(map(str, missing))} did not arrive: dead, hung, or busy outside hetero's "
            "collectives. Check their logs and exit codes (a crash or an out-of-memory kill shows there)."
        )
    for r, w in sorted(waiting.items()) if peers is not None else ():
        lines.append(f"Global rank {r}, this transfer's peer, is itself waiting: {w}.")
    for r, w in sorted(elsewhere.items()):
        lines.append(
            f"Global rank {r} is waiting in a different operation: {w}. The ranks ran different sequences of "
            "collectives: a decision that depends on one rank's data or memory."
        )
    if store is None:
        lines.append("The rendezvous store was unreachable, so the others could not be asked (is rank 0 alive?).")
    if not missing and not elsewhere and peers is None and store is not None:
        lines.append("Every rank reports this same operation: the backend itself did not complete it.")
    lines.append(f"({type(err).__name__}: {err})")
    return RankTimeoutError(" ".join(lines), missing_ranks=missing or None, timeout_s=timeout_s)
