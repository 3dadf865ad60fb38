"""`engine.save_checkpoint(..., async_save=True)`: the state copied to host memory at the call, its files written on a
thread while training goes on, the commit at a point every rank reaches in the same order.

[Note: a save written while training goes on]
A synchronous save ([Note: an atomic save] in save.py) holds every rank until its file is written and fsynced and
rank 0 has committed: minutes of idle accelerators for a large model saved often. An async save splits it:
1. At the call, on the training thread: the same planning, checks and temporary directory as a synchronous save
   (so the same errors, on every rank together), then the capture: every tensor the synchronous save would write
   at this moment (master weights, optimizer states, pending gradients, buffers, random states), copied into host
   memory the save owns (a chunk on NVMe is read back and returned, as the synchronous save does), and the small
   state (counters, random states, client_state, scheduler) taken now. Whether host memory can take the copy is
   each rank's question but the answer is every rank's: the plan's agreement carries it, and all ranks fall back to
   the synchronous save if one must, since the two run different collectives.
2. A thread writes the copies into this rank's file with the synchronous save's writer and fsyncs it. It never
   touches the chunk manager (single-threaded by design: no lock guards it) nor a chunk, and issues no collective:
   a group's collectives are ordered on the training thread, and one issued from a second thread would pair with
   the wrong call on another rank.
3. The commit runs on the training thread. At the end of each `engine.step()` that updated, while a save is pending,
   every rank joins one small gather of the ranks' states (writing, written, failed): all written, rank 0 commits
   there as the synchronous save does; one failed, every rank raises the same CheckpointError there (the temporary
   directory dropped, `latest` untouched); else training goes on. The decision follows from the gathered states,
   never from one rank's timing, so all ranks take it at the same step. `engine.wait_checkpoint()`, the next save,
   `load_checkpoint` and `close` wait for this rank's thread (in a patient meeting, [Note: patient meetings] in
   hetero/comm/patience.py: a slower rank is waited for while it is alive), then gather and commit the same way.
A process killed while the thread writes leaves the new checkpoint a .tmp-* directory, which no reader opens and the
next save deletes ([Note: staging directories a stopped job left] in staging.py): `latest` names the previous
complete checkpoint throughout. The copies' host memory is counted while they live
([Note: the checkpoint copy's memory] in host_copy.py).

[Note: an async save at exit]
A script that returns with a save pending (no `wait_checkpoint()` nor `close()`) would end the writing thread, a
daemon, wherever it was: the checkpoint lost after its call had returned. So the exit waits for the saves pending in
the process, in a hook the interpreter runs before any atexit hook (`threading._register_atexit`, where the standard
library's thread pools stop: from an atexit hook the writer could start no I/O thread, "cannot schedule new futures
after interpreter shutdown"), so before hetero's own too, which leaves the process groups. It logs that it waits and
for what, then does what `wait` does, with a bound: the write may take as long as it keeps making progress
(a run written at least every `_EXIT_STALL_S`, and within `checkpoint_patience` when set); then the ranks commit
together. A write that stalls is given up: every rank reports it failed, rank 0 drops the temporary directory, and
the log says the previous checkpoint and `latest` stand. A job of several ranks stopped by a failure, or ending on
an uncaught exception, meets no one (the others may be inside a collective waiting for this rank): it drops the save,
says so on its own rank's log, and removes the temporary directory. Any rank may remove it: the commit needs every
rank's part of the gather, so none can commit a save one rank dropped; a rank still writing there then finds its
file gone or unopenable and fails, which its own exit drops the same way. In every case `latest` names a complete
checkpoint, and a job whose ranks all end through their exit leaves no .tmp-* behind (a rank killed by its launcher,
as torchrun's SIGTERM to the others, may leave its file there: the next save deletes it).

[Note: an engine dropped with a save pending]
The pending save holds its engine (the commit needs its config, its host-copy account), and the registry of pending
saves holds the save until it is committed or dropped: an engine dropped by the script (`del engine`, a name bound
to a new one) with a save pending lives on until exit, where the save is committed as above and the log says so; its
swap files go then, with the process's others. Before, the registry held the saves weakly: once the write ended,
the garbage collector could take the engine at any allocation and commit from its finalizer (`close`), which in a job
of several ranks ran the commit's gather at a different point on each rank, pairing with the wrong collective, and
said nothing. Call `engine.wait_checkpoint()` or `close()` before dropping an engine to commit earlier and free its
memory.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import psutil
import torch

from hetero.checkpoint import manifest as mf
from hetero.checkpoint import staging
from hetero.checkpoint.agree import SAVE, agree
from hetero.checkpoint.describe import rank_info
from hetero.checkpoint.host_copy import copy_of
from hetero.checkpoint.plan import Item, chunk_runs, item_views, read_tier
from hetero.checkpoint.save import (
    file_entry,
    finish,
    manifest_head,
    open_writer,
    pause_for_test,
    planned_of,
    settle_stale,
    worded,
)
from hetero.comm.patience import Meeting
from hetero.comm.watch import stopped
from hetero.memory import Tier

if TYPE_CHECKING:
    from hetero.comm import Comm
    from hetero.engine import Engine

log = logging.getLogger("hetero.checkpoint")

# Host memory an async save may take: its bytes times this, plus a reserve for the training that goes on meanwhile
# (the host tier's staging, the allocator's slack). Short of it, the save is synchronous (agreed by every rank).
_HOST_MARGIN = 1.1
_HOST_RESERVE = 1 << 30
_IN_FLIGHT = 2  # runs handed to the writer's threads at once: a run's copy is freed once it is written
WRITING, WRITTEN, FAILED, CANCELLED = 0, 1, 2, 3  # a rank's write, as the ranks gather it
_EXIT_STALL_S = 60.0  # at exit, how long the write may go without finishing a run before it is given up
# The saves pending in this process, which the exit hook waits for, and the process that hooked it (a forked child
# inherits both, and neither is its own): [Note: an async save at exit]. Held strongly until committed or dropped:
# [Note: an engine dropped with a save pending].
_PENDING: set[PendingSave] = set()
_DROP_JOIN_S = 5.0  # how long a dropped save waits for its writing thread (a run's write away) before it goes on
_HOOKED = {"pid": 0}


def host_room(nbytes: int) -> bool:
    """Whether this host's available memory takes a capture of `nbytes` with room to spare."""
    return psutil.virtual_memory().available >= nbytes * _HOST_MARGIN + _HOST_RESERVE


