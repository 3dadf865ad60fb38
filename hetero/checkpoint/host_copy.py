"""The host memory an async save's copies hold while they are written: `engine.memory_stats()["host"]
["checkpoint_copy"]`, and a line of the profiler's summary.

[Note: the checkpoint copy's memory]
An async save copies this rank's whole part of the checkpoint into host memory at the call ([Note: a save written
while training goes on] in background.py) and frees it a run (a chunk) at a time as the writing thread writes it.
Those bytes are no tier's: the host tier's budget bounds the chunks, and the copy was sized against the host's
available memory instead (`background.host_room`); charged to the host ledger, it would overrun the budget it was
never asked to fit. So it is counted here, beside the ledgers: taken at the capture, given back run by run as each
run's write ends (on the writing thread, hence the lock), zero once the write has ended, failed or was cancelled.
A user watching the process's memory sees RSS grow by it, and the stats say what it is; the profiler reads the
series of changes to name it at the RSS peak and draw it in the trace.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

_SERIES = 1 << 16  # changes kept for the profiler: a few per chunk per save; the oldest go first


class HostCopy:
    """Bytes held by async saves' host copies, outside the tier ledgers ([Note: the checkpoint copy's memory])."""

    def __init__(self) -> None:
        self.current = 0  # bytes held now by copies not yet written
        self.peak = 0  # highest `current` since the engine began
        # (time.perf_counter(), current) after each change, the last _SERIES of them: the profiler's window
        self.series: collections.deque[tuple[float, int]] = collections.deque(maxlen=_SERIES)
        self._lock = threading.Lock()  # the training thread takes, the writing thread gives back

    def take(self, nbytes: int) -> None:
        self._change(nbytes)

    def give(self, nbytes: int) -> None:
        self._change(-nbytes)

    def _change(self, delta: int) -> None:
        if not delta:
            return
        with self._lock:
            if self.current + delta < 0:
                raise AssertionError(f"checkpoint copy underrun: giving {-delta} of {self.current}")
            self.current += delta
            self.peak = max(self.peak, self.current)
            self.series.append((time.perf_counter(), self.current))

    def stats(self) -> dict[str, int]:
        """What `engine.memory_stats()` reports under host: bytes held now and at most so far."""
        return {"current": self.current, "peak": self.peak}

    def window(self, t0: float, t1: float) -> list[tuple[float, int]]:
        """The series between perf_counter times t0 and t1, as (seconds since t0, bytes), starting with the value
        held at t0 (0 when nothing was held)."""
        with self._lock:
            series = list(self.series)
        before = [n for t, n in series if t <= t0]
        out = [(0.0, before[-1] if before else 0)]
        out += [(t - t0, n) for t, n in series if t0 < t <= t1]
        return out


def copy_of(engine: Any) -> HostCopy | None:
    """The engine's account, where it has one (an engine from before it, or a stand-in, has none)."""
    return getattr(engine, "checkpoint_copy", None)
