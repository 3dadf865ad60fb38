"""How long a checkpoint holds the training thread: a synchronous save against `async_save=True`.

    python benchmarks/checkpoint_async.py [--json] [--tiers host,nvme] [--layers 6] [--embd 512] [--heads 8]
                                          [--intermediate 1312] [--seq 128] [--batch 8] [--vocab 8192]
                                          [--steps 4] [--dir DIR] [--timeout S]

The races' model (benchmarks/step_time.py `--model llama`: transformers' LlamaForCausalLM, 22.6M parameters at the
defaults) trains at ZeRO stage 3 on two ranks (gloo, one intra-op thread each), fp32 AdamW, with its optimizer
states (and parameters) on the host or on NVMe (`--tiers`), in fresh processes per tier. After warm-up steps, each
rank times:
 - `steps` plain steps (no save): the baseline step time;
 - a synchronous `save_checkpoint`: the training thread's time in the call (every byte written and fsynced, the
   commit), the slowest rank's;
 - an async one (`async_save=True`): the time in the call (the capture into host memory), the slowest rank's;
   then steps until it is committed (they overlap the background write; the last one commits) and `steps` more:
   their step times against the baseline's, and the step right after the synchronous save's;
 - the same once more with `wait_checkpoint()` right after the call: the time until it is committed, to compare
   the whole write with the synchronous save's.
A step's time is the slowest rank's (a barrier before each). Figures: blocked_ratio = async call / sync save
(lower is better); overlap_step_ratio = median step from the async call to its commit / median plain step.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, args: dict[str, Any], tier: str, work: str, out: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    try:
        out.put((rank, True, _measure(rank, world, args, tier, work)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def _measure(rank: int, world: int, a: dict[str, Any], tier: str, work: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from step_time import ModelShape, build_llama

    import hetero

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(0)
    shape = ModelShape(vocab=a["vocab"], layers=a["layers"], heads=a["heads"], embd=a["embd"], seq=a["seq"])
    model, _ = build_llama(shape, a["intermediate"])
    config: dict[str, Any] = {"zero_stage": 3, "offload": {"optimizer": tier, "params": tier}}
    if tier == "nvme":
        swap = os.path.join(work, f"swap-{rank}")
        os.makedirs(swap, exist_ok=True)
        config["memory"] = {"nvme_dir": swap}
    engine = hetero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, a["vocab"], (a["batch"], a["seq"]), generator=g)

    def step() -> float:
        dist.barrier()
        t = time.perf_counter()
        loss = engine(tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - t

    def timed(call: Any) -> float:
        dist.barrier()
        t = time.perf_counter()
        call()
        return time.perf_counter() - t

    root = os.path.join(work, "ckpt")
    for _ in range(2):
        step()
    plain = [step() for _ in range(a["steps"])]
    sync_s = timed(lambda: engine.save_checkpoint(root, tag="sync"))
    after_sync = step()  # for symmetry: the step after a save finds its dirty pages still being written back
    async_s = timed(lambda: engine.save_checkpoint(root, tag="async", async_save=True))
    overlapped = []  # the steps from the call to the commit, the committing one last
    while engine.checkpoint_pending and len(overlapped) < 100:
        overlapped.append(step())
    after = [step() for _ in range(a["steps"])]
    whole_s = timed(lambda: (engine.save_checkpoint(root, tag="waited", async_save=True), engine.wait_checkpoint()))
    nbytes = sum(os.path.getsize(os.path.join(root, "sync", f)) for f in os.listdir(os.path.join(root, "sync")))
    engine.close()
    dist.destroy_process_group()
    return {
        "plain": plain,
        "sync_s": sync_s,
        "async_s": async_s,
        "after_sync": after_sync,
        "overlapped": overlapped,
        "after": after,
        "whole_s": whole_s,
        "checkpoint_bytes": nbytes,
    }


def run_tier(args: argparse.Namespace, tier: str) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix=f"ckpt-async-{tier}-", dir=args.dir)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, vars(args), tier, work, out), daemon=True) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        deadline = time.monotonic() + args.timeout
        while len(got) < 2:
            rank, ok, value = out.get(timeout=max(1.0, deadline - time.monotonic()))
            if not ok:
                raise RuntimeError(f"rank {rank} raised:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
    r0, r1 = got[0], got[1]

    def slowest(key: str) -> list[float]:
        return [max(x, y) for x, y in zip(r0[key], r1[key])]

    plain = statistics.median(slowest("plain") + slowest("after"))
    overlapped = slowest("overlapped")
    sync_s, async_s = max(r0["sync_s"], r1["sync_s"]), max(r0["async_s"], r1["async_s"])
    after_sync = max(r0["after_sync"], r1["after_sync"])
    return {
        "tier": tier,
        "checkpoint_mb": round(r0["checkpoint_bytes"] / 2**20, 1),
        "plain_step_s": round(plain, 4),
        "sync_blocked_s": round(sync_s, 4),
        "async_blocked_s": round(async_s, 4),
        "blocked_ratio": round(async_s / sync_s, 3),
        "steps_to_commit": len(overlapped),
        "overlap_step_s": round(statistics.median(overlapped), 4),
        "overlap_step_ratio": round(statistics.median(overlapped) / plain, 3),
        "step_after_sync_s": round(after_sync, 4),
        "step_after_sync_ratio": round(after_sync / plain, 3),
        "async_then_wait_s": round(max(r0["whole_s"], r1["whole_s"]), 4),
        "plain_steps_s": [round(t, 4) for t in slowest("plain") + slowest("after")],
        "overlap_steps_s": [round(t, 4) for t in overlapped],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tiers", default="host,nvme", help="where the states live: host, nvme (comma-separated)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1312)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=4, help="plain steps timed before and after the async save")
    ap.add_argument("--dir", default=None, help="where checkpoints and swap files go (default: the temp dir)")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    results = [run_tier(args, t) for t in args.tiers.split(",")]
    if args.json:
        print(json.dumps({"command": " ".join(sys.argv), "world": 2, "results": results}))
        return
    for r in results:
        print(
            f"{r['tier']}: checkpoint {r['checkpoint_mb']} MiB (both ranks); plain step "
            f"{r['plain_step_s']:.3f} s\n"
            f"  training thread blocked: sync save {r['sync_blocked_s']:.3f} s, "
            f"async save {r['async_blocked_s']:.3f} s "
            f"(ratio {r['blocked_ratio']:.3f})\n"
            f"  {r['steps_to_commit']} step(s) from the call to the commit (the write overlapping them, the last "
            f"committing): median {r['overlap_step_s']:.3f} s (ratio {r['overlap_step_ratio']:.3f}); the step "
            f"after the sync save {r['step_after_sync_s']:.3f} s (ratio {r['step_after_sync_ratio']:.3f})\n"
            f"  async save then wait_checkpoint at once: {r['async_then_wait_s']:.3f} s"
        )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
