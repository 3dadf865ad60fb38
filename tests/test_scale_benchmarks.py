"""The two scale benchmarks run end to end on tiny settings (their real sizes need minutes, or a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A benchmark's children each import torch and transformers (6-7 CPU-seconds) and run a tiny model. Two tests at a
# time (`pytest -n 2`) beside a test of 8 or 16 ranks, under the stand-in (HETERO_STANDIN=1), a run took up to three
# times as long as alone: the gpu_race dry run 157 s of the 170 s it was given. Room for that, and more.
LIMIT_S = 400


def _run(args: list[str], timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, *args, "--json"], capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(LIMIT_S + 20)
def test_gpu_scale_dry_run(tmp_path):
    r = _run([os.path.join(ROOT, "benchmarks/gpu_scale.py"), "--dry-run", "--nvme-dir", str(tmp_path)], LIMIT_S)
    assert r["largest"] is not None and r["largest"]["params"] <= r["machine_limit_params"]
    assert r["largest"]["mfu"] > 0 and set(r["multiples"]) == {"1x", "2x", "4x"}


@pytest.mark.timeout(LIMIT_S + 20)
@pytest.mark.parametrize("in_backward", [False, True], ids=["after-backward", "in-backward"])
def test_bigger_than_ram_tiny(tmp_path, in_backward):
    r = _run(
        [
            os.path.join(ROOT, "benchmarks/bigger_than_ram.py"),
            "--update-in-backward" if in_backward else "--no-update-in-backward",
            *("--layers", "4", "--hidden", "128", "--intermediate", "256", "--heads", "2", "--vocab", "1024"),
            *("--host-budget", "4MiB", "--device-budget", "4MiB", "--chunk-numel", "131072", "--steps", "2"),
            *("--raw-size", "32MiB", "--nvme-dir", str(tmp_path), "--no-reference"),
        ],
        LIMIT_S,
    )
    assert r["states_bytes"] > 3 * r["host_budget"]
    assert r["host_peak"] <= r["host_budget"] and r["device_peak"] <= r["device_budget"]
    assert r["steps"][-1]["nvme_read_bytes"] > 0 and r["io_lower_bound_s"] > 0
    assert r["update_in_backward"] is in_backward
    if in_backward:  # the update ran inside backward: what is left after it is counting
        assert all(s["update_s"] < s["fwd_bwd_s"] / 10 for s in r["steps"])


@pytest.mark.timeout(LIMIT_S + 20)
@pytest.mark.parametrize(
    "only,races",
    [
        ("plain,fsdp2,hetero", {"vs_fsdp2", "vs_plain"}),
        ("plain,fsdp2_offload,hetero_offload,hetero_nvme", {"vs_fsdp2_offload"}),
    ],
    ids=["device", "offload"],
)
def test_gpu_race_dry_run(tmp_path, only, races):
    """Every engine of the GPU race trains the tiny Llama on the CPU to plain PyTorch's loss, and the profile writes
    its tables (with the host-side waits) and a trace. In two halves, each with plain PyTorch's reference: six
    children of 10 s each, one after the other, ran close to the test's limit under load."""
    prof = tmp_path / "prof"
    args = ["--dry-run", "--only", only, "--nvme-dir", str(tmp_path), "--steps", "2"]
    if "hetero_offload" in only:
        args += ["--profile", str(prof), "--profile-only", "hetero_offload"]
    r = _run([os.path.join(ROOT, "benchmarks/gpu_race.py"), *args], LIMIT_S)
    assert set(r["configs"]) == set(only.split(","))
    for name, c in r["configs"].items():
        assert "error" not in c, (name, c.get("log_tail"))
        assert c["loss_agrees"], (name, c["losses"], r["configs"]["plain"]["losses"])
    assert races <= set(r["races"])
    if "hetero_offload" in only:
        assert (prof / "hetero_offload_ops.txt").read_text().count("aten::") > 0
        assert (prof / "hetero_offload_trace.json.gz").stat().st_size > 0


