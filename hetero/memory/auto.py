"""Automatic placement: the device holds as many chunks as its budget allows next to the activations of the step.

[Note: automatic placement]
With `"offload": "auto"` chunks live on the device until the device tier needs their room, and are evicted to the
host (then NVMe) by the manager's usual policy. What changes is the device tier's budget: it is set, moment by
moment, to

    budget - (memory that is not model data at this moment of the step) - margin

where a moment is a chunk access (the manager's "access" hook point), and on the CPU also every tensor autograd
saves for backward. The first step is the warm-up: it records the non-model memory at each access. Later steps use
the recorded profile, looking a few accesses ahead (the prefetch horizon), so chunks are evicted before the
activations need the room rather than when they already do; where a step needs more than the profile says (longer
sequences), the moment's own measurement wins, the profile is raised, and more is evicted at once: the budget never
runs out because of a step larger than the warm-up.

What "non-model memory" is, by device:
  - CUDA: the caching allocator's allocated bytes minus the bytes the device ledger holds (chunk buffers, cached
    ones included): activations, temporaries, gradients not yet in their chunk, anything the model allocates.
  - CPU (the "device" tier is RAM shared with everything else): the bytes of tensors autograd holds for backward,
    counted through saved-tensor hooks while the engine's forward runs (each storage once, chunk memory left out,
    released when autograd frees them). Temporaries between two saves are not seen.

The margin is measured too: 10% of the largest non-model memory seen so far (so a step a little larger than the
profile is absorbed before the next measurement), plus on CUDA the allocator's fragmentation at the warm-up's peak
(reserved minus allocated bytes). The budget never drops below twice the largest chunk, the least a step can run
in; a user budget smaller than that plus the activations cannot be honoured, and is logged.

The budget so set is a target, not a limit: where the chunks a unit computes on at once (its weights, their gradient
buffers, a shared norm's chunk) need more than the target leaves, the request raises it, as far as the whole budget
(the device ledger's `ceiling`), and the next moment sets it again. A hard limit failed the step: on one H200 a
tiny model under a budget of 400 of its 16 KiB chunks had a target of 6 beside what CUDA counted as not model data
(the allocated bytes the chunks do not hold, and the margin), and a layer's backward needed 7 at once; on the CPU a
budget of 16 chunks beside 4 rows' activations did the same.

[Note: a target the tiers below cannot hold]
Every chunk the device does not hold lives on the host (or NVMe). Where the tiers below cannot hold all that the
device sheds for the activations, lowering the target only moved the failure: with `"optimizer": "auto"` at stage 0,
a 640 KiB model under 640 KiB of device budget and 64 KiB of host built and ran its forward and backward, and the
first update failed halfway (some chunks stepped, others not) when an optimizer chunk coming up to the device had to
swap with one going down into a full host tier. So the target never drops below what the tiers below cannot hold
(what all tiers hold now less the host's and NVMe's budgets), and a request whose victim the tiers below refuse (a
chunk on its way up still holds its room below) raises the target towards the whole budget instead of failing
(room.py; a prefetch does not). The device then holds more than its target beside
the activations: where that passes the whole device budget, a warning names the host or device budget that keeps
within it. Only where the chunks themselves exceed the device's and the lower tiers' budgets together does a step
fail, at the build or in the first forward or backward (the first request that finds no room), before any weight
changes, with a host budget that holds them (room.py's [Note: the budget that would have been enough]).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator

import torch

from hetero.config import format_size
from hetero.device import Device
from hetero.memory.manager import ChunkManager
from hetero.memory.tier import Tier

log = logging.getLogger("hetero.memory")

MARGIN_FRACTION = 0.1  # of the largest non-model memory seen: the margin kept free of chunks


class _Held:
    """A saved tensor, counted while autograd holds it (see AutoPlacement.saved_tensors)."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: int, owner: AutoPlacement) -> None:
        self.tensor = tensor
        self.key = key  # storage pointer, or 0 when not counted
        self.owner = owner

    def __del__(self) -> None:
        if self.key:
            self.owner.release_saved(self.key)


