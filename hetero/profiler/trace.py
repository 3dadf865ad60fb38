"""The profile as a Chrome / Perfetto trace (JSON object format with `traceEvents`; open it in ui.perfetto.dev or
chrome://tracing).

Tracks (threads of one process per rank): the step phases, module forward spans (nested), module backward spans
(async: a module's backward uses of what it saved may interleave with its neighbours'), and one track per tier
pair for chunk moves, one for the gradient collectives (issued to completed) and one for the optimizer's math per
chunk (the delayed update's runs beside forward and backward). Counters: each tier's bytes by chunk kind, the exact
ledger total, activations held, and the process's RSS.
"""

from __future__ import annotations

from typing import Any

_PHASES, _FORWARD, _BACKWARD = 1, 2, 3
_MOVE_TRACKS = 10  # first tid of the move tracks


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def chrome_trace(prof: Any) -> dict[str, Any]:
    pid = prof.engine.data_parallel_rank
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"hetero rank {pid}"}},
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
    tracks: dict[str, int] = {}
    for m in prof.moves:
        pair = f"{m.src}->{m.dst}"
        if pair not in tracks:
            tracks[pair] = _MOVE_TRACKS + len(tracks)
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tracks[pair], "args": {"name": pair}})
        args = {"chunk": m.chunk, "kind": m.kind, "bytes": m.nbytes, "GB/s": m.bandwidth / 1e9, "prefetch": m.prefetch}
        events.append(_span(f"chunk {m.chunk} {m.kind}", "move", m.start, m.end, pid, tracks[pair], args))
    for track, name, start, end in prof.spans:
        if track not in tracks:
            tracks[track] = _MOVE_TRACKS + len(tracks)
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tracks[track], "args": {"name": track}})
        events.append(_span(name, track, start, end, pid, tracks[track], {}))
    for t, tiers in prof.samples:
        for tier, kinds in tiers.items():
            events.append({"ph": "C", "name": f"{tier} by kind", "ts": _us(t), "pid": pid, "args": dict(kinds)})
    for tier, series in prof.series.items():
        for t, used in series:
            events.append({"ph": "C", "name": f"{tier} ledger", "ts": _us(t), "pid": pid, "args": {"bytes": used}})
    for t, held in prof.activation_series:
        events.append({"ph": "C", "name": "activations held", "ts": _us(t), "pid": pid, "args": {"bytes": held}})
    for t, rss in prof.rss_series:
        events.append({"ph": "C", "name": "process RSS", "ts": _us(t), "pid": pid, "args": {"bytes": rss}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"producer": "hetero.profile"}}


def _span(name: str, cat: str, start: float, end: float, pid: int, tid: int, args: dict) -> dict[str, Any]:
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "ts": _us(start),
        "dur": _us(max(end - start, 0.0)),
        "pid": pid,
        "tid": tid,
        "args": args,
    }
