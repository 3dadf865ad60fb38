"""The step time of `delayed_param_update` against the exact update, with the compute and the update on separate cores.

    python benchmarks/delayed_speed.py [--rounds R] [--steps N] [--warmup W] [--batch B] [--layers L] [--embd E]
                                       [--offload-optimizer nvme|host] [--nvme-dir DIR] [--runs A,B] [--json]

ZeRO-Offload's delayed update (`delayed_param_update`, [Note: the delayed parameter update]) runs the host's
optimizer step of update t, and its NVMe traffic, while the device runs the forward and backward of step t+1. It
can only win where the update has hardware of its own: on a GPU machine the host's cores and the disk are idle while
the GPU computes. Without a GPU this benchmark gives the "device" one core (the training thread, 1 intra-op thread)
and leaves the machine's other cores to the update's worker and hetero's I/O threads, which is the same split in
miniature. (benchmarks/step_time.py's `delayed_update` race runs two ranks on two cores, one thread each: there no
core is left for the update, and the race measures only what the delay costs.)

Trains a GPT (hetero.models.gpt, 6 layers, embd 512, vocab 8192, seq 128: 23.2M parameters) at ZeRO-3, one rank,
fp32, fused AdamW, optimizer states on NVMe (or the host), three ways, each in a fresh process, in alternating order
for R rounds:

  exact              the update after backward
  exact_in_backward  `update_in_backward`: each chunk steps in backward as soon as its gradient is final (the exact
                     update's own overlap of the NVMe traffic with compute)
  delayed            `delayed_param_update` from the first update (warm-up 0: the steady state is timed)
  delayed_predicted  the same with `delayed_param_update_prediction` ([Note: predicting past the delay]): the master
                     weights kept apart from the parameters (4 more bytes a parameter each way to NVMe) and the
                     prediction's arithmetic

Reported: each run's median step time over its N timed steps (after W untimed), the lowest median over the rounds
(other load only adds time), and `speedup` (`speedup_predicted`): the faster exact run's step over the delayed
(predicted) run's; `predicted_over_delayed`, the predicted run's step over the delayed one's. `--runs` picks some of
the four. The delayed runs train other trajectories (one update stale, or at a prediction), so their losses
are not compared here; benchmarks/delayed_update.py compares the loss curves.
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

RUNS = ("exact", "exact_in_backward", "delayed", "delayed_predicted")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process: the step times."""
    import torch

    import hetero
    from hetero.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)  # the "device": one core; the update's worker and the I/O threads get the rest
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=8192, n_layer=args.layers, n_head=8, n_embd=args.embd, block_size=128, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    config: dict[str, Any] = {
        "zero_stage": 3,
        "precision": "fp32",
        "offload": {"params": "device", "optimizer": args.offload_optimizer},
        "memory": {"nvme_dir": tempfile.mkdtemp(dir=args.nvme_dir)},
        "progress": False,
    }
    if name == "exact_in_backward":
        config["update_in_backward"] = True
    if name.startswith("delayed"):
        config.update(delayed_param_update=True, delayed_param_update_warmup=0)
    if name == "delayed_predicted":
        config["delayed_param_update_prediction"] = True
    engine = hetero.initialize(model, opt, config)
    g = torch.Generator().manual_seed(args.seed + 1)
    times, waits = [], []
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, 8192, (args.batch, 128), generator=g)
        waited = engine.memory_stats()["wait_seconds"]
        t0 = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            waits.append(engine.memory_stats()["wait_seconds"] - waited)
    engine.close()
    return {"step_s": statistics.median(times), "times": times, "wait_s": statistics.median(waits)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="each run this many times, alternating (default 3)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (default 8)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps first (default 4)")
    ap.add_argument("--batch", type=int, default=4, help="sequences of 128 tokens per step (default 4)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offload-optimizer", default="nvme", choices=("nvme", "host"))
    ap.add_argument("--nvme-dir", default=None, help="where the swap files go (default: a temporary directory)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of lines for people")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"which of {','.join(RUNS)} (default all)")
    ap.add_argument("--one", choices=RUNS, help=argparse.SUPPRESS)  # one run in this process
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 1 or args.batch < 1:
        ap.error("--rounds, --steps, --warmup and --batch must be at least 1")
    if args.nvme_dir is not None and not os.path.isdir(args.nvme_dir):
        ap.error(f"--nvme-dir {args.nvme_dir}: not a directory")
    if args.one:
        print(json.dumps(one(args.one, args)))
        return 0
    scratch = tempfile.TemporaryDirectory(dir=args.nvme_dir)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    say(
        f"GPT {args.layers} layers, embd {args.embd}, batch {args.batch} x 128 tokens, ZeRO-3, 1 rank, 1 compute "
        f"thread, optimizer on {args.offload_optimizer}; {args.warmup} + {args.steps} steps, {args.rounds} rounds"
    )
    runs = tuple(n for n in args.runs.split(",") if n)
    if not runs or any(n not in RUNS for n in runs):
        ap.error(f"--runs: a comma-separated subset of {','.join(RUNS)}")
    medians: dict[str, list[float]] = {n: [] for n in runs}
    waits: dict[str, list[float]] = {n: [] for n in runs}
    with scratch:
        for rnd in range(args.rounds):
            for name in runs if rnd % 2 == 0 else runs[::-1]:  # alternate: a drift of the machine hits all alike
                cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--nvme-dir", scratch.name]
                for flag in ("steps", "warmup", "batch", "layers", "embd", "seed", "offload_optimizer"):
                    cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
                env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
                if out.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                medians[name].append(r["step_s"])
                waits[name].append(r["wait_s"])
                say(f"  round {rnd + 1} {name:18s} {r['step_s']:.3f} s a step (waits {r['wait_s']:.3f} s)")
    best = {n: min(ts) for n, ts in medians.items()}
    exact = min((best[n] for n in ("exact", "exact_in_backward") if n in best), default=None)
    result: dict[str, Any] = {
        "offload_optimizer": args.offload_optimizer,
        "batch": args.batch,
        "layers": args.layers,
        "embd": args.embd,
        "rounds": args.rounds,
        "step_s": {n: round(v, 4) for n, v in best.items()},
        "round_step_s": {n: [round(v, 4) for v in ts] for n, ts in medians.items()},
        "wait_s": {n: [round(v, 4) for v in ts] for n, ts in waits.items()},
    }
    for key, name in (("speedup", "delayed"), ("speedup_predicted", "delayed_predicted")):
        if exact is not None and name in best:
            result[key] = round(exact / best[name], 4)
    if "delayed" in best and "delayed_predicted" in best:  # what the prediction costs the delayed update
        result["predicted_over_delayed"] = round(best["delayed_predicted"] / best["delayed"], 4)
    if args.json:
        print(json.dumps(result))
    else:
        for n in runs:
            say(f"{n:18s} {best[n]:.3f} s a step (lowest of the rounds' medians)")
        if "speedup" in result:
            say(f"delayed update: {result['speedup']:.3f}x the faster exact update's speed")
        if "speedup_predicted" in result:
            say(f"delayed update, predicted: {result['speedup_predicted']:.3f}x the faster exact update's speed")
        if "predicted_over_delayed" in result:
            say(f"the predicted step over the delayed one: {result['predicted_over_delayed']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
