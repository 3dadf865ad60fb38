"""The host memory and time of an update that streams its optimizer states from NVMe, with and without a bound on the
write-backs waiting behind reads.

    python benchmarks/update_stream.py --nvme-dir DIR [--rounds R] [--steps N] [--math cpu,none] [--backlog auto,none]
                                       [--layers L --hidden H --intermediate I --vocab V] [--json]

[Note: a bounded write backlog] (hetero/memory/lanes.py): the NVMe tier serves reads before writes, and an update
whose math is quick next to the disk keeps the read lane full, so without a bound its write-backs wait until its last
read and their host buffers with them. This benchmark trains transformers' LlamaForCausalLM (16 layers of 1024, MLP
2752, vocab 8000: 218M parameters in about as many chunks as gpu_race.py's 551M model) at ZeRO-3, one rank, bf16 with
fp32 master weights, fused AdamW, parameters and optimizer states on NVMe with the parameters kept on the host
(`offload.params_host_bytes` at DeepSpeed's `max_in_cpu` default, as in gpu_race.py's `hetero_nvme`), and times its
updates four ways, each in a fresh process, alternating for R rounds:

  math    cpu: the update's AdamW runs on this machine's cores (2 on the development VM);
          none: the math is left out, standing in for a machine whose cores step a chunk in a fraction of its I/O
          (a GPU machine's 16: one H100's race held nearly all its 6.7 GB of states on the host)
  backlog auto: the store's default bound (one 8 MiB block per I/O thread); none: reads always first, as before

Reported per run (median over N timed updates after one untimed step): `update_s`, the update's own time;
`drained_s`, until its last write-back landed (`manager.synchronize()`); `gb_per_s`, the NVMe bytes it moved over
`drained_s`; `host_peak_gb`, the host tier's peak from the update's start until drained; `states_gb`, the optimizer
states streamed; and the process's peak RSS over the timed steps (VmHWM reset after the first step where the kernel
allows). The figures of the rounds are each run's best (lowest) medians. GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
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


def one(math: str, backlog: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process."""
    import torch

    import hetero
    from hetero.memory import Tier

    os.environ["HETERO_NVME_WRITE_BACKLOG"] = "" if backlog == "auto" else backlog  # read when the store is made
    torch.manual_seed(args.seed)
    model = llama(argparse.Namespace(**vars(args), heads=max(1, args.hidden // 128), seq=64))
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    config = {
        "zero_stage": 3,
        "precision": "bf16",
        "offload": {"params": "nvme", "optimizer": "nvme", "params_host_bytes": 2 * 10**9},
        "memory": {"nvme_dir": tempfile.mkdtemp(dir=args.nvme_dir)},
        "progress": False,
    }
    engine = hetero.initialize(model, opt, config)
    if math == "none":
        import hetero.zero.update as update

        update.step_chunk = lambda *a, **k: None  # the states are still read, handed to the step, and written back
    manager = engine.manager
    g = torch.Generator().manual_seed(args.seed + 1)
    rows: list[dict[str, float]] = []
    hwm_reset = False
    for i in range(1 + args.steps):
        x = torch.randint(0, args.vocab, (1, 64), generator=g)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        manager.synchronize()
        manager.reset_peaks()
        before = sum(n for (s, d), n in manager.moved.items() if Tier.NVME in (s, d))
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        manager.synchronize()
        t2 = time.perf_counter()
        moved = sum(n for (s, d), n in manager.moved.items() if Tier.NVME in (s, d)) - before
        if i == 0:
            hwm_reset = _reset_hwm()
            continue
        rows.append(
            {
                "update_s": t1 - t0,
                "drained_s": t2 - t0,
                "gb_per_s": moved / 1e9 / (t2 - t0),
                "host_peak_gb": manager.ledgers[Tier.HOST].peak / 1e9,
            }
        )
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
    ap.add_argument("--backlog", default=",".join(BACKLOGS), help="comma-separated: auto, none (default both)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of lines for people")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # MATH:BACKLOG, one run in this process
    args = ap.parse_args(argv)
    maths, backlogs = args.math.split(","), args.backlog.split(",")
    if bad := [m for m in maths if m not in MATHS] + [b for b in backlogs if b not in BACKLOGS]:
        ap.error(f"unknown --math or --backlog value(s) {bad}: --math takes {MATHS}, --backlog {BACKLOGS}")
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
        f"Llama {args.layers} layers of {args.hidden}, bf16, ZeRO-3, 1 rank, states on NVMe; {args.steps} timed "
        f"updates, {args.rounds} rounds"
    )
    results: dict[str, list[dict[str, Any]]] = {f"{m}:{b}": [] for m, b in runs}
    for rnd in range(args.rounds):
        for m, b in runs if rnd % 2 == 0 else runs[::-1]:  # alternate: a drift of the machine hits all alike
            cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{m}:{b}", "--nvme-dir", args.nvme_dir]
            for flag in ("layers", "hidden", "intermediate", "vocab", "steps", "seed"):
                cmd += [f"--{flag}", str(getattr(args, flag))]
            env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
            if out.returncode != 0:
                raise SystemExit(f"math {m}, backlog {b} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[f"{m}:{b}"].append(r)
            say(
                f"  round {rnd + 1} math {m:4s} backlog {b:4s}: update {r['update_s']:.2f} s, drained "
                f"{r['drained_s']:.2f} s ({r['gb_per_s']:.2f} GB/s), host peak {r['host_peak_gb']:.2f} GB of "
                f"{r['states_gb']:.2f} GB states, peak RSS {r['peak_rss_mb']:.0f} MB"
            )
    best: dict[str, dict[str, Any]] = {}
    for key, rs in results.items():
        best[key] = {k: min(r[k] for r in rs) for k in ("update_s", "drained_s", "host_peak_gb", "peak_rss_mb")}
        best[key]["gb_per_s"] = max(r["gb_per_s"] for r in rs)
        best[key]["states_gb"] = rs[0]["states_gb"]
    ratios = {}
    for m in maths:
        a, b = best.get(f"{m}:auto"), best.get(f"{m}:none")
        if a and b:
            ratios[m] = {k: a[k] / b[k] for k in ("drained_s", "host_peak_gb", "peak_rss_mb")}
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "vocab", "rounds", "steps")}
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
            say(
                f"math {m}: bounded backlog over reads-always-first: drained update {r['drained_s']:.3f}x, host peak "
                f"{r['host_peak_gb']:.3f}x, peak RSS {r['peak_rss_mb']:.3f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
