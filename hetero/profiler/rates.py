"""How fast a machine computes and moves bytes: the rates the planner's cost model divides by.

Measured on this machine (`Rates.measure`: a matrix multiply on the compute device, copies between device and host,
host memory, an all-reduce over a group when one is given, writes and reads under an NVMe directory when one is
given) or described for another (`Rates.node`, whose defaults are an 8-GPU H100 SXM node's datasheet figures
derated to what training reaches; every field can be given).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from hetero.config import format_size, parse_size


@dataclass(frozen=True, kw_only=True)
class Rates:
    device_flops: float
    """FLOP/s one device sustains in a large matrix multiply at the compute dtype."""
    intra_bandwidth: float
    """Bytes/s one rank moves in a collective with ranks of its own node (ring bus bandwidth)."""
    inter_bandwidth: float
    """Bytes/s one rank moves in a collective spanning nodes."""
    pcie_bandwidth: float
    """Bytes/s between one device and host memory."""
    host_bandwidth: float
    """Bytes/s of host memory one rank's optimizer step on the CPU streams through."""
    device_memory_bandwidth: float
    """Bytes/s of the device's own memory (the optimizer step on the device)."""
    nvme_bandwidth: float = 0.0
    """Bytes/s of a node's NVMe, shared by its ranks (reads and writes alike)."""
    latency: float = 10e-6
    """Seconds one collective or point-to-point transfer costs besides its bytes."""
    source: str = "given"

    @classmethod
    def node(cls, **overrides: Any) -> Rates:
        """An 8-GPU H100 SXM node: 989 TFLOP/s bf16 dense at 45% (what large runs sustain), NVLink 4 ring bus bandwidth
        ~360 GB/s, 4 x 400 Gb/s InfiniBand shared by 8 GPUs, PCIe 5 x16 ~50 GB/s, host memory ~20 GB/s per rank's
        optimizer step, HBM3 3.35 TB/s, 4 NVMe drives of ~6 GB/s. Override any field (sizes as bytes or '50GB')."""
        base = dict(
            device_flops=0.45 * 989e12,
            intra_bandwidth=360e9,
            inter_bandwidth=25e9,
            pcie_bandwidth=50e9,
            host_bandwidth=20e9,
            device_memory_bandwidth=3.35e12,
            nvme_bandwidth=24e9,
            latency=10e-6,
            source="given: 8-GPU H100 SXM node",
        )
        for key, value in overrides.items():
            if value is None:
                continue
            if key not in base:
                raise ValueError(f"Rates has no field {key!r}; fields: {', '.join(base)}")
            base[key] = float(parse_size(value, key=key)) if isinstance(value, str) else float(value)
        return cls(**base)  # type: ignore[arg-type]

    @classmethod
    def measure(cls, *, device: Any = None, comm: Any = None, nvme_dir: str | None = None, dtype: Any = None) -> Rates:
        """This machine's rates (a few seconds). comm: a group to time an all-reduce over (every rank of it calls);
        without one, collectives are taken to move at the PCIe/copy rate. nvme_dir: time writes and reads there."""
        from hetero.device import Device

        dev = Device(device) if not isinstance(device, Device) else device
        d = dev.torch_device
        dtype = dtype or torch.float32
        n = 1024 if d.type == "cpu" else 8192
        a, b = torch.randn(n, n, device=d, dtype=dtype), torch.randn(n, n, device=d, dtype=dtype)
        flops = 2 * n**3 / _time(lambda: a @ b, dev)
        big = torch.empty(64 << 20, dtype=torch.uint8, device=d)
        host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=dev.pins_host_memory)
        pcie = big.numel() / _time(lambda: host.copy_(big), dev)
        host2 = torch.empty_like(host)
        host_bw = 2 * host.numel() / _time(lambda: host2.copy_(host), dev)
        dev2 = torch.empty_like(big)
        device_bw = 2 * big.numel() / _time(lambda: dev2.copy_(big), dev)
        intra, latency = pcie, 10e-6
        if comm is not None and comm.size > 1:
            t = torch.zeros(4 << 20, dtype=torch.float32, device=d)
            seconds = _time(lambda: comm.all_reduce(t), dev)
            intra = 2 * (comm.size - 1) / comm.size * t.numel() * 4 / seconds
            tiny = torch.zeros(1, device=d)
            latency = _time(lambda: comm.all_reduce(tiny), dev)
            intra = float(_agree(comm, intra, d))
            latency = float(_agree(comm, latency, d))
            flops = float(_agree(comm, flops, d))
        nvme = _nvme(nvme_dir) if nvme_dir else 0.0
        return cls(
            device_flops=flops,
            intra_bandwidth=intra,
            inter_bandwidth=intra,
            pcie_bandwidth=pcie,
            host_bandwidth=host_bw,
            device_memory_bandwidth=device_bw,
            nvme_bandwidth=nvme,
            latency=latency,
            source="measured",
        )

    def describe(self) -> str:
        def rate(x: float) -> str:
            return f"{format_size(x)}/s"

        return (
            f"device {self.device_flops / 1e12:.3g} TFLOP/s, collectives {rate(self.intra_bandwidth)} in a node, "
            f"{rate(self.inter_bandwidth)} across, PCIe {rate(self.pcie_bandwidth)}, host memory "
            f"{rate(self.host_bandwidth)}, NVMe {rate(self.nvme_bandwidth)}, latency {self.latency * 1e6:.0f} us "
            f"({self.source})"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _time(fn: Any, dev: Any, repeats: int = 5) -> float:
    fn()
    dev.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        dev.synchronize()
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)


def _agree(comm: Any, value: float, device: torch.device) -> float:
    """The group's mean of a measured value, so that every rank plans with the same figures."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    comm.all_reduce(t, op="avg")
    return float(t)


def _nvme(directory: str, nbytes: int = 256 << 20) -> float:
    """Write then read `nbytes` under `directory` (fsync'd; the read may come from the page cache: an upper bound)."""
    data = os.urandom(1 << 20) * (nbytes >> 20)
    fd, path = tempfile.mkstemp(dir=directory)
    try:
        start = time.perf_counter()
        os.write(fd, data)
        os.fsync(fd)
        write = time.perf_counter() - start
        os.lseek(fd, 0, os.SEEK_SET)
        start = time.perf_counter()
        while os.read(fd, 16 << 20):
            pass
        read = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)
    return 2 * nbytes / (write + read)
