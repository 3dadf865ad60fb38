"""The profile as a Chrome / Perfetto trace (JSON object format with `traceEvents`; open it in ui.perfetto.dev or
chrome://tracing).

Tracks (threads of one process per rank): the step phases, module forward spans (nested), module backward spans
(async: a module's backward uses of what it saved may interleave with its neighbours'), and one track per tier
pair for chunk moves, one for the gradient collectives (issued to completed) and one for the optimizer's math per
chunk (the delayed update's runs beside forward and backward); each of these last as many lanes as its events
overlap (`_Lanes`). Counters: each tier's bytes by chunk kind, the exact
ledger total, activations held, the process's RSS and an async save's host copy. The process is named by the global
rank and its coordinates in the mesh (`hetero rank 3 (dp 1/2, tp 1/2)`).
"""

from __future__ import annotations

from typing import Any

from hetero.checkpoint.host_copy import copy_of

_PHASES, _FORWARD, _BACKWARD = 1, 2, 3
_MOVE_TRACKS = 10  # first tid of the move tracks


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def coordinates(engine: Any) -> dict[str, list[int]]:
    """The rank's place in the job's mesh: {"dp": [rank, size], "tp": ..., "pp": ..., "sp": ...}, the groups of more
    than one rank only (a job of one rank has none). Under torchrun a global rank alone does not say which shard,
    stage or data part a profile is of."""
    mesh = getattr(engine, "mesh", None)
    if mesh is None:
        return {}
    out = {"dp": [mesh.dp_rank, mesh.dp_size], "tp": [mesh.tp_rank, mesh.tp_size], "pp": [mesh.pp_rank, mesh.pp_size]}
    out["sp"] = [mesh.sp.rank, mesh.sp.size]  # the sequence split of dp (Ulysses, ring)
    return {k: v for k, v in out.items() if v[1] > 1}


def coordinates_text(coords: dict[str, list[int]]) -> str:
    """`dp 1/2, tp 0/2` (rank / size in each group), or "" where the job has no groups."""
    return ", ".join(f"{k} {r}/{n}" for k, (r, n) in coords.items())


