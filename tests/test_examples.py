"""The example scripts run end to end (a few steps), print their JSON report and leave no swap files behind."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(script: str, tmp_path: Path, *extra: str) -> dict:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cmd = [sys.executable, str(ROOT / "examples" / script), "--steps", "3", "--batch-size", "2", "--sample-tokens", "4"]
    cmd += ["--nvme-dir", str(nvme), "--json", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(nvme.iterdir()) == []  # engine.close() removed the swap files
    return result


def check(result: dict) -> None:
    assert result["steps"] == 3 and result["world_size"] == 1
    assert math.isfinite(result["final_loss"]) and result["final_loss"] < result["first_loss"]
    assert {"device", "host", "nvme", "moved"} <= result["memory"].keys()
    assert result["memory"]["moved"].get("host->nvme", 0) > 0  # the optimizer states went to the swap files
    assert result["sample"].startswith("Once upon a time")


def test_train_gpt(tmp_path):
    check(run_example("train_gpt.py", tmp_path))


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_train_hf(tmp_path, model):
    pytest.importorskip("transformers")
    check(run_example("train_hf.py", tmp_path, "--model", model))


@pytest.mark.timeout(300)
def test_train_parallel_under_torchrun():
    """TP 2 x PP 2 under torchrun (4 processes), a few batches of a tiny GPT: it trains and reports the mesh, then
    evaluates through the layout and generates a few tokens greedily (eval_batch)."""
    from tests.dist import run_torchrun, torchrun_failure

    cmd = [str(ROOT / "examples" / "train_parallel.py"), "--tensor", "2", "--pipeline", "2", "--steps", "4"]
    cmd += ["--layers", "2", "--embd", "32", "--heads", "2", "--block-size", "16", "--batch-size", "4", "--json"]
    cmd += ["--microbatches", "2", "--zero-stage", "3", "--sequence", "--generate", "4"]
    proc = run_torchrun(cmd, nproc=4, timeout=280, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, torchrun_failure(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["mesh"] == {"tensor": 2, "data": 1, "pipeline": 2} and result["world_size"] == 4
    assert math.isfinite(result["final_loss"]) and result["final_loss"] < result["first_loss"]
    assert math.isfinite(result["eval_loss"]) and 1 <= len(result["generated"]) <= 4  # 4 byte tokens, decoded
