"""Checkpoint save and load throughput against the raw disk, and the peak memory of consolidation.

    python benchmarks/checkpoint_io.py [--dir DIR] [--width 1024] [--layers 24] [--repeats 3] [--json]

A model of `--layers` square Linear layers (default 25M parameters: 100 MB of fp32 weights, 300 MB of checkpoint
with AdamW's master weights and two states) is trained one step with hetero (stage 0, one process), then:
 - save: `engine.save_checkpoint` (every byte fsync'd, manifest, rename, `latest`) vs the raw disk writing the same
   files: a new directory holding files of the checkpoint's sizes (its rank file, state.pt, manifest.json and the
   `latest` pointer), each written with plain sequential `os.write` calls of 64 MiB and fsync'd once, then the
   directory fsync'd; in the same directory, in the same run. The raw side skips what makes a save atomic (the
   rename and its directory fsyncs) and what makes it verifiable (checksums): that is the price being measured.
   The save writes each chunk with pwritev on I/O threads and starts the kernel's writeback after each one
   (sync_file_range), so it can beat the plain write-then-fsync baseline, which leaves all writeback to the fsync;
 - load: `engine.load_checkpoint` (header and per-tensor CRC32 checks, filling every chunk) vs plain `os.preadv`
   of those raw files in 64 MiB blocks through the page cache. Reads are made cold: the files are fsync'd, so their
   pages are clean, and POSIX_FADV_DONTNEED drops them from the page cache before every timed read on both sides.
   The load reads each chunk with O_DIRECT straight into its buffer where the rank file's aligned layout allows,
   bypassing the page cache the baseline goes through: either way every byte comes from the disk;
 - consolidation: `hetero.checkpoint.consolidate` to .safetensors in a subprocess; its peak RSS (VmHWM, reset
   after the imports, minus the RSS before) against the largest tensor and the whole model (Linux only).
Each side runs --repeats times, alternating; the best time is reported (the machine may be shared). GB = 1e9 bytes.
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

import torch  # noqa: E402
from torch import nn  # noqa: E402

import hetero  # noqa: E402

BLOCK = 64 << 20


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def drop_cache(path: str) -> None:
    """Evict a file's (clean) pages from the page cache, so that the next read comes from the disk."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def raw_write(directory: str, sizes: list[int], buf: memoryview) -> float:
    """Write files of `sizes` bytes (from `buf`) into a new `directory`, each fsync'd, then fsync the directory."""
    t = time.perf_counter()
    os.makedirs(directory)
    for k, size in enumerate(sizes):
        fd = os.open(os.path.join(directory, f"f{k}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for i in range(0, size, BLOCK):
                os.write(fd, buf[i : min(i + BLOCK, size)])
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def raw_read(directory: str, sizes: list[int], buf: memoryview) -> float:
    drop_cache(directory)
    t = time.perf_counter()
    for k, size in enumerate(sizes):
        fd = os.open(os.path.join(directory, f"f{k}"), os.O_RDONLY)
        try:
            for i in range(0, size, BLOCK):
                os.preadv(fd, [buf[i : min(i + BLOCK, size)]], i)
        finally:
            os.close(fd)
    return time.perf_counter() - t


def file_sizes(root: str) -> list[int]:
    """Sizes of every file of a checkpoint root (its one checkpoint directory and `latest`), largest first."""
    return sorted((os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs), reverse=True)


def build(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


CONSOLIDATE_JOB = """
import json, sys, time
sys.path.insert(0, sys.argv[3])
from hetero.checkpoint import consolidate

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM, the peak RSS, to the RSS now: imports' own peak is not counted
t = time.perf_counter()
consolidate(sys.argv[1], sys.argv[2])
dt = time.perf_counter() - t
print(json.dumps({"rss_before_kib": before, "rss_peak_kib": status("VmHWM"), "seconds": dt}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir in the cwd)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print exactly one JSON object instead of text")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir or os.getcwd())
    say = (lambda *a: None) if args.json else print
    try:
        model, opt = build(args.width, args.layers)
        params = sum(q.numel() for q in model.parameters())
        largest = max(q.numel() * 4 for q in model.parameters())
        engine = hetero.initialize(model, opt, {"zero_stage": 0}, device="cpu")
        x = torch.randn(8, args.width)
        engine.backward(engine(x).square().mean())
        engine.step()
        say(
            f"model: {params / 1e6:.1f}M parameters ({params * 4 / 1e6:.0f} MB fp32), largest tensor "
            f"{largest / 1e6:.1f} MB; directory {work}"
        )

        saves, raws_w, loads, raws_r = [], [], [], []
        nbytes = 0
        for i in range(args.repeats):
            root = os.path.join(work, f"ckpt{i}")
            t = time.perf_counter()
            engine.save_checkpoint(root)
            saves.append(time.perf_counter() - t)
            nbytes = dir_bytes(root)
            sizes = file_sizes(root)
            if i == 0:
                payload = torch.randint(0, 255, (sizes[0],), dtype=torch.uint8)
                view = memoryview(payload.numpy())
            raw_dir = os.path.join(work, f"raw{i}")
            raws_w.append(raw_write(raw_dir, sizes, view))
            drop_cache(root)
            t = time.perf_counter()
            engine.load_checkpoint(root)
            loads.append(time.perf_counter() - t)
            raws_r.append(raw_read(raw_dir, sizes, view))
            shutil.rmtree(raw_dir)
            if i > 0:
                shutil.rmtree(root)
        engine.close()
        res = {
            "checkpoint_bytes": nbytes,
            "save_gbps": gbps(nbytes, min(saves)),
            "raw_write_gbps": gbps(nbytes, min(raws_w)),
            "load_gbps": gbps(nbytes, min(loads)),
            "raw_read_gbps": gbps(nbytes, min(raws_r)),
        }
        res["save_vs_raw"] = res["save_gbps"] / res["raw_write_gbps"]
        res["load_vs_raw"] = res["load_gbps"] / res["raw_read_gbps"]
        files = sum(len(fs) for _, _, fs in os.walk(os.path.join(work, "ckpt0")))
        say(f"checkpoint: {nbytes / 1e6:.0f} MB in {files} files (best of {args.repeats} runs per side)")
        say(
            f"save  {res['save_gbps']:.2f} GB/s vs raw write+fsync {res['raw_write_gbps']:.2f} GB/s: "
            f"{res['save_vs_raw']:.2f}x"
        )
        say(
            f"load  {res['load_gbps']:.2f} GB/s vs raw cold read {res['raw_read_gbps']:.2f} GB/s: "
            f"{res['load_vs_raw']:.2f}x"
        )

        out = os.path.join(work, "model.safetensors")
        repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        job = subprocess.run(
            [sys.executable, "-c", CONSOLIDATE_JOB, os.path.join(work, "ckpt0"), out, repo],
            capture_output=True,
            text=True,
            check=True,
        )
        c = json.loads(job.stdout.strip().splitlines()[-1])
        extra = (c["rss_peak_kib"] - c["rss_before_kib"]) * 1024
        res.update(
            consolidate_peak_rss_increase_bytes=extra,
            consolidate_largest_tensor_bytes=largest,
            consolidate_model_bytes=params * 4,
            consolidate_rss_vs_largest=extra / largest,
            consolidate_gbps=gbps(os.path.getsize(out), c["seconds"]),
        )
        say(
            f"consolidate: peak RSS grew {extra / 1e6:.1f} MB = {extra / largest:.2f}x the largest tensor "
            f"({largest / 1e6:.1f} MB), {extra / (params * 4):.3f}x the model ({params * 4 / 1e6:.0f} MB); "
            f"{res['consolidate_gbps']:.2f} GB/s"
        )
        if args.json:
            print(json.dumps(res))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
