"""The C heap's hold on freed memory: large buffers go back to the system when freed, so that the process's resident
memory follows the tier budgets.

[Note: the heap keeps what the budgets free]
glibc's malloc serves an allocation above its mmap threshold with a mapping of its own, unmapped on free; below it,
from a heap that keeps what is freed for reuse. The threshold is dynamic: each time a mapped block is freed, it rises
to that block's size (up to 32 MiB on 64-bit). hetero frees and allocates chunk-sized buffers all the time (gathered
chunks, tiles' gradients, the update's fp32 temporaries, each a few MiB to tens of MiB), so after the first free they
come from the heap, whose holes, spread over one arena per thread, are never returned: a 416M-parameter Llama with
512 MiB host and device budgets (benchmarks/bigger_than_ram.py --case llama-416m, 2 layers) measured 2.0 GiB of peak
RSS against 1.07 GiB of imports plus ledgers, and 1.2 GiB with a fixed 1 MiB threshold. hetero therefore fixes the
threshold (which also stops its rising) at `THRESHOLD` once per process, on glibc only, unless the user chose one
through glibc's own MALLOC_MMAP_THRESHOLD_ variable or set HETERO_MALLOC_MMAP_THRESHOLD (bytes; 0 leaves malloc as
it is). The cost is a page fault per page of each new large buffer, small beside moving it between tiers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("hetero.memory")

THRESHOLD = 1 << 20  # bytes: buffers at least this large are mapped on their own and unmapped when freed
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_done = False


def bound_heap_retention() -> int | None:
    """Fix glibc's mmap threshold (see [Note: the heap keeps what the budgets free]); returns the threshold set, or
    None where nothing was changed. Idempotent."""
    global _done
    if _done:
        return None
    _done = True
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None  # the user's own choice, which glibc has already applied
    given = os.environ.get("HETERO_MALLOC_MMAP_THRESHOLD", str(THRESHOLD))
    try:
        value = int(given)
    except ValueError:
        log.warning("HETERO_MALLOC_MMAP_THRESHOLD=%r is not a number of bytes: %d used instead", given, THRESHOLD)
        value = THRESHOLD
    if value <= 0:
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
        gnu = getattr(libc, "gnu_get_libc_version", None)
    except OSError:
        return None
    if mallopt is None or gnu is None:  # not glibc (musl, macOS, Windows): their allocators behave otherwise
        return None
    if not mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(value)):
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) was refused", value)
        return None
    log.debug("malloc's mmap threshold fixed at %d bytes", value)
    return value
