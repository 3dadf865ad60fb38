"""The bytes of a chunk layout on each tier, by kind, for one ZeRO stage and offload placement: what every chunk's
buffers keep between steps ([Note: what each stage keeps] in hetero/zero/zero_chunk.py) and what a step adds at its
peak. The estimator and the planner both place their layouts with it ([Note: the engine's own arithmetic] in
estimator.py)."""

from __future__ import annotations

import torch

from hetero.zero.layout import ChunkSpec
from hetero.zero.stages import STAGES, Placement, master_is_shard, shard_homes

TIERS = ("device", "host", "nvme")
MODEL_STATE_KINDS = ("parameters", "gradients", "master_weights", "optimizer_states")
KINDS = (*MODEL_STATE_KINDS, "activations", "buffers")
REDUCES_IN_FLIGHT = 2  # the engine's _REDUCES_IN_FLIGHT: gradient reduce-scatters kept running during backward


def zeros() -> dict[str, dict[str, int]]:
    return {t: dict.fromkeys(KINDS, 0) for t in TIERS}


def place(
    specs: list[ChunkSpec],
    *,
    gathered: int,
    stage: int,
    world: int,
    dtype: torch.dtype,
    n_states: int,
    params: str,
    optim: str,
    prefetch_depth: int,
    params_host_bytes: int = 0,
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """Per tier and kind: the resident bytes of every chunk's buffers (the engine's table: [Note: what each stage
    keeps]), and the transient peak of a step."""
    resident, transient = zeros(), zeros()
    layout, placement = STAGES[stage], Placement.of(params, optim)
    compute = placement.compute.label  # where gradients accumulate and the optimizer steps
    capacities = [s.capacity for s in specs]  # [Note: parameter shards kept on the host]
    homes = shard_homes(capacities, placement, world=world, itemsize=dtype.itemsize, host_bytes=params_host_bytes)
    full_chunks: list[int] = []  # stage 3: bytes of each full chunk, gathered for use
    shards: list[int] = []  # stage 3: bytes of each parameter shard
    grad_full: list[int] = []  # stages 2-3: each chunk's per-micro-batch fp32 gradient buffer
    reduce_targets: list[int] = []
    optim_chunks: list[int] = []  # bytes of each chunk's master + states
    for spec, home in zip(specs, homes):
        cap = spec.capacity
        shard = cap // world
        if not layout.params_sharded:
            resident["device"]["parameters"] += cap * dtype.itemsize
        else:
            if not master_is_shard(layout, spec.trainable, dtype, placement):  # see the note
                resident[home.label]["parameters"] += shard * dtype.itemsize
            full_chunks.append(cap * dtype.itemsize)
            shards.append(shard * dtype.itemsize)
        if not spec.trainable:
            continue
        if layout.grads_sharded:
            # A gradient shard is released once its chunk has stepped (Updater.release_zeroed): between steps it
            # takes nothing; from backward to the update they all live.
            transient[compute]["gradients"] += shard * 4
        else:
            resident[compute]["gradients"] += layout.grad_numel(cap, world) * 4
        if layout.grads_sharded:
            grad_full.append(cap * 4)
            reduce_targets.append(shard * 4)
        s = layout.optim_numel(cap, world)
        resident[optim]["master_weights"] += s * 4
        resident[optim]["optimizer_states"] += n_states * s * 4
        optim_chunks.append(s * 4 * (1 + n_states))

    def largest(sizes: list[int], n: int) -> int:
        return sum(sorted(sizes, reverse=True)[:n])

    if layout.params_sharded:
        working = prefetch_depth + 2  # in use, arriving ahead of use, being released
        transient["device"]["parameters"] += gathered + largest(full_chunks, prefetch_depth)
        if params != "device":
            # Shards read up for a gather: onto the host from NVMe (and onto the device for NCCL to read).
            transient["host" if params == "nvme" else "device"]["parameters"] += largest(shards, working)
    if grad_full:
        # Reduces in flight, the one just issued before the oldest completes, and the chunk being filled.
        transient["device"]["gradients"] += largest(grad_full, REDUCES_IN_FLIGHT + 2)
        transient["device"]["buffers"] += largest(reduce_targets, REDUCES_IN_FLIGHT + 1)
    if optim == "nvme" and optim_chunks:
        # The update reads a chunk's states onto the host while the next one is prefetched.
        both = largest(optim_chunks, 2)
        transient["host"]["master_weights"] += both // (1 + n_states)
        transient["host"]["optimizer_states"] += both - both // (1 + n_states)
    return resident, transient
