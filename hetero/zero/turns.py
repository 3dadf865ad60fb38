"""Tile gathers in turns: a tiled layer that only some ranks run still gathers at points every rank shares.

[Note: tile gathers in turns]
A layer whose weight is split into tiles gathers each tile when its forward (and again its backward) reaches it
([Note: computing on tiles] in `hetero/zero/tiling.py`), not when its unit starts: a unit may hold more tiles than
the device. That point is the rank's own where a branch or a router decides whether the layer runs (an expert larger
than a chunk), and a rank that skipped it met the other ranks' tile gathers with its next collective. So at stage 3
over several ranks the tiled layers of a unit (those whose innermost unit it is) take turns, in one order every rank
shares: their registration order; after the first backward, the layers rank 0's first forward ran take the order it
ran them in, in the places they held, the others keeping theirs (`learn`: one broadcast, once; a model calling its
layers in another order than it registers them, as Mixtral's experts do w1, w3, w2, would otherwise stand in for
one of them before running it and gather it again, every step). Layers skipped on one rank must run in the same
relative order on every rank that runs them (a loop over experts does), as they always must. Backward goes in
the reverse order, without embeddings (an embedding's backward reads no tile). In each pass of the unit (its
forward, its recomputation where `activation_checkpointing` chose it, its backward) every tiled layer gathers its
tiles once. A recomputation calls no hook of the block itself: `ActivationMemory` runs it inside `recomputing`, and
runs it whole (torch's checkpoint stops a recomputation early, after the last tensor this rank's forward saved,
which is a point of the rank's own data):
  - when a layer's turn comes on this rank (its forward or backward is about to gather), this rank first stands in
    for the layers before it in the order that it has not run in this pass: it takes part in their gathers
    (checked like the real ones, with the same identity) and drops the result, since the other ranks need its
    shard; and before the first tile of a pass, the unit's chunks not yet gathered are gathered (what the unit's end
    would have gathered: its modules gather them lazily, in layout order, and a tile gather must not fall between
    two of them on one rank only);
  - the unit's end (forward, or backward) stands in for the layers whose turn never came.
Every rank then issues, per pass, the unit's other chunks in layout order, then each tiled layer's tiles in the
order, whatever its data. Where every rank runs every layer in the order nothing is stood in: the cost is a few
dictionary lookups per tiled layer call. A layer run again in the same pass, or after its turn went by, gathers on
the spot: in step where every rank does the same (a weight applied twice, an order the learnt one does not match),
out of step where only some do, and the collective schedule's check then stops every rank with an error naming the
tiles; so does a tiled layer some ranks run outside its unit's pass (a unit with no backward end, because no input
of it needs a gradient, has no end to stand in at; nor has a recomputation by the model's own checkpointing, inside
a block: there its tiled layers must run on every rank). Measured on `branchy`'s model with every rank routing to
every tiled expert (two CPU ranks, 40 steps): 163 collectives a step with the turns and without, nothing stood in,
0.5 ms a step in `turn` (35 calls, the unit's chunks it gathers first included) of a 350-440 ms step. A skipped layer's
tiles get no gradient on that rank, and their reductions go out at the unit's backward end anyway ([Note:
reductions at shared points] in `hetero/zero/protocol.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from hetero.comm import Comm
from hetero.zero.protocol import BACKWARD, FORWARD, GATHER, Checker, in_backward
from hetero.zero.units import Entry, Unit

if TYPE_CHECKING:
    from hetero.zero.tiling import Tiled


class TileTurns:
    """The turns of the tiled layers of each unit; see [Note: tile gathers in turns]. One per engine, at stage 3
    over several ranks."""

    def __init__(
        self,
        layers: dict[str, tuple[Tiled, str]],
        around: Callable[[str], Unit | None],
        *,
        check: Checker,
        flush: Callable[[Unit, int], None],
    ) -> None:
        self.check = check
        self._flush = flush  # (unit, phase): gathers the unit's chunks still pending
        self._tiles = {name: t.tiles for name, (t, _) in layers.items()}  # layer -> its tiles, in row order
        self._unit: dict[str, Unit] = {}  # layer -> the unit whose turns it takes
        self._reads_back: set[str] = set()  # layers whose backward gathers their tiles (all but embeddings)
        self.order: dict[int, list[str]] = {}  # unit index -> its tiled layers in forward order (shared)
        for name, (_, kind) in layers.items():
            unit = around(name)
            if unit is None:
                continue  # a layer in no unit gathers where it runs
            self._unit[name] = unit
            self.order.setdefault(unit.index, []).append(name)
            if kind != "embedding":
                self._reads_back.add(name)
        self._place: dict[tuple[int, bool], dict[str, int]] = {}  # (unit, backward) -> layer -> its turn
        self._arrange()
        self._open: dict[tuple[int, bool], list[int]] = {}  # (unit, backward) -> [passes open, next turn]
        self.stood_in = 0  # layers stood in for: none where every rank runs every tiled layer in the order
        # Tiles of layers stood in for beside a sibling taking its turn, left gathered: see [Note: siblings out of
        # the order]; given back at the next layer's turn or the pass's end.
        self._kept: list[list[Entry]] = []
        self._learning = True  # until `learn`: each unit's first forward order of its layers, as run here
        self._seen: dict[int, list[str]] = {}

    def _arrange(self) -> None:
        self._place.clear()
        for u, names in self.order.items():
            self._place[(u, False)] = {n: i for i, n in enumerate(names)}
            back = [n for n in reversed(names) if n in self._reads_back]
            self._place[(u, True)] = {n: i for i, n in enumerate(back)}

    def _turns(self, key: tuple[int, bool]) -> list[str]:
        return list(self._place[key])  # in order (dicts keep it)

    # ---- a unit's passes (Gathers, at unit events) --------------------------------------------------------
    def begin(self, unit: Unit, *, backward: bool) -> None:
        key = (unit.index, backward)
        if key not in self._place:
            return
        state = self._open.setdefault(key, [0, 0])
        state[0] += 1  # a unit running inside itself shares the pass of its outer call

    def end(self, unit: Unit, *, backward: bool) -> None:
        """The pass ends: this rank stands in for the layers whose turn never came."""
        key = (unit.index, backward)
        state = self._open.get(key)
        if state is None:
            return
        state[0] -= 1
        if state[0] > 0:
            return
        del self._open[key]
        self._give_back_kept()
        if state[1] < len(self._place[key]):
            phase = BACKWARD if in_backward() else FORWARD
            self._flush(unit, phase)
            for name in self._turns(key)[state[1] :]:
                self._stand_in(self._tiles[name], phase)

    @contextlib.contextmanager
    def recomputing(self, block: nn.Module) -> Iterator[None]:
        """A checkpointed block's recomputation in backward (`ActivationMemory`, which then recomputes it whole, never
        stopping where this rank's data ends it): a forward pass of its tiled layers' turns."""
        unit = next((u for u in self._unit.values() if u.module is block), None)
        if unit is not None:
            self.begin(unit, backward=False)
        yield  # an error leaves the pass open (the step's end forgets it): its stand-ins could only hang
        if unit is not None:
            self.end(unit, backward=False)

    def clear(self) -> None:
        """The step's end: passes cut short (an error, a backward that never reached a unit) are forgotten."""
        self._open.clear()
        self._give_back_kept()

    # ---- a tiled layer's turn (TileRunner) ----------------------------------------------------------------
    def turn(self, layer: str, backward: bool) -> bool:
        """`layer` is about to gather its tiles, in its forward (or its backward): its turn, where its unit's pass
        is open; the earlier layers' turns first. True where its turn went by: it gathers off the shared order."""
        unit = self._unit.get(layer)
        if unit is None:
            return False
        key = (unit.index, backward)
        state = self._open.get(key)
        place = self._place[key].get(layer)
        if state is None or place is None:
            return False  # outside its unit's pass: it gathers where it runs, which every rank must do alike
        phase = BACKWARD if in_backward() else FORWARD
        self._flush(unit, phase)  # a no-op after the pass's first tile
        off = place < state[1]
        if not off:
            self._give_back_kept()
            if place > state[1]:
                for name in self._turns(key)[state[1] : place]:
                    self._stand_in(self._tiles[name], phase, keep=_siblings(name, layer))
            state[1] = place + 1
        # else: its turn went by (run twice, or out of the order): it gathers now, in step only where every rank does
        if self._learning and not backward:
            seen = self._seen.setdefault(unit.index, [])
            if layer not in seen:
                seen.append(layer)
        return off

    def _stand_in(self, tiles: list[Entry], phase: int, *, keep: bool = False) -> None:
        """Take part in a skipped layer's gathers, as `TileRunner.open` issues them, and drop what came (keep: leave
        it gathered, for a sibling's turn; [Note: siblings out of the order])."""
        self.stood_in += 1
        for e in tiles:
            zc = e.chunk
            if not zc.gathered:
                self.check(GATHER, chunk=zc.spec.index, phase=phase)
            zc.unshard()
            if not keep:
                zc.reshard()
        if keep:
            self._kept.append(tiles)

    def _give_back_kept(self) -> None:
        for tiles in self._kept:
            for e in tiles:
                e.chunk.reshard()  # a no-op where the layer ran since and its own close gave the tile back
        self._kept.clear()

    def learn(self, comm: Comm) -> None:
        """After the first backward, on every rank: in each unit's order, the layers rank 0's forward ran take the
        order it first ran them in, in the places they held; those it never ran keep theirs (one broadcast, once)."""
        if not self._learning:
            return
        self._learning = False
        if not self.order:
            return
        perm = []
        for u, names in self.order.items():
            seen = self._seen.get(u, [])
            ran = iter(names.index(n) for n in seen)
            perm += [next(ran) if n in seen else i for i, n in enumerate(names)]
        agreed = torch.tensor(perm, dtype=torch.int64)
        comm.control.broadcast(agreed, src=0)
        flat = iter(agreed.tolist())
        for u, names in self.order.items():
            self.order[u] = [names[next(flat)] for _ in names]
        self._seen.clear()
        self._arrange()


