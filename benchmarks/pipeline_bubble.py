"""Pipeline bubble and activation memory per schedule: measured on real ranks, against the theory.

For each schedule (GPipe, 1F1B, interleaved 1F1B, Chimera) this runs p pipeline ranks (gloo, one process each)
through hetero's pipeline runtime and reports
- the idle ("bubble") fraction: 1 - (time spent computing, summed over ranks) / (p x the batch's makespan), against
  the textbook (p - 1) / (m + p - 1), divided by v for the interleaved schedule, Chimera's (p - 2) / (2m + p - 2)
  (Li and Hoefler: forward and backward counted as equal slots, so compare it at --backward-ratio 1), and against
  the exact value of the same programs in `schedule.simulate_programs` at the measured ratio;
- per stage, the peak of activation bytes saved for backward alive at once, and the most micro-batches in flight
  (1F1B: at most p - rank; GPipe: all m; Chimera: at most p);
- stages balanced by time against stages balanced by parameters (`pipeline_split` "auto" vs "params") on a model
  with uneven units: an embedding-like first unit holding most parameters and taking almost no time, then 2p equal
  units; "auto" times the units in a warm-up (hetero.parallel.pipeline.balance), 1F1B runs both splits.

Two modes, named on every line:
- `sleep` (default): each unit's forward and backward is a fixed-duration wait (t_f, t_b = 2 t_f), so what is
  measured is the schedule and the transfers, not CPU contention: ranks sleeping do not compete for cores. Use it on
  a machine with fewer cores than ranks (this one has 2).
- `compute`: each unit is an MLP doing real matrix work; on a machine with fewer cores than ranks the ranks contend,
  and the measured bubble mixes schedule and contention.

The model has p x v units (v = --virtual), so every schedule does the same work: GPipe and 1F1B run v units per
stage, the interleaved schedule one unit per model chunk.

    python benchmarks/pipeline_bubble.py [--stages 4] [--microbatches 8] [--virtual 2] [--mode sleep|compute]
                                         [--t-forward-ms 20] [--backward-ratio 2] [--iters 3] [--json]
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
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "chimera")


class _Sleep(torch.autograd.Function):
    """y = x * w, with a fixed wait in forward and in backward; saves x for backward like a real layer would."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, t_f: float, t_b: float) -> torch.Tensor:
        time.sleep(t_f)
        ctx.t_b = t_b
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        time.sleep(ctx.t_b)
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum().reshape(w.shape), None, None


class SleepUnit(nn.Module):
    def __init__(self, t_f: float, t_b: float, params: int = 1) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.table = nn.Parameter(torch.zeros(params - 1)) if params > 1 else None  # an embedding's weight, unused
        self.t_f, self.t_b = t_f, t_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.w, self.t_f, self.t_b)


