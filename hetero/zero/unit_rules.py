"""What the budgets allow ZeRO-3's gathers (`hetero/zero/gathers.py`), agreed by every rank (`unit_rules`), and the
peak the estimator counts under those rules (`gathered_peak`).

[Note: the host's part of gathering ahead, agreed]
Whether gathers read shards through host memory follows from the parameters' placement, which is each rank's
own (`offload` is a per-rank key: [Note: one config for every rank] in hetero/config_ranks.py). So each rank
judges its own host budget against its own shards read through the host, and the ranks agree on every rank's
verdict; the device's part takes the smallest device budget as before. Each rank used to compare the smallest host
budget with its own shards: two ranks at stage 3, one with its parameters on the host (a host budget under three
of its largest unit's shards) and one with them on the device, decided apart, so the second gathered ahead and
the first did not: at the first forward one gathered chunk 1 where the other gathered chunk 0 (a
CollectiveMismatchError with the checks on; with them off both ranks waited in the first backward's reduce-scatter
until comm_timeout). tests/test_placements_apart.py.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import torch

from hetero.comm import Comm
from hetero.memory import Tier
from hetero.zero.units import Unit

if TYPE_CHECKING:
    from hetero.zero.zero_chunk import ZeroChunk

KEEP_UNITS = 2  # units left gathered at the end of forward (the first ones backward needs), where memory allows


def gathered_peak(units: list[list[int]], nbytes: dict[int, int], keep: int, *, ahead: bool = False) -> int:
    """The most bytes gathered at once when `units` (each a list of chunk indices) run forward in order and backward
    in reverse, under the rules of `Gathers` (ahead: each unit's start gathers the next one's chunks): what the
    estimator counts for a stage-3 step."""
    users: dict[int, set[int]] = {}
    for u, chunks in enumerate(units):
        for c in chunks:
            users.setdefault(c, set()).add(u)
    gathered: set[int] = set()
    peak = 0
    for order, windowed in ((range(len(units)), True), (range(len(units) - 1, -1, -1), False)):
        done: set[int] = set()
        window: deque[int] = deque()
        for u in order:
            gathered.update(units[u])
            after = u + (1 if windowed else -1)
            if ahead and 0 <= after < len(units):
                gathered.update(units[after])
            peak = max(peak, sum(nbytes[c] for c in gathered))
            done.add(u)
            if windowed:
                window.append(u)
                ending = [window.popleft()] if len(window) > keep else []
            else:
                ending = [u]
            kept = {c for w in window for c in units[w]} if windowed else set()
            for e in ending:
                gathered -= {c for c in units[e] if c not in kept and users[c] <= done}
        gathered.clear()  # the end of backward releases everything
    return peak


class UnitRules(NamedTuple):
    """What the budgets allow the gathers, the same on every rank (`unit_rules`)."""

    keep: int  # units left gathered after forward
    whole: bool  # a unit's backward pins all of its parameters at once
    ahead: bool  # the next unit's gathers are issued as a unit starts ([Note: gathering ahead])


def unit_rules(
    units: list[Unit], comm: Comm, device_budget: int, *, ahead: bool = True, host_budget: int | None = None
) -> UnitRules:
    """How many units stay gathered after forward (keep), whether a unit's backward pins all of its parameters at
    once (whole, [Note: one backward hook per unit]) and whether the next unit is gathered ahead (ahead, [Note:
    gathering ahead]), all from the smallest device budget of the group and every rank's own host memory (and
    `ahead` from every rank's wish), agreed by a collective, so the same on every rank (each changes when gathers are
    issued).

    keep: KEEP_UNITS where that budget holds them and the largest unit besides, with half as much again to spare,
    else none (gathered chunks that do not fit would only be moved to the host and back). whole: where it holds the
    largest unit pinned and two chunks' gradient buffers, with half as much again to spare; else each module pins
    its own parameters in its backward, and a unit's other chunks may be moved away meanwhile. ahead: see
    `ahead_fits` ([Note: the host's part of gathering ahead, agreed])."""
    shards = max((sum(_shard_via_host(zc) for zc in u.chunks) for u in units), default=0)
    host_ok = ahead_fits([], 0, None, host_shards=shards, host_budget=host_budget)  # this rank's own part
    agreed = torch.tensor([device_budget, int(ahead and host_ok)], dtype=torch.int64)
    comm.control.all_reduce(agreed, op="min")
    smallest, every_rank_fits = (int(v) for v in agreed.tolist())  # every rank wished it and its host fits
    sizes = sorted((sum(zc.full.nbytes for zc in u.chunks) for u in units), reverse=True)
    grads = max((4 * zc.spec.capacity for u in units for zc in u.chunks), default=0)  # fp32 per micro-batch
    keep = KEEP_UNITS if smallest >= 1.5 * sum(sizes[: KEEP_UNITS + 1]) else 0
    whole = bool(sizes) and smallest >= 1.5 * (sizes[0] + 2 * grads)
    return UnitRules(keep, whole, bool(every_rank_fits) and ahead_fits(sizes, keep, smallest))


def _shard_via_host(zc: ZeroChunk) -> int:
    """The bytes of `zc`'s shard a gather reads through host memory on this rank, from its placement (where the
    shard sits now is the rank's own too: `param_gather.readable` decides from that as it gathers)."""
    if zc.shard is None:
        return 0
    gloo_reads_host = zc.device.separate_memory and not zc.comm.needs_device_tensors
    return zc.shard.nbytes if zc.placement.params is not Tier.DEVICE or gloo_reads_host else 0


def ahead_fits(
    sizes: list[int], keep: int, budget: int | None, *, host_shards: int = 0, host_budget: int | None = None
) -> bool:
    """Whether the budgets hold what gathering ahead keeps at once: on the device, the units kept after forward, the
    one running and the one after it (`sizes`: every unit's gathered bytes, largest first), with half as much again
    to spare; and where gathers read their shards through host memory, the host holds three of the largest unit's
    shards (`host_shards`: the one being read, the one in flight, and room for everything else to move)."""
    device_ok = budget is None or budget >= 1.5 * sum(sizes[: keep + 2])
    return device_ok and (host_budget is None or host_budget >= 3 * host_shards)
