"""A roll call before a call that every rank must make: a rank that makes it alone fails in seconds, saying so.

[Note: a roll call before save_model]
`HeteroTrainer.save_model` gathers the weights from every rank at ZeRO stage 3 (and settles a delayed update, which
gathers at every stage), so every rank must call it. The common mistake is the plain-PyTorch habit `if
trainer.is_world_process_zero(): trainer.save_model()`: process zero then waited in the first gather for ranks that
never came, until comm_timeout (ten minutes by default) or until they exited, and the error named a rank "busy
outside hetero's collectives", never the call. So before it gathers, each rank counts itself in under a key of the
job's store and waits for the others: a patient meeting with no work in it ([Note: patient meetings] in
comm/patience.py), whose keys, outcome and failure-board watch are the checkpoint's:
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

from typing import TYPE_CHECKING, Any

from hetero.comm.patience import Absence, Meeting

if TYPE_CHECKING:
    from hetero.comm.group import Comm


def roll_call(comm: Comm, name: str, *, limit_s: float, advice: str, store: Any = None) -> None:
    """Return once every member of `comm` has called `roll_call` with this `name` as often as this rank has; raise
    RankTimeoutError on every member that came, with `advice`, when the group's rank 0 waited `limit_s` for the
    others in vain ([Note: a roll call before save_model])."""

    def absent(a: Absence) -> str:
        when = (
            f"global rank {a.me} called {name} after global rank {a.by} had given up waiting for it"
            if a.me in a.ranks
            else f"global rank(s) {', '.join(map(str, a.ranks))} had not called {name} {a.waited_s:g} s after "
            f"global rank {a.by} did"
        )
        return f"{name} must be called on every rank: {when}. {advice}"

    wait_s = limit_s if comm.rank == 0 else comm.rules.timeout_s
    with Meeting(comm, name, f"the work before {name}", limit_s=wait_s, absent=absent, store=store):
        pass  # nothing to do: the meeting is the roll call
