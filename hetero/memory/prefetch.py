"""Prefetch: moving chunks toward the tier of their next use before it comes, never blocking the caller.

See the manager's [Note: prefetch needs room first] and [Note: reads chained behind write-backs].
"""

from __future__ import annotations

from collections import Counter

from hetero.memory.chunk import Chunk
from hetero.memory.moves import Mover
from hetero.memory.policy import AccessTrace
from hetero.memory.room import RoomMaker
from hetero.memory.states import ChunkState
from hetero.memory.tier import Tier


class Prefetcher:
    """Starts moves ahead of use, from the trace or from an explicit list."""

    def __init__(
        self,
        room: RoomMaker,
        mover: Mover,
        chunks: dict[int, Chunk],
        trace: AccessTrace,
        counters: Counter[str],
        *,
        depth: int,
    ) -> None:
        self.room = room
        self.mover = mover
        self.chunks = chunks  # the manager's live chunks, by id
        self.trace = trace
        self.counters = counters
        self.depth = depth  # chunks to move ahead of use while the trace replays

    def ahead(self, protect: set[int]) -> None:
        """Start moving the next chunks of the trace; see [Note: prefetch needs room first]."""
        earmarked = {Tier.DEVICE: 0, Tier.HOST: 0}
        for cid, tier in self.trace.upcoming(self.depth, skip=protect):
            chunk = self.chunks.get(cid)
            if chunk is None or tier is Tier.NVME:
                continue
            if chunk.move is None and (chunk.state is ChunkState.EMPTY or chunk.tier == tier or tier > chunk.tier):
                continue  # there already, or wanted lower down (what `start` would say, without the horizon's cost)
            if not chunk.movable:
                continue  # held where it is: see `start`
            # Evict only what is needed later than this chunk; else prefetching would evict what comes sooner.
            horizon = self.trace.next_use(cid)
            if self.start(chunk, tier, horizon=horizon, protect=protect | {cid}, earmarked=earmarked[tier]):
                continue
            if (
                self.room.available(tier, chunk.nbytes) + self.room.leaving_bytes(tier)
                >= earmarked[tier] + chunk.nbytes
            ):
                earmarked[tier] += chunk.nbytes  # its room is on the way: its move starts at a later access
                continue
            break  # nothing evictable before this chunk's use: the ones after it cannot fare better

    def start(self, chunk: Chunk, tier: Tier, *, horizon: float | None, protect: set[int], earmarked: int = 0) -> bool:
        """Start moving chunk to tier without blocking; True if it is there or on its way."""
        if chunk.move is not None:
            return chunk.move.dst == tier
        if chunk.state is ChunkState.EMPTY or chunk.tier == tier:
            return True
        if not chunk.movable:
            # Computed on where it is (an update stepping states in place on the host), pinned, or a copy landing in
            # it: its holder writes through views of this payload, which a move would give back to the pool.
            return False
        if tier > chunk.tier:
            return True  # a chunk wanted lower down will be evicted there when room is needed
        room = self.room.make(
            tier, chunk.nbytes, protect | {chunk.id}, blocking=False, horizon=horizon, earmarked=earmarked
        )
        if not room or earmarked > self.room.available(tier, chunk.nbytes) - chunk.nbytes:
            started = self.mover.chain_read(chunk, tier)
        else:
            started = self.mover.start(chunk, tier, blocking=False, prefetch=True, protect=frozenset(protect))
        if started:
            chunk.prefetched = True
            self.counters["prefetches"] += 1
        return started