def start(engine: Engine, comm: Comm, root: str, tag: str, tmp: str, plan: list[Item], state: bytes) -> str:
    """Capture this rank's part (step 1 of the note above), agree that every rank did, start the writing thread;
    returns the directory the checkpoint will be committed to. `state`: rank 0's state.pt bytes, taken already."""
    fname = mf.rank_file(comm.global_rank(comm.rank))
    error: Exception | None = None
    runs: list[list[tuple[str, torch.Tensor]]] = []
    info: dict[str, Any] | None = None
    try:
        runs = capture(engine, plan)
        info = rank_info(engine, fname)
    except Exception as e:  # every rank learns of it below: none may start a save another abandoned
        error = e
    try:
        infos = agree(comm, error, f"copying checkpoint {tag!r} to host memory", value=info, advice=SAVE)
    except BaseException:
        if comm.rank == 0:
            staging.remove(tmp)
            settle_stale(root, tag)
        raise
    head = manifest_head(engine, tag, infos) if comm.rank == 0 else None  # the engine as it is now, not at the commit
    pending = PendingSave(engine, comm, root, tag, tmp, os.path.join(tmp, fname), plan, runs, info or {}, state, head)
    engine.pending_save = pending
    pending.thread.start()
    _wait_at_exit(pending)
    return os.path.join(root, tag)


def _wait_at_exit(pending: PendingSave) -> None:
    """Have the exit wait for `pending` ([Note: an async save at exit])."""
    if _HOOKED["pid"] != os.getpid():
        _HOOKED["pid"] = os.getpid()
        _PENDING.clear()
        try:
            threading._register_atexit(_at_exit)
        except (AttributeError, RuntimeError):  # a Python without it, or a save begun as the interpreter ends
            atexit.register(_at_exit)
    _PENDING.add(pending)


def _at_exit() -> None:
    if _HOOKED["pid"] != os.getpid():
        return  # a forked child ending through the interpreter: the saves, and their threads, are the parent's
    for pending in list(_PENDING):
        pending.at_exit()


