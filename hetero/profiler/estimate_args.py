"""What `hetero.estimate` is given, checked before any arithmetic: the config, and the run's sizes.

NVMe offload in a config needs `memory.nvme_dir`, a directory for the swap files. An estimate for this machine reads
the NVMe tier's size from that directory's free space, so it still needs one; an estimate for a machine described by
its sizes (a `Machine`), or checked against none, reads nothing here, so a placeholder name stands in for the
config's check and no directory is read or made. A directory given for this machine must exist, and a placeholder
from the docs pasted as it is gets said so (`config_values.nvme_dir_problem`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from hetero.config import Config, MemoryConfig
from hetero.config_values import check_int, nvme_dir_problem
from hetero.errors import ConfigError
from hetero.profiler.machine import Machine

NVME_PLACEHOLDER = "/path/on/nvme"  # a directory name only, in configs for a machine that is not this one


def config_for(config: Config | Mapping[str, Any] | str | os.PathLike | None, machine: Machine | bool | None) -> Config:
    """The config, validated; `machine` as `hetero.estimate` takes it (True: this machine, measured)."""
    filled = _with_placeholder(config) if isinstance(config, Mapping) else None
    if filled is None:  # a Config (already whole), a file, or a directory given: the config's own checks
        cfg = Config.from_any(config)
        nvme = "nvme" in (cfg.offload.params, cfg.offload.optimizer)
        # This machine's NVMe tier is the directory's free space: the directory must be one, not the docs' name.
        problem = nvme_dir_problem(cfg.memory.nvme_dir) if machine is True and nvme and cfg.memory.nvme_dir else None
        if problem:
            raise ConfigError(f"memory.{problem}")
        return cfg
    cfg = Config.from_any(filled)
    if "nvme" not in (cfg.offload.params, cfg.offload.optimizer):
        return dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, nvme_dir=None))  # as it was given
    if machine is True:
        raise ConfigError(
            "memory.nvme_dir: offload to 'nvme' on this machine is checked against the free space of the NVMe "
            "directory; pass memory.nvme_dir (a directory on the NVMe drive), or describe the target machine with "
            "machine=hetero.profiler.Machine(device_bytes=..., host_bytes=..., nvme_bytes=...)"
        )
    return cfg


def _with_placeholder(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The config with the placeholder as memory.nvme_dir, or None where it names a directory (or its "memory" is
    not a section at all, which the config's checks report)."""
    memory = config.get("memory", {})
    if isinstance(memory, MemoryConfig) and memory.nvme_dir is None:
        return {**config, "memory": dataclasses.replace(memory, nvme_dir=NVME_PLACEHOLDER)}
    if isinstance(memory, Mapping) and memory.get("nvme_dir") is None:
        return {**config, "memory": {**memory, "nvme_dir": NVME_PLACEHOLDER}}
    return None


def check_sizes(*, world_size: object, batch_size: object, seq_len: object) -> None:
    check_int("world_size", world_size, minimum=1, hint="(ranks in all)")
    check_int("batch_size", batch_size, minimum=1, hint="(sequences per micro-batch per rank)")
    if seq_len is not None:
        check_int("seq_len", seq_len, minimum=1, hint="(tokens per sequence; None: the model's context, at most 2048)")
