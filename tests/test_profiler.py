"""hetero.profile: what it records agrees with the engine's own accounting, its outputs are valid, it leaves nothing
installed behind, and tools/memprof.py profiles an example script it has never seen."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import hetero
from hetero.profiler.activations import SavedBytes, storage_key
from tests.dist import ONLY_SEVERAL, ranks_apart, run_distributed
from tests.parity import batches, build, make_optimizer

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("device", "host", "nvme")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _engine(tmp_path: Path) -> hetero.Engine:
    """Stage 3 with optimizer states on NVMe, under a device budget that makes
    chunks move every step."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    config = {
        "zero_stage": 3,
        "chunk_size": 4096,
        "offload": {"params": "device", "optimizer": "nvme"},
        "memory": {"nvme_dir": str(nvme), "device_budget": 150_000},
    }
    model = build()
    return hetero.initialize(model, make_optimizer(model), config)


def _train(engine: hetero.Engine, steps: int) -> None:
    for x, y in batches(steps, 2):
        engine.backward(engine(x, labels=y).loss)
        engine.step()


def _installed(engine: hetero.Engine) -> dict:
    """Everything a profile could leave behind."""
    return {
        "ledger observers": [len(ledger.observers) for ledger in engine.manager.ledgers.values()],
        "engine subscribers": [engine.events.has(n) for n in ("backward_end", "update_end", "close")],
        "manager subscribers": [engine.manager.events.has(n) for n in ("move", "done")],
        "module hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in engine.module.modules()),
    }


@pytest.mark.timeout(240)
def test_profile_records_what_the_engine_accounts(tmp_path):
    engine = _engine(tmp_path)
    _train(engine, 1)  # the trace is recorded: later steps prefetch
    before = _installed(engine)
    out = tmp_path / "prof"
    with hetero.profile(engine, out) as prof:
        # Entering waits for the moves in flight: the window starts here.
        moved0 = dict(engine.memory_stats()["moved"])
        counters0 = dict(engine.manager.counters)
        _train(engine, 3)
    stats = engine.memory_stats()
    counters = {k: v - counters0.get(k, 0) for k, v in engine.manager.counters.items()}

    # Nothing stays installed: a run that is not profiled pays nothing.
    assert _installed(engine) == before
    recorded = (len(prof.activation_series), len(prof.moves), len(prof.samples))
    _train(engine, 1)
    assert (len(prof.activation_series), len(prof.moves), len(prof.samples)) == recorded

    summary = json.loads((out / "summary.json").read_text())
    assert summary["optimizer_steps"] == 3 and summary["micro_steps"] == 3
    for tier in TIERS:
        peak = summary["peaks"][tier]
        # The summary's peaks are the ledgers' (reset on entry), and the recorded series reaches exactly them.
        assert peak["bytes"] == stats[tier]["peak"] == peak["recorded"], tier
        assert sum(n for _, _, n in prof.peaks[tier].holders) == peak["bytes"], tier
    assert stats["device"]["peak"] <= 150_000
    # Bytes moved per tier pair: exactly what the manager counted over the window.
    moved = {pair: n - moved0.get(pair, 0) for pair, n in stats["moved"].items() if n - moved0.get(pair, 0)}
    assert {pair: d["bytes"] for pair, d in summary["moved"].items()} == moved
    assert {"host->nvme", "nvme->host", "device->host"} <= moved.keys()
    assert all(d["bandwidth"] > 0 for d in summary["moved"].values())
    pf = summary["prefetch"]
    assert (pf["hits"], pf["misses"]) == (counters.get("prefetch_hits", 0), counters.get("prefetch_misses", 0))
    assert pf["hits"] > 0 and pf["hit_rate"] == pytest.approx(pf["hits"] / (pf["hits"] + pf["misses"]))
    assert summary["evictions"] == counters["evictions"] > 0

    # Activations per module: the root's forward saved what a plain meter counts on the same forward.
    acts = summary["activations"]["forward"]
    meter = SavedBytes(exclude={storage_key(p) for p in engine.module.parameters()})
    x, y = batches(1, 2)[0]
    with meter.active():
        loss = engine(x, labels=y).loss
    engine.backward(loss)
    engine.step()
    assert acts["GPT"]["saved_per_call"] == meter.total > 0
    assert acts["layers.0"]["saved_per_call"] < acts["GPT"]["saved_per_call"]
    assert summary["activations"]["peak_held"] == meter.total
    assert sum(summary["activations"]["backward_released"].values()) > 0

    text = (out / "summary.txt").read_text()
    for needle in ("peak per tier", "process RSS", "top holders", "bytes moved", "prefetch:", "hit rate", "GB/s"):
        assert needle in text
    assert (out / "timeline.png").read_bytes()[:8] == PNG_MAGIC

    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"]
    for e in events:
        assert {"ph", "name", "pid"} <= e.keys()
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0 and "tid" in e
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"modules: forward", "modules: backward", "host->nvme", "nvme->host"} <= names
    assert sum(1 for e in events if e.get("cat") == "move") == len(prof.moves) > 0
    assert any(e["ph"] == "X" and e.get("cat") == "forward" and e["name"] == "layers.1.mlp" for e in events)
    assert {e["name"] for e in events if e["ph"] == "C"} >= {
        "device ledger",
        "host by kind",
        "activations held",
        "process RSS",
    }
    engine.close()


