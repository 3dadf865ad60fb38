"""One GPU: hetero against plain PyTorch, FSDP2 and DeepSpeed ZeRO-3, with everything on the GPU, with parameters
and optimizer states offloaded to host memory, and offloaded to NVMe. Step time, model FLOPs utilisation, peak GPU
memory and peak host RSS, side by side in one run.

    python benchmarks/gpu_race.py [--json] [--only NAME,...] [--nvme-dir DIR] [--hidden H] [--layers L]
                                  [--heads A] [--intermediate I] [--vocab V] [--seq T] [--batch B]
                                  [--steps N] [--warmup W] [--timeout S] [--max-in-cpu N] [--rounds R]
    python benchmarks/gpu_race.py --dry-run --json     # the same code paths on the CPU with a tiny model

Every configuration trains transformers' LlamaForCausalLM (untied embeddings) from the same seed on the same random
token batches, with bf16 compute, fp32 master weights and AdamW (lr 1e-4, weight decay 0.01) with a fused kernel
(torch's fused AdamW on the GPU or on the host; DeepSpeed's own CPU Adam where it offloads, since it takes no other),
no activation checkpointing and no gradient clipping, W warm-up steps then N timed ones, each configuration in a
fresh process:

  plain              plain PyTorch: the model on the GPU, autocast to bf16, fused AdamW on the GPU
  fsdp2              torch's fully_shard on every decoder layer and the root, bf16 parameters, fp32 reduction
  hetero             hetero ZeRO-3, precision bf16, everything on the GPU
  fsdp2_offload      FSDP2 with CPUOffloadPolicy (pinned): parameters and gradients on the host, fused AdamW there
  deepspeed_offload  DeepSpeed ZeRO-3, offload_param and offload_optimizer to pinned CPU memory, its CPU Adam
  hetero_offload     hetero ZeRO-3, parameters and optimizer states on the host
  hetero_offload_delayed   the same with delayed_param_update (the host update of step t overlaps step t+1)
  hetero_offload_in_backward   the same with update_in_backward (each chunk steps on the host during backward)
  deepspeed_nvme     (--nvme-dir) DeepSpeed ZeRO-Infinity: parameters and optimizer states on NVMe, its aio engine
  deepspeed_nvme_pipelined  (--nvme-dir) the same, its optimizer stepped in sub-groups (a sixth of the parameters
                     each) with the next one's states read and the last one's written while one steps
                     (offload_optimizer.pipeline_read and pipeline_write, 16 swap buffers)
  hetero_nvme        (--nvme-dir) hetero with parameters and optimizer states on NVMe
  hetero_nvme_delayed      (--nvme-dir) the same with delayed_param_update
  hetero_nvme_predicted    (--nvme-dir) the same with delayed_param_update_prediction too (the master kept apart)
  hetero_nvme_in_backward  (--nvme-dir) the same with update_in_backward

With parameters on NVMe both engines keep the same number of parameter elements in host memory (--max-in-cpu N:
DeepSpeed's offload_param.max_in_cpu, hetero's offload.params_host_bytes at the compute dtype's bytes an element);
the default is DeepSpeed's own, 1e9, which keeps every parameter of a model under a billion on the host; 0 sends
them all to NVMe.

Step time is the wall time of the timed steps over their count, the GPU synchronised at both ends (work an engine
leaves running past a step is counted in the step that waits for it); step_median_s is the median of per-step times
with the GPU synchronised after each. MFU is the model's FLOPs per step (6 x parameters x tokens + 12 x layers x
hidden x seq x tokens for attention, without recomputation) per second over the GPU's peak dense bf16 rate (the
vendor's figure; measured_bf16_tflops is an 8192^3 matrix product timed here, for comparison). Races are reported as
hetero's step time and memory over the peer's with the same placement; where the peer ran in more than one
configuration (DeepSpeed's NVMe offload, pipelined or not), over the best of them on each measure. Before each NVMe
configuration the driver waits for the disk to write back what the last one left (disk_settle_s). With --rounds R
every configuration runs R times, the order reversed every other round so that none always follows the same one (a
configuration run right after another's NVMe traffic stepped 1.35x slower on one H200); each keeps its fastest
round's step (other load only adds time) and the highest peak RSS of its rounds, the same rule for every engine
(round_steps_s lists each round's step).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16, vendor figures, no sparsity
LR, WEIGHT_DECAY, SEED = 1e-4, 0.01, 0
LOSS_REL_TOL = 0.02  # bf16 compute: engines that round differently stay within this of plain PyTorch's last loss
CONFIGS = (
    "plain",
    "fsdp2",
    "hetero",
    "fsdp2_offload",
    "deepspeed_offload",
    "hetero_offload",
    "hetero_offload_delayed",
    "hetero_offload_in_backward",
    "deepspeed_nvme",
    "deepspeed_nvme_pipelined",
    "hetero_nvme",
    "hetero_nvme_delayed",
    "hetero_nvme_predicted",
    "hetero_nvme_in_backward",
)
DS_NVME = ("deepspeed_nvme", "deepspeed_nvme_pipelined")  # the peer's NVMe configurations: the best one counts
RACES = (  # (name, hetero's configuration, the peer's, or several: the best of them on each measure)
    ("vs_fsdp2", "hetero", "fsdp2"),
    ("vs_plain", "hetero", "plain"),
    ("vs_fsdp2_offload", "hetero_offload", "fsdp2_offload"),
    ("vs_deepspeed_offload", "hetero_offload", "deepspeed_offload"),
    ("vs_deepspeed_offload_delayed", "hetero_offload_delayed", "deepspeed_offload"),
    ("vs_deepspeed_nvme", "hetero_nvme", DS_NVME),
    ("vs_deepspeed_nvme_delayed", "hetero_nvme_delayed", DS_NVME),
    ("vs_deepspeed_nvme_predicted", "hetero_nvme_predicted", DS_NVME),
    ("vs_fsdp2_offload_in_backward", "hetero_offload_in_backward", "fsdp2_offload"),
    ("vs_deepspeed_nvme_in_backward", "hetero_nvme_in_backward", DS_NVME),
)


def pipelined_swap(zero: dict[str, Any], elements: int) -> None:
    """DeepSpeed's pipelined optimizer swapper in a `zero_optimization` section with an NVMe `offload_optimizer`, for
    a rank stepping `elements` parameters. It overlaps a sub-group's step with the next one's reads and the last one's
    writes, so it needs several sub-groups (the default sub_group_size, 1e9 elements, makes one of any model raced
    here: a sixth each) and more swap buffers than its default 4 (with 4 or 8 it fails an assertion in DeepSpeed
    0.19.8)."""
    zero["sub_group_size"] = -(-elements // 6)
    zero["offload_optimizer"].update(pipeline_read=True, pipeline_write=True, buffer_count=16)


# ------------------------------------------------------------------------------------------------ one process
def llama(args: argparse.Namespace) -> Any:
    """transformers' LlamaForCausalLM, untied, at args' shape (hidden, intermediate, layers, heads, vocab, seq); also
    benchmarks/bigger_than_ram.py's."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(128, args.seq),
        tie_word_embeddings=False,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _setup(name: str, model: Any, args: argparse.Namespace, dev: Any) -> tuple[Any, Any]:
    """(step(x, y) -> loss, close()) for one configuration."""
    import torch
    from torch.profiler import record_function

    bf16 = torch.bfloat16
    if name == "plain":
        model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

        def plain_step(x: Any, y: Any) -> Any:
            with torch.autocast(dev.type, dtype=bf16):
                loss = model(input_ids=x, labels=y).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return plain_step, lambda: None
    if name.startswith("fsdp2"):
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
        except ImportError:  # torch 2.4-2.5: FSDP2 under its first name
            from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
                CPUOffloadPolicy,
                MixedPrecisionPolicy,
                OffloadPolicy,
                fully_shard,
            )

        offload = CPUOffloadPolicy(pin_memory=dev.type == "cuda") if name == "fsdp2_offload" else OffloadPolicy()
        if name == "fsdp2":
            model.to(dev)
        kw = {
            "mp_policy": MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32),
            "offload_policy": offload,
        }
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

        def fsdp_step(x: Any, y: Any) -> Any:
            with record_function("race.forward"):
                loss = model(input_ids=x, labels=y).loss
            with record_function("race.backward"):
                loss.backward()
            with record_function("race.update"):
                opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return fsdp_step, lambda: None
    if name.startswith("hetero"):
        import hetero

        where = "device" if name == "hetero" else ("nvme" if "nvme" in name else "host")
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        config: dict[str, Any] = {
            "zero_stage": 3,
            "precision": "bf16",
            "offload": {"params": where, "optimizer": where},
            "memory": {"nvme_dir": args.nvme_dir} if where == "nvme" else {},
        }
        if args.dry_run:
            config["precision"] = "fp32"  # the CPU's bf16 matmuls are emulated and slow; the code path is the same
        if where == "nvme":  # DeepSpeed's max_in_cpu, in bytes of the compute dtype
            config["offload"]["params_host_bytes"] = args.max_in_cpu * (4 if args.dry_run else 2)
        if name.endswith(("_delayed", "_predicted")):
            config.update(delayed_param_update=True, delayed_param_update_warmup=0)
        if name.endswith("_predicted"):
            config["delayed_param_update_prediction"] = True
        if name.endswith("_in_backward"):
            config["update_in_backward"] = True  # each chunk steps as its gradient is final, during backward
        engine = hetero.initialize(model, opt, config, device=dev)

        def hetero_step(x: Any, y: Any) -> Any:
            with record_function("race.forward"):
                loss = engine(input_ids=x, labels=y).loss
            with record_function("race.backward"):
                engine.backward(loss)
            with record_function("race.update"):
                engine.step()
            return loss

        def close() -> dict[str, Any]:
            engine.manager.synchronize()
            stats = engine.memory_stats()
            engine.close()
            return {"memory_stats": json.loads(json.dumps(stats, default=repr))}

        return hetero_step, close
    if name.startswith("deepspeed"):
        if dev.type == "cuda":
            # DeepSpeed's op builder parses TORCH_CUDA_ARCH_LIST as numbers and fails on "9.0a" (seen on an H200
            # image): name this GPU's plain capability for the ops it compiles on first use.
            os.environ["TORCH_CUDA_ARCH_LIST"] = "{}.{}".format(*torch.cuda.get_device_capability(dev))
        import deepspeed  # type: ignore[import-not-found]

        where = "nvme" if "nvme" in name else "cpu"
        off: dict[str, Any] = {"device": where, "pin_memory": dev.type == "cuda"}
        if where == "nvme":
            off["nvme_path"] = args.nvme_dir
        param_off = {**off, "max_in_cpu": args.max_in_cpu} if where == "nvme" else dict(off)
        zero: dict[str, Any] = {"stage": 3, "offload_param": param_off, "offload_optimizer": dict(off)}
        if name.endswith("_pipelined"):
            pipelined_swap(zero, sum(p.numel() for p in model.parameters()))
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": not args.dry_run},
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told not to; nobody else clips
            # Its aio engine with deeper queues and more threads than its defaults (8, 1): the disk's best.
            "aio": {"block_size": 8 << 20, "queue_depth": 32, "intra_op_parallelism": 8, "single_submit": False},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def ds_step(x: Any, y: Any) -> Any:
            loss = engine(input_ids=x, labels=y).loss
            engine.backward(loss)
            engine.step()
            return loss

        return ds_step, lambda: None
    raise ValueError(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args.dry_run
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    if name.startswith("fsdp2"):
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    torch.manual_seed(SEED)
    model = llama(args)
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    step, close = _setup(name, model, args, dev)
    setup_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(SEED + 1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(4)]
    sync = torch.cuda.synchronize if cuda else _no_sync
    losses, per_step = [], []
    warmup, steps = (args.nvme_warmup, args.nvme_steps) if "nvme" in name else (args.warmup, args.steps)
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            start = time.perf_counter()
        ids = batches[i % len(batches)].to(dev)
        t = time.perf_counter()
        loss = step(ids[:, :-1], ids[:, :-1])
        losses.append(float(loss.detach()))  # a host read: the step's GPU work is done
        sync()
        per_step.append(time.perf_counter() - t)
    sync()
    step_s = (time.perf_counter() - start) / steps
    if args.profile and (not args.profile_only or name in args.profile_only.split(",")):
        ids = batches[0].to(dev)
        _profile(name, lambda: step(ids[:, :-1], ids[:, :-1]), cuda, args.profile)
    extra = close() or {}
    out = {
        "name": name,
        "params": params,
        "setup_s": setup_s,
        "step_s": step_s,
        "step_median_s": statistics.median(per_step[warmup:]),
        "losses": losses,
        "peak_rss_mb": _hwm_mb(),
        **extra,
    }
    if cuda:
        out["gpu_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["gpu_peak_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


# Host-side calls that wait for the GPU or move bytes over the bus: where a step's time goes when it is not the GPU's.
_WAITS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpyAsync",
    "cudaHostRegister",
    "aten::copy_",
    "aten::_to_copy",
    "aten::item",
    "aten::_local_scalar_dense",
)


def _profile(name: str, step: Any, cuda: bool, out_dir: str) -> None:
    """One more step under torch.profiler: the operator tables, the waits with the Python stacks that made them,
    and a trace Perfetto opens (gzipped)."""
    import gzip

    import torch
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, with_stack=True, record_shapes=False) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    lines = [prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)]
    with_device = "self_device_time_total" if hasattr(prof.key_averages()[0], "self_device_time_total") else None
    if with_device and len(acts) > 1:
        lines.append(prof.key_averages().table(sort_by=with_device, row_limit=30))
    # Each wait with the chain of Python frames above it (the profiler's Python tracer records them as parents).
    by_site: dict[tuple[str, ...], list[float]] = {}
    for e in prof.events():
        if not any(e.name.startswith(w) for w in _WAITS):
            continue
        chain, p = [e.name], e.cpu_parent
        while p is not None and len(chain) < 40:
            if any(k in p.name for k in ("hetero/", "gpu_race", "fsdp/", "deepspeed/")):
                chain.append(p.name)
            p = p.cpu_parent
        site = by_site.setdefault(tuple(chain[:7]), [0, 0.0])
        site[0] += 1
        site[1] += e.cpu_time_total
    for chain, (calls, us) in sorted(by_site.items(), key=lambda kv: -kv[1][1])[:40]:
        lines.append(f"{chain[0]}: calls {calls}, CPU total {us / 1e3:.1f} ms")
        lines.extend("    " + frame for frame in chain[1:])
    with open(os.path.join(out_dir, f"{name}_ops.txt"), "w") as f:
        f.write("\n".join(lines))
    trace = os.path.join(out_dir, f"{name}_trace.json")
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(trace)


