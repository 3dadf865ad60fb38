"""Whether the host buffers that asked for transparent huge pages got them.

[Note: huge host pages]
`Device.empty_host` asks for transparent huge pages (THP, madvise) on large host buffers: an O_DIRECT transfer into
4 KiB pages scattered over physical memory goes out as one DMA segment per page, and was measured at a third of the
speed of one into huge pages on this project's VM; first touch also faults once per 2 MiB instead of per 4 KiB. The
kernel grants them silently or not: none when /sys/kernel/mm/transparent_hugepage/enabled says "never", and 4 KiB
pages when no free 2 MiB of physical memory is at hand at first touch (fragmentation; the defrag setting decides
whether it compacts first). Swap and checkpoint I/O then slow down with nothing to say why. So `track` records each
such buffer, and `report` reads the kernel's own account of their mappings (AnonHugePages and Rss in
/proc/self/smaps) and logs one warning per process when less than half of their resident bytes sit on huge pages
(a buffer's unaligned ends may use small pages; a fallback leaves almost none huge).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import re
import threading
import weakref
from typing import Any

log = logging.getLogger("hetero.io.hugepages")

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
SMAPS = "/proc/self/smaps"
MIN_SHARE = 0.5  # below this share of resident bytes on huge pages, the buffers fell back to 4 KiB pages

_tracked: dict[int, int] = {}  # start address -> length of every live tracked buffer
_lock = threading.Lock()
_warned = False  # one warning per process: the cause (settings, fragmentation) is the machine's, not a buffer's
_RANGE = re.compile(r"([0-9a-f]+)-([0-9a-f]+) ")


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's THP setting ("always", "madvise" or "never"), or None where there is none to read."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None


_HUGE = 2 << 20  # the transparent huge page size on x86-64 and most arm64 kernels
_MADV_HUGEPAGE = 14  # <sys/mman.h>
_MADV_DONTNEED = 4
_PAGE = 4096  # the smallest page: a range given back must start and end on one
_madvise: Any = None  # libc's madvise once looked up; False where there is none


def advise_huge(t: Any) -> bool:
    """Ask for transparent huge pages on the 2 MiB-aligned interior of a CPU tensor's memory, before first touch.

    [Note: huge pages for fresh CPU buffers]
    On a CPU compute device the buffers hetero allocates and frees per chunk use (gathered and transient chunks,
    gradient staging, reduction targets: several MiB each, hundreds a step) came from the C heap's own mappings, fresh
    each time (with a fixed threshold, `hetero/memory/heap.py`), and the first write faults once per 4 KiB page: 4.1 ms
    to fill 16 MiB on the 2-core VM, against 0.6 ms into a buffer already touched and 1.3 ms into a fresh one on huge
    pages. This asks for those. A heap-served (small) buffer's range is skipped; a kernel without THP, or a libc without
    madvise, leaves small pages. Better still is no fresh buffer: the largest per-step ones (gathered chunks, tiles'
    gradients) now reuse pooled memory ([Note: transient storage on pooled memory] in hetero/io/swap.py). Returns
    whether the advice was taken."""
    if t.device.type != "cpu":
        return False
    nbytes = t.untyped_storage().nbytes()
    start = t.untyped_storage().data_ptr()
    lo = (start + _HUGE - 1) & ~(_HUGE - 1)
    hi = (start + nbytes) & ~(_HUGE - 1)
    if hi - lo < _HUGE:
        return False
    return _advise(lo, hi - lo, _MADV_HUGEPAGE)


def fresh(t: Any) -> Any:
    """A just-allocated buffer on a CPU compute device asks for huge pages before its first touch
    ([Note: huge pages for fresh CPU buffers]); device memory is the caching allocator's."""
    if t.is_cpu and t.numel() * t.element_size() >= 2 * _HUGE:
        advise_huge(t)
    return t


