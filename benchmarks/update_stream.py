"""The host memory and time of an update that streams its optimizer states from NVMe, with writes first (the store's
default), reads first up to a backlog of writes, or reads always first.

    python benchmarks/update_stream.py --nvme-dir DIR [--rounds R] [--steps N] [--math cpu,none] [--backlog auto,none]
                                       [--layers L --hidden H --intermediate I --vocab V] [--precision bf16|fp32]
                                       [--whole-step [--params-host-gb G] [--delayed]] [--json]

[Note: a bounded write backlog] and [Note: writes first by default] (hetero/memory/lanes.py): the NVMe tier orders
queued reads and writes by a backlog of writes, and an update whose math is quick next to the disk keeps the read
lane full, so with reads always first its write-backs wait until its last read and their host buffers with them. This
benchmark trains transformers' LlamaForCausalLM (16 layers of 1024, MLP 2752, vocab 8000: 218M parameters in about as
many chunks as gpu_race.py's 551M model) at ZeRO-3, one rank, bf16 with fp32 master weights, fused AdamW, parameters
and optimizer states on NVMe with the parameters kept on the host (`offload.params_host_bytes` at DeepSpeed's
`max_in_cpu` default, as in gpu_race.py's `hetero_nvme`), and times its updates in several ways, each in a fresh
process, alternating for R rounds:

  math    cpu: the update's AdamW runs on this machine's cores (2 on the development VM);
          none: the math is left out, standing in for a machine whose cores step a chunk in a fraction of its I/O
          (a GPU machine's 16: one H100's race held nearly all its 6.7 GB of states on the host)
  backlog auto: the store's default (0 unless HETERO_NVME_WRITE_BACKLOG is set: a queued write goes first);
          none: reads always first; a number: write blocks that may wait behind reads (8, one per I/O thread, was
          the default before writes went first)

Reported per run (median over N timed updates after one untimed step): `update_s`, the update's own time;
`drained_s`, until its last write-back landed (`manager.synchronize()`); `gb_per_s`, the NVMe bytes it moved over
`drained_s`; `host_peak_gb`, the host tier's peak from the update's start until drained; `states_gb`, the optimizer
states streamed; and the process's peak RSS over the timed steps (VmHWM reset after the first step where the kernel
allows). The figures of the rounds are each run's best (lowest) medians. GB = 1e9 bytes.

--whole-step times whole steps instead, nothing synchronized between them, so that a forward's parameter reads meet
the last update's write-backs on the disk as in training (with --delayed, the whole update: delayed_param_update
from the first update): `step_s` from one forward's start to the next's, `fwd_bwd_s` and `update_s` within it, and
the host tier's peak over the timed steps. --params-host-gb below the parameters' size (0.44 GB in bf16) streams the
rest of them from NVMe every step; --precision fp32 keeps a CPU without bf16 units from spending the step in bf16
matrix products (36 s of forward and backward on the development VM, against about 5 in fp32).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_race import _hwm_mb, llama  # noqa: E402  (the race's Llama and peak-RSS reader)

MATHS = ("cpu", "none")
BACKLOGS = ("auto", "none")


def _reset_hwm() -> bool:
    """Reset the process's peak RSS (Linux >= 4.0: writing 5 to clear_refs); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _updates(engine: Any, batches: Iterator[Any], steps: int) -> tuple[list[dict[str, float]], bool]:
    """Time `steps` updates after one untimed step, each alone: synchronized before it starts and until it drained.
    Returns one row per update and whether the peak RSS could be reset after the first step."""
    from hetero.memory import Tier

    manager = engine.manager

    def nvme_bytes() -> int:
        return sum(n for (s, d), n in manager.moved.items() if Tier.NVME in (s, d))

    rows, hwm_reset = [], False
    for i in range(1 + steps):
        x = next(batches)
        engine.backward(engine(input_ids=x, labels=x).loss)
        manager.synchronize()
        manager.reset_peaks()
        before = nvme_bytes()
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        manager.synchronize()
        t2 = time.perf_counter()
        if i == 0:
            hwm_reset = _reset_hwm()
            continue
        rows.append(
            {
                "update_s": t1 - t0,
                "drained_s": t2 - t0,
                "gb_per_s": (nvme_bytes() - before) / 1e9 / (t2 - t0),
                "host_peak_gb": manager.ledgers[Tier.HOST].peak / 1e9,
            }
        )
    return rows, hwm_reset


