"""CPU collectives between ranks of one host: hetero's cross-memory transport against gloo, in the same processes.

Two (or --world) ranks on gloo, one thread each. For each size, every operation ZeRO uses (all-gather, reduce-scatter,
all-reduce) runs --repeat times through gloo (`HETERO_CPU_TRANSPORT=gloo`'s path) and through hetero's cross-memory
reads (hetero/comm/cma.py), alternating; the median wall time of each, the bus bandwidth (bytes each rank moves, as
NCCL's tests count it) and the ratio cma / gloo are printed, or one JSON object with --json. Both transports are
checked to give the same result first.

    python benchmarks/cpu_collectives.py --sizes 1MiB,16MiB,46MiB --repeat 7
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

OPS = ("all_gather", "reduce_scatter", "all_reduce")


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
    t = text.strip().lower()
    for u, mult in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * mult)
    return int(t)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bus_bytes(op: str, nbytes: int, world: int) -> float:
    """Bytes each rank moves for a collective on `nbytes` of data a rank holds in full (NCCL tests' bus bandwidth)."""
    return nbytes * (world - 1) / world * (2 if op == "all_reduce" else 1)


def _run(comm: Any, op: str, full: torch.Tensor, world: int, dst: torch.Tensor) -> torch.Tensor:
    """One collective on `full` (every rank's whole tensor; its first 1/world is the shard an all-gather sends) into
    `dst`, allocated once (as an engine's pooled buffers are: a fresh one would time its page faults)."""
    n = full.numel()
    if op == "all_gather":
        comm.all_gather(dst, full[: n // world])
    elif op == "reduce_scatter":
        comm.reduce_scatter(dst[: n // world], full)
    else:
        dst.copy_(full)
        comm.all_reduce(dst)
    return dst[: n // world] if op == "reduce_scatter" else dst


def _rank(rank: int, world: int, port: int, sizes: list[int], repeat: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from hetero.comm import Comm, Rules

    dist.init_process_group("gloo", rank=rank, world_size=world)
    comms = {
        "gloo": Comm(dist.group.WORLD, rules=Rules(cma=False)),
        "cma": Comm(dist.group.WORLD, rules=Rules(cma=True)),
    }
    results = []
    for nbytes in sizes:
        n = nbytes // 4 // world * world  # float32 elements of the full tensor, divisible by the world
        full = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        dst = torch.zeros(n)

        for op in OPS:
            results_of = [_run(comms[name], op, full, world, dst).clone() for name in ("gloo", "cma")]
            same = torch.equal(*results_of) if world == 2 else None  # over 2 ranks a sum has one order
            times: dict[str, list[float]] = {"gloo": [], "cma": []}
            for _ in range(repeat):
                for name in ("gloo", "cma"):
                    comms["gloo"].barrier()
                    start = time.perf_counter()
                    _run(comms[name], op, full, world, dst)
                    times[name].append(time.perf_counter() - start)
            med = {k: statistics.median(v) for k, v in times.items()}
            results.append(
                {
                    "op": op,
                    "bytes": n * 4,
                    "gloo_s": med["gloo"],
                    "cma_s": med["cma"],
                    "cma_vs_gloo": med["cma"] / med["gloo"],
                    "gloo_busbw_gbs": _bus_bytes(op, n * 4, world) / med["gloo"] / 1e9,
                    "cma_busbw_gbs": _bus_bytes(op, n * 4, world) / med["cma"] / 1e9,
                    "same_result": same,
                }
            )
    comms["gloo"].barrier()
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1MiB,16MiB,46MiB", help="bytes a rank holds in full, comma-separated")
    ap.add_argument("--repeat", type=int, default=7, help="timed runs of each operation and transport (median)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.world < 2 or args.repeat < 1 or not sizes or min(sizes) < 4 * args.world:
        ap.error("--world must be at least 2, --repeat at least 1, and every size at least 4 bytes a rank")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, sizes, args.repeat, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    try:
        results = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    report = {"world": args.world, "threads_per_rank": 1, "torch": torch.__version__, "results": results}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"world {args.world} on gloo, 1 thread a rank, median of {args.repeat}; torch {torch.__version__}")
    for r in results:
        same = "" if r["same_result"] is None else ("  same result" if r["same_result"] else "  RESULTS DIFFER")
        print(
            f"{r['op']:15s} {r['bytes'] / 2**20:8.1f} MiB  gloo {r['gloo_s'] * 1e3:8.2f} ms "
            f"({r['gloo_busbw_gbs']:5.2f} GB/s)  cma {r['cma_s'] * 1e3:8.2f} ms ({r['cma_busbw_gbs']:5.2f} GB/s)  "
            f"cma/gloo {r['cma_vs_gloo']:.3f}x{same}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
