"""How much of the step's communication and I/O ran hidden behind compute: the profile's overlap figures.

[Note: measuring overlap]
Each kind of background work is a set of time intervals on its own track: chunk moves per tier pair (the worker's
copy or swap I/O, from `MoveEvent`), gradient collectives (issued to completed, from the engine's "span" events) and
the optimizer's math per chunk (the update's, or the delayed update's worker). For a track, `busy` is the length of
the union of its intervals. Where the driving thread records how long it blocked on that work (the "<track> waited"
spans: waiting for a collective to complete, for the delayed update's worker), `hidden` is busy minus that blocked
time: a collective issued during backward and complete before anyone waits for it cost the step nothing, one waited
for at the end of backward did, although both lie inside the backward phase. For other tracks (chunk moves, and the
optimizer's math on the driving thread) `hidden` is the part of busy during which compute ran: the union of the
forward and backward phases and the optimizer's math, the optimizer's own track against forward and backward only.
hidden / busy is the share of that work the step did not wait for (1.0: fully overlapped; 0.0: serial).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def intersection(xs: list[Interval], ys: list[Interval]) -> float:
    """Length of the time both disjoint sorted sets cover."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            total += b - a
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap(prof: Any) -> dict[str, dict[str, float]]:
    """Per track: busy seconds, hidden seconds and their ratio; see [Note: measuring overlap]."""
    tracks: dict[str, list[Interval]] = {}
    for m in prof.moves:
        tracks.setdefault(f"move {m.src}->{m.dst}", []).append((m.start, m.end))
    for track, _, start, end in prof.spans:
        tracks.setdefault(track, []).append((start, end))
    passes = union((s, e) for name, s, e in prof.phases if name in ("forward", "backward"))
    optimizer = union(tracks.get("optimizer", []))
    compute = union(passes + optimizer)
    out = {}
    for track, intervals in sorted(tracks.items()):
        if track.endswith(" waited"):
            continue
        busy = union(intervals)
        total = length(busy)
        if f"{track} waited" in tracks:
            hidden = total - intersection(busy, union(tracks[f"{track} waited"]))
        else:
            hidden = intersection(busy, passes if track == "optimizer" else compute)
        out[track] = {"busy_s": total, "hidden_s": hidden, "hidden_fraction": hidden / total if total else 0.0}
    return out
