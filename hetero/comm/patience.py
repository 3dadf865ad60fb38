"""Meetings after long local work: a rank still working is waited for, however long; a rank that stopped is named.

[Note: patient meetings]
A checkpoint's ranks each write (or read) their own files, then meet in a gather to learn whether all of them
succeeded. A collective waits at most comm_timeout, which suits ranks that should arrive together; but a rank with a
slower disk, a bigger shard or an NFS hiccup can be minutes behind while nothing is wrong, and the others would fail
the save. So before such a gather the ranks meet in the job's key-value store (the one torch.distributed
rendezvoused through), where a rank's liveness can be seen apart from its arrival:
 - while a rank works, a daemon thread adds 1 to its heartbeat key every beat (comm_timeout / 5, at most 5 s);
 - when its work ends, failed or not (a failure travels in the gather after), the rank stops beating, adds a large
   constant to its key (done) and counts itself in;
 - it then waits for the meeting's outcome, and every beat reads the keys of the members not yet done: a key that
   stood still for comm_timeout is a rank dead, stopped (SIGSTOP, a debugger) or frozen holding the GIL.
The outcome is one value per meeting, set once by compare-and-set: "all in" (by the last rank to count itself in),
"these ranks stood still" (by the first rank to see it) or "this rank left with an error". Every rank follows that
value, not its own observations, so all raise or all go on to the gather together: a decision no rank's timing can
split (a rank frozen, then continued, raises too instead of entering a gather the others left).
Keys are named by the group's members, the meeting's name and a per-process count of the meetings of that name on
that group: every member holds the same meetings in the same order, so the names agree without a message (counted by
name, a roll call one rank held alone does not shift the numbers of the checkpoint meetings after it). The last rank
to leave deletes them; a meeting a rank died in leaves its few keys behind.

Why a thread, and not the writer's progress callbacks: those come once per chunk, and one chunk on a slow disk can
take longer than any beat; a load's reads report nothing. A thread beats on its own clock and stops with its
process. What it cannot see is a main thread blocked forever in a system call (a hard-mounted NFS server that never
answers): that rank looks alive, so the others wait, logging every comm_timeout which ranks they still wait for, unless
the meeting has a limit (`checkpoint_patience`): a rank that has waited that long for its own part's end settles the
outcome "these ranks were still at work", and every rank raises, the late ones as soon as their work returns.

A rank killed outright on this rank's own host is named sooner: each rank posts who its process is beside its
heartbeat, and a waiting rank asks the kernel about those peers every poll ([Note: a dead peer on this host] in
`alive.py`); the first to see one gone settles the outcome "this rank's process ended", which every rank raises.

A meeting with no work in its block is a roll call: ranks not come have no key, and are named after the limit (or,
silent, after comm_timeout) by the error the caller words (`absent`, [Note: a roll call before save_model]).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from hetero.comm import alive
from hetero.comm.watch import default_store, failures
from hetero.errors import CommError, RankFailedError, RankTimeoutError

if TYPE_CHECKING:
    from hetero.comm.group import Comm

log = logging.getLogger("hetero.comm")

_DONE = 1 << 40  # added to a rank's key when its work ends: a key at or past it is done (beats stay far below)
_MAX_BEAT_S = 5.0  # a beat at most this long apart (comm_timeout / 5 when shorter)
_MAX_POLL_S = 0.25  # how late, at most, a waiting rank sees the outcome once it is set
_ALIVE_S = 0.5  # how often a waiting rank asks the kernel whether peers on its host still exist
# Meetings held so far by this process on each group (by its members' digest) under each name: the next one's number.
# Shared by every Comm over the same members, as the store's keys are.
_HELD: dict[tuple[str, str], int] = {}


@dataclass(frozen=True)
class Absence:
    """Ranks a meeting gave up on before they came, for `Meeting(absent=...)` to word the error every rank raises."""

    ranks: list[int]  # global ranks not come (this rank among them when it came after the others had given up)
    me: int  # this rank's global rank
    by: int  # the global rank that gave up on them
    waited_s: float  # how long that rank had waited after its own arrival


class Meeting:
    """`with Meeting(comm, name, what): long local work`, then a collective: leaving the block waits until every
    member of `comm` has left its own, tolerating members still working, and raises RankTimeoutError naming those
    whose heartbeat stood still for the group's timeout ([Note: patient meetings]). Every member enters the same
    meetings in the same order; `name` is the same on every rank, `what` says what this rank does, for messages.
    `absent`, given, words the error for ranks that had not come when the meeting gave up on them (past a rank's
    `limit_s`, or silent for the group's timeout), in place of the checkpoint's wording. A no-op for a group of one,
    or without a store."""

    def __init__(
        self,
        comm: Comm,
        name: str,
        what: str,
        *,
        limit_s: float | None = None,
        absent: Callable[[Absence], str] | None = None,
        store: Any = None,
    ) -> None:
        self.what = what
        self.limit_s = limit_s  # a rank done waits this long at most for those still at work (None: while alive)
        self.absent = absent  # words the error naming ranks not come (None: the checkpoint's wording)
        self.members = comm.global_ranks
        self.me = self.members[comm.rank]
        self.timeout_s = comm.rules.timeout_s  # None: the group waits forever, and so does the meeting
        self.beat_s = max(0.01, min(_MAX_BEAT_S, self.timeout_s / 5 if self.timeout_s else _MAX_BEAT_S))
        self.store = None if comm.size == 1 else (store if store is not None else default_store())
        self._stop = threading.Event()  # set when this rank's work ends: the heartbeat thread returns
        self._beater: threading.Thread | None = None  # the heartbeat thread, while the work runs
        self.who = alive.identity()  # this process, for peers on its host to ask the kernel about
        self.peers: dict[int, dict[str, Any] | None] = {}  # members' identities read so far (None: not askable)
        self.prefix = ""  # the meeting's keys start with it
        if self.store is not None:
            group = hashlib.sha1(",".join(map(str, self.members)).encode()).hexdigest()[:12]
            number = _HELD.get((group, name), 0)
            _HELD[group, name] = number + 1
            self.prefix = f"hetero/meeting/{group}/{number}/{name}/"

    def _key(self, rank: int | str) -> str:
        return f"{self.prefix}{rank}"

    def __enter__(self) -> Meeting:
        if self.store is None:
            return self
        try:
            self.store.set(self._key(f"who/{self.me}"), json.dumps(self.who))  # before the beat that says it came
            self.store.add(self._key(self.me), 1)  # the first beat: the key exists from here
        except Exception as e:
            raise self._unreachable(e) from e
        self._beater = threading.Thread(target=self._beat, name="hetero-heartbeat", daemon=True)
        self._beater.start()
        return self

    def _beat(self) -> None:
        key = self._key(self.me)
        while not self._stop.wait(self.beat_s):
            try:
                self.store.add(key, 1)
            except Exception as e:  # the store is gone: the main thread learns it when it next asks
                log.debug("heartbeat of global rank %d stopped: %s", self.me, e)
                return

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.store is None:
            return
        self._stop.set()
        if self._beater is not None:
            self._beater.join()
        if exc is not None:  # this rank will not come to the collective: the others stop now rather than wait
            try:
                self._settle({"left": self.me, "error": f"{type(exc).__name__}: {exc}"})
                self._leave()
            except Exception as e:
                log.debug("could not tell the others that global rank %d left %s: %s", self.me, self.what, e)
            return
        try:
            self.store.add(self._key(self.me), _DONE)
            if self.store.add(self._key("in"), 1) >= len(self.members):
                self._settle({"ok": True})
            outcome = self._wait()
            self._leave()
        except Exception as e:
            raise self._unreachable(e) from e
        self._follow(outcome)

    def _settle(self, outcome: dict[str, Any]) -> dict[str, Any]:
        """The meeting's outcome: `outcome` if no rank set one before, else the one set first."""
        return json.loads(self.store.compare_set(self._key("outcome"), "", json.dumps(outcome)))

    def _wait(self) -> dict[str, Any]:
        start = time.monotonic()
        pending = {r: (0, start) for r in self.members if r != self.me}  # a member's value read last, and since when
        next_scan, next_log, next_alive = start, start + (self.timeout_s or 60.0), start
        pause = 0.01
        while True:
            if self.store.check([self._key("outcome")]):
                return json.loads(self.store.get(self._key("outcome")))
            now = time.monotonic()
            if now >= next_scan:
                stalled = self._scan(pending, now)
                failed = failures(self.store, self.members, self.me)  # [Note: a rank's failure told to the others]
                if failed:
                    return self._settle({"left": failed[0].origin, "error": failed[0].cause})
                if not pending:  # every key done, though no outcome yet (the last one's process died in between)
                    return self._settle({"ok": True})
                if stalled:
                    silent = [r for r in stalled if pending[r][0] == 0]
                    return self._settle({"stalled": stalled, "silent": silent, "by": self.me})
                if self.limit_s is not None and now - start >= self.limit_s:
                    return self._settle({"late": sorted(pending), "by": self.me, "waited": self.limit_s})
                next_scan = now + self.beat_s
                if self.limit_s is not None:  # the limit is kept to the poll, not to the next beat
                    next_scan = min(next_scan, start + self.limit_s)
                if now >= next_log:
                    self._log_waiting(pending, now - start)
                    next_log = now + (self.timeout_s or 60.0)
            if now >= next_alive:  # [Note: a dead peer on this host]
                dead = self._dead(pending)
                if dead:
                    return self._settle({"dead": dead, "who": {r: self.peers[r] for r in dead}, "by": self.me})
                next_alive = now + _ALIVE_S
            time.sleep(pause)
            pause = min(2 * pause, _MAX_POLL_S, self.beat_s / 2)

    def _dead(self, pending: dict[int, tuple[int, float]]) -> list[int]:
        """The members not done whose processes, on this host, have ended ([Note: a dead peer on this host])."""
        dead = []
        for r, (value, _) in pending.items():
            if value == 0:
                continue  # not come (as far as this rank has read): its identity may not be posted yet
            if r not in self.peers:
                raw = self.store.get(self._key(f"who/{r}"))
                who = json.loads(raw)
                self.peers[r] = who if alive.askable(who, self.who) else None
            who = self.peers[r]
            if who is not None and alive.gone(who):
                dead.append(r)
        return dead

    def _log_waiting(self, pending: dict[int, tuple[int, float]], waited_s: float) -> None:
        """Say whom this rank still waits for: ranks whose heartbeat advances, and ranks not come (a roll call's)."""
        beating = ", ".join(str(r) for r, (value, _) in sorted(pending.items()) if value)
        absent = ", ".join(str(r) for r, (value, _) in sorted(pending.items()) if not value)
        if beating:
            log.warning(
                "global rank %d has waited %.0f s for global rank(s) %s to finish %s; their heartbeats advance, so "
                "they are alive (a rank blocked in a system call looks alive too)",
                self.me,
                waited_s,
                beating,
                self.what,
                extra={"all_ranks": True},
            )
        if absent:
            log.warning(
                "global rank %d has waited %.0f s for global rank(s) %s to come",
                self.me,
                waited_s,
                absent,
                extra={"all_ranks": True},
            )

    def _scan(self, pending: dict[int, tuple[int, float]], now: float) -> list[int]:
        """Read the keys of the members not done: drop those done, and return those whose key stood still for the
        group's timeout."""
        stalled = []
        for r in list(pending):
            value = self.store.add(self._key(r), 0)
            last, since = pending[r]
            if value >= _DONE:
                del pending[r]
            elif value != last:
                pending[r] = (value, now)
            elif self.timeout_s is not None and now - since >= self.timeout_s:
                stalled.append(r)
        return stalled

    def _leave(self) -> None:
        """Count this rank out; the last one out deletes the meeting's keys."""
        if self.store.add(self._key("out"), 1) < len(self.members):
            return
        if hasattr(self.store, "delete_key"):
            for k in [*self.members, *(f"who/{r}" for r in self.members), "in", "out", "outcome"]:
                self.store.delete_key(self._key(k))

    def _follow(self, outcome: dict[str, Any]) -> None:
        if outcome.get("ok"):
            return
        group = f"group {self.members}"
        absence = self._absence(outcome)
        if absence is not None and self.absent is not None:
            raise RankTimeoutError(self.absent(absence), missing_ranks=absence.ranks, timeout_s=absence.waited_s)
        if "left" in outcome:
            raise RankFailedError(
                f"global rank {outcome['left']} left {group} with an error ({outcome['error']}) while global rank "
                f"{self.me} was waiting for every rank to finish {self.what}; it does not come to the collective "
                "that follows, so no rank goes on. Its log says more",
                failed_rank=outcome["left"],
                cause=outcome["error"],
            )
        if "dead" in outcome:
            raise self._dead_error(outcome, group)
        if "late" in outcome:
            late = ", ".join(map(str, outcome["late"]))
            raise RankTimeoutError(
                f"Global rank {self.me} was waiting for every rank of {group} to finish {self.what}. Global rank(s) "
                f"{late} were still at it {outcome['waited']:g} s (checkpoint_patience) after global rank "
                f"{outcome['by']} had finished its own, their heartbeats advancing: alive, but slow or blocked in a "
                "system call (a stalled disk, an NFS server that does not answer). (Every rank raises this, the late "
                "ones when their work returns.) Check those ranks' storage; if it is only slow, raise "
                "checkpoint_patience or set it to None to wait as long as the ranks are alive.",
                missing_ranks=list(outcome["late"]),
                timeout_s=float(outcome["waited"]),
            )
        stalled, silent = outcome["stalled"], outcome["silent"]
        stopped = [r for r in stalled if r not in silent]
        lines = [f"Global rank {self.me} was waiting for every rank of {group} to finish {self.what}."]
        if stopped:
            lines.append(
                f"The heartbeat of global rank(s) {', '.join(map(str, stopped))} stood still for {self.timeout_s:g} s "
                "(comm_timeout) before they finished: dead, stopped (SIGSTOP, a debugger) or frozen in native code."
            )
        if silent:
            lines.append(
                f"Global rank(s) {', '.join(map(str, silent))} posted no heartbeat for this meeting in "
                f"{self.timeout_s:g} s: dead before it, or running a different sequence of operations."
            )
        if self.me in stalled:
            lines.append(f"This rank (global rank {self.me}) was among them: the others gave up on it meanwhile.")
        lines.append(
            f"(Decided by global rank {outcome['by']}; every rank raises this.) Check those ranks' logs and exit "
            "codes: a crash or an out-of-memory kill shows there. Ranks that are only slow are waited for as long as "
            "their heartbeat advances."
        )
        raise RankTimeoutError(" ".join(lines), missing_ranks=list(stalled), timeout_s=self.timeout_s or 0.0)

    def _dead_error(self, outcome: dict[str, Any], group: str) -> RankFailedError:
        dead = outcome["dead"]
        procs = ", ".join(
            f"global rank {r} (pid {who['pid']} on host {who['host']})"
            for r, who in sorted((int(r), who) for r, who in outcome["who"].items())
        )
        cause = "its process ended while it was at work (SIGKILL, an out-of-memory kill, or a crash in native code)"
        return RankFailedError(
            f"Global rank {self.me} was waiting for every rank of {group} to finish {self.what}. The process of "
            f"{procs} has ended before it finished: killed (SIGKILL, the out-of-memory killer) or crashed in native "
            f"code, so it will not come to the collective that follows, and no rank goes on. (Seen by global rank "
            f"{outcome['by']} on the same host; every rank raises this.) Its exit status and the kernel's log "
            "(dmesg: an out-of-memory kill) say why.",
            failed_rank=int(dead[0]),
            cause=cause,
        )

    def _absence(self, outcome: dict[str, Any]) -> Absence | None:
        """The ranks not come, if that is why the meeting gave up: past the limit, or silent all of them."""
        if "late" in outcome:
            return Absence(list(outcome["late"]), self.me, outcome["by"], float(outcome["waited"]))
        if "stalled" in outcome and outcome["stalled"] == outcome["silent"]:
            return Absence(list(outcome["silent"]), self.me, outcome["by"], self.timeout_s or 0.0)
        return None

    def _unreachable(self, err: BaseException) -> CommError:
        return CommError(
            f"global rank {self.me} lost the rendezvous store while finishing {self.what} ({type(err).__name__}: "
            f"{err}): the store lives with the launcher's MASTER_ADDR, usually global rank 0's process. Is it alive?"
        )
