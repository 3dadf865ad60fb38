"""Staging buffers: fp32 host chunks of the manager into which a chunk's first values are written (by a meta model's
initialiser, or read from weight files) before `ZeroChunk.load` takes this rank's share; and a tiled weight's whole
value while its initialiser writes it ([Note: initialising tiles] in materialize.py)."""

from __future__ import annotations

from typing import Any

import torch

from hetero.memory import Chunk, ChunkManager, TensorState, Tier
from hetero.zero.zero_chunk import ZeroChunk


class Staging:
    """One fp32 host chunk per ZeroChunk being filled, counted in the host ledger and pinned there."""

    def __init__(self, manager: ChunkManager, *, checksum: bool = False) -> None:
        self.m = manager
        self.checksum = checksum  # sum each chunk's values as it is loaded (to compare ranks)
        self.open: dict[int, Chunk] = {}  # ZeroChunk index -> staging chunk
        self.whole: dict[int, Chunk] = {}  # tiled parameter id -> its whole value ([Note: initialising tiles])

    def flat(self, zc: ZeroChunk) -> torch.Tensor:
        c = self.open.get(zc.spec.index)
        if c is None:
            c = self.m.new_chunk(dtype=torch.float32, capacity=zc.spec.capacity, kind="staging")
            slot = c.add_tensor(f"{zc.spec.params[0].name}..staging", (zc.spec.capacity,))
            self.m.access(c, Tier.HOST)
            c.set_state(slot, TensorState.HOLD)
            self.m.pin(c)  # loading other chunks must not evict it to NVMe
            c.payload.zero_()  # the padding past the last parameter
            self.open[zc.spec.index] = c
        return c.payload

    def view(self, zc: ZeroChunk, info: Any) -> torch.Tensor:
        return self.flat(zc).narrow(0, info.offset, info.numel).view(info.shape)

    def whole_view(self, info: Any) -> torch.Tensor:
        """A tiled parameter's whole value (fp32, zeros at first), for an initialiser to write."""
        key = id(info.param)
        c = self.whole.get(key)
        if c is None:
            numel = info.param.numel()
            c = self.m.new_chunk(dtype=torch.float32, capacity=numel, kind="staging")
            slot = c.add_tensor(f"{info.name}..staging", (numel,))
            self.m.access(c, Tier.HOST)
            c.set_state(slot, TensorState.HOLD)
            self.m.pin(c)
            c.payload.zero_()
            self.whole[key] = c
        return c.payload.view(info.param.shape)

    def load_tiles(self, tiles: list[tuple[ZeroChunk, Any]]) -> list[tuple[int, float]]:
        """Copy a tiled parameter's whole value into its tiles' chunks, one at a time, and free it; (chunk index,
        checksum) per tile."""
        c = self.whole.pop(id(tiles[0][1].param))
        flat = c.payload
        sums = []
        for zc, info in tiles:
            self.flat(zc).narrow(0, info.offset, info.numel).copy_(flat.narrow(0, info.start, info.numel))
            sums.append((zc.spec.index, self.load(zc)))
        self.free(c)
        return sums

    def load(self, zc: ZeroChunk) -> float:
        """Load the chunk from its staging buffer and free the buffer; returns the values' sum (a checksum)."""
        c = self.open.pop(zc.spec.index)
        flat = c.payload
        total = float(flat.sum(dtype=torch.float64)) if self.checksum else 0.0
        zc.load(flat)
        self.free(c)
        return total

    def free(self, c: Chunk) -> None:
        self.m.unpin(c)
        c.set_state(c.slots[0], TensorState.FREE)
        self.m.free_chunk(c)

    def close(self) -> None:
        for c in [*self.open.values(), *self.whole.values()]:
            self.free(c)
        self.open.clear()
        self.whole.clear()