def _siblings(a: str, b: str) -> bool:
    """Whether two tiled layers are children of one module (an expert's w1, w2 and w3)."""
    return a.rpartition(".")[0] == b.rpartition(".")[0]


# [Note: siblings out of the order]
# Until the order is learnt (and for layers rank 0's first forward never ran), a module whose children run in another
# order than they were registered in (transformers 4's Mixtral expert: w1, w3, then w2) reaches a child's turn with a
# sibling's turn not yet taken: this rank stands in for that sibling, and when the sibling then runs, its turn has
# gone by and it gathered on the spot, on the ranks that run the expert alone, while a rank whose router skipped the
# expert had moved on to the next one's gathers: the first step stopped with a collective mismatch (transformers
# 4.57.6, tests/test_model_checkpointing.py's Mixtral over two ranks). A sibling stood in for beside a layer taking
# its turn keeps its tiles gathered until the next layer's turn or the pass's end, so when it runs it finds them and
# gathers nothing: the collectives stay those of the order on every rank, for one more layer's tiles held a while.
# In backward the same holds for the reversed order (w2's backward comes first there).

# [Note: a gather off the turns waits for its check]
# A check is posted and its collective issued at once, compared at the next wait ([Note: checks posted, verified at
# the wait] in protocol.py): enough where a rank that took another path meets a gather of the same size, whose
# result is never used. A tiled layer gathering after its turn went by is that other path where only some ranks do
# it (a loop visiting the experts in an order of each rank's data, busiest first), and tiles have sizes of their
# own: over gloo the two ranks' gathers of other sizes met and gloo aborted the process in native code, with no
# message (tests/test_moe_routing.py). So such a gather waits for its check before it is issued, and every rank
# stops with the error naming the turns; in step (a layer applied twice on every rank) it costs one rendezvous a
# tile, and a sibling's kept tiles ([Note: siblings out of the order]) gather nothing and wait for nothing.
