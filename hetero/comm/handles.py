"""Handles of asynchronous operations: what `Comm`'s non-blocking calls return; `wait()` completes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from hetero.standin import StandinError


class Handle(Protocol):
    """What isend / irecv and the asynchronous collectives return: wait() blocks until the transfer is done."""

    def wait(self) -> Any: ...


class CopyBack:
    """Handle of a transfer through a temporary contiguous buffer; a receive copies it out on wait()."""

    def __init__(self, work: Handle, buf: torch.Tensor, dest: torch.Tensor | None) -> None:
        self._work, self._buf, self._dest = work, buf, dest  # dest None: only keep buf alive (a send)

    def wait(self) -> bool:
        self._work.wait()
        if self._dest is not None:
            self._dest.copy_(self._buf)
        return True


class AllOf:
    """One handle for several works that complete together (a coalesced group of point-to-point operations)."""

    def __init__(self, works: list[Handle]) -> None:
        self._works = works

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        return True


class Done:
    """Handle of an operation that already finished."""

    def wait(self) -> bool:
        return True


class ThenDivide:
    """Handle of an asynchronous sum that becomes a mean on wait() (backends without a native AVG)."""

    def __init__(self, work: Handle, out: torch.Tensor, divisor: int | None) -> None:
        self._work, self._out, self._divisor = work, out, divisor

    def wait(self) -> bool:
        self._work.wait()
        if self._divisor is not None:
            self._out.div_(self._divisor)
        return True


class Timed:
    """A backend's work whose wait() is bounded: `waiter(work, what)` waits with the group's timeout and turns an
    expiry into an error naming the operation and the ranks that did not arrive. `before`, if given, runs first
    (a collective's: the schedule's checks posted before it are verified, [Note: checks posted, verified at the
    wait] in `hetero/zero/protocol.py`)."""

    def __init__(
        self, work: Any, waiter: Callable[[Any, str], None], what: str, before: Callable[[], None] | None = None
    ) -> None:
        self._work, self._waiter, self._what, self._before = work, waiter, what, before

    def wait(self) -> bool:
        if self._before is not None:
            self._before()
        self._waiter(self._work, self._what)
        return True


class LateGather:
    """The stand-in's handle of an asynchronous gather ([Note: the CPU stand-in]): the backend writes a scratch
    buffer, and `out` (poisoned meanwhile) gets the result only on wait(), as a device stream would order it; `inp`
    must read the same then as when the gather was issued."""

    def __init__(self, work: Handle, out: torch.Tensor, scratch: torch.Tensor, inp: torch.Tensor, what: str) -> None:
        self._work, self._out, self._scratch, self._inp, self._what = work, out, scratch, inp, what
        with torch._C._DisableTorchDispatch():  # the stand-in's own bookkeeping: neither compute nor a host wait
            self._sent = inp.detach().clone()

    def wait(self) -> bool:
        self._work.wait()
        with torch._C._DisableTorchDispatch():
            changed = not torch.equal(self._inp, self._sent)
        if changed:
            raise StandinError(
                f"{self._what}: its input changed while the gather was in flight; a device would have sent some of "
                "the new values"
            )
        self._out.copy_(self._scratch)
        return True
