"""What a machine offers each tier: the compute device's memory, host RAM, and free space under the NVMe directory.

The estimator checks its figures against these. They are read from this machine (the GPU through `hetero.device`,
RAM through psutil, disk space through `shutil.disk_usage`) or given by the user for a machine they plan to use.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from hetero.config import format_size, parse_size
from hetero.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Machine:
    """Bytes available to one node's hetero ranks, per tier."""

    device_bytes: int
    """Memory of one compute device (each rank has its own): a GPU's memory, or the CPU "device"'s share of RAM."""
    host_bytes: int
    """Host RAM the node's ranks share."""
    nvme_bytes: int = 0
    """Free space under the NVMe directory, shared by the node's ranks; 0 when there is none."""
    gpus: int = 0
    """GPUs on the node; 0 on a CPU-only machine."""
    source: str = "given"
    """"detected" (read from this machine) or "given"."""

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "nvme_bytes"):
            object.__setattr__(self, name, parse_size(getattr(self, name), key=f"machine.{name}"))

    @classmethod
    def detect(cls, *, nvme_dir: str | None = None) -> Machine:
        """This machine: the first GPU's memory (else half the RAM, as the CPU "device" shares it), the RAM, and
        the free space of nvme_dir's file system."""
        import psutil

        from hetero.device import Device, gpu_count

        ram = psutil.virtual_memory().total
        gpus = gpu_count()
        device_bytes = Device("cuda:0").total_memory() if gpus else ram // 2
        host_bytes = ram if gpus else ram - device_bytes
        nvme = 0
        if nvme_dir is not None:
            if os.path.exists(nvme_dir) and not os.path.isdir(nvme_dir):  # its free space is its drive's, yet no run
                raise ConfigError(  # could make swap files in it (the engine refuses it)
                    f"nvme_dir {nvme_dir!r} is a file, not a directory; give a directory on the NVMe drive"
                )
            try:
                nvme = shutil.disk_usage(nvme_dir).free
            except OSError as e:
                raise ConfigError(
                    f"nvme_dir {nvme_dir!r}: cannot read its free space ({e}); give an existing directory"
                ) from None
        return cls(device_bytes=device_bytes, host_bytes=host_bytes, nvme_bytes=nvme, gpus=gpus, source="detected")

    def describe(self) -> str:
        dev = (
            f"{self.gpus} GPU(s) of {format_size(self.device_bytes)}"
            if self.gpus
            else (f"CPU device share {format_size(self.device_bytes)}")
        )
        return f"{dev}, host {format_size(self.host_bytes)}, NVMe free {format_size(self.nvme_bytes)} ({self.source})"
