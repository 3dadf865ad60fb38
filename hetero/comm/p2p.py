"""Point-to-point transfers of a `Comm` (a mixin of `group.Comm`): sends, receives, and groups of both that NCCL
runs together (the pipeline's exchanges)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hetero.comm.handles import AllOf, CopyBack, Handle, Timed
from hetero.errors import CommError


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


class PointToPoint:
    """The point-to-point transfers of `Comm`."""

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Send ``t`` to group rank ``dst`` (blocking)."""
        self.isend(t, dst).wait()

    def recv(self, t: torch.Tensor, src: int) -> None:
        """Receive into ``t`` from group rank ``src`` (blocking)."""
        self.irecv(t, src).wait()

    def isend(self, t: torch.Tensor, dst: int, *, tag: int = 0) -> Handle:
        """Start sending ``t`` to group rank ``dst``; do not modify ``t`` before the handle's wait(). ``tag`` pairs it
        with the receive of the same tag (gloo matches by tag; NCCL ignores tags and matches in order)."""
        self._check_p2p(dst, "dst")
        self._check_data("send", t)
        buf = t.contiguous()
        work = dist.isend(buf, dst=self._global_ranks[dst], group=self.group, tag=tag)
        waiter = functools.partial(self._wait_transfer, peers=[self._global_ranks[dst]])
        timed = Timed(work, waiter, f"send of {t.numel()} {t.dtype} elements to group rank {dst}")
        # A contiguous copy must outlive the transfer: the handle holds it until wait().
        return timed if buf is t else CopyBack(timed, buf, None)

    def irecv(self, t: torch.Tensor, src: int, *, tag: int = 0) -> Handle:
        """Start receiving into ``t`` from group rank ``src``; ``t`` holds the data once wait() returns."""
        self._check_p2p(src, "src")
        self._check_data("recv", t)
        what = f"receive of {t.numel()} {t.dtype} elements from group rank {src}"
        waiter = functools.partial(self._wait_transfer, peers=[self._global_ranks[src]])
        if t.is_contiguous():
            work = dist.irecv(t, src=self._global_ranks[src], group=self.group, tag=tag)
            return Timed(work, waiter, what)
        buf = _contiguous_like(t)
        work = dist.irecv(buf, src=self._global_ranks[src], group=self.group, tag=tag)
        return CopyBack(Timed(work, waiter, what), buf, t)

    def batch_p2p(self, ops: Sequence[tuple[str, torch.Tensor, int, int]]) -> list[Handle]:
        """Start sends and receives together: ``ops`` are ("send" | "recv", contiguous tensor, group rank, tag).

        NCCL runs them as one group, so a send and a receive between the same two ranks cannot wait on each other
        (each rank's point-to-point operations share one stream); other backends issue them one by one. Returns one
        handle per operation, in order (on NCCL each stands for the whole group, which completes as one)."""
        p2p = []
        for kind, t, peer, tag in ops:
            self._check_p2p(peer, "peer")
            if kind not in ("send", "recv") or not t.is_contiguous():
                raise ValueError(f"batch_p2p: expected ('send' | 'recv', a contiguous tensor, ...), got {kind!r}")
            self._check_data(f"batch_p2p {kind}", t)
            fn = dist.isend if kind == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, t, self._global_ranks[peer], self.group, tag))
        if not p2p:
            return []
        what = f"point-to-point group of {len(p2p)} transfers with group ranks {sorted({op[2] for op in ops})}"
        waiter = functools.partial(self._wait_transfer, peers=sorted({self._global_ranks[op[2]] for op in ops}))
        works = [Timed(w, waiter, what) for w in dist.batch_isend_irecv(p2p)]
        if len(works) == len(p2p):
            return works
        whole = AllOf(works)  # a coalesced group returns fewer handles than operations
        return [whole] * len(p2p)

    def _check_p2p(self, peer: int, name: str) -> None:
        if self.size == 1:
            raise CommError(f"point-to-point {name} = {peer}: a group of size 1 has no other rank")
        self._check_peer(peer, name, allow_self=False)