def _whole_steps(engine: Any, batches: Iterator[Any], steps: int) -> tuple[list[dict[str, float]], bool]:
    """Time `steps` whole steps after one untimed, nothing synchronized between them: a forward's parameter reads
    meet the last update's write-backs (and, delayed, its whole update) on the disk as in training. A step runs from
    one forward's start to the next's, so one more step is run than timed."""
    from hetero.memory import Tier

    manager = engine.manager
    marks, hwm_reset = [], False
    for i in range(2 + steps):
        x = next(batches)
        t0 = time.perf_counter()
        engine.backward(engine(input_ids=x, labels=x).loss)
        t1 = time.perf_counter()
        engine.step()
        marks.append((t0, t1, time.perf_counter()))
        if i == 0:
            manager.synchronize()
            manager.reset_peaks()
            hwm_reset = _reset_hwm()
    manager.synchronize()
    peak = manager.ledgers[Tier.HOST].peak / 1e9  # over all the timed steps
    rows = [
        {"step_s": b[0] - a[0], "fwd_bwd_s": a[1] - a[0], "update_s": a[2] - a[1], "host_peak_gb": peak}
        for a, b in zip(marks[1:-1], marks[2:])
    ]
    return rows, hwm_reset


def one(math: str, backlog: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process."""
    import torch

    import hetero

    os.environ["HETERO_NVME_WRITE_BACKLOG"] = "" if backlog == "auto" else backlog  # read when the store is made
    torch.manual_seed(args.seed)
    model = llama(argparse.Namespace(**vars(args), heads=max(1, args.hidden // 128), seq=64))
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    config = {
        "zero_stage": 3,
        "precision": args.precision,
        "offload": {"params": "nvme", "optimizer": "nvme", "params_host_bytes": int(args.params_host_gb * 1e9)},
        "memory": {"nvme_dir": tempfile.mkdtemp(dir=args.nvme_dir)},
        "progress": False,
    }
    if args.delayed:
        config.update(delayed_param_update=True, delayed_param_update_warmup=0)
    engine = hetero.initialize(model, opt, config)
    if math == "none":
        import hetero.zero.update as update

        update.step_chunk = lambda *a, **k: None  # the states are still read, handed to the step, and written back
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = (torch.randint(0, args.vocab, (1, 64), generator=g) for _ in itertools.count())
    rows, hwm_reset = (_whole_steps if args.whole_step else _updates)(engine, batches, args.steps)
    states = sum(zc.optim.nbytes for zc in engine.chunks if zc.optim is not None)
    engine.close()
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out.update(params=params, states_gb=states / 1e9, peak_rss_mb=_hwm_mb(), rss_after_first_step=hwm_reset)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvme-dir", required=True, help="directory on the disk to measure (swap files go there)")
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (default 16)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024; heads of 128)")
    ap.add_argument("--intermediate", type=int, default=2752, help="MLP size (default 2752)")
    ap.add_argument("--vocab", type=int, default=8000, help="vocabulary (default 8000: with the rest, 218M parameters)")
    ap.add_argument("--rounds", type=int, default=2, help="each run this many times, alternating (default 2)")
    ap.add_argument("--steps", type=int, default=2, help="timed updates per run, after one untimed (default 2)")
    ap.add_argument("--math", default=",".join(MATHS), help="comma-separated: cpu, none (default both)")
    ap.add_argument(
        "--backlog",
        default=",".join(BACKLOGS),
        help="comma-separated: auto, none or a number of blocks (default auto,none)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--params-host-gb", type=float, default=2.0, help="offload.params_host_bytes in GB (default 2: all of them)"
    )
    ap.add_argument(
        "--whole-step",
        action="store_true",
        help="time whole steps (forward, backward, update) with nothing synchronized between them",
    )
    ap.add_argument(
        "--precision",
        default="bf16",
        choices=("bf16", "fp32"),
        help="bf16 (default; fp32 master weights) or fp32: a CPU without bf16 units computes bf16 slowly",
    )
    ap.add_argument("--delayed", action="store_true", help="delayed_param_update from the first update")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of lines for people")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # MATH:BACKLOG, one run in this process
    args = ap.parse_args(argv)
    maths, backlogs = args.math.split(","), args.backlog.split(",")
    if bad := [m for m in maths if m not in MATHS] + [b for b in backlogs if b not in BACKLOGS and not b.isdigit()]:
        ap.error(f"unknown --math or --backlog value(s) {bad}: --math takes {MATHS}, --backlog {BACKLOGS} or a number")
    if min(args.rounds, args.steps, args.layers, args.hidden, args.intermediate, args.vocab) < 1:
        ap.error("--rounds, --steps, --layers, --hidden, --intermediate and --vocab must be at least 1")
    if not os.path.isdir(args.nvme_dir):
        ap.error(f"--nvme-dir {args.nvme_dir}: not a directory")
    if args.one:
        math, backlog = args.one.split(":")
        print(json.dumps(one(math, backlog, args)))
        return 0
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    runs = [(m, b) for m in maths for b in backlogs]
    say(
        f"Llama {args.layers} layers of {args.hidden}, {args.precision}, ZeRO-3, 1 rank, states on NVMe; "
        f"{args.steps} timed {'steps' if args.whole_step else 'updates'}, {args.rounds} rounds"
    )
    results: dict[str, list[dict[str, Any]]] = {f"{m}:{b}": [] for m, b in runs}
    for rnd in range(args.rounds):
        for m, b in runs if rnd % 2 == 0 else runs[::-1]:  # alternate: a drift of the machine hits all alike
            cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{m}:{b}", "--nvme-dir", args.nvme_dir]
            for flag in ("layers", "hidden", "intermediate", "vocab", "steps", "seed", "params_host_gb", "precision"):
                cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            cmd += ["--whole-step"] * args.whole_step + ["--delayed"] * args.delayed
            env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
            if out.returncode != 0:
                raise SystemExit(f"math {m}, backlog {b} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[f"{m}:{b}"].append(r)
            timing = (
                f"step {r['step_s']:.2f} s (forward and backward {r['fwd_bwd_s']:.2f} s, update {r['update_s']:.2f} s)"
                if args.whole_step
                else f"update {r['update_s']:.2f} s, drained {r['drained_s']:.2f} s ({r['gb_per_s']:.2f} GB/s)"
            )
            say(
                f"  round {rnd + 1} math {m:4s} backlog {b:5s}: {timing}, host peak {r['host_peak_gb']:.2f} GB of "
                f"{r['states_gb']:.2f} GB states, peak RSS {r['peak_rss_mb']:.0f} MB"
            )
    timed = ("fwd_bwd_s", "update_s", "step_s") if args.whole_step else ("update_s", "drained_s")
    best: dict[str, dict[str, Any]] = {}
    for key, rs in results.items():
        best[key] = {k: min(r[k] for r in rs) for k in (*timed, "host_peak_gb", "peak_rss_mb")}
        if not args.whole_step:
            best[key]["gb_per_s"] = max(r["gb_per_s"] for r in rs)
        best[key]["states_gb"] = rs[0]["states_gb"]
    ratios = {}
    for m in maths:
        a, b = best.get(f"{m}:auto"), best.get(f"{m}:none")
        if a and b:
            ratios[m] = {k: a[k] / b[k] for k in (timed[-1], "host_peak_gb", "peak_rss_mb")}
    keys = ("layers", "hidden", "intermediate", "vocab", "rounds", "steps", "params_host_gb", "whole_step", "delayed")
    shape = {k: getattr(args, k) for k in (*keys, "precision")}
    result = {
        **shape,
        "params": next(iter(results.values()))[0]["params"],
        "best": best,
        "auto_over_none": ratios,
        "runs": results,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for m, r in ratios.items():
            what = "step" if args.whole_step else "drained update"
            say(
                f"math {m}: the default (writes first) over reads always first: {what} {r[timed[-1]]:.3f}x, host peak "
                f"{r['host_peak_gb']:.3f}x, peak RSS {r['peak_rss_mb']:.3f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
