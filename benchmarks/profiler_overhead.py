"""What `hetero.profile` costs: training step time with and without the profiler, in the same run, interleaved.

One engine trains a GPT at ZeRO-3 under a device budget that makes chunks move every step (the profiler's busiest
case: every move, ledger change and module is recorded). Rounds alternate: `--steps` steps unprofiled, then
`--steps` steps inside `hetero.profile` (the order flips every round, so drift hits both alike). The overhead is the
median over rounds of (profiled window's median step / plain window's median step); CPU time per step is reported
too, being less disturbed by other processes on a shared machine. Writing the outputs at the end of a window is
timed separately (it happens once, after training). Target: profiled steps within 1.10x of unprofiled ones. When
the profiler is not entered nothing is installed, so the unprofiled steps are the engine's own cost.

    python benchmarks/profiler_overhead.py [--layers 4] [--width 256] [--rounds 10] [--steps 3] [--out DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import hetero
from hetero.models import GPT, GPTConfig


def run(args: argparse.Namespace, out_dir: str) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=256, n_layer=args.layers, n_head=max(1, args.width // 64), n_embd=args.width, block_size=args.seq
    )
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    budget = int(n_params * 4 * args.budget_fraction)  # bytes of fp32 parameters the device may hold
    config = {
        "zero_stage": 3,
        "offload": {"params": "device", "optimizer": "host"},
        "memory": {"device_budget": budget},
        "chunk_size": args.chunk,
    }
    engine = hetero.initialize(model, optimizer, config)
    g = torch.Generator().manual_seed(1)

    def step() -> tuple[float, float]:
        """Wall and CPU seconds of one training step (CPU time is less disturbed by other processes)."""
        x = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
        t0, c0 = time.perf_counter(), time.process_time()
        loss = engine(x[:, :-1], labels=x[:, 1:]).loss
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - t0, time.process_time() - c0

    for _ in range(3):  # warm up: the access trace is recorded, pools are filled
        step()
    plain: list[tuple[float, float]] = []
    profiled: list[tuple[float, float]] = []
    round_ratios: list[float] = []  # per round: profiled window median / the adjacent plain window's
    writes: list[float] = []
    moves = 0
    for r in range(args.rounds):
        window: dict[str, list[float]] = {}
        for mode in ("plain", "profiled") if r % 2 == 0 else ("profiled", "plain"):
            if mode == "plain":
                times = [step() for _ in range(args.steps)]
                plain += times
                window[mode] = [w for w, _ in times]
                continue
            last = r == args.rounds - 1
            prof = hetero.profile(engine, f"{out_dir}/round{r}", plot=last)
            prof.start()
            times = [step() for _ in range(args.steps)]
            t0 = time.perf_counter()
            prof.stop()
            writes.append(time.perf_counter() - t0)
            profiled += times
            window[mode] = [w for w, _ in times]
            moves = max(moves, len(prof.moves))
        round_ratios.append(statistics.median(window["profiled"]) / statistics.median(window["plain"]))
    stats = engine.memory_stats()
    engine.close()
    p, q = statistics.median(w for w, _ in plain), statistics.median(w for w, _ in profiled)
    pc, qc = statistics.median(c for _, c in plain), statistics.median(c for _, c in profiled)
    ratio = statistics.median(round_ratios)
    return {
        "params": n_params,
        "chunks_moved_per_window": moves,
        "device_peak_bytes": stats["device"]["peak"],
        "steps_each": len(plain),
        "plain_step_ms": p * 1e3,
        "profiled_step_ms": q * 1e3,
        "ratio_of_medians": q / p,
        "overhead_ratio": ratio,  # the median of the per-round ratios: robust to drift across the run
        "cpu_plain_step_ms": pc * 1e3,
        "cpu_profiled_step_ms": qc * 1e3,
        "cpu_overhead_ratio": qc / pc,
        "write_outputs_s": statistics.median(writes),
        "target_ratio": 1.10,
        "meets_target": ratio <= 1.10,
        "outputs": f"{out_dir}/round{args.rounds - 1}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget-fraction", type=float, default=0.6, help="device budget / fp32 parameter bytes")
    ap.add_argument("--chunk", type=int, default=1 << 17, help="chunk capacity in elements")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=3, help="steps per window")
    ap.add_argument("--out", default=None, help="where the profiles go (default: a temporary directory)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args()
    if args.out is None:
        with tempfile.TemporaryDirectory(prefix="hetero-prof-") as d:
            result = run(args, d)
    else:
        result = run(args, args.out)
    if args.json:
        print(json.dumps(result))
        return
    print(f"GPT {result['params'] / 1e6:.2f}M parameters, ZeRO-3, {result['chunks_moved_per_window']} moves per window")
    print(f"step without profiler: {result['plain_step_ms']:.1f} ms (median of {result['steps_each']})")
    print(f"step with profiler:    {result['profiled_step_ms']:.1f} ms")
    print(
        f"overhead ratio (median of per-round ratios): {result['overhead_ratio']:.3f} "
        f"(target <= {result['target_ratio']}: {result['meets_target']}); "
        f"ratio of medians {result['ratio_of_medians']:.3f}"
    )
    print(
        f"CPU time per step: {result['cpu_plain_step_ms']:.1f} ms without, {result['cpu_profiled_step_ms']:.1f} ms "
        f"with (ratio {result['cpu_overhead_ratio']:.3f})"
    )
    print(f"writing the outputs once: {result['write_outputs_s']:.2f} s; last window: {result['outputs']}")


if __name__ == "__main__":
    main()
