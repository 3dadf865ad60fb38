"""The estimator's view of the automatic chunk size and of tiles: the same ceiling `chunk_size.budget_cap` gives the
engine (from the config's budgets, or the defaults the engine would take on the machine), and which weights the
layout split into tiles ([Note: tiles] in hetero/memory/chunk_size.py)."""

from __future__ import annotations

from collections.abc import Callable

from hetero.config import Config
from hetero.profiler.machine import Machine
from hetero.zero.layout import ChunkSpec, config_cap


def budgets(cfg: Config, machine: Machine | None, ranks_per_node: int) -> tuple[int | None, int | None]:
    """The device and host budgets a rank gets: the config's, else the engine's defaults on the machine (the CPU
    "device" and the host tier each take half of a rank's share of RAM, [Note: budgets per node]); None without
    either."""
    device, host = cfg.memory.device_budget, cfg.memory.host_budget
    if machine is not None:
        if device is None:
            device = int(machine.device_bytes * 0.9) if machine.gpus else machine.host_bytes // (2 * ranks_per_node)
        if host is None:
            host = machine.host_bytes // (2 * ranks_per_node)
    return device, host


def cap_for(cfg: Config, machine: Machine | None, ranks_per_node: int, n_states: int) -> Callable[[int], int | None]:
    """ZeRO group size -> the largest automatic chunk capacity (None: a fixed chunk_size, or no budget known)."""
    device, host = budgets(cfg, machine, ranks_per_node)

    def cap(zero_world: int) -> int | None:
        if cfg.chunk_size != "auto":
            return None
        return config_cap(cfg, device_budget=device, host_budget=host, n_states=n_states, world=zero_world)

    return cap


def tiled_counts(specs: list[ChunkSpec]) -> dict[str, int]:
    """Weights split into tiles -> how many."""
    out: dict[str, int] = {}
    for spec in specs:
        if spec.tile:
            out[spec.params[0].name] = out.get(spec.params[0].name, 0) + 1
    return out