@pytest.mark.timeout(240)
def test_the_process_rss_peak_is_found_where_it_happens(tmp_path):
    """The ledgers count hetero's buffers only ([Note: what the ledgers do not see] in hetero/profiler/rss.py): the
    profile samples the process's RSS too and names the phase and module of its peak. A module that holds 256 MiB of
    its own for 200 ms in its forward makes that peak."""
    import time

    import torch

    engine = _engine(tmp_path)
    _train(engine, 1)
    held = 256 << 20

    def hog(module, args, out):
        buf = torch.ones(held // 4)  # written: every page resident
        time.sleep(0.2)  # the sampler reads every 5 ms; a loaded machine may delay it
        del buf

    handle = engine.module.get_submodule("layers.1.mlp").register_forward_hook(hog)
    out = tmp_path / "prof"
    with hetero.profile(engine, out) as prof:
        _train(engine, 2)
    handle.remove()
    rss = json.loads((out / "summary.json").read_text())["process_rss"]
    assert rss["where"] == "forward of layers.1.mlp", rss
    assert rss["peak_bytes"] >= rss["first_bytes"] + held * 3 // 4
    assert rss["samples"] == len(prof.rss_series) >= 20
    # On a CPU device the device tier is host memory too (the stand-in's is not).
    assert rss["ledger_tiers"] == (["host"] if engine.device.separate_memory else ["device", "host"])
    assert 0 <= rss["ledgers_at_peak"] < rss["peak_bytes"] - held
    # The RSS peak in parts that add up: the hog's buffer is none of hetero's and no activation, so it is unaccounted.
    parts = ("ledgers_at_peak", "activations_at_peak", "outside_ledgers_before", "unaccounted_at_peak")
    assert sum(rss[k] for k in parts) == rss["peak_bytes"]
    assert rss["unaccounted_at_peak"] >= held * 3 // 4 and rss["outside_ledgers_before"] > 0
    assert (rss["activations_at_peak"] > 0) == (not engine.device.separate_memory)  # mid-forward; in host memory
    assert "process RSS" in (out / "summary.txt").read_text()
    engine.close()


@pytest.mark.timeout(120)
def test_close_inside_the_profile_and_max_steps(tmp_path):
    engine = _engine(tmp_path)
    with hetero.profile(engine, tmp_path / "a", max_steps=2) as prof:
        _train(engine, 3)
        assert prof.finished and len(prof.steps) == 2  # stopped by itself after 2 optimizer steps
    (tmp_path / "b").mkdir()
    engine2 = _engine(tmp_path / "b")
    with hetero.profile(engine2, tmp_path / "c", plot=False) as prof2:
        _train(engine2, 1)
        engine2.close()  # stops the profile first, while the ledgers still hold the run's bytes
        assert prof2.finished
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["peaks"]["device"]["bytes"] > 0
    assert not (tmp_path / "c" / "timeline.png").exists()
    with pytest.raises(RuntimeError, match="one window"):
        prof.start()
    engine.close()


@pytest.mark.timeout(120)
def test_an_unwritable_out_dir_stops_the_profile_before_it_records(tmp_path, caplog):
    """The outputs are written when the window ends, from inside engine.step under max_steps: a folder that cannot
    take them is an error when the profile starts, and one that fails at the end loses the profile, not the run."""
    engine = _engine(tmp_path)
    before = _installed(engine)
    (tmp_path / "file").write_text("")
    with pytest.raises(hetero.ConfigError, match="cannot write there"):
        hetero.profile(engine, tmp_path / "file" / "prof").start()
    assert _installed(engine) == before
    out = tmp_path / "prof"
    prof = hetero.profile(engine, out, max_steps=1, plot=False)
    prof.start()
    out.rmdir()
    out.write_text("")  # the folder went away during the window: writing fails in the step that ends it
    _train(engine, 2)  # the training goes on
    assert prof.finished and _installed(engine) == before
    assert any("could not be written" in r.getMessage() for r in caplog.records)
    engine.close()


def _profile_rank(rank: int, world: int, root: str) -> dict:
    engine = _engine(Path(root) / f"rank{rank}")
    # One folder given on every rank, as a script run under torchrun gives it: each rank writes its own under it.
    with hetero.profile(engine, Path(root) / "prof", plot=False) as prof:
        _train(engine, 2)
    stats = engine.memory_stats()
    engine.close()
    assert prof.out_dir == Path(root) / "prof" / f"rank{rank}"
    summary = json.loads((prof.out_dir / "summary.json").read_text())
    pids = {e["pid"] for e in json.loads((prof.out_dir / "trace.json").read_text())["traceEvents"]}
    # Tensor-parallel ranks: one data-parallel rank each; the summary still counts the job's ranks.
    from hetero.models.gpt_pipe import TP_PLAN
    from tests import pipe_parity

    model = pipe_parity.build()
    config = {"zero_stage": 1, "chunk_size": 4096, "parallel": {"tensor": 2, "tensor_plan": TP_PLAN}}
    tp = hetero.initialize(model, make_optimizer(model), config)
    with hetero.profile(tp, Path(root) / "tp", plot=False) as tp_prof:
        _train(tp, 1)
    tp.close()
    tp_summary = json.loads((tp_prof.out_dir / "summary.json").read_text())
    return {
        "peaks": {t: (summary["peaks"][t]["bytes"], stats[t]["peak"]) for t in TIERS},
        "pids": pids,
        "rank": summary["rank"],
        "world": summary["world_size"],
        "tp": (tp_summary["rank"], tp_summary["world_size"], tp_summary.get("data_parallel_size")),
        "tp_text": (tp_prof.out_dir / "summary.txt").read_text().splitlines()[0],
    }


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(300)
def test_profile_on_two_ranks(tmp_path):
    for r in range(2):
        (tmp_path / f"rank{r}").mkdir()
    results = run_distributed(_profile_rank, 2, str(tmp_path), timeout=240)
    for rank, res in enumerate(results):
        assert (res["rank"], res["world"], res["pids"]) == (rank, 2, {rank})
        assert res["tp"] == (rank, 2, 1) and f"(rank {rank} of 2)" in res["tp_text"], res
        assert all(ours == theirs > 0 for ours, theirs in res["peaks"].values()), res
    # The ranks' traces merged into one, each rank's times shifted by its start on the shared clock.
    prof = tmp_path / "prof"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "merge_traces.py"), str(prof)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    each = [json.loads((prof / f"rank{r}" / "trace.json").read_text()) for r in range(2)]
    merged = json.loads((prof / "trace.json").read_text())
    assert len(merged["traceEvents"]) == sum(len(t["traceEvents"]) for t in each)
    starts = [t["otherData"]["start_unix_s"] for t in each]
    assert merged["otherData"]["ranks"] == [0, 1] and merged["otherData"]["start_unix_s"] == min(starts)
    for r, t in enumerate(each):
        shift = (starts[r] - min(starts)) * 1e6
        theirs = [e["ts"] for e in t["traceEvents"] if "ts" in e]
        ours = [e["ts"] for e in merged["traceEvents"] if "ts" in e and e["pid"] == r]
        assert ours == pytest.approx([ts + shift for ts in theirs], abs=0.002)


