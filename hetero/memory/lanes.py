"""A thread pool with two lanes: a queued urgent job always runs before a queued background one.

[Note: reads before writes]
The NVMe tier's reads are waited for: a prefetch that is late stalls the training thread. Its writes are not: a
write-back only has to end before its host buffer is wanted again, and room-making waits for it then. With one FIFO
queue, a read queued behind a burst of write-backs (an updated optimizer chunk is four states of a chunk each) waits
for all of them, on a disk that writes and reads at about the same speed. So the store's pools take reads (and the
checksums that finish them) from an urgent lane first and writes from a background lane. Reads come only from
prefetches and accesses, which need host room, which the writes give back: the host budget bounds how long writes
wait. Where it holds all the states streamed (a GPU machine's 65 GB against 6.7 GB of optimizer states), an exact
update that asks for each chunk's states as soon as the last one stepped keeps the read lane full, and its
write-backs wait until it ends, their buffers held: on one H100 that update moved 2.06 GB/s, the delayed one, which
leaves the lane empty between chunks, 2.88 (benchmarks/README.md, tenth session; not yet profiled). Jobs in one lane
run in the order they were queued.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("hetero.memory.lanes")


class LanePool:
    """Up to `workers` daemon threads (started as jobs need them) serving an urgent and a background queue."""

    def __init__(self, workers: int, *, name: str) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.max_workers = workers
        self.name = name
        self._cv = threading.Condition()
        self._lanes: tuple[collections.deque, collections.deque] = (collections.deque(), collections.deque())
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], *args: Any, urgent: bool = False) -> None:
        """Queue fn(*args). Its exceptions are logged and dropped: a job reports its own errors."""
        with self._cv:
            if self._shutdown:
                raise RuntimeError(f"pool {self.name} is shut down: cannot queue new jobs")
            self._lanes[0 if urgent else 1].append((fn, args))
            queued = len(self._lanes[0]) + len(self._lanes[1])
            if queued > self._idle and len(self._threads) < self.max_workers:
                # Daemon: an idle worker must not hold the interpreter's exit; a store's close() drains its jobs.
                t = threading.Thread(target=self._work, name=f"{self.name}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            else:
                self._cv.notify()

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new jobs; the queued ones still run. wait: return only once every worker has exited."""
        with self._cv:
            self._shutdown = True
            self._cv.notify_all()
            threads = list(self._threads)
        if wait:
            for t in threads:
                if t is not threading.current_thread():
                    t.join()

    def _work(self) -> None:
        urgent, background = self._lanes
        while True:
            with self._cv:
                self._idle += 1
                while not urgent and not background and not self._shutdown:
                    self._cv.wait()
                self._idle -= 1
                if not urgent and not background:
                    return  # shut down and drained
                fn, args = (urgent or background).popleft()
            try:
                fn(*args)
            except BaseException:  # pragma: no cover - the pipeline's stages catch their own errors
                log.exception("job on %s failed", self.name)
            # An idle worker must not keep its last job's objects (a store, through its callbacks) alive.
            del fn, args
