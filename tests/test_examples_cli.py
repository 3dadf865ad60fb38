"""The examples and tools as a user meets them: bad flags are usage errors naming the flag, user errors (a missing
NVMe directory, a layout the launch cannot hold) end with their message and no traceback, and Ctrl-C stops a run
cleanly, its swap files removed."""

from __future__ import annotations

import argparse
import importlib.util
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


def run_script(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / script), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flag", ["--ranks-per-node", "--max-tensor"])
def test_estimate_refuses_a_zero_count(flag, capsys):
    """--ranks-per-node 0 divided by zero (a traceback); --max-tensor 0 tried no layout and said nothing fits."""
    estimate = load_tool("estimate")
    argv = ["--params", "1e9", flag, "0", "--recommend", "--device-memory", "80GiB", "--host-memory", "1TiB"]
    with pytest.raises(SystemExit) as exit_info:
        estimate.main(argv)
    assert exit_info.value.code == 2
    assert f"{flag}: expected an integer >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--delayed-update-prediction"], ["--delayed-update-warmup", "0"]])
def test_delayed_update_flags_need_the_delayed_update(flag, capsys):
    """They were ignored without --delayed-param-update: the run trained the exact update the user did not ask for."""
    ap = argparse.ArgumentParser()
    train_gpt.add_training_args(ap, steps=1, batch_size=1, lr=1e-3)
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.check_training_args(ap, ap.parse_args(flag))
    assert exit_info.value.code == 2
    assert f"{flag[0]} applies to --delayed-param-update only" in capsys.readouterr().err
    train_gpt.check_training_args(ap, ap.parse_args([*flag, "--delayed-param-update"]))  # accepted with it


def test_negative_grad_clip_is_a_usage_error(capsys):
    ap = argparse.ArgumentParser()
    train_gpt.add_training_args(ap, steps=1, batch_size=1, lr=1e-3)
    with pytest.raises(SystemExit):
        ap.parse_args(["--grad-clip", "-1"])
    assert "--grad-clip: expected a number >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--microbatches", "3"], "--microbatches 3 must divide --batch-size 8"),
        (["--embd", "64", "--heads", "3"], "n_embd = 64 must be divisible by n_head = 3 (--embd, --heads)"),
    ],
)
def test_train_parallel_checks_shapes_before_joining(flags, message, capsys):
    """Both failed with a traceback: the micro-batches at the first train_batch, after the engine was built."""
    import train_parallel

    with pytest.raises(SystemExit) as exit_info:
        train_parallel.main(["--steps", "1", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("script", "flags", "message"),
    [
        ("examples/train_gpt.py", ["--nvme-dir", "{tmp}/missing"], "error: nvme_dir '{tmp}/missing' does not exist"),
        ("examples/train_parallel.py", ["--tensor", "2"], "error: parallel: tensor (2) x pipeline (1) = 2 must divide"),
    ],
)
def test_user_errors_end_without_a_traceback(tmp_path, script, flags, message):
    flags = [f.format(tmp=tmp_path) for f in flags]
    proc = run_script(script, "--steps", "1", *flags)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith(message.format(tmp=tmp_path)), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(150)
def test_ctrl_c_stops_training_cleanly(tmp_path):
    """Ctrl-C mid-run: a one-line message and status 130, not a traceback from inside the backward; the swap files
    are gone (the engine closed as the interrupt unwound)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--steps", "100000", "--nvme-dir", str(nvme)]
    # SIGINT at its default, as under a terminal (a background job of a shell would have it ignored)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not any(nvme.iterdir()) and time.monotonic() < deadline:  # the engine made its swap directory
            time.sleep(0.05)
        assert any(nvme.iterdir()), "the engine never made its swap directory"
        time.sleep(1.0)  # into the training loop
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert err.rstrip().endswith("interrupted (Ctrl-C)") and "Traceback" not in err, err[-3000:]
    assert os.listdir(nvme) == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--resume", "{tmp}/checkpoint-99"], "--resume {tmp}/checkpoint-99: no such checkpoint directory"),
        (["--resume", "--output-dir", "{tmp}"], "--resume: {tmp} holds no checkpoint-N directory"),
        (["--resume", "--output-dir", "{tmp}/absent"], "--resume: {tmp}/absent holds no checkpoint-N directory"),
        (["--compare", "--resume", "{tmp}"], "--compare trains both Trainers from the start"),
    ],
)
def test_train_trainer_resume_of_nothing_is_a_usage_error(tmp_path, monkeypatch, capsys, flags, message):
    """A missing checkpoint was the Trainer's ValueError (or FileNotFoundError) with a traceback, after the models
    were built; --compare with --resume resumed the plain Trainer from hetero's checkpoint."""
    pytest.importorskip("transformers", minversion="5.0")
    pytest.importorskip("accelerate")
    import train_trainer

    monkeypatch.setattr(sys, "argv", ["train_trainer.py", *(f.format(tmp=tmp_path) for f in flags)])
    with pytest.raises(SystemExit) as exit_info:
        train_trainer.main()
    assert exit_info.value.code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("spec", "torch_args"),
    [
        (None, ["torch==2.13.0"]),
        (
            "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
            ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"],
        ),
    ],
)
def test_quickstart_passes_torch_spec_as_pip_words(tmp_path, spec, torch_args):
    """TORCH_SPEC with an --index-url (PyTorch's selector gives one for the CPU and CUDA builds) went to pip as one
    argument, which pip refused as an invalid requirement. Run in a copy of the layout, with a python3 whose venv
    makes a .venv/bin/python that only records its arguments."""
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "quickstart.sh").write_text((ROOT / "tools" / "quickstart.sh").read_text())
    log = tmp_path / "calls.txt"
    recorder = f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a" >> {log}; done\necho --- >> {log}\n'
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nmkdir -p .venv/bin\nprintf '%s' '{recorder}' > .venv/bin/python\n"
                    "chmod +x .venv/bin/python\n")  # fmt: skip
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    env.pop("TORCH_SPEC", None)
    if spec is not None:
        env["TORCH_SPEC"] = spec
    proc = subprocess.run(["bash", str(tmp_path / "tools" / "quickstart.sh"), "--steps", "2"], env=env,
                          capture_output=True, text=True, timeout=20)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    calls = [c.strip("\n").split("\n") for c in log.read_text().split("---\n") if c.strip()]
    assert ["-m", "pip", "install", "-q", *torch_args] in calls
    assert calls[-1] == ["examples/train_gpt.py", "--steps", "2"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"short", "--data {path}: 5 bytes is too short for one sequence of 128 bytes and its label"),
        (b"\xff\xfe" * 200, "--data {path}: not UTF-8 text (invalid start byte at byte 0)"),
        (None, "corpus file {path} not found"),
    ],
)
def test_data_file_errors(tmp_path, capsys, content, message):
    """--data names the text to train on (the corpus' own error told the user to pass a path, and no flag took one);
    a file too short for one sequence, not UTF-8, or missing ends with its message and status 2, before the engine
    is built."""
    path = tmp_path / "text.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.run_cli(lambda: train_gpt.read_text(str(path), block_size=128))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message.format(path=path)) and "Traceback" not in err
    path.write_text("x" * 129)
    assert train_gpt.read_text(str(path), block_size=128) == "x" * 129


