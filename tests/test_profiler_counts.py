"""The profile's counts: optimizer steps and micro-batches (train_batch's micro-batches, not its one engine.step()),
alike in summary.txt, summary.json and the trace; and tools/memprof.py says where it wrote when the script ends
before the steps it was to record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import hetero
from tests import pipe_parity
from tests.dist import NEEDS_DEGREES, ranks_apart, run_distributed
from tests.parity import CHUNK, batches, build, make_optimizer

ROOT = Path(__file__).resolve().parent.parent


def _engine(*, microbatches: int = 1, gas: int = 1) -> hetero.Engine:
    model = build()
    config = {"zero_stage": 1, "grad_accumulation_steps": gas, "parallel": {"microbatches": microbatches}}
    return hetero.initialize(model, make_optimizer(model), config)


def _counts(out: Path) -> tuple[int, int, str, dict]:
    summary = json.loads((out / "summary.json").read_text())
    head = (out / "summary.txt").read_text().splitlines()[0]
    other = json.loads((out / "trace.json").read_text())["otherData"]
    return summary["optimizer_steps"], summary["micro_batches"], head, other


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("microbatches", "gas", "batch_calls", "steps", "micro", "words"),
    [
        # train_batch calls engine.step() once per batch, after all of its micro-batches
        (2, 1, 2, 2, 4, "2 optimizer steps, 4 micro-batches"),
        (2, 2, 2, 1, 4, "1 optimizer step, 4 micro-batches"),  # accumulated over two batches of two
        (1, 1, 1, 1, 1, "1 optimizer step, 1 micro-batch"),
    ],
)
def test_train_batch_counts_its_micro_batches(tmp_path, microbatches, gas, batch_calls, steps, micro, words):
    engine = _engine(microbatches=microbatches, gas=gas)
    with hetero.profile(engine, tmp_path, plot=False):
        for x, y in batches(batch_calls, 2):
            engine.train_batch(x, y)
    engine.close()
    n_steps, n_micro, head, other = _counts(tmp_path)
    assert (n_steps, n_micro) == (steps, micro)
    assert head.startswith(f"hetero memory profile: {words}, "), head
    assert (other["optimizer_steps"], other["micro_batches"]) == (steps, micro)


@pytest.mark.timeout(120)
def test_an_accumulation_loop_counts_its_step_calls(tmp_path):
    # engine.backward and engine.step per micro-batch (retain_graph's second backward is no second micro-batch),
    # with parallel.microbatches set, which only train_batch uses.
    engine = _engine(microbatches=2, gas=2)
    with hetero.profile(engine, tmp_path, plot=False):
        for i, (x, y) in enumerate(batches(4, 2)):
            loss = engine(x, labels=y).loss
            engine.backward(loss, retain_graph=i == 0)
            if i == 0:
                engine.backward(loss)
            engine.step()
    engine.close()
    n_steps, n_micro, head, other = _counts(tmp_path)
    assert (n_steps, n_micro) == (2, 4)
    assert head.startswith("hetero memory profile: 2 optimizer steps, 4 micro-batches, "), head
    assert other["micro_batches"] == 4


def _pipeline_rank(rank: int, world: int, root: str) -> tuple[int, int, str, dict]:
    model = pipe_parity.build()
    parallel = {"pipeline": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": 4}
    engine = hetero.initialize(model, make_optimizer(model), {"chunk_size": CHUNK, "parallel": parallel})
    with hetero.profile(engine, root, plot=False) as prof:
        x, y = batches(1, 4)[0]
        engine.train_batch(x, y)
    engine.close()
    return _counts(prof.out_dir)


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(180)
def test_a_pipeline_counts_micro_batches_not_virtual_stages(tmp_path):
    # Each rank runs two virtual stages: a backward per micro-batch and stage, 8 on each rank, for 4 micro-batches.
    for rank, (steps, micro, head, other) in enumerate(run_distributed(_pipeline_rank, 2, str(tmp_path), timeout=150)):
        assert (steps, micro) == (1, 4), rank
        assert head.startswith("hetero memory profile: 1 optimizer step, 4 micro-batches, "), (rank, head)
        assert (other["optimizer_steps"], other["micro_batches"]) == (1, 4), rank


SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import hetero
from tests import pipe_parity
from tests.dist import NEEDS_DEGREES, ranks_apart, run_distributed
from tests.parity import CHUNK, batches, build, make_optimizer

model = build()
engine = hetero.initialize(model, make_optimizer(model), {{"zero_stage": 1}})
for x, y in batches(2, 2):
    engine.backward(engine(x, labels=y).loss)
    engine.step()
print("script ended")
"""


@pytest.mark.timeout(120)
def test_memprof_says_where_it_wrote_when_the_script_ends_first(tmp_path):
    script = tmp_path / "two_steps.py"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    out = tmp_path / "prof"
    cmd = [sys.executable, str(ROOT / "tools" / "memprof.py"), "--out", str(out), "--steps", "5", "--"]
    proc = subprocess.run([*cmd, "python", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "script ended" in proc.stdout
    assert proc.stderr.count(f"memprof: wrote {out}/summary.txt") == 1, proc.stderr[-4000:]
    assert json.loads((out / "summary.json").read_text())["optimizer_steps"] == 2
