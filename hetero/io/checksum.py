"""Checksums of swap blocks and checkpoint tensors, by name, so that what is written can record which one it used.

[Note: checksum algorithms]
Checking every byte that goes to disk and back must not cost more than moving it. zlib.crc32 runs at 2.3-2.9 GB/s
on one core of the 2-core VM hetero is measured on, below the disk (up to 3.8 GB/s read), and the checksum runs on
every block of every swap and checkpoint transfer. xxhash's XXH3 (64-bit) measured 28 GB/s on a cached 8 MiB block
and 6-12 GB/s from memory, CRC32C with the CPU's crc32 instruction (the `crc32c` package) 23 and 5-6 GB/s; both
release the GIL for large buffers (xxhash's one-shot functions since 4.0; a thread hashing 512 MiB left the main
thread stalls of 5-8 ms, well under the 45 ms call), so checksums on several threads overlap each other and the
I/O. XXH3 is the default: the fastest, and 64 bits make an undetected corruption rarer than 32 do. What
is written records its algorithm (a checkpoint file in its header's metadata, an NVMe store per entry), and data
without a record is CRC32: files written before this stay readable.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

Checksum = Callable[[memoryview], int]

DEFAULT = "xxh3_64"
LEGACY = "crc32"  # what data with no recorded algorithm was written with
ALGORITHMS = ("xxh3_64", "crc32c", "crc32")


def checksum_fn(name: str) -> Checksum:
    """The function computing checksum `name` (one of ALGORITHMS) of a buffer, as an int."""
    if name == "crc32":
        return zlib.crc32
    if name == "xxh3_64":
        try:
            import xxhash
        except ImportError:
            raise ImportError("checksum 'xxh3_64' needs the xxhash package: pip install xxhash") from None
        return xxhash.xxh3_64_intdigest
    if name == "crc32c":
        try:
            import crc32c
        except ImportError:
            raise ImportError("checksum 'crc32c' needs the crc32c package: pip install crc32c") from None
        return crc32c.crc32c
    raise ValueError(f"unknown checksum {name!r}: choose one of {', '.join(ALGORITHMS)}")


class Running:
    """Checksum `name` of a buffer fed in consecutive parts: `digest()` equals `checksum_fn(name)` of the whole (a
    tensor written part by part, never whole in memory: a weight split into tiles, consolidated)."""

    def __init__(self, name: str) -> None:
        checksum_fn(name)  # the package is there, or the same error
        self.name = name
        self.value = 0
        self.hasher = None
        if name == "xxh3_64":
            import xxhash

            self.hasher = xxhash.xxh3_64()

    def update(self, data: memoryview) -> None:
        if self.hasher is not None:
            self.hasher.update(data)
        elif self.name == "crc32":
            self.value = zlib.crc32(data, self.value)
        else:
            import crc32c

            self.value = crc32c.crc32c(data, self.value)

    def digest(self) -> int:
        return self.hasher.intdigest() if self.hasher is not None else self.value
