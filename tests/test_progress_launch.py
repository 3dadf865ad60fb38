"""Progress bars on long work (shown only where someone watches, switchable off), and launchers: SLURM tasks join
one world without torchrun (or stop with a clear error), and a checkpoint root that is not one shared directory is
refused on every rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401

import hetero
from hetero import progress
from hetero.checkpoint import consolidate, verify
from hetero.comm.launchers import adopt_launcher_env
from hetero.errors import CheckpointError, CommError
from tests import parity
from tests.dist import OWN_BATCHES, cpu_ranks_env, free_port, ranks_apart, run_distributed

ROOT = Path(__file__).resolve().parent.parent
DESCS = ("hetero: placing weights", "hetero: saving checkpoint", "hetero: loading checkpoint")


def test_enabled_rules(monkeypatch):
    monkeypatch.setenv("HETERO_PROGRESS", "1")
    assert progress.enabled()
    assert not progress.enabled(rank=1)  # other ranks stay quiet
    assert not progress.enabled(config=False)  # the config switch
    monkeypatch.setenv("HETERO_PROGRESS", "0")
    assert not progress.enabled()  # the environment switch
    monkeypatch.delenv("HETERO_PROGRESS")
    assert progress.enabled() == sys.stderr.isatty()  # a terminal shows them, a log does not


def _work(tmp_path: Path, config: dict) -> None:
    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {"chunk_size": parity.CHUNK, **config})
    x, y = parity.batches(1, 4)[0]
    engine.backward(engine(x, labels=y).loss)
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.load_checkpoint(tmp_path / "ckpt")
    engine.close()
    consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors")
    verify(tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("env", "config", "shown"), [("1", {}, True), ("0", {}, False), ("1", {"progress": False}, False)]
)
def test_bars_on_long_work(tmp_path, monkeypatch, capsys, env, config, shown):
    monkeypatch.setenv("HETERO_PROGRESS", env)
    _work(tmp_path, config)
    err = capsys.readouterr().err
    for desc in DESCS:  # the engine's work follows the config switch and the environment
        assert (desc in err) == shown, desc
    for desc in ("hetero: consolidating", "hetero: verifying"):  # the tools follow the environment
        assert (desc in err) == (env == "1"), desc


def test_bars_while_initialising_and_streaming(tmp_path, monkeypatch, capsys):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    monkeypatch.setenv("HETERO_PROGRESS", "1")
    src = parity.build()
    state = {k: v.contiguous() for k, v in src.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
    safetensors_torch.save_file(state, str(tmp_path / "w.safetensors"))
    for weights in (None, tmp_path / "w.safetensors"):
        with hetero.lazy_init():
            model = parity.build()
        engine = hetero.initialize(model, None, {"zero_stage": 3, "chunk_size": parity.CHUNK}, weights=weights)
        engine.close()
    err = capsys.readouterr().err
    assert "hetero: initialising" in err and "hetero: loading weights" in err


def test_long_work_in_a_log_writes_a_line_every_interval(monkeypatch, capsys):
    """[Note: progress in a log]: standard error a file (capsys: no terminal), no HETERO_PROGRESS: no bar is drawn,
    but work that outlasts LOG_EVERY_S writes a plain line per interval and one at its end; short work, other ranks,
    HETERO_PROGRESS=0 and the config switch write nothing."""
    monkeypatch.delenv("HETERO_PROGRESS", raising=False)
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])

    def run(seconds_each: float, **kw) -> str:
        shown = progress.bar(8, "hetero: ranking layouts", unit="layout", **kw)
        for _ in range(8):
            clock[0] += seconds_each
            shown.update()
        shown.close()
        return capsys.readouterr().err

    err = run(10.0)  # 80 s in all: a line at 30 s and at 60 s, and the end
    lines = err.splitlines()
    assert len(lines) == 3, err
    assert lines[0] == "hetero: ranking layouts: 3/8 layouts (38%), 30s so far, about 50s left"
    assert lines[1].startswith("hetero: ranking layouts: 6/8 layouts (75%), 1m00s so far")
    assert lines[2] == "hetero: ranking layouts: 8/8 layouts (100%), done in 1m20s"
    assert run(1.0) == ""  # 8 s: nothing
    assert run(10.0, rank=1) == "" and run(10.0, config=False) == ""
    monkeypatch.setenv("HETERO_PROGRESS", "0")
    assert run(10.0) == ""
    monkeypatch.setenv("HETERO_PROGRESS", "1")  # bars drawn instead: no log lines
    assert "so far" not in run(10.0)


# ---- launchers ------------------------------------------------------------------------------------------------
def test_adopt_slurm_environment():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1"}
    env["SLURM_STEP_NUM_TASKS"] = "4"  # srun's, for each task it starts
    assert adopt_launcher_env(env) == "SLURM"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "1")
    # No rendezvous: every task stops, saying how to set it, rather than train alone.
    with pytest.raises(CommError, match="MASTER_ADDR and MASTER_PORT are not set.*scontrol"):
        adopt_launcher_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"})
    assert adopt_launcher_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None  # one task: alone is right
    torchrun = {"WORLD_SIZE": "2", "RANK": "1", "SLURM_NTASKS": "8", "SLURM_PROCID": "5"}
    assert adopt_launcher_env(torchrun) is None and torchrun["RANK"] == "1"  # torchrun under srun wins
    with pytest.raises(CommError, match="OpenMPI"):
        adopt_launcher_env({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"})


_SRUN_TASK = """
import sys, torch, hetero
from hetero.comm import init_from_env
comm = init_from_env(timeout_s=60)
t = torch.tensor([float(comm.rank + 1)])
comm.control.all_reduce(t)
print(comm.rank, comm.size, float(t))
"""


@pytest.mark.timeout(120)
def test_srun_tasks_join_one_world():
    """Two processes with only SLURM's variables (what `srun python train.py` gives) form one world of two."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_STEP_NUM_TASKS="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-c", _SRUN_TASK]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=cpu_ranks_env(env), stdout=subprocess.PIPE))
    outs = sorted(p.communicate(timeout=100)[0].decode().split() for p in procs)
    assert all(p.returncode == 0 for p in procs)
    assert outs == [["0", "2", "3.0"], ["1", "2", "3.0"]]


def _save_unshared(rank: int, world: int, roots: list[str]) -> str:
    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": 1, "chunk_size": parity.CHUNK})
    try:
        engine.save_checkpoint(roots[rank])  # each rank sees another directory: no shared file system
    except CheckpointError as e:
        return str(e)
    finally:
        engine.close()
    return "saved"


@ranks_apart(OWN_BATCHES)
@pytest.mark.timeout(120)
def test_checkpoint_root_must_be_shared(tmp_path):
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    messages = run_distributed(_save_unshared, 2, roots, timeout=100)
    assert all("shared" in m and "ranks [1]" in m for m in messages)
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "node0").iterdir())  # nothing left behind
