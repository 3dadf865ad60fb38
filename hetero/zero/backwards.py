"""Whose training backward is running in this process: a model that a backward passes through tells its own engine's
from another engine's ([Note: a backward through another engine's model]).

[Note: a backward through another engine's model]
Two engines in one loop: a GAN's generator loss runs through the discriminator (D(G(z))), an actor's through its
critic (Q(s, pi(s))), a model's loss through a reward or perceptual model it is judged by. engine_G.backward(loss)
then runs backward through D's modules too. Plain PyTorch computes D's parameter gradients there and adds them to
D.grad, and such loops clear them before D's own backward (optimizer_D.zero_grad()): the generator's objective must
not train its discriminator. hetero drops them as they arrive, so D's update has exactly its own backward's gradients
(freezing D for that backward, `requires_grad_(False)`, saves computing them, as in plain PyTorch). Before, the first
of them stopped the loop ("reached hetero outside engine.backward"), and at stage 3 so did the backward reaching D
at all.

At stage 3 D's units gather for that backward as for their own, in the same order on every rank: whose backward is
open is the loop's doing, the same on every rank, so it is shared state ([Note: every rank in step] in protocol.py);
nothing of D's is reduced. When the backward ends, D releases what it gathered and counts each of its units'
forwards whose backward ran as answered (`Gathers.release_foreign`), so that its own next backward reduces at the
same shared points as without it. Only the engine whose backward is open accumulates; every other engine in the
process is foreign to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

_open: list[int] = []  # ids of the engines whose training backward is running, innermost last
_touched: dict[int, Callable[[bool], None]] = {}  # id of an engine's part -> its end of a foreign backward


@contextlib.contextmanager
def training_backward(owner: object, *, retain_graph: bool = False) -> Iterator[None]:
    """`owner`'s training backward runs inside; at its end, every other engine's part it went through is told
    (with retain_graph: its forwards will be backpropagated again)."""
    _open.append(id(owner))
    try:
        yield
    finally:
        _open.pop()
        if not _open:
            ends = list(_touched.values())
            _touched.clear()
            for end in ends:
                end(retain_graph)


def foreign() -> bool:
    """Whether some engine's training backward is running: asked by a part whose own engine's is not."""
    return bool(_open)


def touched(part: object, end: Callable[[bool], None]) -> None:
    """`part` (of an engine whose backward is not open) took part in the running backward: `end` is called when it
    ends."""
    _touched.setdefault(id(part), end)