def _no_sync() -> None:
    pass


# ------------------------------------------------------------------------------------------------ driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    name: str, args: argparse.Namespace, passthrough: list[str], log_dir: str, nvme: bool = True
) -> dict[str, Any]:
    if nvme and "nvme" in name:  # each configuration its own directory, removed after it: the disk holds one at a time
        settle_s = _settle_disk()
        sub = tempfile.mkdtemp(prefix=f"{name}_", dir=args.nvme_dir)
        try:
            out = _child(name, args, [*passthrough, "--nvme-dir", sub], log_dir, nvme=False)
        finally:
            shutil.rmtree(sub, ignore_errors=True)
        return {**out, "disk_settle_s": round(settle_s, 2)}
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", PYTHONUNBUFFERED="1")
    log = os.path.join(log_dir, f"{name}.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, *passthrough]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"name": name, "error": f"timed out after {args.timeout} s", "log_tail": _tail(log)}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
        return {"name": name, "error": f"exit code {proc.returncode}", "log_tail": _tail(log)}
    out = json.loads(lines[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


def _settle_disk(limit_s: float = 120.0, quiet_bytes: int = 64 << 20) -> float:
    """Wait until the kernel has written back what earlier configurations left dirty; the seconds it took.

    On one H200's virtio disk a configuration run right after DeepSpeed's NVMe one stepped 1.35x slower than the same
    configuration first on a fresh machine (benchmarks/README.md, thirty-second session): what one configuration
    left for the disk to finish must not be charged to the next. Swap files are O_DIRECT on both sides, but their
    removal, checkpoints and logs go through the page cache.
    """
    t0 = time.perf_counter()
    os.sync()
    while time.perf_counter() - t0 < limit_s:
        try:
            with open("/proc/meminfo") as f:
                info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
        except OSError:  # not Linux: sync() is all there is
            break
        if info.get("Dirty", 0) + info.get("Writeback", 0) < quiet_bytes:
            break
        time.sleep(0.5)
    time.sleep(2.0)  # the device's own queue (a virtio disk's host side) past what the kernel can see
    return time.perf_counter() - t0


def _tail(path: str, chars: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def measured_tflops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12


def model_flops(params: int, args: argparse.Namespace) -> float:
    tokens = args.batch * args.seq
    return 6 * params * tokens + 12 * args.layers * args.hidden * args.seq * tokens


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace, machine: dict[str, Any]) -> dict[str, Any]:
    peak = machine["peak_tflops"]
    for r in results.values():
        if "step_s" in r:
            r["tflops"] = model_flops(r["params"], args) / r["step_s"] / 1e12
            r["mfu"] = r["tflops"] / peak if peak else None
    ref = results.get("plain", {}).get("losses")
    for r in results.values():
        if ref and r.get("losses"):
            # The same step of plain PyTorch's run: the NVMe configurations take fewer steps.
            n = min(len(ref), len(r["losses"])) - 1
            r["last_loss_rel_gap"] = abs(r["losses"][n] - ref[n]) / abs(ref[n])
            r["loss_agrees"] = r["last_loss_rel_gap"] <= LOSS_REL_TOL
    races = {}
    for race, ours, peers in RACES:
        a = results.get(ours, {})
        ran = [results[p] for p in ((peers,) if isinstance(peers, str) else peers) if "step_s" in results.get(p, {})]
        if "step_s" not in a or not ran:
            continue
        # The peer's best on each measure, whichever of its configurations gave it.
        fast = min(ran, key=lambda r: r["step_s"])
        small = min(ran, key=lambda r: r["peak_rss_mb"])
        gpu = min(ran, key=lambda r: r.get("gpu_peak_reserved_mb", 0))
        races[race] = {
            "ours": ours,
            "peer": fast["name"],
            "peer_rss": small["name"],
            "step_ratio": a["step_s"] / fast["step_s"],
            "rss_ratio": a["peak_rss_mb"] / small["peak_rss_mb"],
            "gpu_peak_ratio": a.get("gpu_peak_reserved_mb", 0) / max(gpu.get("gpu_peak_reserved_mb", 0), 1e-9),
        }
    return {"machine": machine, "shape": vars(args), "configs": results, "races": races}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--only", help="comma-separated configurations (default: all that can run)")
    ap.add_argument("--nvme-dir", help="directory on NVMe for the *_nvme configurations")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--nvme-steps", type=int, default=2, help="timed steps of the *_nvme configurations")
    ap.add_argument("--nvme-warmup", type=int, default=1, help="warm-up steps of the *_nvme configurations")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    ap.add_argument("--rounds", type=int, default=1, help="run everything R times, every other round in reverse")
    ap.add_argument(
        "--max-in-cpu",
        type=int,
        default=10**9,
        metavar="N",
        help="*_nvme: parameter elements both engines keep in host memory (default DeepSpeed's 1e9; 0: none)",
    )
    ap.add_argument("--peak-tflops", type=float, help="the GPU's peak dense bf16 TFLOP/s (default: by name)")
    ap.add_argument("--profile", metavar="DIR", help="profile one more step of each configuration into DIR")
    ap.add_argument("--profile-only", metavar="NAME,...", help="with --profile: only these configurations")
    ap.add_argument("--dry-run", action="store_true", help="the CPU and a tiny model: checks the code paths")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.dry_run:
        args.hidden, args.layers, args.heads, args.intermediate, args.vocab, args.seq, args.batch = (
            64,
            2,
            4,
            128,
            256,
            32,
            2,
        )
    if args.child:
        if args.dry_run:
            os.environ["DS_ACCELERATOR"] = "cpu"  # read by DeepSpeed on import
        print(json.dumps(run_one(args.child, args)))
        return 0
    import importlib.util

    import torch

    names = args.only.split(",") if args.only else list(CONFIGS)
    if unknown := [n for n in names if n not in CONFIGS]:
        ap.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    skipped = {}
    for n in names:
        if "nvme" in n and not args.nvme_dir:
            skipped[n] = "needs --nvme-dir"
        elif n.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
            skipped[n] = "DeepSpeed is not installed"
    cuda = torch.cuda.is_available() and not args.dry_run
    name = torch.cuda.get_device_name(0) if cuda else "cpu (dry run)"
    machine = {
        "gpu": name,
        "peak_tflops": args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None),
        "measured_bf16_tflops": measured_tflops() if cuda else None,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "max_in_cpu": args.max_in_cpu,
        "skipped": skipped,
    }
    raw = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json"]
    valued = ("--only", "--nvme-dir")  # the driver's own: each child gets its configuration and directory
    passthrough = [a for i, a in enumerate(raw) if a not in valued and (i == 0 or raw[i - 1] not in valued)]
    rounds: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_race_") as log_dir:
        for rnd in range(args.rounds):
            for n in names if rnd % 2 == 0 else names[::-1]:
                if n in skipped:
                    continue
                r = {**_child(n, args, passthrough, log_dir), "round": rnd + 1}
                rounds.setdefault(n, []).append(r)
                if not args.json:
                    print(_line(r), flush=True)
                else:  # each result as it comes, on stderr: a run cut short by its caller's timeout keeps it
                    print(_line(r), json.dumps(r), sep="\n", file=sys.stderr, flush=True)
    results = {n: best_round(rs) for n, rs in rounds.items()}
    out = report(results, args, machine)
    if args.json:
        print(json.dumps(out))
    else:
        for n, r in out["configs"].items():
            if "mfu" in r and r["mfu"] is not None:
                print(f"{n:24s} {r['tflops']:.1f} TFLOP/s, MFU {r['mfu']:.3f}")
        for race, r in out["races"].items():
            print(
                f"{race:32s} {r['ours']} / {r['peer']}: step {r['step_ratio']:.3f}x, RSS {r['rss_ratio']:.3f}x"
                + ("" if r["peer_rss"] == r["peer"] else f" (/ {r['peer_rss']})")
                + f", GPU {r['gpu_peak_ratio']:.3f}x"
            )
    return 0 if all("error" not in r for r in results.values()) else 1


def best_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's result from its rounds: the fastest round's figures, with the highest peak RSS (host and
    GPU) of them all; a configuration that failed in any round keeps that failure."""
    failed = [r for r in rounds if "error" in r]
    if failed:
        return failed[0]
    best = dict(min(rounds, key=lambda r: r["step_s"]))
    best["peak_rss_mb"] = max(r["peak_rss_mb"] for r in rounds)
    if all("gpu_peak_reserved_mb" in r for r in rounds):
        best["gpu_peak_reserved_mb"] = max(r["gpu_peak_reserved_mb"] for r in rounds)
    best["round_steps_s"] = [r["step_s"] for r in rounds]
    return best


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['name']:24s} FAILED: {r['error']}\n{r['log_tail']}"
    gpu = f", GPU peak {r['gpu_peak_reserved_mb']:.0f} MB" if "gpu_peak_reserved_mb" in r else ""
    rnd = f", round {r['round']}" if r.get("round", 1) > 1 else ""
    return (
        f"{r['name']:24s} step {r['step_s']:.3f} s (median {r['step_median_s']:.3f}), RSS {r['peak_rss_mb']:.0f} "
        f"MB{gpu}, last loss {r['losses'][-1]:.4f}{rnd}"
    )


if __name__ == "__main__":
    sys.exit(main())
