"""The forwards (or the backwards) of an engine's data-parallel group as a scope of failure posts: a forward or backward
that raised on every rank at the same point is skipped by all, one that raised on some ranks only stops every rank
([Note: failures scoped to a point] in watch.py). Used where the collective schedule's check cannot say it
(check_collectives off)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from hetero.comm import watch

if TYPE_CHECKING:
    from hetero.comm.group import Comm

# Scopes opened so far by this process on each group (by its members' digest): the next one's number. Every rank
# builds its engines in the same order, so the numbers, and the scopes' names, agree without a message.
_OPENED: dict[str, int] = {}


class ForwardScope:
    """One engine's forwards over `comm` (its data-parallel group); with `kind` "backward", its backwards
    (`engine.backward`), numbered apart: a backward's failure never agrees with a forward's at the same count (the
    one drops the accumulation, the other does not). `count()` is the collective schedule's count of this rank (the
    same on every rank at the same point of their programs, whether or not the checks run)."""

    def __init__(self, comm: Comm, count: Callable[[], int], *, kind: str = "forward") -> None:
        self.kind = kind
        self.members = comm.global_ranks
        self.me = self.members[comm.rank]
        self.timeout_s = comm.timeout_s()
        digest = hashlib.sha1(",".join(map(str, self.members)).encode()).hexdigest()[:12]
        number = _OPENED.get(digest, 0)
        _OPENED[digest] = number + 1
        self.prefix = f"{kind}/{digest}/{number}/"
        self.count = count
        self.forwards = 0  # forwards (backwards) begun
        self.inside = False  # in the forward (backward) `forwards`, which has neither returned nor raised
        self.failed: dict[str, int] = {}  # scope -> the count at which this rank's forward of it raised
        watch.judge(self.prefix, self._stops)

    def begin(self) -> None:
        self.forwards += 1
        self.inside = True

    def end(self) -> None:
        self.inside = False

    def _stops(self, post: watch.Failure) -> bool:
        """Whether another rank's post about one of these forwards (backwards) stops this rank: it ran a collective
        the poster will not (it passed the point where the poster raised), or raised at another point."""
        if post.scope in self.failed:
            return post.mark != self.failed[post.scope]
        n = int(post.scope.rsplit("/", 1)[1])
        if n < self.forwards or (n == self.forwards and not self.inside):
            return True  # this rank's forward (backward) n returned
        return n == self.forwards and self.count() > post.mark

    def agree(self, err: BaseException) -> list[watch.Failure] | None:
        """This rank's forward (backward) raised: post it for this one and wait for the others. [] : every rank
        raised at the same point (the post is withdrawn, the ranks go on together); else the posts that stop this
        rank (None: no store to post in)."""
        self.inside = False
        scope, mark = f"{self.prefix}{self.forwards}", self.count()
        self.failed[scope] = mark
        why = (
            f"in its {self.kind}, which it skips as the loop goes on (check_collectives is off): every rank of "
            f"data-parallel group {self.members} must raise at the same point, or none may skip the batch"
        )
        number = watch.post_failure(err, me=self.me, scope=scope, mark=mark, why=why)
        store = watch.default_store()
        if number is None or store is None:
            return None
        stops = watch.agree(store, members=self.members, me=self.me, scope=scope, mark=mark, timeout_s=self.timeout_s)
        if not stops:
            watch.retract(number, store=store)
        return stops

    def close(self) -> None:
        watch.judge(self.prefix, None)
