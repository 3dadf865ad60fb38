"""The profile's summary: peaks per tier and who held them, bytes moved and bandwidths, prefetch hit rate,
activation memory per module. `summary_data` for machines (summary.json), `summary_text` for people."""

from __future__ import annotations

import statistics
from typing import Any

from hetero.checkpoint.host_copy import copy_of
from hetero.config import format_size
from hetero.profiler.overlap import length, overlap, union
from hetero.profiler.recorder import job_of
from hetero.profiler.rss import rss_summary, value_at
from hetero.profiler.trace import coordinates, coordinates_text

TOP = 10  # holders and modules listed


def summary_data(prof: Any) -> dict[str, Any]:
    stats = prof.stats
    peaks: dict[str, Any] = {}
    for tier, peak in prof.peaks.items():
        series = prof.series[tier]
        kinds: dict[str, int] = {}
        for _, kind, n in peak.holders:
            kinds[kind] = kinds.get(kind, 0) + n
        peaks[tier] = {
            "bytes": stats[tier]["peak"],  # the ledger's own peak over the window (reset on entry)
            "recorded": max((u for _, u in series), default=0),  # the maximum of the recorded series: the same
            "budget": stats[tier]["budget"],
            "time": peak.time,
            "where": peak.where,
            "holders": [{"holder": h, "kind": k, "bytes": n} for h, k, n in peak.holders[:TOP]],
            "by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        }
    moved: dict[str, Any] = {}
    spans: dict[str, list[tuple[float, float]]] = {}
    for m in prof.moves:
        pair = f"{m.src}->{m.dst}"
        d = moved.setdefault(pair, {"bytes": 0, "moves": 0, "seconds": 0.0, "prefetched": 0, "_bw": []})
        d["bytes"] += m.nbytes
        d["moves"] += 1
        d["prefetched"] += int(m.prefetch)
        d["_bw"].append(m.bandwidth)
        spans.setdefault(pair, []).append((m.start, m.start + m.seconds))
    for pair, d in moved.items():
        # Moves of one pair overlap (two workers, swap I/O queued at once): the pair was busy for the union of
        # their intervals, and the sum of their durations counted the overlapped time more than once.
        d["seconds"] = length(union(spans[pair]))
        d["bandwidth"] = d["bytes"] / d["seconds"] if d["seconds"] else 0.0  # bytes per second the pair was busy
        d["median_bandwidth"] = statistics.median(d.pop("_bw"))
    rss, copy = rss_summary(prof), _checkpoint_copy(prof)
    if copy is not None:
        series = copy.pop("series")
        if rss is not None:  # named at the RSS peak, no longer unaccounted
            rss["checkpoint_copy_at_peak"] = value_at(series, rss["time"])
            rss["unaccounted_at_peak"] -= rss["checkpoint_copy_at_peak"]
    c = prof.counters
    hits, misses = c.get("prefetch_hits", 0), c.get("prefetch_misses", 0)
    forward: dict[str, dict[str, float]] = {}
    backward: dict[str, int] = {}
    for s in prof.modules:
        if s.phase == "forward":
            d = forward.setdefault(s.name, {"calls": 0, "saved": 0, "allocated": 0, "seconds": 0.0})
            d["calls"] += 1
            d["saved"] += s.saved
            d["allocated"] += s.allocated
            d["seconds"] += s.end - s.start
        else:
            backward[s.name] = backward.get(s.name, 0) + s.saved
    per_call = {
        n: {"saved_per_call": d["saved"] // d["calls"], "allocated_per_call": d["allocated"] // d["calls"], **d}
        for n, d in forward.items()
    }
    return {
        "seconds": prof.duration,
        "micro_steps": prof.batches.steps,  # engine.step() calls: one per train_batch
        "micro_batches": prof.batches.count,  # [Note: counting micro-batches] in hetero/profiler/micro_batches.py
        "optimizer_steps": len(prof.steps),
        "rank": prof.rank,  # the global rank: of the job's ranks, not of the data-parallel group
        "world_size": job_of(prof.engine).size,
        "data_parallel_size": prof.engine.data_parallel_size,
        "coordinates": coordinates(prof.engine),  # {"dp": [rank, size], "tp": ..., "pp": ...}, groups of 2 or more
        "peaks": peaks,
        "process_rss": rss,  # [Note: what the ledgers do not see]
        "checkpoint_copy": copy,  # an async save's host copy over the window, outside the ledgers
        "moved": moved,
        "prefetch": {
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "started": c.get("prefetches", 0),
        },
        "overlap": overlap(prof),
        "evictions": c.get("evictions", 0),
        "clean_evictions": c.get("clean_evictions", 0),
        "released": c.get("released", 0),
        "accesses": c.get("accesses", 0),
        # Weights split into tiles, which their layers compute on one tile at a time ([Note: computing on tiles]).
        "tiled": stats.get("tiled", {}),
        "activations": {
            "peak_held": max((n for _, n in prof.activation_series), default=0),
            "forward": dict(sorted(per_call.items(), key=lambda kv: -kv[1]["saved_per_call"])),
            "backward_released": dict(sorted(backward.items(), key=lambda kv: -kv[1])),
        },
    }


def _checkpoint_copy(prof: Any) -> dict[str, Any] | None:
    """The host memory async saves' copies held over the window ([Note: the checkpoint copy's memory]); None where
    none was held."""
    account = copy_of(prof.engine)
    if account is None:
        return None
    series = account.window(prof.t0, prof.t0 + prof.duration)
    peak_t, peak = max(series, key=lambda e: e[1])
    if not peak:
        return None
    return {"peak_bytes": peak, "time": peak_t, "series": series}


def summary_text(d: dict[str, Any]) -> str:
    where = coordinates_text(d.get("coordinates", {}))
    lines = [
        f"hetero memory profile: {counted(d['optimizer_steps'], 'optimizer step')}, "
        f"{counted(d['micro_batches'], 'micro-batch', 'micro-batches')}, "
        f"{d['seconds']:.3f} s recorded (rank {d['rank']} of {d['world_size']})" + (f" at {where}" if where else ""),
        "",
        "peak per tier (the tier ledgers' peaks over the recording, as engine.memory_stats() reports them):",
    ]
    for tier, p in d["peaks"].items():
        budget = format_size(p["budget"]) if p["budget"] else "-"
        lines.append(
            f"  {tier:<7}{format_size(p['bytes']):>12} of {budget:>11} budget   at {p['time']:.4f} s, {p['where']}"
        )
    rss = d.get("process_rss")
    if rss:
        tiers = " and ".join(rss["ledger_tiers"])
        lines += [
            f"  process RSS {format_size(rss['peak_bytes']):>8} (sampled every {1e3 * rss['interval']:.0f} ms)"
            f"   at {rss['time']:.4f} s, {rss['where']}: hetero's {tiers} ledgers held "
            f"{format_size(rss['ledgers_at_peak'])}, the rest {format_size(rss['outside_ledgers_at_peak'])}: "
            f"activations {format_size(rss['activations_at_peak'])}, "
            + (
                f"an async save's host copy {format_size(rss['checkpoint_copy_at_peak'])}, "
                if rss.get("checkpoint_copy_at_peak")
                else ""
            )
            + "held before the profile began "
            f"{format_size(rss['outside_ledgers_before'])} (the runtime, libraries, data), unaccounted "
            f"{_signed(rss['unaccounted_at_peak'])} (operators' temporaries, the C heap, threads' stacks, allocations "
            "since)",
        ]
    copy = d.get("checkpoint_copy")
    if copy:
        lines.append(
            f"  checkpoint copy {format_size(copy['peak_bytes']):>8} at {copy['time']:.4f} s: an async save's copy in "
            "host memory while its files were written, outside the tier budgets "
            '(engine.memory_stats()["host"]["checkpoint_copy"])'
        )
    for tier, p in d["peaks"].items():
        if not p["bytes"]:
            continue
        lines.append(f"\ntop holders at the {tier} peak ({format_size(p['bytes'])}):")
        for h in p["holders"]:
            lines.append(f"  {format_size(h['bytes']):>12}  {h['kind']:<10} {h['holder']}")
        kinds = ", ".join(f"{k} {format_size(n)}" for k, n in p["by_kind"].items())
        lines.append(f"  by kind: {kinds}")
    lines.append("\nbytes moved per tier pair:")
    if not d["moved"]:
        lines.append("  (nothing moved)")
    for pair, m in sorted(d["moved"].items()):
        lines.append(
            f"  {pair:<14}{format_size(m['bytes']):>12} in {m['moves']:>5} moves ({m['prefetched']} prefetched), "
            f"achieved {m['bandwidth'] / 1e9:.2f} GB/s (median move {m['median_bandwidth'] / 1e9:.2f} GB/s)"
        )
    if d["overlap"]:
        lines.append("\noverlap with compute (share of each kind of background work the step did not wait for):")
    for track, o in d["overlap"].items():
        against = "forward and backward" if track == "optimizer" else "compute"
        lines.append(
            f"  {track:<22}{o['busy_s']:9.3f} s busy, {o['hidden_s']:9.3f} s hidden behind {against} "
            f"({100 * o['hidden_fraction']:.0f}%)"
        )
    pf = d["prefetch"]
    rate = f"{100 * pf['hit_rate']:.1f}%" if pf["hit_rate"] is not None else "n/a (no misses or hits)"
    lines += [
        "",
        f"prefetch: {pf['hits']} hits, {pf['misses']} misses, hit rate {rate}; {pf['started']} prefetches started",
        # The manager counts clean evictions apart from the others: "N (M clean)" read as M of N.
        f"evictions: {d['evictions']} moved down, and {d['clean_evictions']} clean (the swap copy was current: no "
        f"write); {d['released']} chunks released instead; {d['accesses']} accesses",
    ]
    if d.get("tiled"):
        n = len(d["tiled"])
        lines.append(f"\nweights computed on tile by tile ({n}: larger than a chunk, chosen by the budgets):")
        for name, t in list(d["tiled"].items())[:TOP]:
            where = ", ".join(t["modules"]) or "(no module)"
            size = format_size(t["tile_bytes"])
            lines.append(f"  {name} {tuple(t['shape'])}: {t['tiles']} tiles of at most {size}, in {where}")
        if len(d["tiled"]) > TOP:
            lines.append(f"  ... and {len(d['tiled']) - TOP} more")
    lines += [
        "",
        f"activations (saved for backward; peak held {format_size(d['activations']['peak_held'])}), "
        f"per module and forward call, with its children:",
    ]
    for name, a in list(d["activations"]["forward"].items())[:TOP]:
        extra = f", allocated {format_size(a['allocated_per_call'])}" if a["allocated_per_call"] else ""
        lines.append(f"  {format_size(a['saved_per_call']):>12}  {name} ({int(a['calls'])} calls{extra})")
    return "\n".join(lines) + "\n"


def counted(n: int, one: str, many: str | None = None) -> str:
    """`1 optimizer step`, `2 optimizer steps`."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _signed(n: int) -> str:
    """A byte count that can be negative (memory returned to the system since the window opened)."""
    return format_size(n) if n >= 0 else f"-{format_size(-n)}"
