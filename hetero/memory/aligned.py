"""A bounded pool of page-aligned staging buffers, for the NVMe tier's O_DIRECT I/O of unaligned tensors.

The buffers, the alignment and the I/O loops themselves live in `hetero.io.direct` ([Note: direct I/O]), shared
with the checkpoint files; they are re-exported here for the tier's users.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from hetero.io.direct import ALIGN, AlignedBuffer, align_up, is_aligned

__all__ = ["ALIGN", "AlignedBuffer", "StagingPool", "align_up", "is_aligned"]


class StagingPool:
    """At most `count` aligned buffers of `size` bytes, lent out in request order.

    Buffers are created lazily (a store that only ever does aligned or buffered I/O never pays for them) but
    never more than `count`, so staging memory stays bounded at count * size however many requests are queued.
    Nobody blocks waiting for a buffer: acquire_async() queues a callback instead, because a worker thread
    blocked on the pool could be the very one needed to finish the request that holds a buffer.
    """

    def __init__(self, count: int, size: int) -> None:
        if count < 1:
            raise ValueError(f"staging pool needs at least one buffer, got {count}")
        self.count = count
        self.size = align_up(size)
        self._free: list[AlignedBuffer] = []
        self._waiters: collections.deque[Callable[[AlignedBuffer], None]] = collections.deque()
        self._created = 0
        self._lock = threading.Lock()

    @property
    def created(self) -> int:
        """Buffers allocated so far (never above count)."""
        return self._created

    def _take(self) -> AlignedBuffer | None:
        """A free or new buffer, or None if all are lent out (lock held)."""
        if self._free:
            return self._free.pop()
        if self._created < self.count:
            buf = AlignedBuffer(self.size)  # cheap: pages are faulted in on first touch
            self._created += 1
            return buf
        return None

    def acquire_async(self, callback: Callable[[AlignedBuffer], None]) -> None:
        """Call callback(buffer) now if one is free, else from the release() that frees one (FIFO)."""
        with self._lock:
            buf = self._take()
            if buf is None:
                self._waiters.append(callback)
                return
        callback(buf)

    def release(self, buf: AlignedBuffer) -> None:
        with self._lock:
            if not self._waiters:
                self._free.append(buf)
                return
            waiter = self._waiters.popleft()
        waiter(buf)  # hand the buffer straight to the oldest queued request

    def clear(self) -> None:
        """Drop idle buffers (their memory goes back to the OS once no view of them remains)."""
        with self._lock:
            self._created -= len(self._free)
            self._free.clear()
