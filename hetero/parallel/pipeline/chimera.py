"""Chimera (Li and Hoefler, SC'21): two pipelines over the same p ranks, running in opposite directions.

[Note: Chimera's layout]
The model is cut into p stages (p even). The "down" pipeline puts stage s on rank s, the "up" pipeline puts it on
rank p - 1 - s, so every rank holds two stages: r (its chunk 0) and p - 1 - r (its chunk 1), and ranks r and
p - 1 - r hold the same two stages. Half of a batch's micro-batches (the first m / 2) enter the down pipeline at
rank 0, the other half the up pipeline at rank p - 1: each direction's idle slots at its start and end are filled by
the other direction's work, which leaves p - 2 idle slots per rank instead of 1F1B's 2 (p - 1), a bubble of
(p - 2) / (2m + p - 2) when a forward and a backward take one slot each.

A stage's two replicas train as one: the pair of ranks holding it are data-parallel replicas of each other (the
engine shards and reduces ZeRO over the data-parallel ranks of both, `replica_group`), so the gradient of a stage is
the sum of what its down and up replicas computed, and both step the same weights.

[Note: Chimera's order]
The order of each rank's forwards and backwards is found by list scheduling on unit-time slots: whenever a rank is
free it runs, of the actions whose inputs have arrived, the one of the oldest micro-batch of its direction (the
k-th of each direction entered at the same time), a backward before a forward of the same age, then the lower
stage. No rule tells the directions apart, so the order of rank p - 1 - r mirrors that of rank r: the same stages
in the same order, each on the other pipeline. That matters: the two replicas of a stage are one ZeRO group, whose
collectives (stage-3 gathers, in forward, backward and recomputation) must come in the same order on both. On unit
slots this reproduces the paper's schedule and its bubble exactly for m a multiple of p (the paper's basic units of
p micro-batches, concatenated), with at most p micro-batches in flight on a rank; `tests/test_pipeline.py` checks
both against the formula. The order is then fixed: the runtime follows it whatever the real durations are
(backward about twice the forward stretches the bubble, which `schedule.simulate` shows for any ratio).

[Note: Chimera's exchanges]
Every link carries both directions' activations and gradients, and a rank does not consume its peers' messages in
the order they send them, so the per-step exchanges of the other schedules can deadlock under NCCL's worst case
(each send waiting for its receive) or mismatch a link's order. Chimera's transfers are grouped in rounds instead:
after slot t of the list schedule, each rank exchanges with its neighbours exactly the messages produced in slot t
(its sends, and the receives of what its neighbours computed in t), received then even if needed later (they wait
in the runtime's inbox). Both ends of a link put a message in the same round, and round t only needs what the
ranks computed by slot t, so by induction on t nothing waits forever and every link's order agrees;
`schedule.programs` replays the result like any other schedule's.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from hetero.parallel.pipeline.schedule import Action, Exchange, Item, Message, transfers

if TYPE_CHECKING:
    from hetero.comm import Comm
    from hetero.parallel.mesh import Mesh


def replica_group(mesh: Mesh, world: Comm) -> Comm:
    """The ranks holding this rank's two stages: its data-parallel group and that of pipeline rank p - 1 - r, at
    the same tensor rank. ZeRO shards and reduces over it ([Note: Chimera's layout]). Every rank calls it."""
    from hetero.parallel.mesh import Mesh

    t, d, p = mesh.tp_size, mesh.dp_size, mesh.pp_size
    parts = [
        [Mesh.rank_of(a, b, c, tensor=t, data=d) for c in (low, p - 1 - low) for b in range(d)]
        for low in range(p // 2)
        for a in range(t)
    ]
    if len(parts) == 1:
        return world
    return world.split(parts)


def check(p: int, m: int) -> None:
    """Raise ValueError unless p and m suit Chimera ([Note: Chimera's layout])."""
    if p < 2 or p % 2:
        raise ValueError(f"chimera needs an even number of pipeline stages >= 2, got {p}")
    if m < p or m % p:
        raise ValueError(
            f"chimera needs micro-batches ({m}) to be a multiple of the pipeline stages ({p}): each direction takes "
            f"half of them, in basic units of {p // 2}"
        )


def chimera(p: int, m: int, rank: int) -> list[Action]:
    """The order of `rank`'s actions ([Note: Chimera's order]); down micro-batches on chunk 0, up ones on chunk 1."""
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is not a pipeline rank of {p}")
    return [a for _, a in _slots(p, m, False)[rank]]


def chimera_programs(p: int, m: int, *, forward: bool = False) -> list[list[Item]]:
    """Every rank's actions with the exchanges of [Note: Chimera's exchanges] between them; `forward`: forwards
    only (evaluation), list-scheduled the same way."""
    slots = _slots(p, m, forward)
    produced: dict[int, list[tuple[int, int, Message]]] = {}  # slot -> (from, to, message) sent after it
    for r in range(p):
        for t, a in slots[r]:
            send = transfers(a, p, r, 1)[1]
            if send is not None:
                produced.setdefault(t, []).append((r, *send))
    end = 1 + max(t for rank in slots for t, _ in rank)
    progs: list[list[Item]] = []
    for r in range(p):
        at = dict(slots[r])
        prog: list[Item] = []
        for t in range(end):
            if t in at:
                prog.append(at[t])
            out = produced.get(t, [])
            sends = tuple(sorted(((to, msg) for src, to, msg in out if src == r), key=lambda x: x[1]))
            recvs = tuple(sorted(((src, msg) for src, to, msg in out if to == r), key=lambda x: x[1]))
            if sends or recvs:
                prog.append(Exchange(sends, recvs))
        progs.append(prog)
    return progs


@functools.lru_cache(maxsize=64)
def _slots(p: int, m: int, forward: bool) -> tuple[tuple[tuple[int, Action], ...], ...]:
    """Per rank, (slot, action) in order: the list schedule of [Note: Chimera's order] on unit-time slots."""
    check(p, m)
    half = m // 2

    def up(mb: int) -> bool:
        return mb >= half

    def rank_of(mb: int, s: int) -> int:
        return p - 1 - s if up(mb) else s

    def action(kind: str, mb: int) -> Action:
        return Action(kind, mb, 1, up=True) if up(mb) else Action(kind, mb)  # type: ignore[arg-type]

    ready: dict[tuple[str, int, int], int] = {("F", mb, 0): 0 for mb in range(m)}  # (kind, mb, stage) -> slot
    clock = [0] * p
    orders: list[list[tuple[int, Action]]] = [[] for _ in range(p)]
    for _ in range(m * p if forward else 2 * m * p):
        best: tuple | None = None
        for (kind, mb, s), at in ready.items():
            r = rank_of(mb, s)
            # earliest start, the oldest micro-batch of its direction, backward first, the lower stage; then the
            # rank, only to order picks on different ranks, which do not affect each other (see the note)
            key = (max(clock[r], at), mb - half if up(mb) else mb, kind != "B", s, r)
            if best is None or key < best[0]:
                best = (key, (kind, mb, s), r)
        assert best is not None
        key, (kind, mb, s), r = best
        del ready[(kind, mb, s)]
        clock[r] = key[0] + 1
        orders[r].append((key[0], action(kind, mb)))
        if kind == "F":
            if s < p - 1 or not forward:
                ready[("F", mb, s + 1) if s < p - 1 else ("B", mb, s)] = clock[r]
        elif s > 0:
            ready[("B", mb, s - 1)] = clock[r]
    return tuple(tuple(o) for o in orders)


def bubble(p: int, m: int) -> float:
    """The paper's idle fraction, (p - 2) / (2m + p - 2)."""
    return (p - 2) / (2 * m + p - 2)
