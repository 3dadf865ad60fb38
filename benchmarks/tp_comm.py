"""Bytes each tensor-parallel collective moves per transformer layer, against the Megatron-LM formula.

    python benchmarks/tp_comm.py [--json] [--model gpt|gpt2|llama|all] [--degree T] [--batch B] [--seq S]
                                 [--hidden H] [--heads N] [--vocab V]

Each configuration runs one training step (forward, backward) of a model built with L = 1 and L = 2 layers on T
gloo ranks, with hetero's tensor parallelism (without and with Megatron-SP) and with Ulysses sequence parallelism,
while every collective of ``hetero.comm.Comm``
that the step calls is recorded: its kind, its size and whether autograd's backward issued it. One layer's traffic
is the two-layer run's minus the one-layer run's, which removes the embedding, the LM head and the loss.

Sizes are counted two ways, for an fp32 activation of N = b*s*h elements per rank-replica:
- payload: the full tensor the collective works on (an all-reduce of N, an all-gather's output of N, a
  reduce-scatter's input of N);
- ring bytes: what one rank sends with ring algorithms: 2(t-1)/t of the payload for an all-reduce, (t-1)/t for an
  all-gather or a reduce-scatter.

The Megatron formula (Korthikanti et al., 2022): without sequence parallelism, per layer 2 all-reduces of b*s*h in
forward and 2 in backward; with it, 2 all-gathers and 2 reduce-scatters in each direction, the same ring bytes.
Ulysses (Jacobs et al., 2023) moves q, k, v and the attention output through all-to-alls: per rank and direction
(2 + 2 kv/H) b*s*h/t elements of which (t-1)/t leave the rank.

Parameters used inside the sequence-parallel region get their gradients all-reduced over the group: under
Megatron-SP the norm weights and row-parallel biases (``h`` elements each), under Ulysses every weight of the layer
(its weights are replicated, as under data parallelism). They are reported as parameter-gradient all-reduces and
left out of the comparison, since the formulas count activations only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import traceback
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

FP32 = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _build(model: str, layers: int, args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    if model == "gpt":
        from hetero.models.gpt import GPT, GPTConfig

        return GPT(
            GPTConfig(vocab_size=args.vocab, n_layer=layers, n_head=args.heads, n_embd=args.hidden, block_size=args.seq)
        )
    import transformers

    if model == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=args.vocab,
            n_positions=args.seq,
            n_embd=args.hidden,
            n_layer=layers,
            n_head=args.heads,
            resid_pdrop=0,
            embd_pdrop=0,
            attn_pdrop=0,
        )
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.seq,
    )
    return transformers.LlamaForCausalLM(cfg)


class _Recorder:
    """Wraps Comm's collectives in this process; each call is logged as (phase, kind, payload elements, t)."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.calls: list[tuple[str, str, int, int]] = []

    def install(self) -> None:
        from hetero.comm import Comm

        rec = self
        names = ("all_reduce", "all_gather_dim", "reduce_scatter_dim", "all_to_all_dim")
        originals = {name: getattr(Comm, name) for name in names}

        def all_reduce(comm: Any, t: torch.Tensor, op: str = "sum") -> None:
            # Activations are [batch, seq, hidden]; a 1-D or 2-D all-reduce in backward is a parameter's gradient.
            kind = "param_grad" if rec.phase == "backward" and t.dim() < 3 else "all_reduce"
            rec.calls.append((rec.phase, kind, t.numel(), comm.size))
            originals["all_reduce"](comm, t, op)

        def all_gather_dim(comm: Any, t: torch.Tensor, dim: int) -> torch.Tensor:
            rec.calls.append((rec.phase, "all_gather", t.numel() * comm.size, comm.size))
            return originals["all_gather_dim"](comm, t, dim)

        def reduce_scatter_dim(comm: Any, t: torch.Tensor, dim: int, op: str = "sum") -> torch.Tensor:
            rec.calls.append((rec.phase, "reduce_scatter", t.numel(), comm.size))
            return originals["reduce_scatter_dim"](comm, t, dim, op)

        def all_to_all_dim(comm: Any, t: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
            rec.calls.append((rec.phase, "all_to_all", t.numel(), comm.size))
            return originals["all_to_all_dim"](comm, t, scatter_dim, gather_dim)

        Comm.all_to_all_dim = all_to_all_dim
        Comm.all_reduce = all_reduce
        Comm.all_gather_dim = all_gather_dim
        Comm.reduce_scatter_dim = reduce_scatter_dim


def _worker(rank: int, world: int, port: int, jobs: list[tuple], args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        from hetero.comm import init_from_env
        from hetero.parallel import apply_tensor_parallel, apply_ulysses

        comm = init_from_env(backend="gloo", timeout_s=300)
        rec = _Recorder()
        rec.install()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        results = {}
        for model_name, layers, mode in jobs:
            model = _build(model_name, layers, args)
            if mode == "ulysses":
                apply_ulysses(model, comm)
            else:
                apply_tensor_parallel(model, "auto", comm, sequence=mode == "tp+sp")
            rec.calls.clear()
            rec.phase = "forward"
            loss = model(ids, labels=ids).loss
            rec.phase = "backward"
            loss.backward()
            results[(model_name, layers, mode)] = list(rec.calls)
        out.put((rank, True, results))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def _run(jobs: list[tuple], args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.degree, port, jobs, args, out)) for r in range(args.degree)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, ok, payload = out.get(timeout=600)
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        got[rank] = payload
    for p in procs:
        p.join(30)
    return got[0]  # every rank issues the same collectives


def _bytes(calls: list[tuple]) -> dict[str, dict[str, dict[str, float]]]:
    """phase -> kind -> {count, payload_bytes, ring_bytes}."""
    table: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    for phase, kind, numel, t in calls:
        payload = numel * FP32
        # all-to-all: payload is this rank's tensor, of which (t-1)/t leaves it.
        ring = payload * (2 if kind in ("all_reduce", "param_grad") else 1) * (t - 1) / t
        cell = table[phase][kind]
        cell["count"] += 1
        cell["payload_bytes"] += payload
        cell["ring_bytes"] += ring
    return table


def _minus(a: dict, b: dict) -> dict:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for phase in set(a) | set(b):
        for kind in set(a.get(phase, {})) | set(b.get(phase, {})):
            x, y = a.get(phase, {}).get(kind, {}), b.get(phase, {}).get(kind, {})
            cell = {k: x.get(k, 0.0) - y.get(k, 0.0) for k in ("count", "payload_bytes", "ring_bytes")}
            if any(cell.values()):
                out.setdefault(phase, {})[kind] = cell
    return out


def _formula(args: argparse.Namespace, mode: str, kv_share: float) -> dict[str, float]:
    t, n = args.degree, args.batch * args.seq * args.hidden
    if mode == "ulysses":
        # Per direction: all-to-alls of q and the output (n/t elements each per rank) and of k and v (kv_share as
        # large: grouped-query attention), each sending (t-1)/t of what it holds.
        local = (2 + 2 * kv_share) * n / t * FP32
        return {"payload_bytes": local, "ring_bytes": local * (t - 1) / t}
    # Per direction: 2 all-reduces of n (without SP), or 2 all-gathers + 2 reduce-scatters of n (with SP).
    payload = (4 if mode == "tp+sp" else 2) * n * FP32
    ring = 2 * 2 * (t - 1) / t * n * FP32  # equal with and without SP
    return {"payload_bytes": payload, "ring_bytes": ring}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object instead of text")
    ap.add_argument("--model", default="all", choices=("gpt", "gpt2", "llama", "all"))
    ap.add_argument("--degree", type=int, default=2, help="tensor-parallel degree (gloo processes)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    args = ap.parse_args(argv)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    models = ["gpt", "gpt2", "llama"] if args.model == "all" else [args.model]
    if args.model == "all":
        try:
            import transformers  # noqa: F401
        except ImportError:
            models = ["gpt"]
    modes = ("tp", "tp+sp", "ulysses")
    jobs = [(m, layers, mode) for m in models for mode in modes for layers in (1, 2)]
    raw = _run(jobs, args)
    report: dict[str, Any] = {
        "degree": args.degree,
        "batch": args.batch,
        "seq": args.seq,
        "hidden": args.hidden,
        "activation_elements": args.batch * args.seq * args.hidden,
        "results": [],
    }
    say(
        f"tensor-parallel bytes per layer, t={args.degree}, b={args.batch}, s={args.seq}, h={args.hidden} "
        f"(b*s*h = {args.batch * args.seq * args.hidden} fp32 elements)"
    )
    for m in models:
        kv_share = 0.5 if m == "llama" else 1.0  # _build gives Llama half as many key/value heads
        for mode in modes:
            layer = _minus(_bytes(raw[(m, 2, mode)]), _bytes(raw[(m, 1, mode)]))
            formula = _formula(args, mode, kv_share)
            row: dict[str, Any] = {"model": m, "mode": mode, "per_layer": layer, "formula": formula}
            title = {"tp": "tensor parallel", "tp+sp": "tensor + sequence parallel (Megatron-SP)", "ulysses": "Ulysses"}
            say(f"\n{m}, {title[mode]}:")
            for phase in ("forward", "backward"):
                cells = layer.get(phase, {})
                act = {k: v for k, v in cells.items() if k != "param_grad"}
                payload = sum(v["payload_bytes"] for v in act.values())
                ring = sum(v["ring_bytes"] for v in act.values())
                row[f"{phase}_payload_ratio"] = payload / formula["payload_bytes"]
                row[f"{phase}_ring_ratio"] = ring / formula["ring_bytes"]
                ops = ", ".join(f"{int(v['count'])} {k} ({v['payload_bytes'] / 1024:.0f} KiB)" for k, v in act.items())
                say(
                    f"  {phase:8s} {ops or 'none'}; ring bytes/rank {ring / 1024:.0f} KiB vs formula "
                    f"{formula['ring_bytes'] / 1024:.0f} KiB (x{ring / formula['ring_bytes']:.3f})"
                )
                if "param_grad" in cells:
                    pg = cells["param_grad"]
                    say(
                        f"  {'':8s} + {int(pg['count'])} parameter-gradient all-reduces "
                        f"({pg['payload_bytes'] / 1024:.1f} KiB) of the parameters inside the sequence-parallel region"
                    )
            report["results"].append(row)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
