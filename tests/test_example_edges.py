"""examples/train_gpt.py where a new user's walkthrough found rough edges: a save directory that cannot take
checkpoints, an empty --data file, SIGTERM, --keep-last, and the progress bar in a log."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))  # the examples import their neighbours (corpus.py) as a script does

import train_gpt  # noqa: E402


def tiny_args(*flags: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    train_gpt.add_training_args(ap, steps=4, batch_size=2, lr=1e-3)
    args = ap.parse_args(["--sample-tokens", "1", "--offload-optimizer", "host", *flags])
    train_gpt.check_training_args(ap, args)
    return args


def tiny_run(*flags: str) -> dict:
    """train_gpt.train in this process on a 1-layer GPT: a few updates in a second or two."""
    import torch

    from hetero.models import GPT, GPTConfig

    args = tiny_args(*flags)
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=256, n_layer=1, n_head=2, n_embd=16, block_size=16))
    return train_gpt.train(args, model, block_size=16)


def test_an_unwritable_save_dir_fails_before_the_engine(tmp_path, capsys, monkeypatch):
    """The save directory was first written at the first save, after the training before it (all of a run with
    --save-every 0): it is made and written to before the engine is built."""
    (tmp_path / "file").write_text("")
    save_dir = tmp_path / "file" / "ckpt"  # under a file: cannot be made

    def built(*args, **kwargs):
        raise AssertionError("the engine was built before the save directory was checked")

    monkeypatch.setattr(train_gpt.hetero, "initialize", built)
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.run_cli(lambda: tiny_run("--save-dir", str(save_dir)))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --save-dir {str(save_dir)!r}: cannot write there") and "Traceback" not in err


def test_an_empty_data_file_is_a_usage_error(tmp_path, capsys):
    """torch.frombuffer refused the empty buffer with a traceback; an 11-byte file had a message already."""
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.run_cli(lambda: train_gpt.read_text(str(path), block_size=128))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --data {path}: the file is empty; give a text of at least 129 bytes"), err
    assert "Traceback" not in err


def test_keep_last_keeps_the_newest_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    tiny_run("--save-dir", str(ckpt), "--save-every", "1", "--keep-last", "2")
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step-00000003", "step-00000004"]
    assert (ckpt / "latest").read_text().strip() == "step-00000004"


def test_keep_last_needs_a_save_dir(capsys):
    with pytest.raises(SystemExit):
        tiny_args("--keep-last", "2")
    assert "--keep-last needs --save-dir DIR" in capsys.readouterr().err


def test_no_progress_bar_off_a_terminal(capsys):
    """Standard error here is not a terminal (a pipe, a log): tqdm's carriage-return lines filled logs."""
    assert not sys.stderr.isatty()
    tiny_run("--steps", "2")
    err = capsys.readouterr().err
    assert "\r" not in err and "train:" not in err, err[-2000:]


@pytest.mark.timeout(150)
def test_sigterm_removes_the_temporary_nvme_directory(tmp_path):
    """SIGTERM mid-run (a timeout, kill, a scheduler's preemption) left the empty train-gpt-nvme-* directory behind
    (hetero removed only its swap directory inside); now hetero removes it too, and the process still dies of
    SIGTERM."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--steps", "100000"]
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}  # tempfile makes its directory in TMPDIR
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL),  # as a launcher leaves it
    )
    try:
        deadline = time.monotonic() + 120
        # the engine made its swap directory inside the temporary one
        while not any(p.is_dir() and any(p.iterdir()) for p in tmp.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        made = [p.name for p in tmp.iterdir() if p.name.startswith("train-gpt-nvme-")]
        assert made, "no temporary NVMe directory was made"
        time.sleep(1.0)  # into the training loop
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
    assert not (tmp / made[0]).exists(), "the temporary NVMe directory was left behind"
    assert "Traceback" not in err, err[-3000:]
