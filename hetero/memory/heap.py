"""The C heap's hold on freed memory: glibc's own by default, or fixed so that freed buffers leave the process.

[Note: the heap keeps what the budgets free]
glibc's malloc serves an allocation above its mmap threshold with a mapping of its own, unmapped on free; below it,
from a heap that keeps what is freed for reuse. The threshold is dynamic: each time a mapped block is freed, it rises
to that block's size (up to 32 MiB on 64-bit), so a buffer allocated and freed every step comes from the heap after
the first time, with its pages already resident. A fixed threshold stops the rising: every buffer above it is a
fresh mapping, returned on free, whose pages the kernel faults in and zeroes 4 KiB at a time on first touch.

hetero used to fix it at 1 MiB. When the buffers it frees and allocates per chunk (gathered chunks, tiles'
gradients, host staging) came from malloc, their holes, spread over one arena per thread, were never returned: the
416M Llama of benchmarks/bigger_than_ram.py (512 MiB host and device budgets) measured 2.0 GiB of peak RSS dynamic
against 1.2 GiB fixed. Those buffers now come from hetero's pools instead ([Note: transient storage on pooled memory]
in hetero/io/swap.py, [Note: elastic buffers] in hetero/memory/pool.py, `ZeroChunk.grad_target`), and the fixed
threshold's cost is what is left: on a CPU compute device, every activation of a MiB or more faulted in anew each
step. Measured again on the 2-core VM (2026-11-26): the 416M Llama 1.32 GiB dynamic against 1.27 GiB fixed, the same
step time; ZeRO-3 of a 23M GPT over two ranks (benchmarks/step_time.py) 2.10 s and 1.05 GB a rank dynamic against
2.67 s and 0.82 GB fixed, with FSDP2 beside it at 1.99-2.07 s and 1.18 GB. So the heap is now left as glibc keeps it.
HETERO_MALLOC_MMAP_THRESHOLD (bytes; 0 or unset: glibc's own) fixes the threshold once per process, for a host whose
RSS matters more than its step time; glibc's own MALLOC_MMAP_THRESHOLD_ wins over both. On a GPU the activations live
in CUDA's caching allocator and hetero's host chunks in pinned pools: the threshold touches only host temporaries.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("hetero.memory")

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_done = False


def bound_heap_retention() -> int | None:
    """Fix glibc's mmap threshold where HETERO_MALLOC_MMAP_THRESHOLD asks for it (see [Note: the heap keeps what the
    budgets free]); returns the threshold set, or None where nothing was changed. Idempotent."""
    global _done
    if _done:
        return None
    _done = True
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None  # the user's own choice, which glibc has already applied
    given = os.environ.get("HETERO_MALLOC_MMAP_THRESHOLD", "0")
    try:
        value = int(given)
    except ValueError:
        log.warning("HETERO_MALLOC_MMAP_THRESHOLD=%r is not a number of bytes: glibc's own threshold is kept", given)
        return None
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
