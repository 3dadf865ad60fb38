"""The memory behind the tiers: budgets and ledgers, pools of reused buffers, the NVMe swap store, and giving a
chunk's payload memory on a tier or taking it back. Nothing here decides what moves where (see `room.py`,
`moves.py`, `prefetch.py`); every byte a chunk holds passes through here, so the ledgers stay exact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hetero.device import Device
from hetero.io import hugepages
from hetero.memory.budgets import check_budgets, default_device_budget, default_host_budget
from hetero.memory.budgets import nvme_budget as nvme_budget_of
from hetero.memory.chunk import Chunk
from hetero.memory.heap import bound_heap_retention
from hetero.memory.pool import BufferPool
from hetero.memory.states import ChunkState
from hetero.memory.tier import Tier, TierLedger


class Storage:
    """Ledgers, pools and the swap store of one manager."""

    def __init__(
        self,
        device: Device,
        *,
        device_budget: int | None,
        host_budget: int | None,
        nvme_dir: str | None,
        nvme_budget: int | None,
        nvme_options: dict[str, Any] | None = None,
    ) -> None:
        self.device = device
        # Before anything is allocated: a budget larger than the machine has is an error ([Note: budgets per node]).
        check_budgets(
            device, device_budget=device_budget, host_budget=host_budget, nvme_dir=nvme_dir, nvme_budget=nvme_budget
        )
        bound_heap_retention()  # where HETERO_MALLOC_MMAP_THRESHOLD asks ([Note: the heap keeps what the budgets free])
        self.store = None  # the NVMe swap store, when nvme_dir is given
        # Whether a backend may still write into chunk memory (the engine gives hetero.comm.collective_failed).
        self.backend_may_write: Callable[[], object] = lambda: None
        # The chunk size (elements) chunk_size "auto" chose from these budgets, None when the user set one: the
        # out-of-memory advice names it to keep ([Note: a figure at the chunk size it was counted at] in room.py).
        self.auto_chunk_numel: int | None = None
        if nvme_dir is not None:
            from hetero.memory.nvme import NvmeStore

            self.store = NvmeStore(nvme_dir, budget=nvme_budget, **(nvme_options or {}))
        self.ledgers = {
            Tier.DEVICE: TierLedger(Tier.DEVICE, default_device_budget(device, device_budget)),
            Tier.HOST: TierLedger(Tier.HOST, default_host_budget(host_budget)),
            Tier.NVME: TierLedger(Tier.NVME, nvme_budget_of(nvme_dir, nvme_budget) if self.store is not None else 0),
        }
        # On a CPU compute device its chunks take page-aligned memory as the host's do, so that checkpoint loads and
        # the NVMe tier can read into them with O_DIRECT in place (torch.empty is only 64-byte aligned).
        # There, host memory is never pinned: the host pool is elastic ([Note: elastic buffers] in pool.py).
        shared = not device.separate_memory
        self.pools = {  # reused chunk buffers, per tier
            Tier.DEVICE: BufferPool(
                device.empty_host if shared else device.empty_bytes,
                self.ledgers[Tier.DEVICE],
                free=device.free_host if shared else device.free_bytes,
                on_release=device.released,
            ),
            Tier.HOST: BufferPool(
                device.empty_host,
                self.ledgers[Tier.HOST],
                free=device.free_host,
                on_release=device.released,
                elastic=shared,
            ),
        }

    # ---- buffers ------------------------------------------------------------------------------------------
    def reserve(self, chunk: Chunk) -> None:
        """A new chunk: elastic pools map buffers that can hold it from now on."""
        for pool in self.pools.values():
            pool.reserve(chunk.nbytes)

    def new_buffer(self, tier: Tier, chunk: Chunk) -> torch.Tensor:
        """A buffer for the chunk's payload on the device or host tier (the caller made room for it)."""
        if chunk.transient and tier is Tier.DEVICE and self.device.lends_buffers:
            # [Note: transient storage on pooled memory] (io/swap.py): the same storage, a pooled buffer's memory.
            chunk.lent = self.pools[tier].acquire(chunk.nbytes)
            kept = self.device.exchange(chunk.kept, chunk.lent)
            chunk.kept = kept if kept.dtype == chunk.dtype else kept.view(chunk.dtype)
            return chunk.kept
        if chunk.transient and tier is Tier.DEVICE:
            # [Note: transient chunks] The same storage object grows back. It takes no pooled buffer, so a cached one
            # that made room must be freed for real.
            ledger = self.ledgers[tier]
            if ledger.free < chunk.nbytes:
                self.pools[tier].trim(chunk.nbytes - ledger.free)
            if chunk.kept is None:
                chunk.kept = self.device.empty_bytes(chunk.nbytes).view(chunk.dtype)
            else:
                self.device.regrow(chunk.kept, chunk.nbytes)
            ledger.take(chunk.nbytes)  # once the memory is there: an allocation that fails took none
            return chunk.kept
        return self.pools[tier].acquire(chunk.nbytes).view(chunk.dtype)

    def free_buffer(self, tier: Tier, buf: torch.Tensor, chunk: Chunk) -> None:
        """Give a payload's buffer back (a transient chunk's storage shrinks to nothing; others go to the pool)."""
        if self.backend_may_write():
            # Neither shrunk, swapped back nor pooled again: the memory goes with its last view, a failed collective's
            # queued work among them ([Note: memory a failed collective may still write] in hetero/comm/rules.py).
            chunk.lent = None
            if chunk.transient and tier is Tier.DEVICE:
                self.ledgers[tier].give(chunk.nbytes)
            return
        if chunk.lent is not None and tier is Tier.DEVICE:  # the memory goes back to the pool, the storage none
            lent, chunk.lent = chunk.lent, None
            self.device.exchange(chunk.kept, lent)
            self.pools[tier].release(lent)
            return
        if chunk.transient and tier is Tier.DEVICE:
            self.ledgers[tier].give(chunk.nbytes)
            buf.untyped_storage().resize_(0)  # frees the memory; views of it stay valid objects
            return
        self.pools[tier].release(buf)

    def staging(self, nbytes: int) -> torch.Tensor:
        """A host buffer for a device<->NVMe hop (the caller made room on the host)."""
        return self.pools[Tier.HOST].acquire(nbytes)

    def release_staging(self, buf: torch.Tensor) -> None:
        self.pools[Tier.HOST].release(buf)

    # ---- a chunk's memory ---------------------------------------------------------------------------------
    def allocate(self, chunk: Chunk, tier: Tier) -> None:
        """Give an EMPTY chunk a payload on `tier` (the caller made room)."""
        if tier is Tier.NVME:
            raise ValueError(f"{chunk.describe()} is EMPTY: give it memory on the device or host tier first")
        if chunk.transient and tier is not Tier.DEVICE:
            raise ValueError(f"{chunk.describe()} is transient: it lives on the device tier only")
        chunk.payload = self.new_buffer(tier, chunk)
        chunk.tier = tier
        chunk.transition(ChunkState.RESIDENT)

    def drop_payload(self, chunk: Chunk) -> None:
        """The chunk holds no memory above NVMe any more (EMPTY)."""
        if chunk.state is ChunkState.EMPTY:
            return
        if chunk.payload is not None:
            self.free_buffer(chunk.tier, chunk.payload, chunk)
        chunk.payload = None
        chunk.tier = None
        chunk.transition(ChunkState.EMPTY)

    def take_nvme_slot(self, chunk: Chunk) -> None:
        """The chunk's swap slot is counted from now (its bytes are valid once the write ends)."""
        self.ledgers[Tier.NVME].take(chunk.nbytes)
        chunk.on_nvme = True

    def drop_nvme_copy(self, chunk: Chunk) -> None:
        if chunk.on_nvme:
            assert self.store is not None
            self.store.discard(chunk.id)
            self.ledgers[Tier.NVME].give(chunk.nbytes)
            chunk.on_nvme = False
            chunk.dirty = True  # no swap copy: the payload is the only one, and an eviction must write it

    def forget(self, chunk: Chunk) -> None:
        """Free everything a chunk holds, on every tier, its transient storage included (closing)."""
        self.drop_payload(chunk)
        self.drop_nvme_copy(chunk)
        if chunk.kept is not None:
            self.device.free_bytes(chunk.kept)

    def trim(self) -> None:
        for pool in self.pools.values():
            pool.trim()

    def stats(self) -> dict[str, Any]:
        """Per tier: current, cached, peak and budget bytes."""
        out: dict[str, Any] = {}
        for tier, ledger in self.ledgers.items():
            out[tier.label] = {
                "current": ledger.current,
                "cached": ledger.cached,
                "peak": ledger.peak,
                "budget": ledger.budget,
            }
        # The swap store's own O_DIRECT staging (bounded, outside the ledgers: only unaligned I/O uses it).
        out["nvme"]["staging"] = self.store.staging_bytes if self.store is not None else 0
        out["host"]["huge_pages"] = hugepages.report()  # [Note: huge host pages]: granted, or fallen back to 4 KiB
        return out


def nvme_io(memory: Any) -> dict[str, int]:
    """The NVMe store's I/O settings a MemoryConfig gives (memory.nvme_io_threads, nvme_block_bytes; unset: the
    store's own)."""
    io = {"io_threads": memory.nvme_io_threads, "block_bytes": memory.nvme_block_bytes}
    return {k: v for k, v in io.items() if v is not None}
