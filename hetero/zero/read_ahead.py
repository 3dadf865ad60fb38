"""How far the update reads the next chunks' gradients and states ahead of the one stepping (states on NVMe)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetero.memory import Tier

if TYPE_CHECKING:
    from hetero.memory import ChunkManager
    from hetero.zero.zero_chunk import ZeroChunk

LOOKAHEAD = 2  # chunks whose optimizer states are read ahead of the one stepping (NVMe offload), at most
AHEAD_BYTES = 256 << 20  # and no further chunk once this much is read ahead ([Note: how far the update reads ahead])
ROOM = 0.85  # of the compute tier's budget, at most, for the chunks stepping and read ahead


# [Note: how far the update reads ahead]
# Reading ahead hides a chunk's read behind the step of the one before; it needs one chunk's worth of disk time, not
# more. Two chunks ahead at any size held the host memory of both and gained nothing once chunks are large: with
# 426 MB of states a chunk (218M parameters in 6 chunks, bf16, `benchmarks/update_stream.py`), one chunk ahead took
# the update from 3.70 to 3.02 s and the host tier's peak from 3.27 to 2.83 GB on the development VM (one run each,
# the math on its 2 cores). A quarter GiB is a tenth of a second of a 2-3 GB/s disk: small chunks still read two ahead.
# Writes first (the NVMe store's default since) did not change that: two chunks ahead again, three alternating runs
# each, drained the update in 2.97-3.99 s against 2.54-2.80 s with a host tier peak of 2.98 against 2.53 GB.


def read_ahead(manager: ChunkManager, order: list[ZeroChunk], i: int, tier: Tier) -> None:
    """Bring chunk order[i]'s gradient and states, and as many of the next ones' as the rules above allow, to `tier`
    (order: the chunks in the order they step)."""
    # Chunk i first, then as many of the next LOOKAHEAD as leave the tier room to spare (a read ahead that crowds
    # out the chunk stepping now is evicted again before its use).
    room = int(manager.ledgers[tier].budget * ROOM)
    ahead: list[ZeroChunk] = []
    further = 0  # bytes read ahead beyond chunk i
    for zc in order[i : i + 1 + LOOKAHEAD]:
        size = zc.grad.nbytes + zc.optim.nbytes + (zc.shard.nbytes if zc.shard is not None else 0)
        room -= size
        if ahead and (room < 0 or further >= AHEAD_BYTES):
            break
        further += size if ahead else 0
        ahead.append(zc)
    # The update reads the shard of a master that follows it ([Note: the master follows the shard]): read it too.
    wanted = [c for zc in ahead for c in (zc.grad, zc.optim, zc.shard if zc.master_follows else None) if c]
    # Every gradient still to be used stays: evicting one for a read ahead would write it only to read it back.
    later = [zc.grad for zc in order[i + len(ahead) :]]
    manager.prefetch(wanted, tier, keep=wanted + later)


# [Note: the first states read in backward]
# With states on NVMe the exact update used to start its first read when it began: its first chunk waited a whole read
# (and the second and third, read behind it, most of theirs) while the cores idled, since nothing else was left to
# run. Those reads start with the backward before the update instead, under the same rules as the update's own
# (chunk i and what LOOKAHEAD and AHEAD_BYTES allow after it), so that the disk works while backward computes; while
# the trace replays, the prefetch evicts only what is used after those states, never what backward still needs. One
# rank of the race's 22.6M Llama (`benchmarks/step_time.py --with-nvme`) waited 1.39 s for states over six steps
# before, 0.19 s after; two ranks 0.3 s a round a rank before, 0.17 s after, the step unchanged on the 2-core VM, whose
# cores the ranks' compute fills either way (a rank waiting leaves its core to the other). On a GPU the wait is idle.
# Local reads only: which chunks are read, and when, decides no collective. Not with `update_in_backward`, which
# reads its own first states as backward starts, nor the delayed update, which steps during the next forward.


def states_in_backward(manager: ChunkManager, order: list[ZeroChunk]) -> None:
    """The backward before an exact update begins: start reading the states of the first chunks (in `order`, as
    they will step) whose states live on NVMe ([Note: the first states read in backward])."""
    for i, zc in enumerate(order):
        if zc.placement.optim is Tier.NVME:
            read_ahead(manager, order, i, zc.placement.compute)
            return