def mlp_unit(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from hetero.comm import init_from_env
    from hetero.device import Device
    from hetero.parallel.pipeline.balance import unit_costs
    from hetero.parallel.pipeline.runtime import PipelineRuntime
    from hetero.parallel.pipeline.split import keep_stages, units_of

    comm = init_from_env(backend="gloo", timeout_s=300)
    p, m, v = world, args.microbatches, args.virtual
    t_f = args.t_forward_ms / 1000 / v  # per unit: a stage of v units takes t_f in all
    t_b = args.backward_ratio * t_f

    def unit() -> nn.Module:
        return SleepUnit(t_f, t_b) if args.mode == "sleep" else mlp_unit(args.width)

    def measure(name: str, model: nn.Module, chunks: list, vs: int) -> dict[str, Any]:
        rt = PipelineRuntime(chunks, comm, schedule=name, microbatches=m, virtual=vs, device=torch.device("cpu"))
        rt.measure = True
        x = [torch.randn(args.rows, args.width) for _ in range(m)]
        rows = []
        for it in range(args.iters + 1):  # the first batch warms up
            comm.barrier()
            t0 = time.perf_counter()
            rt.run(x, [None] * m, loss_fn=lambda y, _: y.float().pow(2).mean(), loss_scale=1 / m,
                   after_forward=lambda: None, after_backward=lambda: None)  # fmt: skip
            wall = time.perf_counter() - t0
            busy = sum(e - s for _, s, e in rt.stats.actions)  # transfers happen between actions, not in them
            if it:
                rows.append((wall, busy, rt.stats.peak_saved_bytes, rt.stats.peak_in_flight))
            model.zero_grad(set_to_none=True)
        return {
            "wall_s": statistics.median(r[0] for r in rows),
            "busy_s": statistics.median(r[1] for r in rows),
            "peak_saved_bytes": max(r[2] for r in rows),
            "peak_in_flight": max(r[3] for r in rows),
            "virtual": vs,
        }

    results = {}
    for name in args.schedules:
        vs = v if name == "interleaved_1f1b" else 1
        torch.manual_seed(0)
        model = nn.Sequential(*[unit() for _ in range(p * v)])
        split = [str(i) for i in range(0, p * v, v // vs)][1:]  # equal stages
        chunks = keep_stages(model, rank=rank, ranks=p, virtual=vs, split=split, bidirectional=name == "chimera")
        results[name] = measure(name, model, chunks, vs)
    # Uneven units: stages by time ("auto", timed here) against stages by parameters.
    for split in ("auto", "params") if args.uneven else ():
        torch.manual_seed(0)
        heavy = SleepUnit(t_f / 50, t_b / 50, params=args.embedding_params)
        model = nn.Sequential(heavy, *[SleepUnit(t_f / 2, t_b / 2) for _ in range(2 * p)])
        costs = None
        if split == "auto":
            sample = torch.randn(args.rows, args.width)
            costs, _ = unit_costs(model, units_of(model), given=None, world=comm, device=Device("cpu"), sample=sample)
        chunks = keep_stages(model, rank=rank, ranks=p, virtual=1, split=split, costs=costs)
        results[f"uneven-{split}"] = measure("1f1b", model, chunks, 1)
        results[f"uneven-{split}"]["units"] = [n for c in chunks for n, _ in c.units]
    out.put((rank, results))
    comm.barrier()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hetero.parallel.pipeline import schedule as S

    p = args.stages
    found = spawn_ranks(_rank_main, p, args, name="pipeline_bubble", timeout=600)
    per_rank: dict[int, dict] = dict(found)
    out: dict[str, Any] = {
        "mode": args.mode,
        "stages": p,
        "microbatches": args.microbatches,
        "t_forward_ms": args.t_forward_ms,
        "backward_ratio": args.backward_ratio,
        "schedules": {},
    }
    for name in args.schedules:
        ranks = [per_rank[r][name] for r in range(p)]
        v = ranks[0]["virtual"]
        makespan = max(x["wall_s"] for x in ranks)
        measured = 1 - sum(x["busy_s"] for x in ranks) / (p * makespan)
        progs = S.programs(name, p, args.microbatches, v)
        sim = S.simulate_programs(p, progs, t_f=1.0 / v, t_b=args.backward_ratio / v)
        per_mb = ranks[-1]["peak_saved_bytes"] / max(1, ranks[-1]["peak_in_flight"])
        theory = S.theory_bubble(name, p, args.microbatches, v)
        out["schedules"][name] = {
            "virtual": v,
            "batch_s": makespan,
            "bubble_measured": measured,
            "bubble_theory": theory,
            "bubble_simulated": sim.idle_fraction,
            "measured_vs_theory": (measured - theory) / theory if theory else None,
            "peak_in_flight_per_stage": [x["peak_in_flight"] for x in ranks],
            "peak_saved_bytes_per_stage": [x["peak_saved_bytes"] for x in ranks],
            "saved_bytes_per_microbatch_chunk": per_mb,
        }
    out["uneven"] = {}
    for split in ("auto", "params") if args.uneven else ():
        ranks = [per_rank[r][f"uneven-{split}"] for r in range(p)]
        makespan = max(x["wall_s"] for x in ranks)
        out["uneven"][split] = {
            "batch_s": makespan,
            "bubble_measured": 1 - sum(x["busy_s"] for x in ranks) / (p * makespan),
            "stages": [x["units"] for x in ranks],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=4, help="pipeline ranks p (processes)")
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches m per batch")
    ap.add_argument("--virtual", type=int, default=2, help="model chunks per rank v for the interleaved schedule")
    ap.add_argument("--mode", choices=("sleep", "compute"), default="sleep")
    ap.add_argument("--t-forward-ms", type=float, default=20.0, help="sleep mode: one stage's forward")
    ap.add_argument("--backward-ratio", type=float, default=2.0, help="sleep mode: backward time / forward time")
    ap.add_argument("--embedding-params", type=int, default=1 << 22, help="parameters of the uneven model's first unit")
    ap.add_argument("--width", type=int, default=256, help="activation width (compute mode: MLP width)")
    ap.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    ap.add_argument("--iters", type=int, default=3, help="measured batches per schedule (median)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated schedules to run")
    ap.add_argument("--no-uneven", dest="uneven", action="store_false", help="skip the uneven-units comparison")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object instead of text")
    args = ap.parse_args(argv)
    args.schedules = [x for x in args.schedules.split(",") if x]
    unknown = sorted(set(args.schedules) - set(SCHEDULES))
    if unknown:
        ap.error(f"--schedules: unknown {unknown}; choose from {', '.join(SCHEDULES)}")
    if args.microbatches % args.stages or args.stages % 2:
        ap.error("--stages must be even and --microbatches a multiple of it (interleaved and Chimera need it)")
    out = run(args)
    out["load_average"] = list(os.getloadavg())  # the machine is shared: the noise behind the figures
    if args.json:
        print(json.dumps(out))
        return 0
    p, m = args.stages, args.microbatches
    work = (
        f"forward {args.t_forward_ms} ms/stage, backward {args.backward_ratio:g}x"
        if args.mode == "sleep"
        else f"MLP width {args.width}"
    )
    print(f"load average {out['load_average'][0]:.1f} (1 min), {out['load_average'][1]:.1f} (5 min)")
    print(f"pipeline bubble, mode={args.mode} (p={p} stages, m={m} micro-batches, {work}, {args.rows} rows)")
    for name, r in out["schedules"].items():
        rel = r["measured_vs_theory"]
        print(
            f"  [{args.mode}] {name:<17} v={r['virtual']}  batch {r['batch_s'] * 1000:7.1f} ms  bubble measured "
            f"{r['bubble_measured']:.3f}  theory {r['bubble_theory']:.3f}"
            + (f" ({100 * rel:+.1f}%)" if rel is not None else "")
            + f"  simulated {r['bubble_simulated']:.3f}"
        )
        mib = [b / 2**20 for b in r["peak_saved_bytes_per_stage"]]
        print(
            f"  [{args.mode}] {'':<17} peak micro-batches in flight per stage {r['peak_in_flight_per_stage']}, "
            f"peak saved activations per stage {', '.join(f'{x:.2f}' for x in mib)} MiB"
        )
    if args.uneven:
        print(f"uneven units (first unit {args.embedding_params:,} parameters, 1/50 of a unit's time), 1F1B:")
    for split, r in out["uneven"].items():
        stages = " | ".join(",".join(units) for units in r["stages"])
        print(
            f"  [{args.mode}] split {split:<6} batch {r['batch_s'] * 1000:7.1f} ms  bubble measured "
            f"{r['bubble_measured']:.3f}  stages {stages}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
