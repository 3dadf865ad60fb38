"""What the tensor group's agreement on each batch costs ([Note: a batch agreed over the model-parallel group] in
hetero/parallel/agree.py), on gloo ranks of this machine.

Two measurements, both on rank 0 of a tensor-parallel group of `--world` ranks:
- the check alone, on a [batch, seq] int64 batch with labels of the same shape: its median time with the shapes
  only (`check_collectives` off), with the values' checksum too (on), and the checksum's own share (no exchange);
- `train_batch` of a small GPT (tensor = world, ZeRO-1), in rounds that alternate the agreement on and off (the
  order flips every round, so drift hits both alike): the median step of each, and the median over rounds of
  their ratio.

    python benchmarks/batch_agreement.py [--world 2] [--batch 8] [--seq 512] [--checks 500] [--rounds 10]
                                         [--steps 3] [--json]
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


def _median_us(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import hetero
    from hetero.comm import Comm, init_from_env
    from hetero.models.gpt import GPTConfig
    from hetero.models.gpt_pipe import TP_PLAN, GPTPipe
    from hetero.parallel.agree import BatchAgreement, checksum, leaves

    comm = init_from_env(backend="gloo", timeout_s=300)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    batch = {"inputs": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    result: dict[str, Any] = {}
    for name, values in (("shapes_us", False), ("shapes_and_values_us", True)):
        agree = BatchAgreement(comm, kind="tensor-parallel", values=values)
        _median_us(lambda a=agree: a.check(batch, "train_batch"), 20)  # warm up
        result[name] = _median_us(lambda a=agree: a.check(batch, "train_batch"), args.checks)
    tensors = [v for _, v in leaves(batch, "") if isinstance(v, torch.Tensor)]
    result["checksum_alone_us"] = _median_us(lambda: checksum(tensors), args.checks)
    row, rows = torch.zeros(2, dtype=torch.int64), torch.empty(2 * world, dtype=torch.int64)
    result["bare_gather_us"] = _median_us(lambda: comm.control.all_gather(rows, row), args.checks)

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, n_layer=2, n_head=4, n_embd=128, block_size=args.seq, bias=False)
    model = GPTPipe(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = hetero.initialize(model, opt, {"zero_stage": 1, "parallel": {"tensor": world, "tensor_plan": TP_PLAN}})
    on, off = engine.agree, BatchAgreement(Comm(), kind="tensor-parallel", values=True)  # a group of one: no check
    steps: dict[str, list[float]] = {"on": [], "off": []}
    ratios = []
    engine.train_batch(batch["inputs"], batch["labels"])  # warm up
    for r in range(args.rounds):
        window = {}
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            engine.agree = on if mode == "on" else off
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                engine.train_batch(batch["inputs"], batch["labels"])
                times.append(time.perf_counter() - t0)
            steps[mode] += times
            window[mode] = statistics.median(times)
        ratios.append(window["on"] / window["off"])
    engine.agree = on
    engine.close()
    result["step_on_ms"] = statistics.median(steps["on"]) * 1e3
    result["step_off_ms"] = statistics.median(steps["off"]) * 1e3
    result["step_ratio"] = statistics.median(ratios)  # of the rounds' medians: drift hits both windows of a round
    result["check_share_of_step"] = result["shapes_and_values_us"] / 1e3 / result["step_off_ms"]
    out.put((rank, result))
    comm.barrier()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--checks", type=int, default=500)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    found = dict(spawn_ranks(_rank_main, args.world, args, name="batch_agreement", timeout=1200))
    r = found[0]
    if args.json:
        print(json.dumps({"args": vars(args), "rank0": r}, indent=2))
        return 0
    print(f"world {args.world}, batch [{args.batch}, {args.seq}] int64 + labels, gloo on this machine (rank 0)")
    print(f"  check, shapes only:         {r['shapes_us']:8.1f} us")
    print(f"  check, shapes and values:   {r['shapes_and_values_us']:8.1f} us")
    print(f"  of which the checksums:     {r['checksum_alone_us']:8.1f} us")
    print(f"  a bare all_gather of 2 int64 on the control group: {r['bare_gather_us']:8.1f} us")
    print(f"  train_batch, agreement on:  {r['step_on_ms']:8.2f} ms")
    print(f"  train_batch, agreement off: {r['step_off_ms']:8.2f} ms")
    print(f"  ratio {r['step_ratio']:.4f}; the check is {100 * r['check_share_of_step']:.3f}% of a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
