"""Making room on a tier: free cached buffers, wait for moves leaving it, evict the chunk used furthest ahead.

See the manager's [Note: making room]. Victims are chosen by `policy.choose_victim` (the trace's OPT order, else LRU);
a victim whose tensors are all FREE is released instead of copied, and on NVMe only a swap copy that is not a
chunk's only copy can go.
"""

from __future__ import annotations

from collections import Counter

from hetero.config import format_size
from hetero.errors import TierOutOfMemoryError
from hetero.memory.chunk import Chunk
from hetero.memory.moves import Mover
from hetero.memory.policy import AccessTrace, choose_victim
from hetero.memory.states import ChunkState
from hetero.memory.storage import Storage
from hetero.memory.tier import Tier

_RAISE = {Tier.DEVICE: "memory.device_budget", Tier.HOST: "memory.host_budget", Tier.NVME: "memory.nvme_budget"}
_CHUNKS = (
    'or a smaller chunk_size (or "auto", which sizes chunks by the budgets): a weight larger than a chunk is split '
    "into tiles and computed on tile by tile where its layer is a Linear, Embedding or Conv1D (config tiling)"
)


class RoomMaker:
    """Frees bytes on a tier for a request, evicting one tier down as needed."""

    def __init__(
        self, storage: Storage, mover: Mover, chunks: dict[int, Chunk], trace: AccessTrace, counters: Counter[str]
    ) -> None:
        self.storage = storage
        self.mover = mover
        self.chunks = chunks  # the manager's live chunks, by id
        self.trace = trace
        self.counters = counters

    def make(
        self,
        tier: Tier,
        nbytes: int,
        protect: set[int] | frozenset[int],
        *,
        blocking: bool,
        horizon: float | None = None,
        earmarked: int = 0,
    ) -> bool:
        """Make nbytes free on the tier (see [Note: making room]).

        Non-blocking: start evictions and return whether the room is there now. horizon: only evict chunks next
        used later than this many accesses ahead. earmarked: bytes already on their way out that belong to other
        prefetches, so this one must free its own on top.
        """
        ledger = self.storage.ledgers[tier]
        mover = self.mover
        if nbytes > ledger.budget:
            if not blocking:
                return False  # a prefetch is a wish: the access that needs the chunk raises, naming it
            if not self._rise(tier, nbytes):
                raise self.oom(tier, nbytes, extra="the request alone exceeds the budget", protect=protect)
        while self.available(tier, nbytes) < nbytes:
            if mover.poll():
                continue
            if ledger.cached:
                self.storage.pools[tier].trim(nbytes - ledger.free)
                continue
            leaving = mover.leaving(tier)
            if self.available(tier, nbytes) + sum(c.nbytes for c in leaving) < nbytes + earmarked:
                try:
                    if self._evict_one(tier, protect, horizon, blocking):  # not enough on its way out: one more
                        continue
                except TierOutOfMemoryError:
                    # The tiers below cannot take the victim: a target budget rises over it instead ([Note: a
                    # target the tiers below cannot hold]); a limit fails with their error, a prefetch (a wish,
                    # which no target rises for) waits for its access.
                    if not blocking:
                        return False
                    if not self._rise(tier, nbytes):
                        raise
                    continue
                if not leaving:
                    if not blocking:
                        return False
                    # What is left is arriving (prefetches, reads chained into handed-off buffers): once in, it
                    # can be evicted.
                    arriving = mover.arriving(tier)
                    landing = [c for c, *_ in mover.landing.values() if c.tier is tier]
                    if not arriving and landing:
                        mover.land(landing[0])  # a copy writing into it pins it; once it lands it can go
                        continue
                    if not arriving:
                        if self._rise(tier, nbytes):
                            continue
                        raise self.oom(tier, nbytes, protect=protect)
                    mover.wait(arriving[0])
                    continue
            if not blocking:
                return False  # room is on its way; a later call tries again
            mover.wait(leaving[0])
        return True

    def _rise(self, tier: Tier, nbytes: int) -> bool:
        """A target budget below what the chunks being computed on need, with the request: raise it towards the
        ledger's ceiling (the whole budget). False where the budget is a limit or already at its ceiling."""
        ledger = self.storage.ledgers[tier]
        ceiling = ledger.ceiling
        if ceiling is None or ledger.budget >= ceiling:
            return False
        ledger.budget = min(ceiling, max(ledger.budget, ledger.used + nbytes))
        self.counters["budget_raised"] += 1
        return True

    def _evict_one(self, tier: Tier, protect: set[int] | frozenset[int], horizon: float | None, blocking: bool) -> bool:
        """Start evicting one chunk from the tier; False if none can go."""
        if tier is Tier.NVME:
            victim = self._nvme_victim(protect)
            if victim is None:
                return False
            self.storage.drop_nvme_copy(victim)
            return True
        victim = self._victim(tier, protect, horizon)
        if victim is None:
            return False
        if victim.all_free:
            self.storage.drop_payload(victim)
            self.counters["released"] += 1
            return True
        return self.mover.start(victim, tier.below, blocking=blocking, protect=frozenset(protect))

    def available(self, tier: Tier, nbytes: int) -> int:
        """Bytes a request of nbytes can have now: free budget, or a cached buffer of exactly its size."""
        pool = self.storage.pools.get(tier)
        free = self.storage.ledgers[tier].free
        if pool is not None and pool.has_cached(nbytes):
            return max(nbytes, free)
        return free

    def leaving_bytes(self, tier: Tier) -> int:
        return sum(c.nbytes for c in self.mover.leaving(tier))

    def _victim(self, tier: Tier, protect: set[int] | frozenset[int], horizon: float | None) -> Chunk | None:
        candidates = [
            c
            for c in self.chunks.values()
            if c.state is ChunkState.RESIDENT and c.tier == tier and c.movable and c.id not in protect
        ]
        if horizon is not None:
            candidates = [c for c in candidates if self.trace.next_use(c.id) > horizon]
        return choose_victim(candidates, self.trace)

    def _nvme_victim(self, protect: set[int] | frozenset[int]) -> Chunk | None:
        """A swap copy that is not the chunk's only copy (it is resident above): dropping it loses nothing."""
        copies = [
            c
            for c in self.chunks.values()
            if c.on_nvme and c.tier is not Tier.NVME and not c.moving and c.id not in protect
        ]
        return min(copies, key=lambda c: (not c.dirty, c.last_access), default=None)

    def oom(
        self, tier: Tier, nbytes: int, extra: str = "", protect: set[int] | frozenset[int] = frozenset()
    ) -> TierOutOfMemoryError:
        """The error for a request the tier cannot hold: what it was for, what holds the tier, the budget that would
        have been enough, and what to do."""
        ledger = self.storage.ledgers[tier]
        staging = tier is Tier.HOST
        holders = sorted(
            (
                c
                for c in self.chunks.values()
                if c.tier == tier
                or (c.move is not None and (c.move.dst == tier or (staging and c.move.staging is not None)))
            ),
            key=lambda c: -c.nbytes,
        )
        # The chunk asking: a protected one of the request's size (a caller protects what it makes room for), one
        # not on the tier yet first: what a request protects on the tier (the chunk an eviction makes room for, on
        # its way up) is not what it asks room for.
        asking = [self.chunks[i] for i in protect if i in self.chunks and self.chunks[i].nbytes == nbytes]
        asking.sort(key=lambda c: (c.tier == tier and c.state is ChunkState.RESIDENT, c.moving, -c.id))
        asking = asking[:1]
        what = f" for {asking[0].describe()}" if asking else ""

        def why(c: Chunk) -> str:
            if c.computing:
                return "being computed on"
            if c.pins:
                return "pinned"
            if c.id in protect:
                return "needed by this request"
            return "moving" if c.moving else "resident"

        lines = [f"  {c.describe()} ({why(c)})" for c in holders[:8] if c not in asking]
        if len(holders) > 8:
            lines.append(f"  ... and {len(holders) - 8} more chunks")
        # What could not make room: chunks that cannot move, and those this very request keeps where they are.
        stuck = [c for c in holders if (not c.movable or c.id in protect) and c not in asking]
        # And what the step needs beside this moment ([Note: the budget that would have been enough]).
        kept = {c.kind for c in holders if c.computing and not c.transient}
        if tier is Tier.DEVICE and asking and asking[0].kind == "param" and not asking[0].transient:
            kept.add("param")  # the first request of a step: [Note: the budget that would have been enough]
        counted = {c.id for c in (*stuck, *asking)}
        coming = [c for c in self.chunks.values() if c.kind in kept and not c.transient and c.id not in counted]
        largest = max([nbytes, *(c.nbytes for c in holders)])
        enough = max(nbytes + sum(c.nbytes for c in (*stuck, *coming)) + (2 * largest if kept else 0), 2 * largest)
        # Never below what the tier holds now and the request: nothing more could go ([Note: the host's figure]).
        enough = max(enough, ledger.used + nbytes)
        if tier is Tier.HOST and self.storage.store is None:
            # The asking chunk is EMPTY too, and already counted as the request.
            pending = sum(
                c.nbytes
                for c in self.chunks.values()
                if c.state is ChunkState.EMPTY and not c.transient and c not in asking
            )
            enough = max(enough, ledger.used + nbytes + pending + largest)
        advice = [
            f"raise {_RAISE[tier]} to at least {format_size(enough)} (the request, what could not move and what the "
            "step computes on beside it)"
        ]
        if tier is Tier.DEVICE:
            advice.append("offload more to 'host'/'nvme'")
        if tier is Tier.HOST and self.storage.store is None:
            advice.append("set memory.nvme_dir to spill to NVMe")
        if tier is Tier.NVME:
            advice.append("free space in memory.nvme_dir")
        elif nbytes * 4 > ledger.budget:
            advice.append(_CHUNKS)  # one request is a large part of the budget: smaller chunks are the answer
        msg = (
            f"{tier.label} tier out of memory: needed {format_size(nbytes)} ({nbytes} B){what} with "
            f"{format_size(ledger.used)} held of a {format_size(ledger.budget)} budget"
            f"{'; ' + extra if extra else ''}. Nothing more can be evicted. Held by:\n"
            + ("\n".join(lines) if lines else "  (no chunks: cached buffers only)")
            + f"\nA budget of {format_size(enough)} would have been enough at these chunk sizes (the largest "
            f"{format_size(largest)}{self._pinned()}). To fix: {', '.join(advice)}."
        )
        return TierOutOfMemoryError(msg, tier=tier.label, needed=nbytes, held=ledger.used, budget=ledger.budget)

    def _pinned(self) -> str:
        """Where chunk_size "auto" sized the chunks from this budget: the size to keep with the figure ([Note: a
        figure at the chunk size it was counted at])."""
        chosen = self.storage.auto_chunk_numel
        if chosen is None:
            return ""
        return (
            f'; chunk_size "auto" chose {chosen} elements from this budget and would choose larger chunks from a '
            f"larger one, so set chunk_size: {chosen} with the larger budget for the figure to hold"
        )