def test_merging_traces_needs_their_start_times(tmp_path):
    from hetero.profiler.trace import merge

    def trace(rank, start):
        other = {"producer": "hetero.profile", "rank": rank, "start_unix_s": start}
        return {"traceEvents": [{"ph": "M", "name": "process_name", "pid": rank},
                                {"ph": "X", "name": "forward", "ts": 10.0, "dur": 5.0, "pid": rank}],
                "otherData": other}  # fmt: skip

    merged = merge([trace(1, 100.5), trace(0, 100.0)])
    assert [e["ts"] for e in merged["traceEvents"] if "ts" in e] == [500010.0, 10.0]
    assert merged["otherData"]["ranks"] == [0, 1]
    old = trace(0, 100.0)
    del old["otherData"]["start_unix_s"]
    with pytest.raises(ValueError, match="older hetero"):
        merge([old])
    tool = str(ROOT / "tools" / "merge_traces.py")
    proc = subprocess.run([sys.executable, tool, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "no rank*/trace.json" in proc.stderr


@pytest.mark.timeout(300)
def test_memprof_runs_an_unmodified_example(tmp_path):
    out, nvme = tmp_path / "prof", tmp_path / "nvme"
    nvme.mkdir()
    script = ["python", str(ROOT / "examples" / "train_gpt.py"), "--steps", "3", "--batch-size", "2"]
    script += ["--sample-tokens", "4", "--nvme-dir", str(nvme), "--json"]
    cmd = [sys.executable, str(ROOT / "tools" / "memprof.py"), "--out", str(out), "--steps", "2", "--", *script]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # the script ran on to its own end
    assert result["steps"] == 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["optimizer_steps"] == 2
    assert summary["moved"]["host->nvme"]["bytes"] > 0
    assert "traceEvents" in json.loads((out / "trace.json").read_text())
    assert (out / "timeline.png").read_bytes()[:8] == PNG_MAGIC
    assert list(nvme.iterdir()) == []  # the script's own cleanup still ran


def test_memprof_usage_errors(tmp_path):
    tool = str(ROOT / "tools" / "memprof.py")
    proc = subprocess.run([sys.executable, tool, "--steps", "2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr
    # A folder that exists but takes no files (root may write anywhere else): refused before the script runs.
    script = tmp_path / "script.py"
    script.write_text("print('ran')")
    if Path("/proc/self").is_dir():
        cmd = [sys.executable, tool, "--out", "/proc/self", "--", "python", str(script)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "cannot write there" in proc.stderr and "ran" not in proc.stdout


def test_estimate_cli(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=128, n_positions=64).to_json_file(str(path))
    tool = str(ROOT / "tools" / "estimate.py")
    args = ["--zero-stage", "3", "--world-size", "8", "--device-memory", "16GiB", "--host-memory", "64GiB"]
    proc = subprocess.run(
        [sys.executable, tool, "--hf-config", str(path), *args, "--json"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["world_size"] == 8 and d["config"]["zero_stage"] == 3 and d["fits"] is True
    assert d["recommendation"]["zero_stage"] == 0  # a tiny model fits plain data parallel
    proc = subprocess.run(
        [sys.executable, tool, "--params", "13e9", "--world-size", "8"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "recommended" in proc.stdout and "device" in proc.stdout


def test_estimate_cli_params_host_bytes(tmp_path):
    """--params-host-bytes moves that many bytes of parameter shards from the NVMe tier to the host in the estimate
    ([Note: parameter shards kept on the host])."""
    tool = str(ROOT / "tools" / "estimate.py")
    base = ["--params", "2e8", "--zero-stage", "3", "--offload-params", "nvme", "--offload-optimizer", "nvme"]
    base += ["--nvme-dir", str(tmp_path), "--precision", "bf16", "--device-memory", "16GiB", "--host-memory", "64GiB"]
    out = {}
    for kept in ("0", "128MiB"):
        proc = subprocess.run(
            [sys.executable, tool, *base, "--params-host-bytes", kept, "--nvme-space", "1TiB", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        out[kept] = json.loads(proc.stdout)["resident"]
    moved = out["128MiB"]["host"]["parameters"] - out["0"]["host"]["parameters"]
    assert 0 < moved <= 128 << 20  # whole shards, as many as fit
    assert out["0"]["nvme"]["parameters"] - out["128MiB"]["nvme"]["parameters"] == moved
