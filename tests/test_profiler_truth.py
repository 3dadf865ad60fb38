"""hetero.profile reports what is true, not only what runs: its per-kind bytes against a count of the chunks' own
buffers at the same moments, its bandwidths against the moves' busy time, its trace against the rules Perfetto's
JSON importer applies, and its summary text against its JSON."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import pytest

import hetero
from hetero.memory import ChunkState, Tier
from hetero.profiler.overlap import length, union
from hetero.profiler.recorder import MoveRecord
from hetero.profiler.summary import summary_data, summary_text
from tests.parity import build, make_optimizer
from tests.test_profiler import _train

TIERS = ("device", "host", "nvme")


def _engine(
    tmp_path: Path, *, stage: int = 3, params: str = "device", optimizer: str = "nvme", host_budget: int | None = None
) -> hetero.Engine:
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    config = {
        "zero_stage": stage,
        "chunk_size": 4096,
        "offload": {"params": params, "optimizer": optimizer},
        "memory": {"nvme_dir": str(nvme), "device_budget": 150_000},
    }
    if host_budget is not None:
        config["memory"]["host_budget"] = host_budget
    model = build()
    return hetero.initialize(model, make_optimizer(model), config)


def _chunk_bytes(manager) -> dict[str, int]:
    """Bytes per tier counted from the chunks' own buffers: payloads where they are, the buffer a move in flight
    fills, and the swap copies on NVMe. Independent of the profiler's and the ledgers' arithmetic."""
    out = dict.fromkeys(TIERS, 0)
    for c in manager.chunks:
        if c.on_nvme:
            out["nvme"] += c.nbytes
        if c.state is ChunkState.EMPTY:
            continue
        if c.payload is not None and c.tier is not None and c.tier is not Tier.NVME:
            out[c.tier.label] += c.payload.numel() * c.payload.element_size()
        if c.move is not None and c.move.new_payload is not None:
            out[c.move.dst.label] += c.move.new_payload.numel() * c.move.new_payload.element_size()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "stage,params,optimizer", [(0, "device", "host"), (2, "device", "nvme"), (3, "device", "nvme"), (3, "nvme", "nvme")]
)
def test_bytes_by_kind_match_the_chunks_and_the_ledgers(tmp_path, stage, params, optimizer):
    """Whenever a manager call returns and the profile's last by-kind sample is of the ledgers as they are now, the
    sample's chunk kinds hold exactly the chunks' buffers and its total is the ledger's. A sample taken at a new peak
    inside a call (a buffer taken before its chunk is marked resident) labelled that chunk's bytes "staging" for
    good: the kinds at the peaks, the moments that matter most, were wrong while their totals were right."""
    engine = _engine(tmp_path, stage=stage, params=params, optimizer=optimizer)
    _train(engine, 1)
    checked = []
    with hetero.profile(engine, tmp_path / "prof", plot=False) as prof:
        began: list[float] = []  # when the access under way began, on the profile's clock

        def access() -> None:
            began[:] = [time.perf_counter() - prof.t0]

        def check() -> None:
            if not began:
                return  # not an access: its start is unknown
            start = began.pop()
            when, sample = prof.samples[-1]
            # The chunks counted before and after the ledgers are read: moves run on worker threads, and one that
            # finished in between would set a count of one moment against a sample of another.
            before = _chunk_bytes(engine.manager)
            stats = engine.memory_stats()
            if _chunk_bytes(engine.manager) != before:
                return  # a move ended meanwhile: no one moment to compare
            used = {t: stats[t]["current"] + stats[t]["cached"] for t in TIERS}
            if when < start or {t: sum(sample[t].values()) for t in TIERS} != used:
                return  # no sample of this moment: the last was taken before this access, or the ledgers moved on
            kinds = {t: sum(n for k, n in sample[t].items() if k not in ("cached", "staging")) for t in TIERS}
            checked.append((kinds, before, sample))

        unsubscribe_access = engine.manager.events.subscribe("access", access)
        unsubscribe = engine.manager.events.subscribe("done", check)
        _train(engine, 3)
        unsubscribe()
        unsubscribe_access()
    # The sample taken as the profile stopped (moves finished) is of the ledgers and chunks as they are now.
    stats, last = engine.memory_stats(), prof.samples[-1][1]
    assert {t: sum(last[t].values()) for t in TIERS} == {t: stats[t]["current"] + stats[t]["cached"] for t in TIERS}
    assert {t: sum(n for k, n in last[t].items() if k not in ("cached", "staging")) for t in TIERS} == _chunk_bytes(
        engine.manager
    )
    assert checked or stage == 0  # stage 0's accesses move nothing: its samples are at steps and module boundaries
    wrong = [c for c in checked if c[0] != c[1]]
    assert not wrong, f"{len(wrong)} of {len(checked)} samples mislabel chunk bytes, e.g. {wrong[0]}"
    # Every sample's total is the exact ledger series at its time.
    for t, sample in prof.samples:
        for tier in TIERS:
            at = [u for s, u in prof.series[tier] if s <= t]
            assert sum(sample[tier].values()) == at[-1], (tier, t)
    engine.close()


def _finished_profile(tmp_path: Path, **kwargs) -> tuple[hetero.Engine, hetero.profiler.Profile]:
    engine = _engine(tmp_path, **kwargs)
    _train(engine, 1)
    with hetero.profile(engine, tmp_path / "prof", plot=False) as prof:
        _train(engine, 3)
    return engine, prof


@pytest.mark.timeout(240)
def test_bandwidth_is_bytes_over_the_time_the_pair_was_busy(tmp_path):
    """Moves of one tier pair overlap (two workers, swap I/O queued at once): dividing their bytes by the sum of
    their durations counted the overlapped time twice, and reported a fraction of what the pair achieved."""
    engine, prof = _finished_profile(tmp_path)
    for name, d in summary_data(prof)["moved"].items():
        moves = [m for m in prof.moves if f"{m.src}->{m.dst}" == name]
        busy = length(union((m.start, m.end) for m in moves))
        assert d["bandwidth"] == pytest.approx(d["bytes"] / busy), name
    prof.moves = [
        MoveRecord(1, "optim", "host", "nvme", 1000, 0.0, 1.0, False),
        MoveRecord(2, "optim", "host", "nvme", 1000, 0.0, 1.0, False),  # alongside the first
        MoveRecord(3, "optim", "host", "nvme", 2000, 2.0, 3.0, False),  # after an idle second
    ]
    pair = summary_data(prof)["moved"]["host->nvme"]
    assert pair["bytes"] == 4000 and pair["moves"] == 3
    assert pair["seconds"] == pytest.approx(2.0)  # busy: the union of the moves' intervals
    assert pair["bandwidth"] == pytest.approx(2000.0)
    assert pair["median_bandwidth"] == pytest.approx(1000.0)
    engine.close()


@pytest.mark.timeout(240)
def test_trace_follows_the_trace_event_format(tmp_path):
    """What Perfetto's JSON importer requires: complete events ("X") on one thread nest (moves of one tier pair
    overlap, so they need lanes of their own), a counter's series keep their values until set again (a kind that
    left a tier must be set to 0, or it stays drawn at its last value), counter events carry numeric values, every
    thread used is named, and timestamps run forward per counter."""
    engine, prof = _finished_profile(tmp_path)
    prof.write()
    events = json.loads((tmp_path / "prof" / "trace.json").read_text())["traceEvents"]
    named = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert any(e["ph"] == "M" and e["name"] == "process_name" for e in events)
    slices = defaultdict(list)
    for e in events:
        if e["ph"] in ("X", "i", "b", "e"):
            assert (e["pid"], e["tid"]) in named, e
        if e["ph"] == "X":
            assert e["dur"] >= 0
            # In integer nanoseconds, as Perfetto's importer reads them: ts + dur in floats may land an ulp past
            # the next slice's ts where the two touch (the forward phase ends as the backward begins).
            start_ns = round(e["ts"] * 1000)
            slices[(e["pid"], e["tid"])].append((start_ns, start_ns + round(e["dur"] * 1000), e["name"]))
    for track, spans in slices.items():
        stack: list[tuple[float, float, str]] = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1][1], f"{name} overlaps {stack[-1][2]} on track {track}"
            stack.append((start, end, name))
    series: dict[str, set[str]] = defaultdict(set)
    last: dict[str, float] = {}
    for e in (e for e in events if e["ph"] == "C"):
        assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
        assert series[e["name"]] <= e["args"].keys(), f"{e['name']}: {series[e['name']] - e['args'].keys()} dropped"
        series[e["name"]] |= e["args"].keys()
        assert e["ts"] >= last.get(e["name"], 0.0)
        last[e["name"]] = e["ts"]
    # The move lanes still hold every move, on tracks named for their tier pair.
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    moves = [e for e in events if e.get("cat") == "move"]
    assert len(moves) == len(prof.moves) > 0
    assert all(lanes[e["tid"]].startswith(f"{e['args']['src']}->{e['args']['dst']}") for e in moves)
    engine.close()


@pytest.mark.timeout(240)
def test_summary_text_says_what_the_json_says(tmp_path):
    """The text's numbers are the JSON's. Evictions: the manager counts a clean eviction (no write: the swap copy is
    current) apart from the evictions that moved bytes, so "evictions: N (M clean, no write)" read as N in all, M of
    them clean, where there were N + M."""
    # Parameter shards on NVMe under a tight host budget: shards read back and dropped again unchanged.
    engine, prof = _finished_profile(tmp_path, params="nvme", host_budget=200_000)
    data = summary_data(prof)
    text = summary_text(data)
    assert f"{data['optimizer_steps']} optimizer steps, {data['micro_batches']} micro-batches" in text
    pf = data["prefetch"]
    assert f"prefetch: {pf['hits']} hits, {pf['misses']} misses" in text
    assert f"{pf['started']} prefetches started" in text
    assert data["evictions"] == prof.counters.get("evictions", 0) > 0
    assert data["clean_evictions"] == prof.counters.get("clean_evictions", 0) > 0
    assert f"evictions: {data['evictions']} moved down, and {data['clean_evictions']} clean" in text
    for pair, m in data["moved"].items():
        assert f"in {m['moves']:>5} moves ({m['prefetched']} prefetched)" in text
        assert f"achieved {m['bandwidth'] / 1e9:.2f} GB/s" in text, pair
    engine.close()
