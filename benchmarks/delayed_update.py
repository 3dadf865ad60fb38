"""The loss curve of `delayed_param_update` against the exact update, with and without the warm-up.

    python benchmarks/delayed_update.py [--steps N] [--window W] [--warmup K] [--lr LR] [--seed S]
                                        [--offload-optimizer nvme|host] [--jobs J] [--png PATH] [--keep DIR] [--json]

Trains examples/train_gpt.py (its byte-level GPT on the shipped corpus, ZeRO-3, one rank, fp32) three times from
the same seed on the same batches, each in a fresh process:

  exact            the exact update
  delayed_warmup   delayed_param_update after K exact updates (delayed_param_update_warmup, default 40 as in the
                   ZeRO-Offload paper)
  delayed          delayed_param_update from the first update (warm-up 0)
  predicted        delayed_warmup with delayed_param_update_prediction: forward and backward on a prediction of the
                   weights the pending update gives ([Note: predicting past the delay] in hetero/zero/predict.py)

With --plain, plain PyTorch trains the same model on the same batches with the same optimizer, schedule and clipping
through the same algorithms (runs `plain_exact`, `plain_delayed_warmup`, ...: two copies of the weights, the
gradient of update t taken at the weights of update t-2 once the delay runs, or at their prediction), so a gap can
be told apart from an engine bug: `engine_vs_plain` is the largest loss difference between hetero and plain
PyTorch over the first `--warmup` + 10 steps, before rounding differences grow chaotically.

Losses are deterministic (one process, one thread each), so other load on the machine changes the wall times but
not the curves. Reported per run: the mean loss over the last W steps; per delayed run, its gap to the exact run
over that window, as a mean of the per-step differences (the runs see the same batches, so the batch-to-batch
noise that both curves share cancels) with that mean's standard error; `within_noise` says whether the gap is at
most two standard errors, i.e. the curves cannot be told apart at this resolution. With matplotlib, --png draws
the three curves (each a W-step moving average over the raw losses).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")
RUNS = ("exact", "delayed_warmup", "delayed", "predicted")


def run_flags(name: str, warmup: int) -> list[str]:
    if name == "exact":
        return []
    flags = ["--delayed-param-update", "--delayed-update-warmup", str(0 if name == "delayed" else warmup)]
    return flags + (["--delayed-update-prediction"] if name == "predicted" else [])


def train(name: str, args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    """One run of the example in a fresh process; its JSON result."""
    nvme = os.path.join(scratch, name)
    os.makedirs(nvme, exist_ok=True)
    cmd = [sys.executable, EXAMPLE, "--steps", str(args.steps), "--seed", str(args.seed), "--json"]
    cmd += ["--sample-tokens", "1", "--offload-optimizer", args.offload_optimizer, "--nvme-dir", nvme]
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    cmd += run_flags(name, args.warmup)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HETERO_PROGRESS": "0"}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=os.path.join(ROOT, "examples"))
    if done.returncode != 0:
        raise RuntimeError(f"{name}: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    result = json.loads(line)
    result["wall_s"] = time.perf_counter() - t0
    result["command"] = " ".join(cmd)
    return result


def train_plain(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Plain PyTorch through the algorithm of run `name` (without its `plain_` prefix), as examples/train_gpt.py
    sets the model, data, optimizer, schedule and clipping up: the forward model holds the weights the last applied
    update gave; the master copy, which the optimizer steps, runs one update ahead once the delay runs."""
    import copy

    import torch

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from corpus import VOCAB_SIZE, batches, load_corpus
    from train_gpt import BLOCK_SIZE, param_groups, warmup_cosine

    from hetero.models import GPT, GPTConfig

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, n_layer=4, n_head=4, n_embd=128, block_size=BLOCK_SIZE))
    master = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(master, 0.1), lr=args.lr or 3e-3, betas=(0.9, 0.95))
    sched = warmup_cosine(opt, steps=args.steps)
    data = batches(load_corpus(), block_size=BLOCK_SIZE, batch_size=8, seed=args.seed)
    exact_until = {"exact": args.steps, "delayed_warmup": args.warmup, "delayed": 0, "predicted": args.warmup}[name]
    predictor = PlainPrediction(opt) if name == "predicted" else None
    losses = []
    t0 = time.perf_counter()
    for update in range(1, args.steps + 1):
        loss = model(**next(data)).loss
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():  # the boundary: the pending update's values reach the model, its gradient the master
            for p, pm in zip(model.parameters(), master.parameters()):
                pm.grad, p.grad = p.grad, None
            torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
            if update > exact_until + 1 or (update > exact_until and predictor is None):
                for p, pm in zip(model.parameters(), master.parameters()):
                    p.copy_(pm if predictor is None else predictor.forward_weights(pm))
        opt.step()
        opt.zero_grad()
        if predictor is not None and update > exact_until:
            predictor.after_step()
        sched.step()
        if update <= exact_until:  # an exact update: the model takes its values at once
            with torch.no_grad():
                for p, pm in zip(model.parameters(), master.parameters()):
                    p.copy_(pm)
    return {"losses": losses, "seconds": time.perf_counter() - t0, "command": f"plain PyTorch, {name}"}


