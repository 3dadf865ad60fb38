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
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hetero.errors import RankTimeoutError

log = logging.getLogger("hetero.comm")

_GRACE_S = 10.0  # at most this long to hear from the other ranks once our own wait expired
_KEY = "hetero/waiting/{rank}"
_SKEW_S = 5.0  # hosts' clocks may differ by this much; a post older than this wait by more is from an earlier one


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("-inf")  # not a post of this format: as old as can be


def diagnose(store: Any, *, me: int, members: list[int], what: str, timeout_s: float, err: BaseException) -> Exception:
    """The error to raise after `what` timed out on global rank `me` in a group of global `members`."""
    posted: dict[int, str] = {}
    since = time.time() - timeout_s - _SKEW_S  # when this wait began (the others' began near it)
    if store is not None:
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
    for r, w in sorted(elsewhere.items()):
        lines.append(
            f"Global rank {r} is waiting in a different operation: {w}. The ranks ran different sequences of "
            "collectives: a decision that depends on one rank's data or memory."
        )
    if store is None:
        lines.append("The rendezvous store was unreachable, so the others could not be asked (is rank 0 alive?).")
    if not missing and not elsewhere and store is not None:
        lines.append("Every rank reports this same operation: the backend itself did not complete it.")
    lines.append(f"({type(err).__name__}: {err})")
    return RankTimeoutError(" ".join(lines), missing_ranks=missing or None, timeout_s=timeout_s)
