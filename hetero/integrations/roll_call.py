"""A roll call before a call that every rank must make: a rank that makes it alone fails in seconds, saying so.

[Note: a roll call before save_model]
`HeteroTrainer.save_model` gathers the weights from every rank at ZeRO stage 3 (and settles a delayed update, which
gathers at every stage), so every rank must call it. The common mistake is the plain-PyTorch habit `if
trainer.is_world_process_zero(): trainer.save_model()`: process zero then waited in the first gather for ranks that
never came, until comm_timeout (ten minutes by default) or until they exited, and the error named a rank "busy
outside hetero's collectives", never the call. So before it gathers, each rank counts itself in under a key of the
job's store named by the group and the number of calls this process made on it, and waits for the others:
 - the last rank to count itself in settles the outcome "all in" (compare-and-set: the first outcome stands);
 - the group's rank 0 waits at most `limit_s` (it is the rank a `is_world_process_zero()` guard lets through; the
   other ranks are seldom behind it, since work done on one process only is process zero's), then settles "these
   ranks did not come";
 - the other ranks wait up to the group's comm_timeout, as a collective would, for a process zero still busy with
   work of its own (uploading, deleting old checkpoints);
 - every rank follows the outcome, not its own clock: all go on to the gather together, or all raise. A rank that
   comes after the outcome was settled without it reads it and raises too, instead of waiting in a gather alone.
A rank whose failure is on the failure board ([Note: a rank's failure told to the others] in watch.py) ends the wait
for the others. Without a store (one process) there is nothing to wait for.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import TYPE_CHECKING, Any

from hetero.comm.watch import default_store, failures
from hetero.errors import RankFailedError, RankTimeoutError

if TYPE_CHECKING:
    from hetero.comm.group import Comm

_POLL_S = 0.05  # how often a waiting rank reads the outcome
_CALLS: dict[str, int] = {}  # roll calls held so far by this process, by name and group: the next one's number


def roll_call(comm: Comm, name: str, *, limit_s: float, advice: str, store: Any = None) -> None:
    """Return once every member of `comm` has called `roll_call` with this `name` as often as this rank has; raise
    RankTimeoutError on every member that came, with `advice`, when the group's rank 0 waited `limit_s` for the
    others in vain ([Note: a roll call before save_model])."""
    store = store if store is not None else default_store()
    if comm.size == 1 or store is None:
        return
    members = comm.global_ranks
    me = members[comm.rank]
    group = hashlib.sha1(f"{name}:{','.join(map(str, members))}".encode()).hexdigest()[:12]
    number = _CALLS.get(group, 0)
    _CALLS[group] = number + 1
    prefix = f"hetero/roll/{group}/{number}/"
    store.set(f"{prefix}{me}", "1")
    if store.add(f"{prefix}in", 1) >= len(members):
        store.compare_set(f"{prefix}outcome", "", json.dumps({"ok": True}))
    timeout_s = comm.rules.timeout_s
    wait_s = limit_s if comm.rank == 0 else timeout_s
    start = time.monotonic()
    while not store.check([f"{prefix}outcome"]):
        failed = failures(store, members, me)
        if failed:
            raise RankFailedError(
                f"global rank {failed[0].origin} stopped with an error ({failed[0].cause}) before calling {name}; "
                "its log says more",
                failed_rank=failed[0].origin,
                cause=failed[0].cause,
            )
        if wait_s is not None and time.monotonic() - start >= wait_s:
            absent = [r for r in members if not store.check([f"{prefix}{r}"])]
            store.compare_set(f"{prefix}outcome", "", json.dumps({"absent": absent, "by": me, "waited": wait_s}))
            break
        time.sleep(_POLL_S)
    outcome = json.loads(store.get(f"{prefix}outcome"))
    if store.add(f"{prefix}out", 1) >= len(members) and hasattr(store, "delete_key"):
        for k in [*members, "in", "out", "outcome"]:
            store.delete_key(f"{prefix}{k}")
    if outcome.get("ok"):
        return
    absent = outcome["absent"]
    when = (
        f"global rank {me} called {name} after global rank {outcome['by']} had given up waiting for it"
        if me in absent
        else f"global rank(s) {', '.join(map(str, absent))} had not called {name} {outcome['waited']:g} s after "
        f"global rank {outcome['by']} did"
    )
    raise RankTimeoutError(
        f"{name} must be called on every rank: {when}. {advice}",
        missing_ranks=absent,
        timeout_s=float(outcome["waited"]),
    )
