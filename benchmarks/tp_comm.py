"""Bytes each rank sends per transformer layer in every tensor and sequence mode, against the papers' formulas, and
each mode's per-rank parameter and activation memory against 1D tensor parallelism at the same degree.

    python benchmarks/tp_comm.py [--json] [--model gpt|gpt2|llama|all] [--modes tp,2d,...] [--degree T] [--q Q]
                                 [--depth D] [--batch B] [--seq S] [--hidden H] [--heads N] [--vocab V]

Modes: "tp" (1D, Megatron), "tp+sp" (with Megatron-SP), "ulysses" and "ring" (sequence split over T ranks, layers
whole), all at degree T; "2d" at q^2, "2.5d" at q^2 d, "3d" at q^3 ranks. Each (model, mode) runs one training
step (forward, backward) of the model built with L = 1 and L = 2 layers on gloo ranks while every collective and
point-to-point send of ``hetero.comm.Comm`` is recorded (kind, size, group size, forward or backward); one layer's
traffic is the two-layer run's minus the one-layer run's, which removes the embeddings, the LM head and the loss.
The same difference of rank 0's parameters and of the bytes autograd saves for backward gives a layer's memory.

Bytes a rank sends, for fp32 elements, with ring algorithms over a group of g ranks: (g-1)/g of the payload of an
all-gather (its output) or a reduce-scatter (its input), 2(g-1)/g of an all-reduce, the whole tensor of a
point-to-point send, (g-1)/g of a rank's tensor in an all-to-all. With n = b*s tokens, h hidden, the layer's linear
maps (in -> out), norms of h:

- 1D (Megatron-LM, Shoeybi et al. 2019; Korthikanti et al. 2022): 2 all-reduces of n h per direction; with
  Megatron-SP 2 all-gathers + 2 reduce-scatters, the same bytes. Activations only: the norms' and row-parallel
  biases' gradient all-reduces of Megatron-SP are listed apart.
- Ulysses (Jacobs et al. 2023): all-to-alls of q, k, v and the output, (2 + 2 kv/h) n h / T per direction, (T-1)/T
  of it leaving a rank.
- Ring self-attention (Li et al. 2021): forward, T-1 sends of this rank's k and v (2 n kv / T); backward, T-1 sends
  of k, v and T of their gradients ([Note: ring attention] in hetero/parallel/ring.py).
- 2D (Optimus, Xu et al. 2021) and 2.5D (Tesseract, Wang et al. 2021), B = q d batch parts, r = (q-1)/q: per
  linear map, forward SUMMA's broadcasts of X blocks along rows and W blocks along columns, r (n/B) in + r in out/q;
  backward 2 times that (the blocks again, and the reductions of the transposed products: Optimus' ABT and ATB);
  a bias r out/q each way; a norm 2 (layer norm) or 1 (RMS norm) all-reduces of its n/B statistics each way plus
  r h/q per weight vector each way; 2.5D adds the depth all-reduce of every gradient, 2(d-1)/d of the local block.
- 3D (Bian et al. 2021), r = (q-1)/q, r2 = (q^2-1)/q^2: per linear map, forward r (n in + in out + n out) / q^2
  (input gathered, weight gathered, output reduce-scattered), backward r (2 n in + 2 in out + n out) / q^2 (input,
  weight and the output's gradient gathered, the input's and weight's gradients reduce-scattered); a bias r2 out/q
  each way; a norm its statistics' all-reduces of n/q^2 plus r2 h/q per weight vector each way.

[Note: measured bytes, not assumed ones] Nothing here computes a mode's traffic from its code's intent: the recorder
sees what the layers actually call, and the formulas above are written from the algorithms, so a layer that
gathered twice, or gathered the wrong group, shows up as a ratio other than 1.
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
MODES = ("tp", "tp+sp", "ulysses", "ring", "2d", "2.5d", "3d")
GRID = ("2d", "2.5d", "3d")
TITLES = {
    "tp": "1D tensor parallel (Megatron)",
    "tp+sp": "1D + sequence parallel (Megatron-SP)",
    "ulysses": "Ulysses sequence parallel",
    "ring": "ring sequence parallel (zig-zag)",
    "2d": "2D tensor parallel (SUMMA, Optimus)",
    "2.5d": "2.5D tensor parallel (Tesseract)",
    "3d": "3D tensor parallel",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def degree_of(mode: str, args: argparse.Namespace) -> int:
    return {"2d": args.q**2, "2.5d": args.q**2 * args.depth, "3d": args.q**3}.get(mode, args.degree)


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
    """Wraps Comm's collectives and point-to-point batches in this process; each call is logged as (phase, kind,
    payload elements, group size)."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.calls: list[tuple[str, str, int, int]] = []

    def install(self) -> None:
        from hetero.comm import Comm

        rec = self
        names = ("all_reduce", "all_gather_dim", "reduce_scatter_dim", "all_to_all_dim", "batch_p2p")
        originals = {name: getattr(Comm, name) for name in names}

        def all_reduce(comm: Any, t: torch.Tensor, op: str = "sum") -> None:
            # Activations are [batch, seq, ...]; a 1-D or 2-D all-reduce in backward is a parameter's gradient.
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

        def batch_p2p(comm: Any, ops: Any) -> Any:
            sent = sum(t.numel() for kind, t, _, _ in ops if kind == "send")
            rec.calls.append((rec.phase, "send", sent, comm.size))
            return originals["batch_p2p"](comm, ops)

        Comm.all_to_all_dim = all_to_all_dim
        Comm.all_reduce = all_reduce
        Comm.all_gather_dim = all_gather_dim
        Comm.reduce_scatter_dim = reduce_scatter_dim
        Comm.batch_p2p = batch_p2p


