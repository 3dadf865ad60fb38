"""Activation memory per pipeline stage, with and without re-materialisation (activation checkpointing).

GPipe's claim: with checkpointing, a stage keeps only its units' inputs for every micro-batch in flight, plus one
micro-batch's activations of the one block it is recomputing: O(micro-batches x stage inputs + one block), against
O(micro-batches x all of the stage's activations) without. This trains a GPT (hetero.models.gpt_pipe, blocks
checkpointed by `"activation_checkpointing": true`) with each schedule on p pipeline ranks (gloo, one process each),
through `engine.train_batch`, and per stage reports
- the measured peak: bytes of every tensor storage created during the batch's forwards and backwards and still alive
  (`hetero.profiler.activations.LiveBytes`: recomputation and received activations included, the optimizer update
  left out), after a first batch that warms up;
- the prediction: the rank's actions walked in order, each forward adding what its stage keeps for one micro-batch
  (counted on meta: `unit_activations`), each backward releasing it; with checkpointing, plus the largest block's
  activations (the recomputation);
- the loss of the batch, which must be the same with and without checkpointing.

    python benchmarks/pipeline_memory.py [--stages 2] [--microbatches 4] [--layers 8] [--embd 256] [--seq 128]
                                         [--rows 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
from ranks import spawn_ranks  # benchmarks/ranks.py (the script's own folder is on sys.path)

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("chimera", 1))


def _build(args: argparse.Namespace) -> torch.nn.Module:
    from hetero.models.gpt import GPTConfig
    from hetero.models.gpt_pipe import GPTPipe

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=args.vocab, n_layer=args.layers, n_head=4, n_embd=args.embd, block_size=args.seq, tie_weights=False
    )
    return GPTPipe(cfg)


def predicted(args: argparse.Namespace, name: str, v: int, rank: int, checkpointing: bool) -> int:
    """Peak bytes the rank's actions keep alive (see the module docstring)."""
    from hetero.parallel.pipeline import schedule as S
    from hetero.parallel.pipeline.split import boundaries, units_of
    from hetero.profiler.activations import unit_activations

    p, m = args.stages, args.microbatches
    model = _build(args)
    units = units_of(model)
    ids = torch.zeros(args.rows, args.seq, dtype=torch.long)
    acts = unit_activations(units, ids, dtype=torch.float32, labels=ids)
    stages = p * v if name != "chimera" else p
    starts = boundaries(units, stages, "params") + [len(units)]
    blocks = [n.startswith("layers.") for n, _ in units]

    def kept(s: int) -> int:
        idx = range(starts[s], starts[s + 1])
        if not checkpointing:
            return sum(acts[i].saved for i in idx)
        return sum(acts[i].input if blocks[i] else acts[i].saved for i in idx)

    alive = peak = 0
    for a in S.build(name, p, m, rank, v):
        alive += kept(S.stage(a, p, rank)) * (1 if a.kind == "F" else -1)
        peak = max(peak, alive)
    recompute = max((acts[i].saved for i in range(len(units)) if blocks[i]), default=0) if checkpointing else 0
    return peak + recompute


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import hetero
    from hetero.comm import init_from_env
    from hetero.profiler.activations import LiveBytes

    init_from_env(backend="gloo", timeout_s=300)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, args.vocab, (args.rows * args.microbatches, args.seq + 1), generator=g) for _ in range(2)]
    results = {}
    for name, v in SCHEDULES:
        for checkpointing in (False, True):
            model = _build(args)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            parallel = {"pipeline": world, "schedule": name, "microbatches": args.microbatches}
            parallel.update(pipeline_split="params", virtual_stages=v)
            config = {"zero_stage": 0, "activation_checkpointing": checkpointing, "parallel": parallel}
            engine = hetero.initialize(model, opt, config)
            meter = LiveBytes(device_type="cpu")
            step = engine.step

            def paused_step(step: Any = step, meter: Any = meter) -> None:
                meter.paused = True  # the optimizer update is not activation memory
                step()
                meter.paused = False

            engine.step = paused_step  # type: ignore[method-assign]
            losses = []
            for i, batch in enumerate(data):
                x, y = batch[:, :-1], batch[:, 1:]
                if i == 0:
                    losses.append(float(engine.train_batch(x, y)))
                    continue
                start = time.perf_counter()
                with meter:
                    losses.append(float(engine.train_batch(x, y)))
                seconds = time.perf_counter() - start
            results[f"{name}/{int(checkpointing)}"] = {
                "peak_bytes": meter.peak,
                "losses": losses,
                "seconds": seconds,
                "predicted_bytes": predicted(args, name, v, rank, checkpointing),
            }
            engine.close()
    out.put((rank, results))


def run(args: argparse.Namespace) -> dict[str, Any]:
    p = args.stages
    per_rank: dict[int, dict] = dict(spawn_ranks(_rank_main, p, args, name="pipeline_memory", timeout=1200))
    out: dict[str, Any] = {"stages": p, "microbatches": args.microbatches, "layers": args.layers, "schedules": {}}
    for name, _ in SCHEDULES:
        entry = {}
        for ck in (0, 1):
            ranks = [per_rank[r][f"{name}/{ck}"] for r in range(p)]
            entry["checkpointed" if ck else "plain"] = {
                "peak_bytes_per_stage": [x["peak_bytes"] for x in ranks],
                "predicted_bytes_per_stage": [x["predicted_bytes"] for x in ranks],
                "losses": ranks[0]["losses"],
                "batch_s": max(x["seconds"] for x in ranks),
            }
        entry["losses_equal"] = entry["plain"]["losses"] == entry["checkpointed"]["losses"]
        out["schedules"][name] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=2, help="pipeline ranks p (processes); even (Chimera)")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches m per batch (a multiple of p)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--rows", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object instead of text")
    args = ap.parse_args(argv)
    if args.stages % 2 or args.microbatches % args.stages:
        ap.error("--stages must be even and --microbatches a multiple of it (interleaved and Chimera need it)")
    out = run(args)
    out["load_average"] = list(os.getloadavg())  # the machine is shared: the noise behind the figures
    if args.json:
        print(json.dumps(out))
        return 0
    p, m = args.stages, args.microbatches
    print(f"load average {out['load_average'][0]:.1f} (1 min), {out['load_average'][1]:.1f} (5 min)")
    print(
        f"activation memory per stage (p={p}, m={m} micro-batches of {args.rows} x {args.seq} tokens, GPT of "
        f"{args.layers} blocks, width {args.embd}); measured peak of live activations / predicted"
    )
    for name, e in out["schedules"].items():
        for kind in ("plain", "checkpointed"):
            r = e[kind]
            cells = "  ".join(
                f"{a / 2**20:6.2f}/{b / 2**20:6.2f} MiB"
                for a, b in zip(r["peak_bytes_per_stage"], r["predicted_bytes_per_stage"])
            )
            print(f"  {name:<17} {kind:<12} {cells}   batch {r['batch_s']:.2f} s")
        plain, ckpt = e["plain"]["peak_bytes_per_stage"], e["checkpointed"]["peak_bytes_per_stage"]
        ratio = [c / max(1, a) for a, c in zip(plain, ckpt)]
        print(
            f"  {name:<17} checkpointed / plain per stage {', '.join(f'{x:.2f}' for x in ratio)}; losses "
            f"{'identical' if e['losses_equal'] else 'DIFFER'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
