"""Prefetch: moving chunks toward the tier of their next use before it comes, never blocking the caller.

See the manager's [Note: prefetch needs room first] and [Note: reads chained behind write-backs].

[Note: a partial step takes its prefetches back]
Whether a prefetch starts at an access depends on the worker threads: making room starts an eviction, and if the worker
has finished it by the time room-making looks again (microseconds later, in the same call) the copy starts at once, else
the room is earmarked and the copy starts at the next access. Within a step that is only a lead gained early, and the
next access starts what was earmarked. A step that ends partial (`step_end(keep=False)`: a backward that raised) has no
next access to even it out, and its trace is dropped: the chunks it prefetched for a future that is not coming stayed on
the device or not by that race, marked owed a place (`choose_victim` evicts them last). In 1-5% of runs of
`tests/test_trace_modes.py` (131 of 1,600 looped runs on a busy 2-core machine) the race had filled the device with
them, so the evaluation after it could only start evicting for its first chunk at its `step_begin`, and loaded that
chunk on demand. So where a partial step ends, the manager waits for every move in flight and this file takes back what
was prefetched and not used since: each such chunk returns to the tier it came from (a read from NVMe is clean: it goes
back without a write). The placement after a partial step is then the one its accesses and evictions made, whatever the
threads' timing, and the next step begins with the room it would have after a complete one. Costs: at most the
prefetches of one lead (a few chunks) copied back, on the rare partial step only; a normal step waits for nothing more.
"""

from __future__ import annotations

import logging
from collections import Counter

from hetero.errors import TierOutOfMemoryError
from hetero.memory.chunk import Chunk
from hetero.memory.moves import Mover
from hetero.memory.policy import AccessTrace
from hetero.memory.room import RoomMaker
from hetero.memory.states import ChunkState
from hetero.memory.tier import Tier

log = logging.getLogger("hetero.memory")


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
        # chunk id -> the tier its last prefetch moved it from: where `withdraw` returns it if it was never used
        self.sources: dict[int, Tier] = {}

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
        src = chunk.tier
        room = self.room.make(
            tier, chunk.nbytes, protect | {chunk.id}, blocking=False, horizon=horizon, earmarked=earmarked
        )
        if not room or earmarked > self.room.available(tier, chunk.nbytes) - chunk.nbytes:
            started = self.mover.chain_read(chunk, tier)
        else:
            started = self.mover.start(chunk, tier, blocking=False, prefetch=True, protect=frozenset(protect))
        if started:
            chunk.prefetched = True
            self.sources[chunk.id] = src
            if len(self.sources) > 2 * len(self.chunks):  # ids of freed chunks are never reused: forget them
                self.sources = {cid: t for cid, t in self.sources.items() if cid in self.chunks}
            self.counters["prefetches"] += 1
        return started

    def end_partial(self) -> None:
        """A partial step ends: wait for every move in flight, then `withdraw` ([Note: a partial step takes its
        prefetches back])."""
        try:
            self.mover.synchronize()
        except Exception as e:  # a caller ending a failed step: its error is the one to raise
            log.warning(
                "ending a partial step: a move in flight failed (%s); its chunk stays where it was",
                e,
                extra={"all_ranks": True},
            )
        self.withdraw()

    def withdraw(self) -> None:
        """Return every chunk prefetched and not used since to the tier it came from, each move waited for; see
        [Note: a partial step takes its prefetches back]. Call with no move in flight. Best effort: a chunk that cannot
        go back (held, or no room there) stays where it is, no longer owed a place."""
        sources, self.sources = self.sources, {}
        for cid, src in sorted(sources.items()):  # by id: the same order whatever order the prefetches started in
            chunk = self.chunks.get(cid)
            if chunk is None or not chunk.prefetched:
                continue  # used since (or evicted, or freed): it was no wasted prefetch
            chunk.prefetched = False
            if chunk.state is not ChunkState.RESIDENT or chunk.tier is None or src <= chunk.tier:
                continue
            if not chunk.movable:
                continue  # held where it is (pinned, computed on, a copy landing in it)
            try:
                self.mover.start(chunk, src, blocking=True, inline=True)
                self.mover.wait(chunk)
            except TierOutOfMemoryError:
                continue  # its old tier filled up since: it stays, an ordinary victim now
            except Exception as e:  # the caller is ending a failed step: its error, not this one, is the story
                log.warning(
                    "taking back the prefetch of %s failed (%s); it stays where it is",
                    chunk.describe(),
                    e,
                    extra={"all_ranks": True},
                )
                continue
            self.counters["prefetches_withdrawn"] += 1