def drop_pages(t: Any, keep: int) -> bool:
    """Give the pages of a CPU tensor's memory past its first `keep` bytes back to the system (MADV_DONTNEED: they
    read as zeros again, faulted in afresh on the next touch); the mapping stays. Returns whether it was done."""
    if t.device.type != "cpu":
        return False
    start = t.untyped_storage().data_ptr()
    lo = (start + keep + _PAGE - 1) & ~(_PAGE - 1)
    hi = (start + t.untyped_storage().nbytes()) & ~(_PAGE - 1)
    return hi <= lo or _advise(lo, hi - lo, _MADV_DONTNEED)


def _advise(address: int, length: int, advice: int) -> bool:
    global _madvise
    if _madvise is None:
        name = ctypes.util.find_library("c")
        try:
            fn = ctypes.CDLL(name, use_errno=True).madvise if name else None
        except (OSError, AttributeError):
            fn = None
        if fn is not None:
            fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            fn.restype = ctypes.c_int
        _madvise = fn or False
    return bool(_madvise) and _madvise(address, length, advice) == 0


def track(owner: object, address: int, nbytes: int) -> None:
    """Count the buffer [address, address + nbytes) in `report` for as long as `owner` (its memory) is alive."""
    if nbytes <= 0:
        return
    with _lock:
        _tracked[address] = nbytes
    weakref.finalize(owner, _untrack, address)


def _untrack(address: int) -> None:
    with _lock:
        _tracked.pop(address, None)


def _mappings(smaps: str) -> list[tuple[int, int, int, int]]:
    """(start, end, resident bytes, anonymous huge-page bytes) of every mapping in a /proc/<pid>/smaps text."""
    out: list[tuple[int, int, int, int]] = []
    start = end = rss = huge = 0
    for line in smaps.splitlines():
        m = _RANGE.match(line)
        if m:
            if end:
                out.append((start, end, rss, huge))
            start, end, rss, huge = int(m.group(1), 16), int(m.group(2), 16), 0, 0
        elif line.startswith("Rss:"):
            rss = int(line.split()[1]) << 10
        elif line.startswith("AnonHugePages:"):
            huge = int(line.split()[1]) << 10
    if end:
        out.append((start, end, rss, huge))
    return out


def report(smaps_path: str = SMAPS) -> dict[str, Any]:
    """The tracked buffers' huge-page use: THP setting, how many buffers, their resident bytes, the bytes of those on
    huge pages and the share (None when nothing is resident or the kernel does not say). Warns once per process when
    the share is below MIN_SHARE ([Note: huge host pages])."""
    global _warned
    with _lock:
        ranges = sorted(_tracked.items())
    out: dict[str, Any] = {"thp": thp_mode(), "buffers": len(ranges), "resident_bytes": 0, "huge_bytes": 0}
    out["huge_share"] = None
    if not ranges:
        return out
    try:
        with open(smaps_path) as f:
            maps = _mappings(f.read())
    except OSError:
        return out
    for start, end, rss, huge in maps:  # a mapping may hold several buffers (the kernel merges alike neighbours)
        if any(a < end and start < a + n for a, n in ranges):
            out["resident_bytes"] += rss
            out["huge_bytes"] += huge
    if out["resident_bytes"]:
        out["huge_share"] = out["huge_bytes"] / out["resident_bytes"]
        if out["huge_share"] < MIN_SHARE and not _warned:
            _warned = True
            log.warning(
                "only %.0f%% of the %.1f MiB of host buffers that asked for transparent huge pages got them (THP "
                "setting %r): O_DIRECT swap and checkpoint I/O into 4 KiB pages runs far below the disk's speed. "
                "Enable THP (echo madvise > %s), or free or compact memory (echo 1 > /proc/sys/vm/compact_memory) "
                "before starting",
                100 * out["huge_share"],
                out["resident_bytes"] / 2**20,
                out["thp"],
                THP_ENABLED,
                extra={"all_ranks": True},  # this process's buffers: another rank's may have them
            )
    return out
