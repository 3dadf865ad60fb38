"""The process's resident memory over a profile, sampled on a thread of its own.

[Note: what the ledgers do not see]
The tier ledgers count every buffer hetero takes for a chunk, exactly; a step's memory holds more: the activations and
the temporaries of the model's own operators, the C heap's slack, torch's runtime, the user's data. On a CPU device all
of it is in the process's resident set; on a GPU machine, whatever of it lives in host memory. So the profile also
samples the process's RSS and reports its peak with the phase and module it fell in, and how much of it the ledgers in
host memory held then (on a CPU device: the device tier's too): what is left is memory hetero does not own.

A thread, because the peak falls where nothing of hetero's runs (in an operator's temporaries, between two modules'
hooks); every `interval` seconds, so a peak held for less than that can be missed. Each sample is one read of
/proc/self/statm, the only time the thread holds the GIL.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """This process's resident set now, in bytes; None where /proc is not there (not Linux)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


class RssSampler:
    """Samples `rss_bytes()` every `interval` seconds into `series` as (seconds since t0, bytes)."""

    def __init__(self, t0: float, *, interval: float) -> None:
        self.t0 = t0
        self.interval = interval
        self.series: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._sample()
        if not self.series:
            return  # nothing to read here (no /proc): the profile reports no RSS
        self._thread = threading.Thread(target=self._run, name="hetero-rss", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        n = rss_bytes()
        if n is not None:
            self.series.append((time.perf_counter() - self.t0, n))


def value_at(series: list[tuple[float, int]], t: float) -> int:
    """The value of a step series (time, value), as recorded, at time t (0 before its first entry)."""
    i = bisect.bisect_right(series, t, key=lambda e: e[0])
    return series[i - 1][1] if i else 0


def where_at(prof: Any, t: float) -> str:
    """The phase (and, in forward, the innermost module) running at time t of a profile."""
    inner = None
    for s in prof.modules:
        if s.phase == "forward" and s.start <= t <= s.end and (inner is None or s.start >= inner.start):
            inner = s
    if inner is not None:
        return f"forward of {inner.name}"
    for name, start, end in prof.phases:
        if start <= t <= end:
            return name
    return "between phases" if prof.phases else "outside a step"


def host_tiers(prof: Any) -> list[str]:
    """The tiers whose ledgers count host memory: on a CPU device, the device tier's too."""
    return ["host"] if prof.engine.device.separate_memory else ["device", "host"]


def rss_summary(prof: Any) -> dict[str, Any] | None:
    """The RSS peak over the profile, where it fell and what the host-memory ledgers held then; None unsampled."""
    series = prof.rss_series
    if not series:
        return None
    t, peak = max(series, key=lambda e: e[1])
    tiers = host_tiers(prof)
    held = sum(value_at(prof.series[tier], t) for tier in tiers)
    # The rest, as far as the profile can name it: activations (in host memory only where the device is the CPU),
    # and what the process held outside the ledgers when the window opened (the runtime, libraries, the data);
    # what is left of the peak is unaccounted: operators' temporaries, the C heap's slack, anything since.
    acts = 0 if prof.engine.device.separate_memory else value_at(prof.activation_series, t)
    before = series[0][1] - sum(value_at(prof.series[tier], series[0][0]) for tier in tiers)
    return {
        "peak_bytes": peak,
        "time": t,
        "where": where_at(prof, t),
        "first_bytes": series[0][1],
        "last_bytes": series[-1][1],
        "samples": len(series),
        "interval": prof.rss_interval,
        "ledger_tiers": tiers,
        "ledgers_at_peak": held,
        "outside_ledgers_at_peak": peak - held,
        "activations_at_peak": acts,
        "outside_ledgers_before": before,
        "unaccounted_at_peak": peak - held - acts - before,
    }
