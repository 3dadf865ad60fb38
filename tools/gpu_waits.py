"""Count where hetero's training step makes the host wait for the GPU ([Note: host waits] in hetero/standin.py).

    python tools/gpu_waits.py [--json] [--steps N] [--nvme-dir DIR] [--only NAME,...]

A wait (a value read back, a data-dependent size, a copy to or from pageable memory) stops the host from queuing
more work until the GPU has run everything before it; the GPU then idles while the host catches up. On a GPU this
runs each configuration for two warm-up steps, then N steps under `torch.cuda.set_sync_debug_mode("warn")`, where
every synchronizing CUDA operation warns: each is counted with the frames of hetero's code that made it. Without
CUDA the same steps run under the CPU stand-in (`HETERO_STANDIN=1`), which records the waits it can see, so the
script and its configurations are checked on any machine. The training loop reads nothing back (no `loss.item()`):
what is counted is hetero's own.

Configurations (hetero's GPT, 4 layers of 256, stage 3, bf16 on a GPU, fp32 elsewhere): device (everything on the
device), device_clip (the same with grad_clip_norm 1.0), host (parameters and optimizer states in host memory),
host_delayed (the same with delayed_param_update), nvme (--nvme-dir: optimizer states on NVMe).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CONFIGS: dict[str, dict[str, Any]] = {
    "device": {},
    "device_clip": {"grad_clip_norm": 1.0},
    "host": {"offload": {"params": "host", "optimizer": "host"}},
    "host_delayed": {
        "offload": {"params": "host", "optimizer": "host"},
        "delayed_param_update": True,
        "delayed_param_update_warmup": 1,
    },
    "nvme": {"offload": {"optimizer": "nvme"}},
}


def _where() -> str:
    """hetero's innermost frames of the current stack (the caller of the synchronizing operation)."""
    frames = [f for f in traceback.extract_stack()[:-2] if "/hetero/" in f.filename and "standin" not in f.filename]
    return " < ".join(f"{f.filename.rsplit('/hetero/', 1)[1]}:{f.lineno}" for f in reversed(frames[-3:])) or "outside"


def run(name: str, extra: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import hetero
    from hetero.models.gpt import GPT, GPTConfig

    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, n_layer=4, n_head=4, n_embd=256, block_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    config: dict[str, Any] = {"zero_stage": 3, "precision": "bf16" if cuda else "fp32", **extra}
    if "nvme" in name:
        config["memory"] = {"nvme_dir": args.nvme_dir}
    engine = hetero.initialize(model, opt, config)
    dev = engine.device.torch_device
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (4, 65), generator=gen).to(dev) for _ in range(2)]

    def step(i: int) -> None:
        ids = batches[i % 2]
        engine.backward(engine(ids[:, :-1], labels=ids[:, 1:]).loss)
        engine.step()

    for i in range(2):
        step(i)
    counts: collections.Counter[str] = collections.Counter()
    if cuda:
        torch.cuda.synchronize()
        seen: list[str] = []
        with warnings.catch_warnings():  # restores showwarning and the filters after
            warnings.simplefilter("always")
            warnings.showwarning = lambda *a, **k: seen.append(_where())  # called where the operation warns
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for i in range(args.steps):
                    step(i)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.update(seen)
    else:
        before = len(engine.device.standin.waits)
        for i in range(args.steps):
            step(i)
        counts.update(where for _, where in engine.device.standin.waits[before:])
    norm = engine.last_grad_norm
    engine.close()
    return {
        "waits_per_step": sum(counts.values()) / args.steps,
        "where": dict(counts.most_common()),
        "grad_norm": norm,
        "gpu": cuda,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nvme-dir", help="a directory on the NVMe disk: adds the nvme configuration")
    ap.add_argument("--only", help="comma-separated configuration names")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        os.environ["HETERO_STANDIN"] = "1"  # before hetero makes its device
    names = [n for n in CONFIGS if n != "nvme" or args.nvme_dir]
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - set(CONFIGS)
        if unknown:
            ap.error(f"--only: unknown {sorted(unknown)}; known: {sorted(CONFIGS)}")
        names = [n for n in names if n in wanted]
    out = {name: run(name, CONFIGS[name], args) for name in names}
    if args.json:
        print(json.dumps(out))
        return 0
    for name, row in out.items():
        where = "; ".join(f"{k} x{v}" for k, v in list(row["where"].items())[:4]) or "-"
        print(f"{name:13s} {row['waits_per_step']:5.1f} waits a step ({'GPU' if row['gpu'] else 'stand-in'}): {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
