"""How large a Llama-style model trains on one GPU with host and NVMe offload, and at what model FLOPs utilisation.

    python benchmarks/gpu_scale.py --nvme-dir /mnt/nvme [--hidden 4096] [--seq 2048] [--json]
    python benchmarks/gpu_scale.py --dry-run --json          # the same code path on the CPU with a tiny model

Each trial builds a Llama-style model (transformers' LlamaForCausalLM, untied embeddings) of some depth on the meta
device, initialises it into chunks and trains a few steps with ZeRO stage 3, bf16, activation checkpointing and
"auto" placement of parameters and optimizer states (the GPU holds what the step's activations leave; the rest
goes to pinned host memory, then to NVMe), with budgets from the machine. Trials run in subprocesses, so a failed
one (out of memory anywhere) does not disturb the next. The search doubles the depth until a trial fails or the
model exceeds the machine's limit, then bisects.

Reported: the largest model that trains, its parameter count against the machine's limit
(GPU + host + NVMe bytes) / 16 bytes per parameter (fp32 master weights, two Adam moments, gradients), and model
FLOPs utilisation (6 x parameters x tokens + attention, per second, over the GPU's peak dense bf16 FLOPs) of models
whose training states are 1x, 2x and 4x the GPU's memory; a multiple beyond the largest that trains is reported
as such.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

BYTES_PER_PARAM = 16
# Peak dense bf16 tensor-core FLOP/s by device name (vendor figures, without sparsity).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def llama_config(layers: int, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(8 * args.hidden / 3 / 256 + 1) * 256,
        num_hidden_layers=layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )


def count_params(layers: int, args: argparse.Namespace) -> int:
    cfg = llama_config(layers, args)
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    return layers * (4 * h * h + 3 * h * f + 2 * h) + 2 * v * h + h


def model_flops(params: int, layers: int, args: argparse.Namespace) -> float:
    """FLOPs of one training step (forward + backward), without recomputation: the MFU convention."""
    tokens = args.batch * args.seq
    return 6 * params * tokens + 12 * layers * args.hidden * args.seq * tokens


def trial(layers: int, args: argparse.Namespace) -> dict:
    """One training run in this process; the parent reads the JSON line it prints."""
    import torch

    import hetero

    cuda = torch.cuda.is_available() and not args.dry_run
    torch.manual_seed(0)
    with hetero.lazy_init():
        import transformers

        model = transformers.LlamaForCausalLM(llama_config(layers, args))
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    memory: dict = {"nvme_dir": args.nvme_dir}
    if args.dry_run:
        memory.update(device_budget="64MiB", host_budget="64MiB")
    engine = hetero.initialize(
        model,
        opt,
        {
            "zero_stage": 3,
            "precision": "bf16" if cuda else "fp32",
            "activation_checkpointing": True,
            "offload": {"params": "auto", "optimizer": "auto"},
            "memory": memory,
        },
        device="cuda" if cuda else "cpu",
    )
    times = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        engine.manager.synchronize()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    stats = engine.memory_stats()
    engine.close()
    step = min(times[1:] or times)  # the first step records the trace and measures the activations
    return {"layers": layers, "params": params, "step_s": step, "device_peak": stats["device"]["peak"]}


def run_trial(layers: int, args: argparse.Namespace) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--trial", str(layers), *args.passthrough]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.trial_timeout)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["?"]
        print(f"  {layers} layers: failed ({tail[0][:160]})", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine(args: argparse.Namespace) -> dict:
    import psutil
    import torch

    if args.dry_run or not torch.cuda.is_available():
        gpu, name = 64 << 20, "cpu (dry run)"  # the dry run's device budget stands in for a GPU
        host = 64 << 20
    else:
        props = torch.cuda.get_device_properties(0)
        gpu, name = props.total_memory, props.name
        host = psutil.virtual_memory().total
    nvme = shutil.disk_usage(args.nvme_dir).free
    if args.dry_run:
        nvme = min(nvme, 256 << 20)
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 1.0)
    return {"gpu_name": name, "gpu_bytes": gpu, "host_bytes": host, "nvme_bytes": nvme, "peak_tflops": peak}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme-dir", default=tempfile.gettempdir())
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=0, help="0: 8/3 of hidden, rounded up to 256")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-layers", type=int, default=1024)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="the GPU's peak; 0: from the device name")
    p.add_argument("--trial-timeout", type=float, default=3600)
    p.add_argument("--dry-run", action="store_true", help="CPU, a tiny model and small budgets: the code path only")
    p.add_argument("--trial", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        args.hidden, args.heads, args.vocab, args.seq, args.steps = 64, 2, 256, 32, 2
        args.max_layers = min(args.max_layers, 1)
    if args.trial:
        print(json.dumps(trial(args.trial, args)))
        return 0
    args.passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json"]
    m = machine(args)
    limit = (m["gpu_bytes"] + m["host_bytes"] + m["nvme_bytes"]) // BYTES_PER_PARAM

    # Double the depth while it trains and stays under the machine's limit, then bisect.
    ok: dict[int, dict] = {}
    lo, hi, layers = 0, None, 1
    while layers <= args.max_layers and count_params(layers, args) <= limit:
        r = run_trial(layers, args)
        if r is None:
            hi = layers
            break
        ok[layers], lo, layers = r, layers, layers * 2
    if hi is None:
        hi = min(layers, args.max_layers + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_params(mid, args) > limit:
            hi = mid
            continue
        r = run_trial(mid, args)
        if r is None:
            hi = mid
        else:
            ok[mid], lo = r, mid
    largest = ok.get(lo)

    def mfu(r: dict) -> float:
        return model_flops(r["params"], r["layers"], args) / r["step_s"] / (m["peak_tflops"] * 1e12)

    multiples = {}
    for k in (1, 2, 4):
        target = k * m["gpu_bytes"] // BYTES_PER_PARAM  # parameters whose states are k x the GPU's memory
        layers_k = max(1, min(range(1, args.max_layers + 1), key=lambda n: abs(count_params(n, args) - target)))
        if largest is None or layers_k > lo:
            multiples[f"{k}x"] = {"layers": layers_k, "params": count_params(layers_k, args), "trains": False}
            continue
        r = ok.get(layers_k) or run_trial(layers_k, args)
        multiples[f"{k}x"] = {**r, "trains": True, "mfu": mfu(r)} if r else {"layers": layers_k, "trains": False}
    result = {
        **m,
        "machine_limit_params": limit,
        "largest": {**largest, "mfu": mfu(largest), "of_limit": largest["params"] / limit} if largest else None,
        "multiples": multiples,
        "trials": sorted(ok.values(), key=lambda r: r["layers"]),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{m['gpu_name']}: GPU {m['gpu_bytes'] / 1e9:.1f} GB, host {m['host_bytes'] / 1e9:.1f} GB, NVMe "
        f"{m['nvme_bytes'] / 1e9:.1f} GB free: limit {limit / 1e9:.2f}B parameters at {BYTES_PER_PARAM} B each"
    )
    if largest:
        print(
            f"largest that trains: {lo} layers x {args.hidden}, {largest['params'] / 1e9:.3f}B parameters "
            f"({largest['params'] / limit:.0%} of the limit), step {largest['step_s']:.2f} s, MFU {mfu(largest):.1%}"
        )
    for k, r in multiples.items():
        state = f"MFU {r['mfu']:.1%}, step {r['step_s']:.2f} s" if r.get("trains") else "does not train here"
        print(f"states {k} the GPU's memory: {r['layers']} layers, {r.get('params', 0) / 1e9:.3f}B parameters: {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
