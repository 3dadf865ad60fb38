"""Count where hetero's training step makes the host wait for the GPU ([Note: host waits] in hetero/standin.py).

    python tools/gpu_waits.py [--json] [--steps N] [--nvme-dir DIR] [--only NAME,...] [--precision P]

A wait (a value read back, a data-dependent size, a copy to or from pageable memory) stops the host from queuing
more work until the GPU has run everything before it; the GPU then idles while the host catches up. On a GPU this
runs each configuration for two warm-up steps, then N steps under `torch.cuda.set_sync_debug_mode("warn")`, where
every synchronizing CUDA operation warns: each is counted with the frames of hetero's code that made it (outside
hetero: the innermost frame; a worker thread's are listed but not counted, the training thread goes on), and so is
each CUDA event the host blocks on before the device has reached it, which that mode does not report, where the
compute stream has run dry when the host goes on (one with work still queued behind it is listed under "blocked").
Without CUDA the same steps run under the CPU stand-in (`HETERO_STANDIN=1`), which records the waits it can see, so
the script and its configurations are checked on any machine. The training loop reads nothing back (no `loss.item()`):
what is counted is hetero's own.

Configurations (hetero's GPT, 4 layers of 256, stage 3, bf16 on a GPU, fp32 elsewhere): device (everything on the
device), device_clip (the same with grad_clip_norm 1.0), stage0 and stage2 (those stages on the device),
stage1_host (stage 1, the optimizer states in host memory: ZeRO-Offload's layout), stage1_host_writes (the same, the
loop clamping every parameter in place after each update), host (parameters and optimizer states in host memory),
host_delayed (the same with delayed_param_update), host_predicted (and delayed_param_update_prediction),
host_in_backward (with update_in_backward), and with --nvme-dir:
nvme (optimizer states on NVMe), nvme_host (and the parameters in host memory: gpu_race.py's layout), nvme_delayed
(nvme with delayed_param_update), nvme_predicted (and delayed_param_update_prediction).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
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
    "host_predicted": {
        "offload": {"params": "host", "optimizer": "host"},
        "delayed_param_update": True,
        "delayed_param_update_warmup": 1,
        "delayed_param_update_prediction": True,
    },
    "host_in_backward": {"offload": {"params": "host", "optimizer": "host"}, "update_in_backward": True},
    "stage0": {"zero_stage": 0},
    "stage1_host": {"zero_stage": 1, "offload": {"optimizer": "host"}},  # ZeRO-Offload's layout
    "stage2": {"zero_stage": 2},
    # The loop clamps every parameter in place after each update (WGAN's clip): the writes go into the host
    # masters before the next backward ([Note: the loop's writes into parameters])
    "stage1_host_writes": {"zero_stage": 1, "offload": {"optimizer": "host"}},
    "nvme": {"offload": {"optimizer": "nvme"}},
    "nvme_host": {"offload": {"params": "host", "optimizer": "nvme"}},  # benchmarks/gpu_race.py's NVMe layout
    "nvme_delayed": {"offload": {"optimizer": "nvme"}, "delayed_param_update": True, "delayed_param_update_warmup": 1},
    "nvme_predicted": {
        "offload": {"optimizer": "nvme"},
        "delayed_param_update": True,
        "delayed_param_update_warmup": 1,
        "delayed_param_update_prediction": True,
    },
}
NVME = ("nvme", "nvme_host", "nvme_delayed", "nvme_predicted")
WRITES = ("stage1_host_writes",)


def _where() -> str:
    """hetero's innermost frames of the current stack (the caller of the synchronizing operation); outside hetero,
    the innermost frame there is, so that the next run can tell whose it is. A wait on one of Python's worker threads
    (hetero's moves, the delayed update's math) is marked with the thread's name: it does not hold up the training
    thread. Autograd's device threads, which run backward and its hooks on a GPU while the training thread waits for
    them, count as the training thread (they are made in C++: `threading` knows them as dummies)."""
    stack = [f for f in traceback.extract_stack()[:-2] if f.filename != __file__ and "/warnings" not in f.filename]
    frames = [f for f in stack if "/hetero/" in f.filename and "standin" not in f.filename]
    where = " < ".join(f"{f.filename.rsplit('/hetero/', 1)[1]}:{f.lineno}" for f in reversed(frames[-3:]))
    if not where:
        where = f"outside ({os.path.basename(stack[-1].filename)}:{stack[-1].lineno})" if stack else "outside"
    thread = threading.current_thread()
    if thread is threading.main_thread() or isinstance(thread, threading._DummyThread):
        return where
    return f"worker thread {thread.name}: {where}"


class _EventWaits:
    """Counts `torch.cuda.Event.synchronize` calls that block (the event not yet reached): a wait for the device
    that torch's sync debug mode does not report (`Device.landed` waits on such events). A block after which the
    compute stream still has work queued left the device busy while the host waited (fp16's overflow flag, read once
    the update is queued: [Note: the overflow check on the device]): listed apart (`blocked`), not counted as a wait;
    one after which the compute stream has run dry is a wait."""

    def __init__(self, seen: list[str], blocked: list[str]) -> None:
        self.seen, self.blocked = seen, blocked
        self.original = torch.cuda.Event.synchronize

    def __enter__(self) -> None:
        original, seen, blocked = self.original, self.seen, self.blocked

        def synchronize(event: torch.cuda.Event) -> None:
            reached = event.query()
            original(event)
            if not reached:
                busy = not torch.cuda.current_stream().query()  # the compute stream still has work queued
                (blocked if busy else seen).append(f"event: {_where()}")

        torch.cuda.Event.synchronize = synchronize  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        torch.cuda.Event.synchronize = self.original  # type: ignore[method-assign]


def run(name: str, extra: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import hetero
    from hetero.models.gpt import GPT, GPTConfig

    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, n_layer=4, n_head=4, n_embd=args.embd, block_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    precision = args.precision or ("bf16" if cuda else "fp32")
    config: dict[str, Any] = {"zero_stage": 3, "precision": precision, **extra}
    if name in NVME:
        config["memory"] = {"nvme_dir": args.nvme_dir}
    try:
        engine = hetero.initialize(model, opt, config)
    except hetero.ConfigError as e:  # a placement this precision does not take (fp16 with the update in backward)
        return {"skipped": str(e)}
    dev = engine.device.torch_device
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (4, 65), generator=gen).to(dev) for _ in range(2)]

    def step(i: int) -> None:
        ids = batches[i % 2]
        engine.backward(engine(ids[:, :-1], labels=ids[:, 1:]).loss)
        engine.step()
        if name in WRITES:
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.05, 0.05)

    for i in range(2):
        step(i)
    counts: collections.Counter[str] = collections.Counter()
    blocked: list[str] = []
    if cuda:
        torch.cuda.synchronize()
        seen: list[str] = []
        with warnings.catch_warnings():  # restores showwarning and the filters after
            warnings.simplefilter("always")
            warnings.showwarning = lambda *a, **k: seen.append(_where())  # called where the operation warns
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with _EventWaits(seen, blocked):
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
    mine = sum(n for where, n in counts.items() if "worker thread" not in where)
    return {
        "waits_per_step": mine / args.steps,  # the training thread's; a worker's are listed under "where" only
        "where": dict(counts.most_common()),
        "blocked": dict(collections.Counter(blocked).most_common()),  # the device busy meanwhile: no wait (GPU only)
        "grad_norm": norm,
        "gpu": cuda,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--embd", type=int, default=256, help="the GPT's width (4 layers, 4 heads; 64 splits into chunks alike: tests)"
    )
    ap.add_argument("--nvme-dir", help="a directory on the NVMe disk: adds the nvme configuration")
    ap.add_argument("--only", help="comma-separated configuration names")
    ap.add_argument(
        "--precision", choices=("fp32", "bf16", "fp16"), help="the engine's (default: bf16 on a GPU, fp32 elsewhere)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps: expected an integer >= 1, got {args.steps}")
    if args.embd < 4 or args.embd % 4:
        ap.error(f"--embd: expected a multiple of the 4 heads, got {args.embd}")
    if not torch.cuda.is_available():
        os.environ["HETERO_STANDIN"] = "1"  # before hetero makes its device
    names = [n for n in CONFIGS if n not in NVME or args.nvme_dir]
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - set(CONFIGS)
        if unknown:
            ap.error(f"--only: unknown {sorted(unknown)}; known: {sorted(CONFIGS)}")
        needs_dir = [n for n in wanted if n in NVME and not args.nvme_dir]
        if needs_dir:
            ap.error(f"--only {','.join(needs_dir)}: these configurations need --nvme-dir DIR (on the NVMe disk)")
        names = [n for n in names if n in wanted]
    out = {name: run(name, CONFIGS[name], args) for name in names}
    if args.json:
        print(json.dumps(out))
        return 0
    for name, row in out.items():
        if "skipped" in row:
            print(f"{name:13s} skipped: {row['skipped']}")
            continue
        where = "; ".join(f"{k} x{v}" for k, v in list(row["where"].items())[:4]) or "-"
        print(f"{name:13s} {row['waits_per_step']:5.1f} waits a step ({'GPU' if row['gpu'] else 'stand-in'}): {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
