"""Each tier's budget: the one given, checked against what the machine has, or a default that leaves room for the
other ranks of the node.

[Note: budgets per node]
Host RAM and the NVMe disk are shared by every rank of a node (`LOCAL_WORLD_SIZE`, which torchrun sets; 1 without
it), so a default budget is a rank's share of them: half the available RAM for the host tier split among the local
ranks (the other half is the CPU "device"'s, split alike, when there is no GPU), and the free space of `nvme_dir`
split alike. A GPU belongs to one rank: its default is 90% of what is free on it. A budget that is given is checked
before anything is allocated: one larger than the machine has (all local ranks' budgets together, for RAM and disk)
is a `ConfigError` naming both numbers, instead of the OOM killer or a full disk ending the run midway.
"""

from __future__ import annotations

import os
import shutil

from hetero.config import format_size
from hetero.device import Device
from hetero.errors import ConfigError
from hetero.memory.swap_file import remove_orphans


def local_ranks() -> int:
    """Ranks of this job on this node (torchrun's LOCAL_WORLD_SIZE; 1 without it)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_budgets(
    device: Device, *, device_budget: int | None, host_budget: int | None, nvme_dir: str | None, nvme_budget: int | None
) -> None:
    """Raise `ConfigError` for a given budget larger than the machine has (see [Note: budgets per node])."""
    ranks = local_ranks()
    per = f" x {ranks} ranks on this node" if ranks > 1 else ""
    if device.is_cuda and device_budget is not None and device_budget > device.total_memory():
        raise ConfigError(
            f"memory.device_budget: {format_size(device_budget)} is more than the {format_size(device.total_memory())}"
            f" that {device.torch_device} has; lower it (or leave it out: 90% of what is free)"
        )
    import psutil

    ram = psutil.virtual_memory().total
    # Without a GPU the "device" tier is RAM too: both budgets come out of it.
    rss = (host_budget or 0) + (0 if device.is_cuda else device_budget or 0)
    if rss and rss * ranks > ram:
        given = (("device_budget", None if device.is_cuda else device_budget), ("host_budget", host_budget))
        what = " + ".join(f"memory.{n}" for n, b in given if b is not None)
        raise ConfigError(
            f"{what}: {format_size(rss)}{per} is more than the {format_size(ram)} of RAM this machine has; lower it "
            "(or leave it out: a share of the available RAM per local rank)"
        )
    if nvme_dir is not None and nvme_budget is not None and os.path.isdir(nvme_dir):
        # A killed run's swap file is free space: [Note: swap directories left by a killed process].
        remove_orphans(nvme_dir)
        free = shutil.disk_usage(nvme_dir).free
        if nvme_budget * ranks > free:
            raise ConfigError(
                f"memory.nvme_budget: {format_size(nvme_budget)}{per} is more than the {format_size(free)} free in "
                f"{nvme_dir!r}; lower it, free space there, or leave it out (the free space, split among local ranks)"
            )


def default_device_budget(device: Device, budget: int | None) -> int:
    if budget is not None:
        return budget
    if device.is_cuda:
        return int(device.available_memory() * 0.9)
    return device.available_memory() // (2 * local_ranks())  # the CPU "device" shares RAM with the host tier


def default_host_budget(budget: int | None) -> int:
    if budget is not None:
        return budget
    import psutil

    return psutil.virtual_memory().available // (2 * local_ranks())


def nvme_budget(nvme_dir: str, budget: int | None) -> int:
    return budget if budget is not None else shutil.disk_usage(nvme_dir).free // local_ranks()