def capture(engine: Engine, plan: list[Item]) -> list[list[tuple[str, torch.Tensor]]]:
    """Copies of the plan's tensors in host memory, one run per chunk, in the plan's order. A chunk is made resident
    (read back from NVMe and returned there, as `save._write_rank` does) and pinned while it is copied."""
    m = engine.manager
    runs: list[list[tuple[str, torch.Tensor]]] = []
    for chunk, items in chunk_runs(plan):
        if chunk is None:  # a buffer or a random state: copied too, as the training goes on changing buffers
            runs.append([(items[0].key, engine.device.to_host(items[0].tensor.reshape(-1), copy=True))])
            continue
        tier, was_nvme = read_tier(chunk)
        m.access(chunk, tier, write=False)  # only read: a clean swap copy stays valid
        with m.pinned(chunk):
            keys, views = zip(*item_views(chunk, items))
            if views[0].device.type == "cpu":
                copies = [v.clone() for v in views]
            else:  # queued together, one wait for the device
                copies = engine.device.to_host_all(list(views))
        if was_nvme:
            m.move(chunk, Tier.NVME)  # back home; clean, so no write
        runs.append(list(zip(keys, copies)))
    return runs


class _Cancelled(Exception):
    """Another rank's write failed: this one stops."""


class PendingSave:
    """One async save between its call and its commit: the thread writing this rank's file, and what the commit
    needs (step 3 of [Note: a save written while training goes on])."""

    def __init__(
        self,
        engine: Engine,
        comm: Comm,
        root: str,
        tag: str,
        tmp: str,
        path: str,
        plan: list[Item],
        runs: list[list[tuple[str, torch.Tensor]]],
        info: dict[str, Any],
        state: bytes,
        head: dict[str, Any] | None,
    ) -> None:
        self.engine = engine
        self.comm = comm  # every rank of the job (`model_parallel.world`)
        self.root, self.tag, self.tmp, self.path = root, tag, tmp, path
        self.info = info  # this rank's small state, taken at the call
        self.state, self.head = state, head  # rank 0's state.pt and manifest head, taken at the call
        # The thread's inputs: no Item (they hold chunks, which the thread must not reach).
        self.planned, self.numels = planned_of(plan), [(it.key, it.numel) for it in plan]
        self.runs: list[list[tuple[str, torch.Tensor]] | None] = list(runs)
        # Each run's host bytes, counted until its write ends ([Note: the checkpoint copy's memory] in host_copy.py).
        self.account = copy_of(engine)
        self.held = {k: sum(t.numel() * t.element_size() for _, t in run) for k, run in enumerate(runs)}
        self.held_lock = threading.Lock()  # runs are given back on the writer's I/O threads and the writing one
        if self.account is not None:
            self.account.take(sum(self.held.values()))
        self.stall = ""  # why the wait at exit gave up on the write, for the message
        self.status = WRITING  # set by the thread, last, once its file is written and fsynced or it failed
        self.error = ""  # what failed, said to every rank
        self.entry: dict[str, Any] = {}  # the file's manifest entry, once written
        self.cancel = threading.Event()  # another rank failed: stop writing
        self.gathered = False  # this rank's part went to the commit's gather: the directory is the commit's now
        self.rank = comm.global_rank(comm.rank)
        self.thread = threading.Thread(target=self._write, name="hetero-ckpt-async", daemon=True)

    def _write(self) -> None:
        """The thread: write and fsync this rank's file from the copies, a run at a time."""
        try:
            with open_writer(self.path, self.planned) as w:
                in_flight: collections.deque = collections.deque()
                for k, run in enumerate(self.runs):
                    if self.cancel.is_set():
                        raise _Cancelled  # the writer's exit waits for what it was given, then closes the file
                    future = w.submit(run)
                    future.add_done_callback(lambda _, k=k: self._written(k))
                    in_flight.append(future)
                    self.runs[k] = None  # the writer holds the run until written: its memory goes then
                    while len(in_flight) > _IN_FLIGHT:
                        in_flight.popleft().result()
            self.entry = file_entry(w, self.numels)
            pause_for_test("async-written")
            self.status = WRITTEN
        except _Cancelled:
            self.status = CANCELLED
        except BaseException as e:  # said to every rank at the next boundary
            self.error = f"rank {self.rank} could not write {self.path}: {worded(e, self.root)}"
            self.status = FAILED
        finally:
            self.runs = []
            for k in list(self.held):
                self._written(k)  # the copies are gone with the thread's work, whatever its end

    def _written(self, k: int) -> None:
        """Run k's copy is no longer held: its bytes leave the account (once)."""
        with self.held_lock:
            n = self.held.pop(k, 0)
        if n and self.account is not None:
            self.account.give(n)

    def poll(self) -> None:
        """At an update boundary, on every rank: the ranks' states gathered; all written, commit; one failed, every
        rank raises the same CheckpointError; else nothing (the write goes on)."""
        states = self.comm.all_gather_object(self.status)
        if all(s == WRITTEN for s in states):
            self._finish()
        elif FAILED in states:
            self.cancel.set()
            self._finish()

    def wait(self) -> str:
        """Block until this rank's file is written (and every rank's), then commit; returns the directory."""
        what = f"writing its part of checkpoint {self.tag!r} under {self.root} (async_save)"
        patience = self.engine.config.checkpoint_patience
        with Meeting(self.comm, "checkpoint-async-write", what, limit_s=patience):
            self.thread.join()
        return self._finish()

    def close(self) -> None:
        """At `engine.close()`: commit as `wait` does; a job stopped by a failure runs no collective, and drops it."""
        if stopped() is None:
            self.wait()
            return
        self.cancel.set()
        self.thread.join()
        self._drop("the job stopped while it was written")

    def at_exit(self) -> None:
        """At exit, with this save pending: [Note: an async save at exit]. Never raises (the interpreter ends)."""
        if self.engine.pending_save is not self:
            return
        what = f"checkpoint {self.tag!r} under {self.root}"
        if self.comm.size > 1 and (stopped() is not None or getattr(sys, "last_value", None) is not None):
            self.cancel.set()
            self._drop("the script ended on an error while it was written, and the other ranks cannot be met")
            return
        log.warning(
            "the script ended with %s still being written (async_save=True, and no engine.wait_checkpoint() or "
            "close() after it, or its engine dropped before it was committed): waiting for this rank's write to end "
            "and committing it before exiting",
            what,
        )
        try:
            patience = self.engine.config.checkpoint_patience
            with Meeting(self.comm, "checkpoint-async-write", f"writing its part of {what} at exit", limit_s=patience):
                ended = self._join_while_progressing(patience)
            self._finish(stalled=None if ended else f"its write had not ended by exit ({self.stall})")
            log.warning("committed %s at exit", what)
        except BaseException as e:  # said, not raised: the interpreter is ending
            self.cancel.set()
            self._drop(f"{type(e).__name__}: {e}")

    def _join_while_progressing(self, limit_s: float | None) -> bool:
        """Join the writing thread while it finishes a run at least every `_EXIT_STALL_S` (and, with a limit, within
        it); whether it ended."""
        start = last = time.monotonic()
        left = len(self.held)
        while self.thread.is_alive():
            self.thread.join(0.05)
            now = time.monotonic()
            if len(self.held) != left:
                left, last = len(self.held), now
            if now - last > _EXIT_STALL_S:
                self.stall = f"no run written for {_EXIT_STALL_S:.0f} s, {left} of its runs left"
                return False
            if limit_s is not None and now - start > limit_s:
                self.stall = f"checkpoint_patience {limit_s:g} s passed"
                return False
        return True

    def _drop(self, why: str) -> None:
        """Not committed, on this rank's word alone: its thread stopped, the temporary directory removed, and that
        said on this rank's log with what stands instead ([Note: an async save at exit])."""
        self.engine.pending_save = None
        _PENDING.discard(self)
        self.cancel.set()
        gone = ""
        if not self.gathered:  # once its part is in the commit's gather, the directory is the commit's (commit.py)
            self.thread.join(_DROP_JOIN_S)  # so that it opens no file in the directory after it is gone
            staging.remove(self.tmp)
            gone = ", and its temporary directory was removed"
        latest = mf.latest_tag(self.root)
        stands = f"`latest` still names {latest!r}" if latest else "no earlier checkpoint is there"
        log.warning(
            "checkpoint %r under %s was not committed: %s; %s%s",
            self.tag,
            self.root,
            why,
            stands,
            gone,
            extra={"all_ranks": True},  # this rank's own end: every rank that drops it says so
        )

    def _finish(self, *, stalled: str | None = None) -> str:
        """Gather every rank's outcome and commit (rank 0) or raise on every rank. stalled: this rank's write is
        given up at exit (why), its thread left running."""
        self.engine.pending_save = None  # over, committed or not
        _PENDING.discard(self)
        if stalled is not None:
            self.cancel.set()
            mine: dict[str, Any] = {"error": f"rank {self.rank}: {stalled}"}
        else:
            self.thread.join()  # done or cancelled: at most a run's write away
            if self.status == WRITTEN:
                mine = {**self.entry, **self.info}  # the synchronous save's order of keys
            elif self.status == FAILED:
                mine = {"error": self.error}
            else:  # cancelled: another rank failed, and its error is the one said
                mine = {"cancelled": True}
        self.gathered = True
        infos = self.comm.all_gather_object(mine)
        return finish(self.comm, self.root, self.tag, self.tmp, infos, self.state, lambda _: self.head)
