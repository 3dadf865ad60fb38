"""Does the planner rank layouts the way they run? Predicted against measured step times on this machine.

A handful of layouts of the same GPT and global batch on `--world` ranks (gloo, one process each, one thread each):
data parallel at ZeRO 0 / 1 (optimizer states on the host) / 3, tensor parallel (with and without Megatron sequence
parallelism), pipelines (GPipe, 1F1B, interleaved, Chimera). Each is trained through `engine.train_batch` for a few
steps (the median after one to warm up); `hetero.plan` predicts each one's step time with the rates measured here
(`Rates.measure` over the same ranks: a matrix multiply, copies, an all-reduce and its latency), by its stated cost
model (hetero/profiler/planner.py, [Note: the planner's cost model]). Printed: both times per layout, and the
Spearman rank correlation of predicted against measured.

    python benchmarks/planner_ranking.py [--world 2] [--layers 4] [--embd 512] [--seq 32] [--batch 4]
                                         [--steps 5] [--json]

The defaults keep compute from drowning the other terms on a CPU: a wide model on few tokens, so that data-parallel
gradients, offload traffic, pipeline bubbles and tensor collectives separate the layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from ranks import spawn_ranks  # benchmarks/ranks.py (the script's own folder is on sys.path)

# name -> (zero_stage, optimizer placement, parallel section); micro-batches and rows follow the global batch.
LAYOUTS: dict[str, tuple[int, str, dict[str, Any]]] = {
    "dp-zero0": (0, "device", {}),
    "dp-zero3": (3, "device", {}),
    "dp-zero1-optim-host": (1, "host", {}),
    "tp-zero1": (1, "device", {"tensor": 2}),
    "tp-sp-zero1": (1, "device", {"tensor": 2, "sequence": True}),
    "pp-gpipe-m2": (1, "device", {"pipeline": 2, "schedule": "gpipe", "microbatches": 2}),
    "pp-1f1b-m4": (1, "device", {"pipeline": 2, "schedule": "1f1b", "microbatches": 4}),
    "pp-interleaved-m4": (1, "device", {"pipeline": 2, "schedule": "interleaved_1f1b", "microbatches": 4}),
    "pp-chimera-m4": (1, "device", {"pipeline": 2, "schedule": "chimera", "microbatches": 4}),
}


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from hetero.models.gpt import GPTConfig
    from hetero.models.gpt_pipe import GPTPipe

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, n_layer=args.layers, n_head=4, n_embd=args.embd, block_size=args.seq,
                    tie_weights=False)  # fmt: skip
    return GPTPipe(cfg)


def _config(zero: int, optim: str, parallel: dict[str, Any]) -> dict[str, Any]:
    from hetero.models.gpt_pipe import TP_PLAN

    par = {**parallel, "pipeline_split": "params"}
    if par.get("tensor", 1) > 1:
        par["tensor_plan"] = TP_PLAN
    return {"zero_stage": zero, "offload": {"optimizer": optim}, "parallel": par}


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import hetero
    from hetero.comm import init_from_env
    from hetero.profiler import Rates

    comm = init_from_env(backend="gloo", timeout_s=600)
    rates = Rates.measure(comm=comm)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 256, (args.batch, args.seq + 1), generator=g) for _ in range(args.steps + 1)]
    measured = {}
    for name, (zero, optim, parallel) in LAYOUTS.items():
        model = _model(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = hetero.initialize(model, opt, _config(zero, optim, parallel))
        d, r = engine.data_parallel_size, engine.data_parallel_rank
        rows = args.batch // d
        times = []
        for i, batch in enumerate(data):
            x, y = batch[r * rows : (r + 1) * rows, :-1], batch[r * rows : (r + 1) * rows, 1:]
            comm.barrier()
            start = time.perf_counter()
            engine.train_batch(x, y)
            comm.barrier()
            if i:
                times.append(time.perf_counter() - start)
        measured[name] = statistics.median(times)
        engine.close()
    if rank == 0:
        out.put((measured, rates.to_dict()))
    comm.barrier()


def predict(args: argparse.Namespace, rates: dict[str, Any]) -> dict[str, float]:
    """The planner's step time for each layout (an option of `hetero.plan` on this world and batch)."""
    import hetero
    from hetero.models.gpt_pipe import TP_PLAN
    from hetero.profiler import Machine, Rates

    machine = Machine(device_bytes="1TiB", host_bytes="1TiB", nvme_bytes=0, gpus=args.world)
    with torch.device("meta"):
        model = _model(args)
    plan = hetero.plan(model, args.world, machine=machine, rates=Rates(**rates), global_batch=args.batch,
                       seq_len=args.seq, precision="fp32", checkpointing=False, tensor_modes=("1d",),
                       tensor_plan=TP_PLAN)  # fmt: skip
    out = {}
    for name, (zero, optim, parallel) in LAYOUTS.items():
        t, p = parallel.get("tensor", 1), parallel.get("pipeline", 1)
        m = parallel.get("microbatches", 1)
        sched = parallel.get("schedule", "1f1b")
        seq = "megatron" if parallel.get("sequence") else None
        match = [
            o
            for o in plan.options
            if (o.layout["tensor"], o.layout["pipeline"], o.layout["microbatches"], o.layout["sequence"])
            == (t, p, m, seq)
            and o.layout["schedule"] == sched
            and (o.zero_stage, o.offload["optimizer"], o.offload["params"]) == (zero, optim, "device")
        ]
        if len(match) != 1:
            raise RuntimeError(f"planner_ranking: layout {name} is {len(match)} options of the plan, expected 1")
        out[name] = match[0].seconds
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    [(measured, rates)] = spawn_ranks(
        _rank_main, args.world, args, name="planner_ranking", timeout=1800, messages=1
    )  # rank 0 reports for all
    predicted = predict(args, rates)
    names = list(LAYOUTS)
    return {
        "world": args.world,
        "rates": rates,
        "layouts": {n: {"measured_s": measured[n], "predicted_s": predicted[n]} for n in names},
        "spearman": spearman([predicted[n] for n in names], [measured[n] for n in names]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="ranks (processes)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per layout (median), after one warm-up")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object instead of text")
    ap.add_argument("--save", help="also write the JSON object to this file")
    args = ap.parse_args(argv)
    out = run(args)
    out["load_average"] = list(os.getloadavg())  # the machine is shared: the noise behind the figures
    if args.save:
        with open(args.save, "w") as f:
            json.dump(out, f)
    if args.json:
        print(json.dumps(out))
        return 0
    from hetero.profiler import Rates

    print(f"load average {out['load_average'][0]:.1f} (1 min), {out['load_average'][1]:.1f} (5 min)")
    print(f"planner ranking on {args.world} ranks (GPT {args.layers} x {args.embd}, batch {args.batch} x {args.seq})")
    print(f"rates measured here: {Rates(**out['rates']).describe()}")
    rows = sorted(out["layouts"].items(), key=lambda kv: kv[1]["measured_s"])
    for name, r in rows:
        print(f"  {name:<22} measured {r['measured_s'] * 1000:8.1f} ms   predicted {r['predicted_s'] * 1000:8.1f} ms")
    print(f"Spearman rank correlation, predicted vs measured: {out['spearman']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