def tiny_run(tmp_path: Path, *flags: str) -> dict:
    """train_gpt.train in this process on a 1-layer GPT: a few updates in a second or two."""
    from hetero.models import GPT, GPTConfig

    ap = argparse.ArgumentParser()
    train_gpt.add_training_args(ap, steps=4, batch_size=2, lr=1e-3)
    args = ap.parse_args(["--sample-tokens", "1", "--offload-optimizer", "host", "--json", *flags])
    train_gpt.check_training_args(ap, args)
    torch = pytest.importorskip("torch")
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=256, n_layer=1, n_head=2, n_embd=16, block_size=16))
    return train_gpt.train(args, model, block_size=16)


def test_resume_goes_on_as_the_unbroken_run(tmp_path):
    """--resume CKPT loads weights, optimizer and schedule and skips the batches trained on: the resumed updates'
    losses are the unbroken run's. Exact: the same fp32 arithmetic on the same batches in the same process."""
    ckpt = tmp_path / "ckpt"
    whole = tiny_run(tmp_path, "--save-dir", str(ckpt), "--save-every", "2")
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step-00000002", "step-00000004"]
    resumed = tiny_run(tmp_path, "--resume", str(ckpt / "step-00000002"))
    assert resumed["first_step"] == 2 and resumed["steps"] == 2
    assert resumed["losses"] == whole["losses"][2:]


def test_resume_of_a_corrupt_checkpoint_names_the_file(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    tiny_run(tmp_path, "--steps", "1", "--save-dir", str(ckpt))
    (shard,) = (ckpt / "step-00000001").glob("rank-*.safetensors")
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.run_cli(lambda: tiny_run(tmp_path, "--steps", "2", "--save-dir", str(ckpt), "--resume"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {shard}: truncated") and "Traceback" not in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--save-every", "5"], "--save-every needs --save-dir DIR"),
        (["--resume"], "--resume without CKPT resumes the latest checkpoint in --save-dir"),
        (["--resume", "{tmp}/absent"], "--resume: {tmp}/absent does not exist"),
        (["--save-dir", "{tmp}/absent", "--resume"], "--resume: {tmp}/absent does not exist"),
    ],
)
def test_checkpoint_flags_are_checked(tmp_path, capsys, flags, message):
    ap = argparse.ArgumentParser()
    train_gpt.add_training_args(ap, steps=1, batch_size=1, lr=1e-3)
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.check_training_args(ap, ap.parse_args([f.format(tmp=tmp_path) for f in flags]))
    assert exit_info.value.code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