def _apply(model: torch.nn.Module, mode: str, comm: Any, grids: dict, args: argparse.Namespace) -> None:
    from hetero.parallel import apply_tensor_parallel, apply_ulysses
    from hetero.parallel.grid import Grid, apply_grid_parallel
    from hetero.parallel.ring import apply_ring

    if mode in GRID:
        if mode not in grids:  # process groups are made once per mode
            grids[mode] = Grid.build(comm, mode, args.depth if mode == "2.5d" else None)
        apply_grid_parallel(model, "auto", grids[mode])
    elif mode in ("ulysses", "ring"):
        # As through hetero.initialize: the sequence group is inside ZeRO's group, whose reduction is ZeRO's.
        (apply_ring if mode == "ring" else apply_ulysses)(model, comm, reduce_grads=False)
    else:
        apply_tensor_parallel(model, "auto", comm, sequence=mode == "tp+sp")


def _saved_bytes(model: torch.nn.Module) -> tuple[Any, list[int]]:
    """A saved-tensors hook context counting the bytes of every storage autograd saves, parameters' excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total[0] += s.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), total


def _worker(rank: int, world: int, port: int, jobs: list[tuple], args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        from hetero.comm import init_from_env

        comm = init_from_env(backend="gloo", timeout_s=300)
        rec = _Recorder()
        rec.install()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        results, grids = {}, {}
        for model_name, layers, mode in jobs:
            model = _build(model_name, layers, args)
            _apply(model, mode, comm, grids, args)
            hooks, saved = _saved_bytes(model)
            rec.calls.clear()
            rec.phase = "forward"
            with hooks:
                loss = model(ids, labels=ids).loss
            rec.phase = "backward"
            loss.backward()
            params = sum(p.numel() for p in model.parameters())
            results[(model_name, layers, mode)] = {"calls": list(rec.calls), "params": params, "saved": saved[0]}
        out.put((rank, True, results))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def _run(jobs: list[tuple], world: int, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, jobs, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, ok, payload = out.get(timeout=900)
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        got[rank] = payload
    for p in procs:
        p.join(30)
    return got[0]  # rank 0's sends and memory (every rank of a mode sends the same bytes, by symmetry)


def _bytes(calls: list[tuple]) -> dict[str, dict[str, dict[str, float]]]:
    """phase -> kind -> {count, payload_bytes, sent_bytes}."""
    table: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    for phase, kind, numel, t in calls:
        payload = numel * FP32
        if kind == "send":
            sent = payload
        else:  # all-to-all: payload is this rank's tensor, of which (t-1)/t leaves it
            sent = payload * (2 if kind in ("all_reduce", "param_grad") else 1) * (t - 1) / t
        cell = table[phase][kind]
        cell["count"] += 1
        cell["payload_bytes"] += payload
        cell["sent_bytes"] += sent
    return table


def _minus(a: dict, b: dict) -> dict:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for phase in set(a) | set(b):
        for kind in set(a.get(phase, {})) | set(b.get(phase, {})):
            x, y = a.get(phase, {}).get(kind, {}), b.get(phase, {}).get(kind, {})
            cell = {k: x.get(k, 0.0) - y.get(k, 0.0) for k in ("count", "payload_bytes", "sent_bytes")}
            if any(cell.values()):
                out.setdefault(phase, {})[kind] = cell
    return out


def layer_shape(model: str, args: argparse.Namespace) -> tuple[list[tuple[int, int, bool]], list[tuple[str, bool]]]:
    """A transformer layer's linear maps (in, out, bias) and norms (kind, bias), as _build makes them."""
    h = args.hidden
    if model == "llama":
        kv = h // 2  # half as many key/value heads
        linears = [(h, h), (h, kv), (h, kv), (h, h), (h, 4 * h), (h, 4 * h), (4 * h, h)]
        return [(i, o, False) for i, o in linears], [("rms", False)] * 2
    if model == "gpt2":
        return [(h, 3 * h, True), (h, h, True), (h, 4 * h, True), (4 * h, h, True)], [("layer", True)] * 2
    linears = [(h, h)] * 4 + [(h, 4 * h), (4 * h, h)]
    return [(i, o, True) for i, o in linears], [("layer", True)] * 2


