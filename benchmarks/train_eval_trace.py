"""Training steps right after an evaluation: one access trace per kind of step against one shared trace.

An evaluation every few steps (a forward under torch.no_grad(), as HF's Trainer and most loops write it) used to
become the manager's trace: the training step after it replayed a forward only, prefetched nothing for its backward
and update, and evicted by the evaluation's future ([Note: one trace per kind of step] in hetero/memory/policy.py).
This runs the same loop both ways on a small GPT at ZeRO stage 3 with a device budget of a few chunks, parameters and
optimizer states on the host (or `--nvme`: on NVMe, with a host budget that holds a fraction of them), and reports,
for the training steps after a training step and those after an evaluation: demand loads (an access that found its
chunk neither where wanted nor on its way), bytes moved, time the training thread waited for moves, and step time.
"shared" emulates the old single trace by giving every step the kind "train".

    python benchmarks/train_eval_trace.py [--layers 8] [--embd 256] [--rounds 6] [--every 3] [--nvme DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

import hetero
from hetero.models.gpt import GPT, GPTConfig


def run(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=args.layers, n_head=4, n_embd=args.embd, block_size=64, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    chunk = args.embd * args.embd * 4  # elements: a layer's MLP weight per chunk, about
    nb = chunk * 4
    memory: dict[str, Any] = {"device_budget": args.device_chunks * nb}
    offload = {"params": "host", "optimizer": "host"}
    if args.nvme:
        memory |= {"nvme_dir": args.nvme, "host_budget": args.host_chunks * nb}
        offload = {"params": "nvme", "optimizer": "nvme"}
    engine = hetero.initialize(model, opt, {"zero_stage": 3, "chunk_size": chunk, "offload": offload, "memory": memory})
    m = engine.manager
    if mode == "shared":  # the old behaviour: every step replays (and overwrites) one trace
        begin = m.step_begin
        m.step_begin = lambda kind="train": begin("train")  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (args.rows, 64), generator=g)
    y = torch.randint(0, 256, (args.rows, 64), generator=g)

    def snap() -> tuple:
        return (m.counters["prefetch_misses"], sum(m.moved.values()), m.wait_seconds, time.perf_counter())

    def train() -> tuple:
        engine.train()
        before = snap()
        engine.backward(engine(x, labels=y).loss)
        engine.step()
        after = snap()
        return tuple(b - a for a, b in zip(before, after))

    def evaluate() -> None:
        engine.eval()
        with torch.no_grad():
            engine(x, labels=y)

    for _ in range(2):  # record the training trace, replay it once
        train()
    evaluate()  # record the evaluation's (the first of its kind, in either mode)
    train()
    after_train, after_eval = [], []
    for _ in range(args.rounds):
        for i in range(args.every):
            (after_eval if i == 0 else after_train).append(train())
        evaluate()
    engine.close()

    def summary(steps: list[tuple]) -> dict[str, float]:
        return {
            "steps": len(steps),
            "demand_loads": statistics.mean(s[0] for s in steps),
            "moved_mb": statistics.mean(s[1] for s in steps) / 2**20,
            "wait_ms": 1e3 * statistics.median(s[2] for s in steps),
            "step_ms": 1e3 * statistics.median(s[3] for s in steps),
        }

    return {"after_train": summary(after_train), "after_eval": summary(after_eval), "mismatches": m.trace.mismatches}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6, help="evaluations measured")
    p.add_argument("--every", type=int, default=3, help="training steps between evaluations")
    p.add_argument("--device-chunks", type=int, default=4, help="device budget, in chunks")
    p.add_argument("--nvme", default=None, help="a directory: parameters and states on NVMe there")
    p.add_argument("--host-chunks", type=int, default=12, help="host budget with --nvme, in chunks")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = {mode: run(args, mode) for mode in ("shared", "per_kind")}
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        print()
        return
    head = ("trace", "training step", "n", "demand loads", "moved MB", "wait ms", "step ms")
    print("{:<9} {:<13} {:>3} {:>13} {:>9} {:>8} {:>8}".format(*head))
    for mode, res in out.items():
        for when in ("after_train", "after_eval"):
            s = res[when]
            print(
                f"{mode:<9} {when:<13} {s['steps']:>3} {s['demand_loads']:>13.1f} {s['moved_mb']:>9.1f} "
                f"{s['wait_ms']:>8.1f} {s['step_ms']:>8.1f}"
            )
        print(f"{mode:<9} trace mismatches: {res['mismatches']}")


if __name__ == "__main__":
    main()
