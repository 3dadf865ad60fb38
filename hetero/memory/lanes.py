"""A thread pool with two lanes: a queued urgent job runs before a queued background one, up to a backlog.

[Note: reads before writes]
The NVMe tier's reads are waited for: a prefetch that is late stalls the training thread. Its writes are not: a
write-back only has to end before its host buffer is wanted again, and room-making waits for it then. With one FIFO
queue, a read queued behind a burst of write-backs (an updated optimizer chunk is four states of a chunk each) waits
for all of them, on a disk that writes and reads at about the same speed. So the store's pools take reads (and the
checksums that finish them) from an urgent lane and writes from a background lane, and either may go first: the
pool's backlog decides.

[Note: a bounded write backlog]
Reads first without a bound starved the writes whenever reads never ran out. An update whose math is quick next to
the disk (a GPU machine's 16 cores stepping states streamed from NVMe) asks for the next chunk's states the moment
one has stepped, so the read lane is never empty, and every write-back waited until the update's last read: each
chunk's buffer stayed held until then, and the host tier peaked at nearly all the states streamed (10.09 GB on one
H100: 1.1 GB of parameters, up to 2.2 of gradients, most of the 6.7 GB of states; on the development VM, the math
taken out to stand in for that machine, 2.95 GB of write-backs in flight at once in an update of 3.9 GB). The host
budget bounds it only when it is small. So a pool takes a background job first while more than `backlog` of them
wait. Jobs in one lane run in the order they were queued.

[Note: writes first by default]
How big a backlog: none, measured. A write that goes first frees its host buffer soonest; a read that goes first
saves only its own wait, and the reads a step waits for were not measurably slower behind writes (below; why the
update also drains faster is not profiled: the disk sees long runs of one kind instead of alternating). Measured on
the development VM (`benchmarks/update_stream.py`, an update of 2.68 GB of states from NVMe, math left out,
alternating): drained in 2.28-2.30 s at backlog 0 against 2.46-2.68 s at 8 blocks (one per I/O thread, the previous
default) and 3.75-3.80 s with reads always first; the host tier peaked at 2.53 GB against 2.83 and 3.42. Nor did the
reads a step waits for lose: whole fp32 steps with the parameters streamed from NVMe too (`--whole-step
--params-host-gb 0.1`) took 7.53-7.74 s against 8.43-9.63 s, forward and backward included; with the delayed update
overlapping them, medians of four runs 5.33 against 5.51 s (4.01, 5.29, 5.36, 8.28 against 4.14, 5.33, 5.68, 6.03);
`bigger_than_ram.py --case llama-416m`, every shard through NVMe each step, 5.72-5.91 s against 5.99-6.37 s. So the
store's default backlog is 0: a queued write goes before a queued read, and reads go first only between bursts of
write-backs. `HETERO_NVME_WRITE_BACKLOG` sets another bound (`none`: reads always first).
On one H100's virtio disk (fio from huge pages: 1.91 GB/s writing, 1.72 reading, 2.04 both at once) the order made
no difference to speed beyond the runs' spread and writes first kept less: the same update drained in 2.58 and 2.37 s
at backlog 0 against 2.12 and 2.33 s at 8 (host tier 2.68 against 3.12 GB), and a whole NVMe step of the 551M Llama
took 6.41 s against 6.30 s at 6.73 against 7.12 GB of RSS.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("hetero.memory.lanes")


class LanePool:
    """Up to `workers` daemon threads (started as jobs need them) serving an urgent and a background queue.

    backlog: background jobs that may wait while urgent ones run; beyond it the oldest background job goes first
    ([Note: a bounded write backlog]). None: urgent jobs always first."""

    def __init__(self, workers: int, *, name: str, backlog: int | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if backlog is not None and backlog < 0:
            raise ValueError(f"backlog must be >= 0 or None, got {backlog}")
        self.max_workers = workers
        self.backlog = backlog
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
                behind = self.backlog is not None and len(background) > self.backlog
                fn, args = (background if behind or not urgent else urgent).popleft()
            try:
                fn(*args)
            except BaseException:  # pragma: no cover - the pipeline's stages catch their own errors
                log.exception("job on %s failed", self.name)
            # An idle worker must not keep its last job's objects (a store, through its callbacks) alive.
            del fn, args