@pytest.mark.timeout(LIMIT_S + 20)
def test_host_overhead_tiny():
    """Plain PyTorch, FSDP2 and hetero at stages 0 and 3 train the same tiny Llama to the same loss, and the JSON
    gives each one's overhead over plain PyTorch."""
    args = ["--layers", "2", "--steps", "2", "--warmup", "1", "--rounds", "1", "--stages", "0,3"]
    r = _run([os.path.join(ROOT, "benchmarks/host_overhead.py"), *args], LIMIT_S)
    rows = r["configurations"]
    assert set(rows) == {"plain", "fsdp2", "hetero_s0", "hetero_s3"}
    for name, row in rows.items():
        assert abs(row["last_loss"] - rows["plain"]["last_loss"]) < 1e-4, (name, row)
        assert row["median_step_s"] > 0 and "overhead_s" in row
    assert "vs_fsdp2" in rows["hetero_s3"]


@pytest.mark.timeout(LIMIT_S + 20)
def test_update_stream_tiny(tmp_path):
    """The four runs (the math on or off, writes first or reads always first) stream the same states through NVMe,
    and the JSON gives each one's update time, host peak and the ratios of the default order over reads first."""
    args = ["--layers", "2", "--hidden", "128", "--intermediate", "256", "--vocab", "256", "--rounds", "1"]
    r = _run(
        [os.path.join(ROOT, "benchmarks/update_stream.py"), *args, "--steps", "1", "--nvme-dir", str(tmp_path)], LIMIT_S
    )
    assert set(r["best"]) == {"cpu:auto", "cpu:none", "none:auto", "none:none"}
    states = {b["states_gb"] for b in r["best"].values()}
    assert len(states) == 1 and states.pop() > 0
    for b in r["best"].values():
        assert b["drained_s"] >= b["update_s"] > 0 and b["gb_per_s"] > 0 and b["host_peak_gb"] > 0
    assert set(r["auto_over_none"]) == {"cpu", "none"}


@pytest.mark.timeout(LIMIT_S + 20)
def test_update_stream_whole_step_tiny(tmp_path):
    """--whole-step times unsynchronised steps (the parameters streamed from NVMe too, the update delayed) for the
    default order and a numeric backlog; each step holds its forward, backward and update."""
    args = ["--layers", "2", "--hidden", "128", "--intermediate", "256", "--vocab", "256", "--rounds", "1"]
    args += ["--whole-step", "--delayed", "--params-host-gb", "0.0001", "--precision", "fp32", "--math", "cpu"]
    r = _run(
        [os.path.join(ROOT, "benchmarks/update_stream.py"), *args, "--backlog", "auto,8", "--steps", "1"]
        + ["--nvme-dir", str(tmp_path)],
        LIMIT_S,
    )
    assert set(r["best"]) == {"cpu:auto", "cpu:8"} and r["whole_step"] and r["delayed"]
    for b in r["best"].values():
        assert b["step_s"] >= b["fwd_bwd_s"] > 0 and b["update_s"] > 0 and b["host_peak_gb"] > 0


def test_gpu_race_rounds_alternate_the_order_and_keep_the_fastest_step(monkeypatch, capsys):
    """--rounds R runs every configuration R times, every other round in reverse (one H200 stepped a configuration
    1.35x slower right after DeepSpeed's NVMe run on the same disk); each keeps its fastest round's step and the
    highest peak RSS of its rounds, peers and hetero alike."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import gpu_race

    calls, steps = [], {"plain": [2.0, 1.0], "hetero": [1.5, 1.8]}
    rss = {"plain": [100.0, 90.0], "hetero": [80.0, 85.0]}

    def child(name, args, passthrough, log_dir, nvme=True):
        i = sum(c == name for c in calls)
        calls.append(name)
        return {"name": name, "params": 10, "step_s": steps[name][i], "step_median_s": steps[name][i],
                "peak_rss_mb": rss[name][i], "losses": [1.0]}  # fmt: skip

    monkeypatch.setattr(gpu_race, "_child", child)
    assert gpu_race.main(["--dry-run", "--json", "--rounds", "2", "--only", "plain,hetero"]) == 0
    assert calls == ["plain", "hetero", "hetero", "plain"]
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    plain, hetero = out["configs"]["plain"], out["configs"]["hetero"]
    assert (plain["step_s"], plain["peak_rss_mb"], plain["round_steps_s"]) == (1.0, 100.0, [2.0, 1.0])
    assert (hetero["step_s"], hetero["peak_rss_mb"], hetero["round"]) == (1.5, 85.0, 1)
    assert out["races"]["vs_plain"]["step_ratio"] == 1.5
