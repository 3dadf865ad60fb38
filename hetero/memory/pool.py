"""Pools of chunk buffers, one per memory tier, so moves reuse memory instead of allocating it per move.

Allocation is the hidden cost of a move: pinning host memory (`cudaHostAlloc`) costs far more than the copy it
serves, and a fresh pageable buffer is paid for again in page faults on first touch. So a buffer given back by a
chunk that left a tier is kept, keyed by its exact size, for the next chunk of that size. Chunks of one dtype share
one capacity, so exact-size reuse hits almost always and keeps the ledger exact. Cached buffers count against the
tier's budget; when room is needed they are freed before any chunk is evicted.

[Note: elastic buffers]
Not so with tiles ([Note: tiles] in chunk_size.py): their chunks are sized to their rows, and a Llama's come in a
dozen sizes (8,380,416 / 8,388,608 / 11,919,360 / 35,758,080 bytes ... for the 416M Llama of
benchmarks/bigger_than_ram.py), so exact-size reuse missed about 240 times a step there: each miss freed cached
buffers of other sizes and mapped a fresh one, whose pages the kernel zeroes inside the next NVMe read into it.
Where host memory is not pinned (a CPU device), the host pool is *elastic*: every buffer it maps has the largest
size a chunk has asked for so far (`reserve`), virtual address space that costs nothing until touched, and the
ledger counts the bytes a buffer holds resident. A request takes a cached buffer with at least its size resident
and gives the pages past its size back (`hugepages.drop_pages`), or one with fewer, touching only the difference.
Pinned buffers (CUDA, the stand-in) keep exact sizes: pinning commits every byte of a mapping. The device pool keeps
them too (made elastic as well, `"offload": "auto"` over-counted the activations it measures: not pursued).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from hetero.io import hugepages
from hetero.memory.tier import TierLedger


class BufferPool:
    def __init__(
        self,
        alloc: Callable[[int], torch.Tensor],
        ledger: TierLedger,
        *,
        free: Callable[[torch.Tensor], None] | None = None,
        on_release: Callable[[torch.Tensor], None] | None = None,
        elastic: bool = False,
    ) -> None:
        self._alloc = alloc  # nbytes -> a flat uint8 buffer on this pool's tier
        self._ledger = ledger  # the tier's ledger: buffers in use and cached both count
        self._free_buf = free  # gives a buffer's memory back for real (unpins it), when trimmed
        self._on_release = on_release  # sees every buffer handed back (the stand-in poisons it)
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)  # nbytes -> cached free buffers
        self.allocations = 0  # buffers actually allocated since creation: what the pool saves
        # Elastic ([Note: elastic buffers]): None, or the size every new buffer is mapped with.
        self.elastic: int | None = 0 if elastic else None
        self._lent: dict[int, tuple[torch.Tensor, int]] = {}  # address -> (whole buffer, bytes resident), in use
        # Exact-size pools: buffers of each size in use now; at `mark`, those and the most in use at once since.
        self._in_use: dict[int, int] = defaultdict(int)
        self._marked: dict[int, int] = {}
        self._high: dict[int, int] = {}

    def reserve(self, nbytes: int) -> None:
        """Buffers mapped from now on can serve a request of nbytes (elastic pools)."""
        if self.elastic is not None:
            self.elastic = max(self.elastic, nbytes)

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of exactly nbytes. The caller has made room on the ledger for nbytes."""
        if self.elastic is not None:
            return self._acquire_elastic(nbytes)
        cached = self._free.get(nbytes)
        if cached:
            buf = cached.pop()
            self._ledger.from_cache(nbytes)
        else:
            # Allocated before it is counted: an allocator that refuses (torch.OutOfMemoryError where activations
            # took the memory the budget allows) leaves the ledger as it was, not a buffer's bytes short for good.
            buf = self._alloc(nbytes)
            self._ledger.take(nbytes)
            self.allocations += 1
        self._in_use[nbytes] += 1
        self._high[nbytes] = max(self._high.get(nbytes, 0), self._in_use[nbytes])
        return buf

    def mark(self) -> None:
        """Start counting what is taken from here (`taken_since_mark`)."""
        self._marked = {size: n for size, n in self._in_use.items() if n}
        self._high = dict(self._marked)

    def taken_since_mark(self) -> dict[int, int]:
        """Per size, the most buffers in use at once since `mark` beyond those in use at it (exact-size pools;
        elastic ones count none)."""
        return {size: n - self._marked.get(size, 0) for size, n in self._high.items() if n > self._marked.get(size, 0)}

    def _acquire_elastic(self, nbytes: int) -> torch.Tensor:
        # The cached buffer that can hold nbytes with the fewest bytes to give back, else the most already resident.
        fits = [(size, i) for size, bufs in self._free.items() for i, b in enumerate(bufs) if b.numel() >= nbytes]
        if not fits:
            whole = self._alloc(max(nbytes, self.elastic or 0))  # before it is counted, as in `acquire`
            self._ledger.take(nbytes)
            self.allocations += 1
        else:
            size, i = min(fits, key=lambda f: (f[0] < nbytes, f[0] if f[0] >= nbytes else -f[0]))
            whole = self._free[size].pop(i)
            if size >= nbytes:
                self._ledger.from_cache(nbytes)
                if size > nbytes:
                    self._ledger.drop_cache(size - nbytes)
                    hugepages.drop_pages(whole, nbytes)
            else:
                self._ledger.from_cache(size)
                self._ledger.take(nbytes - size)  # the room made for nbytes covers it
        self._lent[whole.data_ptr()] = (whole, nbytes)
        return whole[:nbytes]

    def has_cached(self, nbytes: int) -> bool:
        """A cached buffer serves nbytes without taking more of the budget."""
        if self.elastic is None:
            return bool(self._free.get(nbytes))
        return any(size >= nbytes and any(b.numel() >= nbytes for b in bufs) for size, bufs in self._free.items())

    def release(self, buf: torch.Tensor) -> None:
        flat = buf.view(torch.uint8).view(-1)
        nbytes = flat.numel()
        if self.elastic is not None:
            flat, nbytes = self._lent.pop(flat.data_ptr())  # the whole buffer; its resident bytes are the request's
        else:
            self._in_use[nbytes] -= 1
        self._ledger.to_cache(nbytes)
        if self._on_release is not None:
            self._on_release(flat)
        self._free[nbytes].append(flat)

    def trim(self, nbytes: int | None = None, *, keep: dict[int, int] | None = None) -> int:
        """Free cached buffers until at least nbytes are returned (all of them if None), leaving `keep[size]`
        buffers of each size cached. Returns bytes freed."""
        freed = 0
        for size in sorted(self._free, reverse=True):
            bufs = self._free[size]
            spare = (keep or {}).get(size, 0)
            while len(bufs) > spare and (nbytes is None or freed < nbytes):
                buf = bufs.pop()
                if self._free_buf is not None:
                    self._free_buf(buf)
                self._ledger.drop_cache(size)
                freed += size
        return freed
