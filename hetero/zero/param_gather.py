"""One chunk's stage-3 gather, issued and completed apart: what stays put while it is in flight ([Note: gathering
ahead] in `hetero/zero/gathers.py` decides when)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from hetero.comm.handles import Done, Handle
from hetero.memory import Chunk, Tier

if TYPE_CHECKING:
    from hetero.zero.zero_chunk import ZeroChunk


class InFlight(NamedTuple):
    """A gather issued and not completed. Until `complete`, the shard it reads and the full buffer it writes are
    pinned where they are: the manager may neither move nor drop them."""

    handle: Handle | None  # None: it was done as it was issued
    held: Chunk  # the chunk the shard is read from (the shard, or the optimizer chunk holding the master)
    copied: bool  # the device reads the host shard late, on the compute stream or (copy_stream) the copy stream
    copy_stream: bool = False  # one rank: the handle is a `Device.copy_later` of the shard into the full buffer


def readable(zc: ZeroChunk, chunk: Chunk) -> Tier:
    """The nearest tier a collective can read the chunk on: NCCL (and the stand-in) reads device memory; gloo
    reads host memory, where a chunk already on the device or the host stays."""
    if zc.comm.size == 1:
        # Nothing is exchanged: the "gather" is a local copy from wherever the shard is. (Sending a device shard
        # to the host for gloo's sake and back cost a GPU step 1.1 GB each way on one H200.)
        return chunk.tier if chunk.tier in (Tier.DEVICE, Tier.HOST) else Tier.HOST
    if zc.comm.needs_device_tensors:
        return Tier.DEVICE
    if zc.device.separate_memory:
        return Tier.HOST  # gloo with CUDA tensors would copy them to the host itself
    return chunk.tier if chunk.tier in (Tier.DEVICE, Tier.HOST) else Tier.HOST


def issue(zc: ZeroChunk, *, wait: bool) -> InFlight:
    """Issue the gather of `zc`'s full parameters from every rank's shard (waited for at once if `wait`)."""
    m, full = zc.manager, zc.full
    if zc.shard is None:  # [Note: the master is the shard]
        held = zc.optim
        m.access(held, Tier.DEVICE, write=False)
        shard = held.view(held.slots[0])
    else:
        held = zc.shard
        shard = m.access(held, readable(zc, held), write=False)
    held.pins += 1  # making room for `full` must not evict the shard being read
    try:
        m.access(full, Tier.DEVICE)
        full.pins += 1  # nor may anything drop `full` while its tensors are FREE, or move it while it is written
        try:
            if not wait and zc.comm.size == 1 and held.tier is not Tier.DEVICE and zc.device.separate_memory:
                # One rank: the "gather" is a host-to-device copy, put on the copy stream ahead of the compute that
                # needs it (on the compute stream it would stand between two units' kernels).
                marker = zc.device.compute_marker()
                handle = zc.device.copy_later(full.payload.view(-1), shard.reshape(-1), after=marker)
                return InFlight(handle, held, copied=True, copy_stream=True)
            src = shard if held.tier is Tier.DEVICE else zc.device.to_device(shard)
            what, handle = f"the parameters of {zc.label}", None
            if wait:
                zc.comm.all_gather(full.payload, src, what=what)
            else:
                handle = zc.comm.all_gather_async(full.payload, src, what=what)
                handle = None if isinstance(handle, Done) else handle  # done already (one rank, a fallback)
        except BaseException:
            full.pins -= 1
            raise
    except BaseException:
        held.pins -= 1
        raise
    return InFlight(handle, held, src is not shard)


def complete(zc: ZeroChunk, pending: InFlight) -> None:
    """Wait for the gather (with the group's timeout) and let its chunks go."""
    try:
        if pending.copy_stream:
            zc.device.compute_waits(pending.handle)  # the compute stream waits, not the host
        elif pending.handle is not None:
            pending.handle.wait()
    finally:
        pending.held.pins -= 1
        zc.full.pins -= 1
    if pending.copied:  # the device reads the host shard late ([Note: the compute stream reads host memory late]);
        # once the compute has passed this point, so has a copy it waited for
        zc.manager.land_later(pending.held, zc.device.compute_reached(), reads=True)