class AutoPlacement:
    """Sets the device tier's budget moment by moment; see [Note: automatic placement]."""

    def __init__(self, manager: ChunkManager, device: Device, *, prefetch_depth: int) -> None:
        self.m = manager
        self.device = device
        self.ledger = manager.ledgers[Tier.DEVICE]
        self.budget = self.ledger.budget  # the device tier's whole budget; chunks get what the step leaves
        self.horizon = prefetch_depth + 2  # accesses to look ahead in the profile
        self.profile: list[int] = []  # non-model bytes at each access of a step (the highest seen)
        self.pos = 0  # index of the next access in the step
        self.steps = 0  # steps begun
        self.peak_nonmodel = 0  # largest non-model bytes measured
        self.fragmentation = 0  # CUDA: reserved - allocated at the warm-up's peak
        self.worst = 0  # largest ledger bytes + non-model bytes seen at any moment (should stay <= budget)
        self._saved: dict[int, list[int]] = {}  # CPU: storage pointer -> [nbytes, holders]
        self._saved_bytes = 0  # CPU: bytes of those storages
        self._chunk_ptrs: dict[int, weakref.ref] = {}  # storage pointer -> chunk memory, refreshed at each access
        chunk_bytes = [c.nbytes for c in manager.chunks]
        self.largest = max(chunk_bytes, default=0)
        self.floor = 2 * self.largest  # the least device budget a step can run with
        self.warned = False  # the warning that what the device keeps leaves the activations too little room: once
        self.ledger.ceiling = self.budget  # a unit needing more than the target raises it: see the Note
        manager.events.subscribe("access", self._before_access)
        manager.events.subscribe("step_begin", self._step_begin)

    # ---- measurement --------------------------------------------------------------------------------------
    def nonmodel(self) -> int:
        """Bytes on the device that are not chunks, now."""
        if self.device.is_cuda:
            return max(0, self.device.allocated_bytes() - self.ledger.used)
        return self._saved_bytes

    @property
    def margin(self) -> int:
        return int(MARGIN_FRACTION * self.peak_nonmodel) + self.fragmentation

    @contextlib.contextmanager
    def saved_tensors(self) -> Iterator[None]:
        """Count what autograd saves for backward (the CPU measurement); wraps the engine's forward."""
        if self.device.is_cuda:
            yield  # the allocator's own statistics are exact there
            return
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, t: torch.Tensor) -> _Held:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if not key or self._is_chunk_memory(key) or t.device != self.device.torch_device:
            return _Held(t, 0, self)
        entry = self._saved.get(key)
        if entry is None:
            self._saved[key] = [storage.nbytes(), 1]
            self._saved_bytes += storage.nbytes()
            self._moment(None)
        else:
            entry[1] += 1
        return _Held(t, key, self)

    def _is_chunk_memory(self, key: int) -> bool:
        # The map is from the last access; a chunk freed since may have left its address to an activation, so the
        # chunk must still hold that storage now.
        ref = self._chunk_ptrs.get(key)
        t = ref() if ref is not None else None
        return t is not None and t.untyped_storage().data_ptr() == key and t.untyped_storage().nbytes() > 0

    def release_saved(self, key: int) -> None:
        entry = self._saved.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._saved[key]
            self._saved_bytes -= entry[0]

    # ---- the budget ---------------------------------------------------------------------------------------
    def _step_begin(self) -> None:
        self.steps += 1
        self.pos = 0

    def _before_access(self) -> None:
        if not self.device.is_cuda:
            self._chunk_ptrs = {
                t.untyped_storage().data_ptr(): weakref.ref(t)
                for c in self.m.chunks
                for t in (c.payload, c.kept)
                if t is not None and t.device == self.device.torch_device
            }
        self._moment(self.pos)
        self.pos += 1

    def _moment(self, pos: int | None) -> None:
        now = self.nonmodel()
        if now > self.peak_nonmodel:
            self.peak_nonmodel = now
            if self.device.is_cuda and self.steps <= 1:
                self.fragmentation = max(0, self.device.reserved_bytes() - self.device.allocated_bytes())
        expect = now
        if pos is not None:
            if pos >= len(self.profile):
                self.profile.extend([0] * (pos + 1 - len(self.profile)))
            self.profile[pos] = max(self.profile[pos], now)  # a larger step raises the profile for the next
            if self.steps > 1:  # after the warm-up: make room ahead of what the next accesses will need
                expect = max(expect, max(self.profile[pos : pos + self.horizon]))
        target = self.budget - expect - self.margin
        # Never below two chunks, nor below what the tiers below cannot hold ([Note: a target the tiers below cannot
        # hold]).
        kept = self.kept_on_device()
        floor = max(self.floor, kept)
        if target < floor:
            if floor < self.budget:
                log.debug("auto placement: %d B of activations leave less than %d B of room for chunks", expect, floor)
            if kept > self.floor and kept + expect + self.margin > self.budget and not self.warned:
                self._warn(kept, expect)
            target = min(floor, self.budget)
        if target != self.ledger.budget:
            self.m.set_budget(Tier.DEVICE, target)
        self.worst = max(self.worst, self.ledger.used + now)

    def kept_on_device(self) -> int:
        """Bytes of chunks the device must hold now whatever the activations: what the tiers below cannot ([Note: a
        target the tiers below cannot hold])."""
        ledgers = self.m.ledgers
        held = sum(ledgers[t].current for t in Tier)
        return max(0, held - ledgers[Tier.HOST].budget - ledgers[Tier.NVME].budget)

    def _warn(self, kept: int, expect: int) -> None:
        self.warned = True
        host = self.m.ledgers[Tier.HOST].budget
        short = kept + expect + self.margin - self.budget
        log.warning(
            'offload "auto": the host tier%s holds at most %s of chunks, so the device keeps %s of them beside '
            "%s of this step's activations, more than memory.device_budget = %s. The step runs over the device budget"
            " by %s; to stay within it, raise memory.host_budget to at least %s or memory.device_budget to at least"
            " %s%s",
            " and NVMe" if self.m.store is not None else "",
            format_size(host + self.m.ledgers[Tier.NVME].budget),
            format_size(kept),
            format_size(expect),
            format_size(self.budget),
            format_size(short),
            format_size(host + short),
            format_size(self.budget + short),
            "" if self.m.store is not None else ", or set memory.nvme_dir to spill to NVMe",
        )

    def stats(self) -> dict[str, int]:
        """For memory_stats(): the whole device budget, the chunks' share now, and what was measured."""
        return {
            "device_budget": self.budget,
            "chunk_budget_now": self.ledger.budget,
            "peak_nonmodel": self.peak_nonmodel,
            "margin": self.margin,
            "worst_total": self.worst,
        }


def _unpack(held: _Held) -> torch.Tensor:
    return held.tensor
