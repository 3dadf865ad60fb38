"""A `TensorWriter` that also writes a tensor from consecutive parts, none of them the whole tensor: consolidation of a
weight split into tiles ([Note: tiles] in hetero/memory/chunk_size.py) holds one part in memory at a time."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from hetero.checkpoint.format import TensorWriter
from hetero.io.checksum import Running
from hetero.io.direct import as_bytes, write_full


class PartWriter(TensorWriter):
    def write_parts(self, name: str, numel: int, parts: Iterable[torch.Tensor]) -> None:
        """Write the next planned tensor (`numel` elements) from consecutive flat CPU parts, each written before the
        next is asked for: a tensor need never be whole in memory (consolidation writes tiles this way)."""
        if self.block_bytes:
            raise ValueError("write_parts records no block checksums: make the writer without block_bytes")
        self._drain()  # runs submitted before are written first: offsets and checksums stay in plan order
        if (
            self._next >= len(self._order)
            or self._order[self._next].name != name
            or self._order[self._next].numel != numel
        ):
            raise ValueError(f"{self.path}: wrote {name!r} ({numel} elements) out of the plan's order or size")
        entry = self._order[self._next]
        self._next += 1
        offset = self.data_start + entry.begin
        if name in self._gaps:
            gap = self._gaps[name]
            os.pwrite(self._fd, self._zeros[:gap], offset - gap)
        crc, end = Running(self.checksum), self.data_start + entry.end
        for part in parts:
            view = as_bytes(part if part.dtype == entry.dtype else part.to(entry.dtype))
            crc.update(view)
            offset += write_full(self._fd, view, offset)
        if offset != end:
            raise ValueError(f"{self.path}: {name!r}: its parts hold {offset - self.data_start - entry.begin} bytes")
        self.crcs[name], self.blocks[name] = crc.digest(), None