def formula(model: str, mode: str, args: argparse.Namespace) -> dict[str, float]:
    """Bytes one rank sends per layer, forward and backward, by the papers' algorithms (module docstring)."""
    n, h = args.batch * args.seq, args.hidden
    kv = h // 2 if model == "llama" else h
    linears, norms = layer_shape(model, args)
    t = degree_of(mode, args)
    if mode in ("tp", "tp+sp"):
        each = 2 * 2 * (t - 1) / t * n * h
        return {"forward": each * FP32, "backward": each * FP32}
    if mode == "ulysses":
        each = (2 * n * h + 2 * n * kv) / t * (t - 1) / t
        return {"forward": each * FP32, "backward": each * FP32}
    if mode == "ring":
        m = n * kv / t  # one of this rank's k or v
        return {"forward": (t - 1) * 2 * m * FP32, "backward": ((t - 1) * 2 * m + t * 2 * m) * FP32}
    q = args.q
    fwd = bwd = 0.0
    stats = {"layer": 2, "rms": 1}
    if mode in ("2d", "2.5d"):
        d = args.depth if mode == "2.5d" else 1
        r, rows = (q - 1) / q, n / (q * d)
        depth = 2 * (d - 1) / d  # all-reduce of every local gradient over the depth layers
        for i, o, bias in linears:
            one = r * rows * i + r * i * o / q
            fwd += one + (r * o / q if bias else 0)
            bwd += 2 * one + (r * o / q if bias else 0) + depth * (i * o + (o if bias else 0)) / q**2
        for kind, bias in norms:
            vectors = 1 + bias
            fwd += stats[kind] * 2 * r * rows + vectors * r * h / q
            bwd += stats[kind] * 2 * r * rows + vectors * (r * h / q + depth * h / q**2)
    else:  # 3d
        r, r2 = (q - 1) / q, (q * q - 1) / (q * q)
        for i, o, bias in linears:
            x, w, y = r * n * i / q**2, r * i * o / q**2, r * n * o / q**2
            fwd += x + w + y + (r2 * o / q if bias else 0)  # gather x and W, reduce-scatter y
            # gather x, W and dy; reduce-scatter dx and dW
            bwd += 2 * x + 2 * w + y + (r2 * o / q if bias else 0)
        for kind, bias in norms:
            each = stats[kind] * 2 * r * n / q**2 + (1 + bias) * r2 * h / q
            fwd += each
            bwd += each
    return {"forward": fwd * FP32, "backward": bwd * FP32}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object instead of text")
    ap.add_argument("--model", default="all", choices=("gpt", "gpt2", "llama", "all"))
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--degree", type=int, default=4, help="degree of tp, tp+sp, ulysses and ring (gloo processes)")
    ap.add_argument("--q", type=int, default=2, help="grid side of 2d, 2.5d and 3d")
    ap.add_argument("--depth", type=int, default=2, help="depth of 2.5d")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=256)
    args = ap.parse_args(argv)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    models = ["gpt", "gpt2", "llama"] if args.model == "all" else [args.model]
    if args.model == "all":
        try:
            import transformers  # noqa: F401
        except ImportError:
            models = ["gpt"]
    # Every mode runs at its degree, next to 1D at the same degree (the memory baseline).
    by_degree: dict[int, list[str]] = defaultdict(list)
    for mode in modes:
        for m in (mode, "tp"):
            if m not in by_degree[degree_of(mode, args)]:
                by_degree[degree_of(mode, args)].append(m)
    raw: dict[int, dict] = {}
    for degree, ms in sorted(by_degree.items()):
        jobs = [(m, layers, mode) for m in models for mode in ms for layers in (1, 2)]
        raw[degree] = _run(jobs, degree, args)
    n = args.batch * args.seq * args.hidden
    report: dict[str, Any] = {
        "degree": args.degree,
        "q": args.q,
        "depth": args.depth,
        "batch": args.batch,
        "seq": args.seq,
        "hidden": args.hidden,
        "activation_elements": n,
        "results": [],
    }
    say(
        f"bytes each rank sends per transformer layer, b={args.batch}, s={args.seq}, h={args.hidden}, heads "
        f"{args.heads} (b*s*h = {n} fp32 elements); ring algorithms; measured on gloo ranks of this machine"
    )
    for m in models:
        for mode in modes:
            t = degree_of(mode, args)
            got = raw[t]
            layer = _minus(_bytes(got[(m, 2, mode)]["calls"]), _bytes(got[(m, 1, mode)]["calls"]))
            expect = formula(m, mode, args)
            params = (got[(m, 2, mode)]["params"] - got[(m, 1, mode)]["params"]) * FP32
            saved = got[(m, 2, mode)]["saved"] - got[(m, 1, mode)]["saved"]
            base_params = (got[(m, 2, "tp")]["params"] - got[(m, 1, "tp")]["params"]) * FP32
            base_saved = got[(m, 2, "tp")]["saved"] - got[(m, 1, "tp")]["saved"]
            row: dict[str, Any] = {
                "model": m,
                "mode": mode,
                "ranks": t,
                "per_layer": layer,
                "formula_bytes": expect,
                "param_bytes": params,
                "activation_bytes": saved,
                "param_bytes_1d": base_params,
                "activation_bytes_1d": base_saved,
            }
            say(f"\n{m}, {TITLES[mode]}, {t} ranks:")
            for phase in ("forward", "backward"):
                cells = layer.get(phase, {})
                # Megatron-SP's norm gradients are not in Megatron's activation formula; everything else is.
                counted = {k: v for k, v in cells.items() if not (k == "param_grad" and mode == "tp+sp")}
                sent = sum(v["sent_bytes"] for v in counted.values())
                row[f"{phase}_bytes"] = sent
                row[f"{phase}_ratio"] = sent / expect[phase] if expect[phase] else float("nan")
                ops = ", ".join(f"{int(v['count'])} {k}" for k, v in counted.items())
                say(
                    f"  {phase:8s} {sent / 1024:9.2f} KiB sent vs formula {expect[phase] / 1024:9.2f} KiB "
                    f"(x{row[f'{phase}_ratio']:.4f}); {ops or 'nothing'}"
                )
                if mode == "tp+sp" and "param_grad" in cells:
                    pg = cells["param_grad"]
                    say(f"  {'':8s} + {int(pg['count'])} gradient all-reduces of norms / row-parallel biases")
            say(
                f"  memory   parameters {params / 1024:8.1f} KiB ({params / base_params:.3f} of 1D at {t}), "
                f"saved activations {saved / 1024:8.1f} KiB ({saved / base_saved:.3f} of 1D at {t})"
            )
            report["results"].append(row)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
