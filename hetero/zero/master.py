"""The fp32 master weights of a stage-3 chunk whose optimizer states live on NVMe: kept in the parameter shard.

[Note: the master follows the shard]
Stage 3 in fp32 with the optimizer states on NVMe: outside an update the master weights hold the values the parameter
shard holds (the write-back copies one into the other), and both would be written to NVMe and read back every step.
So after each write-back the master slot is FREE, and NVMe does not store it ([Note: FREE slots are not stored] in
hetero/memory/moves.py): the optimizer chunk's swap traffic is the states alone, 8 bytes a parameter each way instead
of 12 with Adam. Whoever needs the master (`ZeroChunk.optimizer_views`: a checkpoint load, the optimizer's state
dict, the update where the shard is on the device) gets it filled from the shard first; the update steps a shard on
the host in place of the master ([Note: stepping the shard in place]), reading it where it would have read the master; a
checkpoint saves the shard's values under the master's name (`hetero/checkpoint/plan.py`). Not on the device or the
host, where no swap traffic is saved by it (on the device the master *is* the shard: [Note: the master is the
shard]). On the 416M Llama of benchmarks/bigger_than_ram.py it took NVMe writes from 6.66 to 5.00 GB a step and reads
from 8.0 to 6.3 GB.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hetero.memory import TensorState, Tier

if TYPE_CHECKING:
    from hetero.zero.zero_chunk import ZeroChunk


def follows(zc: ZeroChunk) -> bool:
    """Whether the chunk's master follows its shard (set once, at construction)."""
    return zc.shard is not None and zc.spec.trainable and zc.dtype == torch.float32 and zc.placement.optim is Tier.NVME


def fill(zc: ZeroChunk) -> Any:
    """The optim chunk is resident on the compute tier: give a FREE master the shard's values. A shard on the device
    is copied up on a copy stream the host does not wait for ([Note: the master copied up late]); the copy's handle
    is returned, for `Device.landed` before anything reads the master (None: the master is filled)."""
    master = zc.optim.slots[0]
    if not zc.master_follows or master.state is not TensorState.FREE:
        return None
    m = zc.manager
    zc.complete_gather()  # a gather issued ahead holds the shard where it is until then
    handle = None
    with m.pinned(zc.optim):  # reading the shard in must not evict the chunk it fills
        tier = Tier.DEVICE if zc.placement.params is Tier.DEVICE else Tier.HOST
        shard = m.access(zc.shard, tier, write=False)
        # The master lives on the host: the optimizer steps there whenever its states are on NVMe.
        if tier is Tier.DEVICE:
            handle = zc.device.copy_later(zc.optim.view(master), shard, after=zc.device.compute_marker())
        else:
            zc.optim.view(master).copy_(zc.device.to_host(shard))
    zc.optim.set_state(master, TensorState.HOLD)
    if handle is not None:
        m.land_later(zc.optim, handle)  # nothing moves or reuses the master until the copy is done
        m.land_later(zc.shard, handle, reads=True)  # nor overwrites the shard it reads
    return handle


def views_filling(zc: ZeroChunk) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
    """`ZeroChunk.optimizer_views` for a step on another thread: where a FREE master fills from a shard on the device,
    the copy up runs on a copy stream and the host does not wait for it; the third item is its handle, which the
    thread reading the master must give `Device.landed` first (None: nothing in flight).

    [Note: the master copied up late]
    The delayed update ([Note: the delayed parameter update] in delayed.py) starts a chunk's step from the model's
    hooks in the middle of forward and backward. Filling its master with a copy the host waits for made the host wait
    for every kernel queued before it, once a chunk: tools/gpu_waits.py counted 5 waits a step (one a chunk) in
    `nvme_delayed` under the stand-in. The copy is now handed to the manager (`land_later`): the optimizer chunk stays
    pinned where it is and the shard unchanged until the copy has landed, and the worker waits for it before the math.
    The exact update (`ZeroChunk.optimizer_views`) fills its master the same way and the training thread waits for
    the copy: it is ordered after the kernels queued before it, as a blocking copy is, but it lands in the chunk's
    pinned memory at the bus's speed, where the blocking copy went through fresh pageable memory first (staged by the
    driver page by page, then copied again on the host: [Note: gradients to the host through pinned memory]). That
    blocking copy was the one wait a chunk tools/gpu_waits.py still counted in `nvme` (fp32) under the stand-in. (At
    the update the kernels before it are backward's, which the chunk's gradient had to wait for anyway.)
    """
    zc.manager.access(zc.optim, zc.placement.compute)
    handle = fill(zc)
    views = [zc.optim.view(s) for s in zc.optim.slots]  # not through the manager: that would wait for the copy
    return views[0], views[1:], handle


def in_place_views(zc: ZeroChunk) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """The update's (master, states) with the shard's payload as the master, or None where the update steps a
    filled master instead (`ZeroChunk.optimizer_views`).

    [Note: stepping the shard in place]
    Filling a FREE master from the shard and copying it back after the step moves the chunk's fp32 weights through
    memory twice (3.3 GB of copies a step on the 416M Llama of benchmarks/bigger_than_ram.py, on the training
    thread). Where the shard sits on the host, the tier the optimizer steps on whenever its states are on NVMe, the
    update steps the shard itself: same values, same arithmetic, the same bits as stepping the master
    (tests/test_master_shard.py). The shard is put in COMPUTE (no eviction, marked written) until
    `ZeroChunk.write_shard` sees it back; the master slot stays FREE. Parameters on the device keep the copy.
    """
    if not zc.master_follows or zc.placement.params is Tier.DEVICE or zc.optim.slots[0].state is not TensorState.FREE:
        return None
    states = zc.state_views()
    m = zc.manager
    zc.complete_gather()  # a gather issued ahead still reads the shard about to be stepped
    with m.pinned(zc.optim):  # reading the shard in must not evict the states about to step
        m.access(zc.shard, Tier.HOST)
        zc.shard.set_state(zc.shard.slots[0], TensorState.COMPUTE)
    return zc.shard.view(zc.shard.slots[0]), states


def in_shard(zc: ZeroChunk) -> None:
    """The shard now holds the master's values: the master slot holds nothing NVMe must keep."""
    if zc.master_follows and zc.optim.slots[0].state is not TensorState.FREE:
        zc.optim.skip_free_head = True  # [Note: FREE slots are not stored]: its FREE master is not written
        zc.optim.set_state(zc.optim.slots[0], TensorState.FREE)
