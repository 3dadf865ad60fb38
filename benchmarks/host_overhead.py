"""Host overhead a step: hetero against plain PyTorch and FSDP2 on a model too small for its kernels to hide it.

On a GPU the Python a step runs (hooks, gathers, bookkeeping) overlaps the kernels it launches until there is more of
it than of them; then it is the step. This benchmark measures that Python on the CPU, where nothing hides it: a tiny
Hugging Face Llama (default hidden 64, 16 layers, 2 x 32 tokens), one process, one thread, everything on the CPU
"device", fused AdamW for everyone, and reports each configuration's median step and the difference to plain
PyTorch's, which is the overhead a step (per layer, too):

  plain    PyTorch's loop
  fsdp2    fully_shard on every layer and the root, world 1 on gloo (its hooks and collectives, no peer)
  hetero   hetero.initialize, ZeRO stage 3 (and `--stages` for others), world 1

Configurations alternate round by round in the same process, so a drifting machine touches them alike.

    python benchmarks/host_overhead.py [--layers 16] [--hidden 64] [--steps 30] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def build(args: argparse.Namespace) -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.seq,
        tie_word_embeddings=True,
        use_cache=False,
    )
    torch.manual_seed(args.seed)
    return transformers.LlamaForCausalLM(cfg)


def _plain(model: nn.Module, args: argparse.Namespace) -> Callable[[torch.Tensor], float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step(x: torch.Tensor) -> float:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _fsdp2(model: nn.Module, args: argparse.Namespace) -> Callable[[torch.Tensor], float]:
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.4-2.5: FSDP2 under its first name
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]

    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _plain(model, args)


def _hetero(stage: int) -> Callable[[nn.Module, argparse.Namespace], Callable[[torch.Tensor], float]]:
    def setup(model: nn.Module, args: argparse.Namespace) -> Callable[[torch.Tensor], float]:
        import hetero

        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        config: dict[str, Any] = {"zero_stage": stage, "precision": "fp32", "offload": {"params": "device"}}
        if args.chunks:
            total = sum(p.numel() for p in model.parameters())
            config["chunk_size"] = -(-total // args.chunks)
        engine = hetero.initialize(model, opt, config)

        def step(x: torch.Tensor) -> float:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            return loss.item()

        return step

    return setup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8, help="hetero's chunk size: the model over this many (0: auto)")
    ap.add_argument("--stages", default="3", help="comma-separated ZeRO stages to run hetero at (default 3)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps a round")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", help="comma-separated configurations (plain, fsdp2, hetero_sK)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))

    setups: dict[str, Callable[[nn.Module, argparse.Namespace], Callable[[torch.Tensor], float]]] = {
        "plain": _plain,
        "fsdp2": _fsdp2,
    }
    for k in args.stages.split(","):
        setups[f"hetero_s{int(k)}"] = _hetero(int(k))
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - set(setups)
        if unknown:
            ap.error(f"--only: unknown {sorted(unknown)}; known: {sorted(setups)}")
        setups = {k: v for k, v in setups.items() if k in wanted}
    if "fsdp2" in setups:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)

    g = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(8)]
    steps: dict[str, Callable[[torch.Tensor], float]] = {}
    losses: dict[str, float] = {}
    for name, setup in setups.items():
        steps[name] = setup(build(args), args)
        for i in range(args.warmup):
            steps[name](batches[i % len(batches)])
    params = sum(p.numel() for p in build(args).parameters())
    log(
        f"Llama {params / 1e6:.2f}M: hidden {args.hidden}, {args.layers} layers, {args.batch} x {args.seq} tokens; "
        f"1 thread, CPU; {args.rounds} rounds of {args.steps} steps after {args.warmup}"
    )
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            for i in range(args.steps):
                t0 = time.perf_counter()
                losses[name] = step(batches[i % len(batches)])
                times[name].append(time.perf_counter() - t0)
    median = {k: statistics.median(v) for k, v in times.items()}
    base = median.get("plain")
    out: dict[str, Any] = {"params": params, "layers": args.layers, "configurations": {}}
    for name, m in median.items():
        row = {"median_step_s": m, "last_loss": losses[name], "steps": len(times[name])}
        if base is not None:
            row["overhead_s"] = m - base
            row["overhead_per_layer_ms"] = 1e3 * (m - base) / args.layers
            row["vs_plain"] = m / base
        out["configurations"][name] = row
        extra = ""
        if base is not None and name != "plain":
            extra = f", {1e3 * (m - base):+.1f} ms over plain ({row['overhead_per_layer_ms']:+.2f} ms a layer)"
        log(f"{name:10s} {1e3 * m:7.1f} ms a step{extra}, loss {losses[name]:.4f}")
    if "fsdp2" in median:
        for name in median:
            if name.startswith("hetero"):
                out["configurations"][name]["vs_fsdp2"] = median[name] / median["fsdp2"]
                log(f"{name} / fsdp2: {median[name] / median['fsdp2']:.3f}x")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