# [Note: the host's figure]
# Without NVMe nothing leaves the host: whatever it holds stays, so the figure above (the request, what could not move
# and what is computed on) named budgets below the one that failed: 96 KiB for a 128 KiB host tier full of evicted
# optimizer chunks under `"optimizer": "auto"`. There the figure is what it holds, the request, the chunks the step has
# not allocated yet (gradient buffers arrive in the backward, wherever they go), and one chunk of room for a move on
# its way through; under automatic placement the device keeps what the host cannot beyond that ([Note: a target the
# tiers below cannot hold]), so the figure runs (tests/test_auto_budgets_host.py). Every tier's figure is at least
# what it holds and the request.


# [Note: a figure at the chunk size it was counted at]
# The figure counts the chunks as they are. Under chunk_size "auto" their size follows the budgets (at most what the
# budgets hold with room to spare), so the larger budget brought larger chunks, and the figure, right for the old
# ones, fell short again: stage 2 at 1, 4 and 12 KiB named 120 KiB, which failed at its larger chunks, and then 160 KiB.
# The size "auto" chose is kept on the storage (the engine sets it) and the message says to set it with the figure,
# which then runs at the first try (tests/test_budget_hints.py).


# [Note: the budget that would have been enough]
# The error is raised at the first moment the tier runs out, so "this request and what could not move" is what that
# moment needs, not the step: at 1 KiB the example's first request (a 4 KiB shard) failed with nothing held, and at
# the 4 KiB that figure named, a later moment (a layer's weight tile while its bias's chunk was computed on) needed
# 8 KiB. So the figure counts besides:
#   - two of the largest chunks: a step computes on a chunk while the next comes in (a module's weight and bias in
#     two chunks, a shard and its gathered chunk); the least `memory/auto.py` keeps its target above;
#   - where chunks that stay allocated (not transient) are computed on, every chunk of their kind and two of the
#     largest chunks besides: such chunks are computed on from the forward to the backward (stages 0-2 keep all
#     parameters on the device), so the rest of the forward brings the others, and the backward its gradient
#     buffers beside them. At the first request of a step nothing is computed on yet: there a parameter chunk that
#     stays allocated, asked for on the device, is the first of those (stages 0-2; ZeRO-3's shards kept on the
#     device), so its kind counts as well (at 1 KiB, stages 0-2 named 8 KiB before, where the step needed 120 KiB).
# With chunk_size "auto" the budget sizes the chunks too: a larger budget gives larger ones, at most what
# `chunk_size.budget_cap` lets its working set take of half of it. Under ZeRO-3 that keeps two of them within a
# quarter of the new budget, so the figure holds (tests/test_budget_hints.py); below the 1024-element floor the size
# does not change at all. Stages 0-2 hold every parameter on the device, whose padding may grow with the chunks
# (stage 2's automatic size follows the device budget): there the figure holds at the chunk size it names.