def chrome_trace(prof: Any) -> dict[str, Any]:
    pid = prof.rank  # the global rank: data-parallel ranks repeat across tensor and pipeline groups
    coords = coordinates(prof.engine)
    where = coordinates_text(coords)
    name = f"hetero rank {pid}" + (f" ({where})" if where else "")
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": _PHASES, "args": {"name": "step phases"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": _FORWARD, "args": {"name": "modules: forward"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": _BACKWARD, "args": {"name": "modules: backward"}},
    ]
    for name, start, end in prof.phases:
        events.append(_span(name, "phase", start, end, pid, _PHASES, {}))
    for t, step in prof.steps:
        events.append({"ph": "i", "name": f"optimizer step {step}", "s": "p", "ts": _us(t), "pid": pid, "tid": 1})
    for i, s in enumerate(prof.modules):
        if s.phase == "forward":
            args = {"saved_bytes": s.saved, "allocated_bytes": s.allocated}
            events.append(_span(s.name, "forward", s.start, s.end, pid, _FORWARD, args))
        else:
            common = {"name": s.name, "cat": "backward", "id": i, "pid": pid, "tid": _BACKWARD}
            events.append({**common, "ph": "b", "ts": _us(s.start), "args": {"released_bytes": s.saved}})
            events.append({**common, "ph": "e", "ts": _us(max(s.end, s.start))})
    lanes = _Lanes(pid, events)
    for m in sorted(prof.moves, key=lambda m: m.start):  # by start: a lane takes the next event that fits
        args = {"chunk": m.chunk, "kind": m.kind, "src": m.src, "dst": m.dst, "bytes": m.nbytes}
        args.update({"GB/s": m.bandwidth / 1e9, "prefetch": m.prefetch})
        tid = lanes.tid(f"{m.src}->{m.dst}", m.start, m.end)
        events.append(_span(f"chunk {m.chunk} {m.kind}", "move", m.start, m.end, pid, tid, args))
    for track, name, start, end in sorted(prof.spans, key=lambda s: s[2]):
        events.append(_span(name, track, start, end, pid, lanes.tid(track, start, end), {}))
    kinds: dict[str, list[str]] = {}  # per tier, every kind it held during the recording
    for _, tiers in prof.samples:
        for tier, held in tiers.items():
            kinds.setdefault(tier, [])
            kinds[tier] += [k for k in held if k not in kinds[tier]]
    for t, tiers in prof.samples:
        for tier, held in tiers.items():
            # Every kind in every event: a counter's series keeps its last value until set again, so a kind that
            # left the tier would stay drawn at what it last held. A tier that never held anything has no counter.
            if kinds[tier]:
                args = {k: held.get(k, 0) for k in kinds[tier]}
                events.append({"ph": "C", "name": f"{tier} by kind", "ts": _us(t), "pid": pid, "args": args})
    for tier, series in prof.series.items():
        for t, used in series:
            events.append({"ph": "C", "name": f"{tier} ledger", "ts": _us(t), "pid": pid, "args": {"bytes": used}})
    for t, held in prof.activation_series:
        events.append({"ph": "C", "name": "activations held", "ts": _us(t), "pid": pid, "args": {"bytes": held}})
    for t, rss in prof.rss_series:
        events.append({"ph": "C", "name": "process RSS", "ts": _us(t), "pid": pid, "args": {"bytes": rss}})
    copy = copy_of(prof.engine)
    if copy is not None:  # an async save's host copy ([Note: the checkpoint copy's memory]): outside the ledgers
        window = copy.window(prof.t0, prof.t0 + prof.duration)
        if any(n for _, n in window):
            for t, held in window:
                events.append({"ph": "C", "name": "checkpoint copy", "ts": _us(t), "pid": pid, "args": {"bytes": held}})
    other = {"producer": "hetero.profile", "rank": pid, "start_unix_s": prof.t0_unix, "coordinates": coords}
    # The summary's counts ([Note: counting micro-batches] in hetero/profiler/micro_batches.py)
    other.update({"optimizer_steps": len(prof.steps), "micro_batches": prof.batches.count})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def merge(traces: list[dict[str, Any]]) -> dict[str, Any]:
    """One trace of several ranks' (`chrome_trace`'s, read back), each rank's times shifted to the earliest start
    on the system clock (`otherData.start_unix_s`), so that their steps and collectives line up in one view. The
    ranks of one node share that clock; across nodes it is as close as their clocks are kept (NTP: milliseconds).
    Each rank is its own process already (pid: the global rank)."""
    starts = []
    for i, t in enumerate(traces):
        start = t.get("otherData", {}).get("start_unix_s")
        if not isinstance(start, (int, float)) or start <= 0:
            raise ValueError(
                f"trace {i} has no start time (otherData.start_unix_s): it was written by an older hetero; "
                "record the ranks again to merge them"
            )
        starts.append(float(start))
    first = min(starts)
    events: list[dict[str, Any]] = []
    for t, start in zip(traces, starts, strict=True):
        shift = _us(start - first)
        for e in t["traceEvents"]:
            events.append({**e, "ts": round(e["ts"] + shift, 3)} if "ts" in e else e)
    ranks = sorted(t.get("otherData", {}).get("rank", i) for i, t in enumerate(traces))
    other = {"producer": "hetero.profile", "ranks": ranks, "start_unix_s": first}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _span(name: str, cat: str, start: float, end: float, pid: int, tid: int, args: dict) -> dict[str, Any]:
    ts = _us(start)
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "ts": ts,
        "dur": round(max(_us(end) - ts, 0.0), 3),  # from the rounded ends: a slice ending with its parent stays in it
        "pid": pid,
        "tid": tid,
        "args": args,
    }


class _Lanes:
    """Threads for a track's complete events: one thread's slices must nest, and moves of one tier pair (or two
    collectives) overlap without nesting, which Perfetto's importer mis-nests or drops. An event goes to the first
    lane of its track free at its start ("host->nvme", "host->nvme (2)", ...); a lane's thread is named when made."""

    def __init__(self, pid: int, events: list[dict[str, Any]]) -> None:
        self.pid = pid
        self.events = events
        self.ends: dict[str, list[tuple[int, float]]] = {}  # track -> its lanes' (tid, end of the last event)
        self.next_tid = _MOVE_TRACKS

    def tid(self, track: str, start: float, end: float) -> int:
        lanes = self.ends.setdefault(track, [])
        for i, (tid, busy_until) in enumerate(lanes):
            if busy_until <= start:
                lanes[i] = (tid, max(end, start))
                return tid
        tid, self.next_tid = self.next_tid, self.next_tid + 1
        name = track if not lanes else f"{track} ({len(lanes) + 1})"
        lanes.append((tid, max(end, start)))
        self.events.append({"ph": "M", "name": "thread_name", "pid": self.pid, "tid": tid, "args": {"name": name}})
        return tid
