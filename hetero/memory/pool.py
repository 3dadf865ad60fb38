"""Pools of chunk buffers, one per memory tier, so moves reuse memory instead of allocating it per move.

Allocation is the hidden cost of a move: pinning host memory (`cudaHostAlloc`) costs far more than the copy it
serves, and a fresh pageable buffer is paid for again in page faults on first touch. So a buffer given back by a
chunk that left a tier is kept, keyed by its exact size, for the next chunk of that size. Chunks of one dtype share
one capacity, so exact-size reuse hits almost always and keeps the ledger exact. Cached buffers count against the
tier's budget; when room is needed they are freed before any chunk is evicted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from hetero.memory.tier import TierLedger


class BufferPool:
    def __init__(
        self,
        alloc: Callable[[int], torch.Tensor],
        ledger: TierLedger,
        *,
        free: Callable[[torch.Tensor], None] | None = None,
        on_release: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self._alloc = alloc  # nbytes -> a flat uint8 buffer on this pool's tier
        self._ledger = ledger  # the tier's ledger: buffers in use and cached both count
        self._free_buf = free  # gives a buffer's memory back for real (unpins it), when trimmed
        self._on_release = on_release  # sees every buffer handed back (the stand-in poisons it)
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)  # nbytes -> cached free buffers
        self.allocations = 0  # buffers actually allocated since creation: what the pool saves

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of exactly nbytes. The caller has made room on the ledger for nbytes."""
        cached = self._free.get(nbytes)
        if cached:
            self._ledger.from_cache(nbytes)
            return cached.pop()
        self._ledger.take(nbytes)
        self.allocations += 1
        return self._alloc(nbytes)

    def has_cached(self, nbytes: int) -> bool:
        return bool(self._free.get(nbytes))

    def release(self, buf: torch.Tensor) -> None:
        nbytes = buf.numel() * buf.element_size()
        self._ledger.to_cache(nbytes)
        flat = buf.view(torch.uint8).view(-1)
        if self._on_release is not None:
            self._on_release(flat)
        self._free[nbytes].append(flat)

    def trim(self, nbytes: int | None = None) -> int:
        """Free cached buffers until at least nbytes are returned (all of them if None). Returns bytes freed."""
        freed = 0
        for size in sorted(self._free, reverse=True):
            bufs = self._free[size]
            while bufs and (nbytes is None or freed < nbytes):
                buf = bufs.pop()
                if self._free_buf is not None:
                    self._free_buf(buf)
                self._ledger.drop_cache(size)
                freed += size
        return freed
