"""The parameters written from an update's values: on the device from host memory without the host waiting.

[Note: writing parameters up without a wait]
An update on the host (the optimizer offloaded to host memory or NVMe) writes each chunk's new master weights into
parameters that live on the device. A plain `copy_` from host memory makes the host wait for the device's whole
queue, converts to the compute dtype on a CPU core, and only then copies: one H200 counted a wait a chunk there in
every update (tools/gpu_waits.py, the optimizer on NVMe, the parameters on the device, exact and delayed alike), which
the stand-in missed, as it did not count blocking copies then; the same wait sat in stages 0-2 with the optimizer on
the host, the layout of ZeRO-Offload. So the copy is queued on the compute stream (`Device.copy_in`, converted on the
device) and the host goes on to the next chunk. The host memory it reads, the chunk `source` (the optimizer's chunk
holding the master, or the delayed update's values), stays unchanged until the device has read it
(`ChunkManager.land_later(..., reads=True)`): whatever would write into it or hand its buffer back waits for that
first, and the states' write to NVMe starts once it has landed (`Updater.write_out`), by when the device has long
done it. Without a source to keep (a view, outside a step) the host waits for the copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hetero.memory import TensorState, Tier

if TYPE_CHECKING:
    from hetero.memory import Chunk
    from hetero.zero.zero_chunk import ZeroChunk


def copy_up(zc: ZeroChunk, dst: torch.Tensor, values: torch.Tensor, source: Chunk | None) -> None:
    """`dst` (the chunk's parameters or shard, device memory) takes `values`: see the note."""
    handle = zc.device.copy_in(dst, values)
    if handle is None:
        return
    if source is None:
        zc.device.landed(handle)
    else:
        zc.manager.land_later(source, handle, reads=True)


def write_shard(zc: ZeroChunk, values: torch.Tensor, source: Chunk | None) -> None:
    """Stage 3: the chunk's shard of the parameters becomes `values` (the shard's numel, or the full chunk)."""
    zc.complete_gather()  # a gather still reading the shard
    m = zc.manager
    if values.numel() == zc.spec.capacity:
        values = zc.kept(values)
    if zc.shard is None:  # the master is the shard ([Note: the master is the shard])
        if (master := zc.optimizer_views()[0]).data_ptr() != values.data_ptr():
            master.copy_(values)
        return
    tier = Tier.DEVICE if zc.placement.params is Tier.DEVICE else Tier.HOST
    slot = zc.shard.slots[0]
    if slot.state is TensorState.COMPUTE:  # stepped in place: [Note: stepping the shard in place]
        assert values.data_ptr() == zc.shard.view(slot).data_ptr()
    else:
        if slot.state is TensorState.HOLD:
            zc.shard.set_state(slot, TensorState.FREE)  # overwritten whole: one on NVMe gets fresh memory, no read
        shard = m.access(zc.shard, tier)
        zc.shard.set_state(slot, TensorState.COMPUTE)  # written: any swap copy is stale from here
        if tier is Tier.DEVICE:
            copy_up(zc, shard, values, source)
        else:
            shard.copy_(values)
    zc.shard.set_state(slot, TensorState.HOLD)
    if zc.placement.params is Tier.NVME:
        m.move(zc.shard, Tier.NVME, wait=False)
