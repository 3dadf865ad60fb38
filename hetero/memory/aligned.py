"""Page-aligned host buffers and a bounded pool of them, for O_DIRECT I/O.

O_DIRECT needs the memory address, the file offset and the length of every request to be aligned to the
device's logical block size. 4096 covers every block size in practice (512e and 4Kn drives alike), and
anonymous mmap memory is page-aligned, so an mmap-backed buffer satisfies the memory side for free.
"""

from __future__ import annotations

import collections
import mmap
import threading
from collections.abc import Callable

import torch

ALIGN = 4096  # offset/length/address alignment used for all swap I/O


def align_up(n: int, align: int = ALIGN) -> int:
    """Round n up to a multiple of align."""
    return (n + align - 1) // align * align


def is_aligned(n: int, align: int = ALIGN) -> bool:
    return n % align == 0


class AlignedBuffer:
    """A page-aligned block of anonymous memory, seen as a memoryview and as a uint8 tensor.

    Both views share the mmap's memory; the tensor is used for GIL-free memcpy (torch's copy_ releases it),
    the memoryview for os.pwrite/os.preadv.
    """

    __slots__ = ("size", "_map", "view", "tensor")

    def __init__(self, size: int) -> None:
        self.size = align_up(max(size, 1))
        self._map = mmap.mmap(-1, self.size)
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)


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
