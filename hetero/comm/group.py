"""One process group: the collectives and point-to-point transfers hetero uses, with NCCL's rules and timeouts.

A :class:`Comm` wraps one process group. A world of size 1 needs no group at all: then every operation is a
no-op or a local copy and no ``torch.distributed`` function is called, so single-process training works with
``torch.distributed`` uninitialised (or even unavailable).

Ranks given to and returned by a :class:`Comm` are ranks *within its group*; they are translated to the global
ranks ``torch.distributed`` wants where it wants them, so code written against a subgroup reads the same as
code written against the world.

[Note: data and control groups]
NCCL moves device memory only. Bulk data (chunks, gradients, activations) goes through the group itself, on device
tensors; small host-side messages (flags, scalar sums, checksums, pickled objects, the collective schedule's
checks) go through `comm.control`, a gloo group over the same ranks, so they neither need a device copy nor a
device synchronisation. On gloo the control group is the group itself, except under the CPU stand-in
(`HETERO_STANDIN=1`), which makes it a separate group and holds the data group to NCCL's rule, so that a host
tensor sent through the data group fails on a CPU as it would on a GPU (see [Note: the CPU stand-in]).

Every blocking operation waits at most the group's timeout (`comm_timeout`); on expiry the error names the operation
and the ranks that did not arrive ([Note: naming the rank that did not arrive], `watch.py`). NCCL's data operations
stay asynchronous on the device: their timeout is NCCL's own watchdog, and each collective of the chunk protocol is
preceded by a check on the control group, which does time out with that error.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hetero import logs
from hetero.comm import leaving, watch
from hetero.comm.collectives import Collectives
from hetero.comm.p2p import PointToPoint
from hetero.comm.rules import CONTROL_OF, Rules, group_failed, mark_failed, peer_gone, timed_out, world_rules
from hetero.comm.watch import diagnose
from hetero.errors import RESTART, CommError, GroupUnusableError, RankFailedError, add_note

logger = logging.getLogger("hetero.comm")


class Guard(Protocol):
    """Posts checks that collectives must pass: `mark()` names the last one posted, `verify(upto)` waits for those
    up to it (all, for None) and raises if the ranks disagreed."""

    def mark(self) -> int: ...

    def verify(self, upto: int | None) -> None: ...


class Comm(Collectives, PointToPoint):
    """One process group, or a world of size 1 with no group at all (``group=None``)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, rules: Rules | None = None) -> None:
        self.group = group
        self._control: Comm | None = None  # see [Note: data and control groups]; None: this group itself
        # Probed on first use: whether the backend has the single-tensor reduce_scatter / all_gather.
        self._native_rs: bool | None = None
        self._native_ag: bool | None = None
        # Whoever posts checks that this group's collectives must pass before their results are used (the ZeRO
        # protocol's `Checker`: [Note: checks posted, verified at the wait] in hetero/zero/protocol.py).
        self.guards: list[Guard] = []
        if group is None:
            self.rank, self.size = 0, 1
            self._global_ranks = [0]
            self._backend = "none"
            self.rules = Rules()
            return
        leaving.hold(self)  # it lets go of the group at exit: [Note: letting the groups go]
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise CommError("this process is not a member of the process group it was given")
        self.size = dist.get_world_size(group)
        self._global_ranks = list(dist.get_process_group_ranks(group))
        logs.set_world_rank(self._global_ranks[self.rank])  # hetero's log lines speak for it: [Note: one rank speaks]
        self._backend = str(dist.get_backend(group))
        self.rules = rules if rules is not None else world_rules(self._backend)
        if self.rules.separate_control and self.size > 1:
            control = CONTROL_OF.get(group)
            if control is None:
                # Made when the group is first wrapped, which every member does at the same point of the program.
                control = dist.new_group(
                    ranks=self._global_ranks,
                    backend="gloo",
                    timeout=self._timedelta(),
                    use_local_synchronization=self.size != dist.get_world_size(),
                )
                CONTROL_OF[group] = control
            self._control = Comm(control, rules=Rules(timeout_s=self.rules.timeout_s))

    @classmethod
    def world(cls) -> Comm:
        """The default group, or a size-1 Comm when ``torch.distributed`` is not initialised."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.group.WORLD, rules=world_rules(str(dist.get_backend())))
        return cls()

    @property
    def control(self) -> Comm:
        """The group for small host-side messages: see [Note: data and control groups]."""
        return self._control if self._control is not None else self

    @property
    def needs_device_tensors(self) -> bool:
        """Whether data collectives take device memory only (NCCL, or the stand-in)."""
        return self.rules.device_only is not None

    def with_timeout(self, timeout_s: float | None) -> Comm:
        """The same group (and control group), with every blocking operation bounded by `timeout_s` seconds."""
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s = {timeout_s} must be positive seconds (or None for the group's own)")
        if self.group is None:
            return self  # nothing to wait for
        return Comm(self.group, rules=replace(self.rules, timeout_s=timeout_s))  # the control group is reused

    @property
    def backend(self) -> str:
        """The group's backend name ("gloo", "nccl", ...), or "none" for the group-less size-1 Comm."""
        return self._backend

    @property
    def global_ranks(self) -> list[int]:
        """Global rank of each group rank, in group rank order."""
        return list(self._global_ranks)

    @property
    def is_job(self) -> bool:
        """Whether this group holds every process of the job (torch.distributed's default group's size)."""
        return self.group is not None and self.size == dist.get_world_size()

    def global_rank(self, group_rank: int) -> int:
        """The global rank of a rank of this group."""
        self._check_peer(group_rank, "group_rank", allow_self=True)
        return self._global_ranks[group_rank]

    def __repr__(self) -> str:
        ranks = self._global_ranks
        return f"Comm(rank={self.rank}, size={self.size}, backend={self._backend}, ranks={ranks})"

    @property
    def _local(self) -> bool:
        # A group of one has nothing to exchange: skip torch.distributed (and the group-less Comm has none).
        return self.size == 1

    def timeout_s(self) -> float:
        """How long a blocking operation may wait: the Comm's own bound, else the process group's (which its backend
        keeps, and a transport beside it must keep too: [Note: collectives by cross-memory attach])."""
        if self.rules.timeout_s is not None:
            return self.rules.timeout_s
        try:
            return float(self.group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
        except Exception:  # a torch that does not say: its default for gloo
            return 1800.0

    def _timedelta(self) -> datetime.timedelta | None:
        t = self.rules.timeout_s
        return None if t is None else datetime.timedelta(seconds=t)

    def refuse_if_failed(self, op: str) -> None:
        """Raise before `op` is issued where a wait on this group (or its control group) failed earlier in this
        process: [Note: a group no collective may use after a failure] in rules.py."""
        if self._local:
            return
        found = group_failed(self.group) or group_failed(self.control.group)
        if found is None:
            return
        failed, error = found
        refused = f"{op} on group {self._global_ranks} (global rank {self._global_ranks[self.rank]}) was refused"
        if isinstance(error, RankFailedError):  # the rank and its cause, as the failed wait said
            raise RankFailedError(
                f"{refused}: global rank {error.failed_rank} failed with {error.cause}, and {failed} stopped for it "
                f"earlier in this process. {RESTART}",
                failed_rank=error.failed_rank,
                cause=error.cause,
            )
        raise GroupUnusableError(
            f"{refused}: {failed} failed on this group earlier in this process (the ranks disagreed, or one timed out "
            f"or died; that error was raised then). {RESTART}",
            failed=failed,
        )

    def _check_data(self, op: str, *tensors: torch.Tensor) -> None:
        """A group that failed takes nothing more; NCCL's rule (and the stand-in's): data operations take device
        memory only."""
        self.refuse_if_failed(op)
        rule = self.rules.device_only
        if rule is None or self._local:
            return
        for t in tensors:
            why = rule(t)
            if why is not None:
                raise CommError(
                    f"{op} on group {self._global_ranks} was given {why} (shape {tuple(t.shape)}, {t.dtype}). "
                    "Put bulk data on the device first; send small host-side values through comm.control"
                )

    def _wait_transfer(self, work: Any, what: str, *, peers: list[int] | None = None) -> None:
        """`_wait` for a send or receive: in one piece, as gloo breaks the pair of one whose wait expired; a timeout
        asks only `peers` (global ranks) about it ([Note: diagnosing a transfer] in watch.py)."""
        self._wait(work, what, look=False, peers=peers)

    def _wait(self, work: Any, what: str, *, look: bool = True, peers: list[int] | None = None) -> None:
        """Wait for a backend's work, bounded by the group's timeout; see [Note: naming the rank that did not
        arrive]. NCCL's work is left to the device stream (and NCCL's watchdog)."""
        if work is None:
            return
        if self._backend == "nccl":
            work.wait()
            return
        me = self._global_ranks[self.rank]
        try:
            # No timeout of ours: the backend's own (the process group's), whose failure leaves memory the operation
            # may still write all the same ([Note: memory a failed collective may still write]). A rank that failed
            # ends the wait at once ([Note: a rank's failure told to the others]).
            ok = watch.wait(
                work, timeout_s=self.rules.timeout_s, members=self._global_ranks, me=me, what=what, look=look
            )
        except RankFailedError as err:
            self.failed_wait(what, err)
            raise
        except RuntimeError as err:
            if not (timed_out(err) or peer_gone(err)):
                self.failed_wait(what, err)
                raise
            raise self.failed_wait(what, self.timeout_error(what, err, peers=peers)) from err
        if ok is False:
            raise self.failed_wait(what, self.timeout_error(what, RuntimeError("the wait gave up"), peers=peers))

    def failed_wait(self, what: str, error: BaseException) -> BaseException:
        """`what` failed on this group: the group takes nothing more, and `error` says so (returned, to raise)."""
        # Recorded for the group: [Note: a group no collective may use after a failure] in rules.py
        mark_failed(what, self.group, self.control.group, error=error)
        if RESTART not in str(error) and RESTART not in getattr(error, "__notes__", ()):
            add_note(error, RESTART)
        return error

    def timeout_error(self, what: str, err: BaseException, *, peers: list[int] | None = None) -> Exception:
        """The error for `what` not completing in time on this group, naming the ranks that did not arrive."""
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:
            store = None
        desc = f"{what} on group {self._global_ranks}"
        me = self._global_ranks[self.rank]
        return diagnose(
            store, me=me, members=self._global_ranks, what=desc, timeout_s=self.timeout_s(), err=err, peers=peers
        )

    def _run(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """A blocking operation: started asynchronously, then waited for with the group's timeout (after the checks
        posted before it)."""
        work = fn(*args, group=self.group, async_op=True, **kwargs)
        self.verify_checks()
        self._wait(work, what)

    def guarded(self) -> Callable[[], None] | None:
        """For an asynchronous collective issued now: what its wait runs first, verifying the checks posted up to
        here (and no later ones: a gather issued ahead does not wait for the ranks to reach the next check)."""
        if not self.guards:
            return None
        marks = [(g, g.mark()) for g in self.guards]

        def verify() -> None:
            try:
                for g, upto in marks:
                    g.verify(upto)
            except BaseException as err:
                self.failed_wait("the collective schedule's checks", err)  # queued collectives may still write
                raise

        return verify

    def verify_checks(self) -> None:
        """Verify every check posted so far (before a blocking operation)."""
        try:
            for g in self.guards:
                g.verify(None)
        except BaseException as err:
            self.failed_wait("the collective schedule's checks", err)  # collectives issued before it may be queued
            raise

    def _check_peer(self, r: int, name: str, *, allow_self: bool) -> None:
        if not isinstance(r, int) or not 0 <= r < self.size:
            raise ValueError(f"{name} = {r!r} is not a rank of this group (size {self.size})")
        if not allow_self and r == self.rank:
            raise ValueError(f"{name} = {r} is this rank itself: point-to-point needs another rank")

    # ------------------------------------------------------------------------------------------ subgroups
    def split(self, ranks_list: Sequence[Sequence[int]]) -> Comm:
        """Partition this group; every rank of it calls with the same full partition and gets its own part.

        Ranks are ranks of this group. Within a part, group ranks follow ascending global rank (torch sorts).
        """
        seen: dict[int, int] = {}
        for gi, ranks in enumerate(ranks_list):
            if len(ranks) == 0:
                raise ValueError(f"ranks_list[{gi}] is empty: every part of the partition needs a rank")
            for r in ranks:
                self._check_peer(r, f"ranks_list[{gi}] member", allow_self=True)
                if r in seen:
                    raise ValueError(
                        f"rank {r} is in ranks_list[{seen[r]}] and ranks_list[{gi}]: parts must not overlap"
                    )
                seen[r] = gi
        if len(seen) != self.size:
            absent = sorted(set(range(self.size)) - set(seen))
            raise ValueError(f"ranks_list must cover every rank of the group; missing {absent}")
        if self.size == 1:
            return self
        self.refuse_if_failed("split")
        parts = [sorted(self._global_ranks[r] for r in ranks) for ranks in ranks_list]
        me = self._global_ranks[self.rank]
        mine: dist.ProcessGroup | None = None
        timeout = self._timedelta()
        control = self.rules.separate_control

        def make(part: list[int], local: bool) -> Any:
            pg = dist.new_group(ranks=part, timeout=timeout, use_local_synchronization=local)
            if control and len(part) > 1:  # its control group, made at once, in the same order on every rank
                ctl = dist.new_group(ranks=part, timeout=timeout, backend="gloo", use_local_synchronization=local)
                if me in part:
                    CONTROL_OF[pg] = ctl
            return pg

        if self.size == dist.get_world_size():
            # new_group must be entered by every process of the job, for every new group, in the same order.
            for part in parts:
                pg = make(part, local=False)
                if me in part:
                    mine = pg
        else:
            # Processes outside this group will not call us: only members of each part synchronise (the parts
            # are disjoint, which is what local synchronisation needs to be deadlock-free).
            mine = make(parts[seen[self.rank]], local=True)
        logger.debug("split %s into %s", self._global_ranks, parts)
        return Comm(mine, rules=self.rules)

    new_subgroups = split
