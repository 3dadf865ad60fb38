"""What the budgets allow the automatic chunk size (`budget_costs`, read by `chunk_size.budget_cap`), and the warning
for a size they force so small that per-chunk costs dominate (`small_chunks`)."""

from __future__ import annotations

import math

from hetero.config import format_size


def budget_costs(
    *,
    device_budget: int | None,
    host_budget: int | None,
    stage: int,
    param_bytes: int,
    n_states: int,
    params_tier: str,
    optim_tier: str,
    prefetch_depth: int,
    world: int,
    spare: float = 0.5,
) -> dict[str, tuple[int, float]]:
    """Per budget that limits the automatic chunk size (its config key): its value and the bytes of it one element of
    chunk capacity takes, so that `int(value / cost)` is the largest capacity it holds (`budget_cap`). `spare` of each
    budget is left for everything else: activations, units gathered whole, other buffers.

    Device, stage 3: the chunks gathered in use, arriving (`prefetch_depth`) and leaving, in the compute dtype, and
    the per-micro-batch fp32 gradient buffers of the reduce-scatters in flight (two, the one being filled and the one
    just issued); stage 2 only the latter; stages 0-1 keep every parameter on the device anyway. Host: with optimizer
    states on NVMe, the update's chunk stepping and the two read ahead (gradient, master and states of a shard); with
    parameters on NVMe, the shards read up for gathers."""
    costs: dict[str, tuple[int, float]] = {}
    if device_budget is not None:
        per = 0.0
        if stage == 3:
            per += (prefetch_depth + 2) * param_bytes
        if stage >= 2:
            per += 4 * 4
        if per:
            costs["memory.device_budget"] = (device_budget, per / spare)
    if host_budget is not None:
        per = 0.0
        if optim_tier == "nvme":
            per += 3 * (4 + 4 * (1 + n_states)) / world
        if params_tier == "nvme":
            per += (prefetch_depth + 2) * param_bytes / world
        if per:
            costs["memory.host_budget"] = (host_budget, per / spare)
    return costs


# [Note: chunks too small for their fixed costs]
# Each chunk costs a few fixed things per step: collectives, hooks, tensor state changes, moves. The example's GPT
# (0.84M parameters, ZeRO-3) on 2 shared CPU cores at explicit chunk sizes (2026-12-01): 32768 elements and up
# ~1.4-2.4 s per step, 16384 ~2-5.7 s, 8192 ~7-14 s, 4096 ~6-17 s, 1024 (the automatic floor: 8 KiB of device budget)
# 26 s; ~40 ms per chunk against ~2 us of work per element, even near 2^15 elements (on a GPU later: a floor). Such
# budgets are legitimate (tests use them) and the step is correct, only slow, and an explicit chunk_size is the
# user's choice: so a forced small automatic size is a warning at initialize (the budget that forced it, the one
# that lifts it to the mark), not an error.
SMALL_NUMEL = 1 << 15  # elements: below this the automatic size is reported as forced small (see the note)


def small_chunks(
    chunk_numel: int, *, natural_numel: int, itemsize: int, costs: dict[str, tuple[int, float]]
) -> str | None:
    """The warning for an automatic `chunk_numel` that the budgets (`budget_costs`) forced below both SMALL_NUMEL and
    `natural_numel` (the smallest size the model alone would be given); None where nothing forced it."""
    target = min(SMALL_NUMEL, natural_numel)
    if chunk_numel >= target:
        return None
    forcing = {key: (value, cost) for key, (value, cost) in costs.items() if int(value / cost) < target}
    if not forcing:
        return None  # the model's own packing chose it (a tiny model), not a budget
    why = ", ".join(f"{key} = {format_size(value)}" for key, (value, _) in forcing.items())
    fix = " and ".join(
        f"{key} to {format_size(_printable(math.ceil(cost * target)))}" for key, (_, cost) in forcing.items()
    )
    return (
        f'chunk_size "auto" chose chunks of {chunk_numel} elements ({format_size(chunk_numel * itemsize)}) because '
        f"{why} holds no larger ones with room to spare: with chunks this small the per-chunk costs (a collective, "
        f"hooks and moves per chunk) dominate, and a step can be 10-100x slower than at the usual size. Raise {fix} "
        f"for chunks of {target} elements, or set chunk_size yourself to keep these budgets."
    )


def _printable(n: int) -> int:
    """n rounded up to a quarter of its unit (KiB, MiB, ...), which `format_size` prints exactly."""
    unit = 1 << (10 * ((n.bit_length() - 1) // 10))
    return -(-n // max(1, unit // 4)) * max(1, unit // 4)
