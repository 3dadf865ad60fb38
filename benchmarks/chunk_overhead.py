"""What the chunk manager costs on top of the copies it makes.

1. A device <-> host round trip of one chunk through the manager (`move` down, `move` back) against a plain
   `copy_` of the same bytes between two preallocated buffers, measured alternately in the same run.
   Target: within 1.1x of the plain copy.
2. The bookkeeping of an access per tensor: `access` of a resident chunk plus the COMPUTE -> HOLD_AFTER_FWD state
   changes of each tensor in it, in microseconds per tensor.

Without CUDA the "device" tier is the CPU under its own budget, so (1) measures memory-to-memory copies.

    python benchmarks/chunk_overhead.py [--chunk 64MiB] [--iters 20] [--tensors 1000] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hetero.config import parse_size
from hetero.device import Device
from hetero.memory import ChunkManager, TensorState, Tier


def _sync(device: Device) -> None:
    device.synchronize()


def round_trip(chunk_bytes: int, iters: int) -> dict[str, float]:
    device = Device()
    numel = chunk_bytes // 4
    with ChunkManager(device=device, device_budget=2 * chunk_bytes, host_budget=2 * chunk_bytes) as m:
        chunk = m.new_chunk(dtype=torch.float32, capacity=numel)
        slot = chunk.add_tensor("w", (numel,))
        m.access(chunk, Tier.DEVICE)
        chunk.view(slot).normal_()
        chunk.set_state(slot, TensorState.HOLD)
        dev = device.empty_bytes(chunk_bytes).view(torch.float32).normal_()
        host = device.empty_host(chunk_bytes).view(torch.float32)

        def managed() -> float:
            t0 = time.perf_counter()
            m.move(chunk, Tier.HOST)
            m.move(chunk, Tier.DEVICE)
            return time.perf_counter() - t0

        def plain() -> float:
            t0 = time.perf_counter()
            host.copy_(dev)
            _sync(device)
            dev.copy_(host)
            _sync(device)
            return time.perf_counter() - t0

        for _ in range(3):  # warm up: pools filled, pages touched
            managed()
            plain()
        hetero_s, plain_s = [], []
        for i in range(iters):  # alternate so drift (turbo, other load) hits both alike
            if i % 2:
                hetero_s.append(managed())
                plain_s.append(plain())
            else:
                plain_s.append(plain())
                hetero_s.append(managed())
        h, p = statistics.median(hetero_s), statistics.median(plain_s)
        return {
            "chunk_bytes": chunk_bytes,
            "round_trip_ms": h * 1e3,
            "plain_copy_ms": p * 1e3,
            "round_trip_ratio": h / p,
            "round_trip_GBps": 2 * chunk_bytes / h / 1e9,
            "plain_GBps": 2 * chunk_bytes / p / 1e9,
        }


def bookkeeping(tensors: int, iters: int) -> dict[str, float]:
    with ChunkManager(device_budget=1 << 30, host_budget=1 << 30) as m:
        chunk = m.new_chunk(dtype=torch.float32, capacity=tensors * 64)
        slots = [chunk.add_tensor(f"layer.{i}.weight", (8, 8)) for i in range(tensors)]
        m.access(chunk)
        for s in slots:
            chunk.set_state(s, TensorState.HOLD)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            for s in slots:  # what forward hooks do per parameter: access, compute, release
                m.access(chunk)
                chunk.set_state(s, TensorState.COMPUTE)
                chunk.set_state(s, TensorState.HOLD_AFTER_FWD)
            for s in slots:
                chunk.set_state(s, TensorState.COMPUTE)
                chunk.set_state(s, TensorState.HOLD)
            times.append(time.perf_counter() - t0)
        per = statistics.median(times) / tensors
        return {"bookkeeping_us_per_tensor": per * 1e6, "tensors": tensors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", default="64MiB", help="chunk size (default 64MiB)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tensors", type=int, default=1000, help="tensors in the bookkeeping chunk")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args()
    torch.manual_seed(0)
    result = {"device": str(Device().torch_device), **round_trip(parse_size(args.chunk), args.iters)}
    result.update(bookkeeping(args.tensors, max(3, args.iters // 4)))
    result["target_ratio"] = 1.1
    result["meets_target"] = result["round_trip_ratio"] <= 1.1
    if args.json:
        print(json.dumps(result))
        return
    mib = result["chunk_bytes"] / 2**20
    print(f"device: {result['device']}, chunk {mib:.0f} MiB, median of {args.iters}")
    print(f"round trip device->host->device: {result['round_trip_ms']:.2f} ms ({result['round_trip_GBps']:.2f} GB/s)")
    print(f"plain copy_ of the same bytes:   {result['plain_copy_ms']:.2f} ms ({result['plain_GBps']:.2f} GB/s)")
    print(f"ratio hetero/plain: {result['round_trip_ratio']:.3f} (target <= 1.1: {result['meets_target']})")
    print(f"access bookkeeping: {result['bookkeeping_us_per_tensor']:.2f} us per tensor ({args.tensors} tensors)")


if __name__ == "__main__":
    main()