class PlainPrediction:
    """[Note: predicting past the delay] (hetero/zero/predict.py) in plain PyTorch, for AdamW (and SGD): after each
    delayed update the pending values are the new weights minus the next update's drift (for Adam divided by the
    per-tensor mean of sqrt(v-hat) of the update before, or by the least sqrt(v-hat) the next update can have where
    that is larger); at the next boundary they lose the fresh part, the clipped gradient divided likewise by the
    newest means, and become the weights the model runs on."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self.sgd = type(opt).__name__ == "SGD"
        self.values: dict[Any, Any] = {}  # per master parameter: the pending values
        self.scale: dict[Any, float] = {}  # per master parameter: mean sqrt(v-hat) after its last update
        self.sums: dict[Any, float] = {}  # the pending update's means, not yet the scales

    def group_of(self, pm: Any) -> dict[str, Any]:
        return next(g for g in self.opt.param_groups if any(q is pm for q in g["params"]))

    def forward_weights(self, pm: Any) -> Any:
        """At the boundary of the next update (its gradient in pm.grad, clipped, not stepped yet)."""
        self.scale.update(self.sums)  # refresh, once per boundary (the first parameter's call)
        self.sums = {}
        out = self.values.get(pm, pm).clone()
        g = self.group_of(pm)
        if self.sgd:
            mu, damp = g["momentum"], g["dampening"]
            c = g["lr"] * ((1 + mu * (1 - damp)) if g["nesterov"] else (1 - damp if mu != 0 else 1.0))
            out.add_(pm.grad, alpha=-c)
        elif pm in self.scale:
            (b1, b2), k = g["betas"], float(self.opt.state[pm]["step"]) + 1
            s = self.scale[pm] + g["eps"]
            bound = math.sqrt((1 - b2**k) / (1 - b2)) * s  # |g| / sqrt(v-hat) of update k is at most bound / s
            out.add_(pm.grad.clamp(min=-bound, max=bound), alpha=-g["lr"] * (1 - b1) / (1 - b1**k) / s)
        return out

    def after_step(self) -> None:
        """Beside the update: its values minus the next drift, and its means."""
        import torch

        with torch.no_grad():
            for g in self.opt.param_groups:
                lr = g["lr"]
                for pm in g["params"]:
                    st = self.opt.state[pm]
                    self.values[pm] = pm.clone()
                    if self.sgd:
                        mu = g["momentum"]
                        if mu != 0:
                            self.values[pm].add_(st["momentum_buffer"], alpha=-lr * (mu * mu if g["nesterov"] else mu))
                        continue
                    (b1, b2), k = g["betas"], float(st["step"])
                    self.sums[pm] = float(st["exp_avg_sq"].sqrt().sum(dtype=torch.float64)) / math.sqrt(1 - b2**k)
                    self.sums[pm] /= pm.numel()
                    if pm in self.scale:  # the least sqrt(v-hat) of update k + 1 is q sqrt(v), where above the scale
                        q = math.sqrt(b2 / (1 - b2 ** (k + 1)))
                        root = st["exp_avg_sq"].sqrt().clamp_(min=(self.scale[pm] + g["eps"]) / q)
                        if lr * g["weight_decay"] != 0 and g.get("decoupled_weight_decay", True):  # L2: in g
                            self.values[pm].mul_(1 - lr * g["weight_decay"])
                        self.values[pm].addcdiv_(st["exp_avg"], root, value=-lr * b1 / (1 - b1 ** (k + 1)) / q)


def run_one(name: str, args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    if not name.startswith("plain_"):
        return train(name, args, scratch)
    cmd = [sys.executable, os.path.abspath(__file__), "--plain-run", name.removeprefix("plain_")]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed)]
    cmd += ["--lr", str(args.lr)] if args.lr is not None else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def gap(delayed: list[float], exact: list[float], window: int) -> dict[str, float | bool]:
    """The delayed run's loss minus the exact run's over the last `window` steps, paired step by step."""
    d = [a - b for a, b in zip(delayed[-window:], exact[-window:])]
    m = mean(d)
    se = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) if len(d) > 1 else math.inf
    return {"gap": m, "gap_relative": m / mean(exact[-window:]), "stderr": se, "within_noise": abs(m) <= 2 * se}


def moving_average(xs: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x - (xs[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(results: dict[str, dict[str, Any]], window: int, warmup: int, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = {
        "exact": "exact",
        "delayed_warmup": f"delayed after {warmup} exact",
        "delayed": "delayed from step 1",
        "predicted": f"delayed after {warmup} exact, predicted",
    }
    colors = {"exact": "tab:blue", "delayed_warmup": "tab:orange", "delayed": "tab:green", "predicted": "tab:red"}
    for name, r in results.items():
        base, plain = name.removeprefix("plain_"), name.startswith("plain_")
        label = f"{labels[base]}, plain PyTorch" if plain else labels[base]
        xs, ys = range(1, len(r["losses"]) + 1), moving_average(r["losses"], window)
        ax.plot(
            xs, ys, label=label, color=colors[base], linestyle="--" if plain else "-", linewidth=1 if plain else 1.5
        )
    ax.axvline(warmup, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("update")
    ax.set_ylabel(f"training loss ({window}-step moving average)")
    ax.set_title("examples/train_gpt.py: delayed_param_update against the exact update")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="optimizer updates per run (default 300)")
    ap.add_argument("--window", type=int, default=20, help="steps at the end that are averaged (default 20)")
    ap.add_argument("--warmup", type=int, default=40, help="exact updates before delaying (default 40, the paper's)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the example's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offload-optimizer", default="nvme", choices=("host", "nvme"))
    ap.add_argument("--runs", default=",".join(RUNS), help=f"which of {','.join(RUNS)} (default all)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (default 1); the losses do not depend on it")
    ap.add_argument("--png", default=None, help="draw the curves to this PNG (needs matplotlib)")
    ap.add_argument("--keep", default=None, help="write each run's JSON result into this directory")
    ap.add_argument("--plain", action="store_true", help="also run the same algorithms in plain PyTorch")
    ap.add_argument("--plain-run", choices=RUNS, help=argparse.SUPPRESS)  # one plain run in this process
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of lines for people")
    args = ap.parse_args()
    if args.plain_run:
        print(json.dumps(train_plain(args.plain_run, args)))
        return
    names = [n for n in args.runs.split(",") if n]
    if not names or any(n not in RUNS for n in names) or "exact" not in names:
        ap.error(f"--runs: a comma-separated subset of {','.join(RUNS)} that includes exact")
    if args.plain:
        names += [f"plain_{n}" for n in names]
    if args.steps < 2 or not 2 <= args.window <= args.steps or args.warmup < 0 or args.jobs < 1:
        ap.error("need --steps >= 2, 2 <= --window <= --steps, --warmup >= 0 and --jobs >= 1")

    with tempfile.TemporaryDirectory(prefix="hetero-delayed-") as scratch, ThreadPoolExecutor(args.jobs) as pool:
        futures = {n: pool.submit(run_one, n, args, scratch) for n in names}
        results = {n: f.result() for n, f in futures.items()}
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        for n, r in results.items():
            with open(os.path.join(args.keep, f"{n}.json"), "w") as f:
                json.dump(r, f, default=str)

    out: dict[str, Any] = {
        "steps": args.steps,
        "window": args.window,
        "warmup": args.warmup,
        "lr": args.lr,
        "seed": args.seed,
        "offload_optimizer": args.offload_optimizer,
        "runs": {},
    }
    for n, r in results.items():
        entry: dict[str, Any] = {
            "final_window_mean": mean(r["losses"][-args.window :]),
            "first_loss": r["losses"][0],
            "max_loss_after_step_10": max(r["losses"][10:]) if len(r["losses"]) > 10 else None,
            "seconds": r["seconds"],
            "command": r["command"],
            "losses": r["losses"],
        }
        plain = n.startswith("plain_")
        if n.removeprefix("plain_") != "exact":
            entry.update(gap(r["losses"], results["plain_exact" if plain else "exact"]["losses"], args.window))
        if not plain and f"plain_{n}" in results:
            head = min(args.warmup + 10, args.steps)
            entry["engine_vs_plain"] = max(
                abs(a - b) for a, b in zip(r["losses"][:head], results[f"plain_{n}"]["losses"])
            )
        out["runs"][n] = entry
    if args.png:
        out["png"] = args.png if plot(results, args.window, args.warmup, args.png) else None

    if args.json:
        print(json.dumps(out))
        return
    lr = f"lr {args.lr}" if args.lr is not None else "the example's lr"
    print(f"examples/train_gpt.py, {args.steps} updates, {lr}, seed {args.seed}, states on {args.offload_optimizer}")
    print(f"mean loss over the last {args.window} updates:")
    for n, e in out["runs"].items():
        line = f"  {n:<21} {e['final_window_mean']:.4f}   ({e['seconds']:.0f} s of training)"
        if "gap" in e:
            verdict = "within noise" if e["within_noise"] else "apart"
            line += f"   gap {e['gap']:+.4f} ({100 * e['gap_relative']:+.1f}%, stderr {e['stderr']:.4f}: {verdict})"
        if "engine_vs_plain" in e:
            head = min(args.warmup + 10, args.steps)
            line += f"   vs plain PyTorch over the first {head} steps: {e['engine_vs_plain']:.2g}"
        print(line)
    if args.png:
        print(f"curves: {out['png']}" if out["png"] else "curves: not drawn (matplotlib is not installed)")


if __name__ == "__main__":
    main()
