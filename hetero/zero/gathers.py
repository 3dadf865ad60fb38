"""ZeRO-3's gathers: when each unit's chunks are gathered, pinned and released, by the rules of [Note: every rank
in step] (`hetero/zero/protocol.py`); and the rules the budgets set for them, agreed by every rank (`unit_rules`)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from hetero.comm import Comm
from hetero.errors import HeteroError
from hetero.memory import TensorState
from hetero.zero import backwards
from hetero.zero.protocol import BACKWARD, FORWARD, GATHER, GATHER_AHEAD, Checker, in_backward
from hetero.zero.turns import TileTurns
from hetero.zero.units import Entry, Unit

if TYPE_CHECKING:
    from hetero.zero.tiling import TileRunner
    from hetero.zero.zero_chunk import ZeroChunk

log = logging.getLogger("hetero.zero")

# [Note: gathering ahead]
# A gather issued as its unit starts stands between two units' compute: on a GPU, NCCL's stream starts it only after
# the kernels queued before it, and the unit's first kernel waits for its end. Where every rank's device budget holds
# one more unit gathered (`unit_rules`: the units kept after forward, the one running and the next, with half as much
# again to spare), a unit's start issues the gathers of the next unit without waiting (forward: the next in module
# order; backward: the one before), and the first use of each chunk (`ZeroChunk.unshard`) completes it, so the
# transfer runs beside this unit's compute, as FSDP2's prefetch does. Which gathers go out depends only on the unit
# that started and on `gathered`, both shared state: every rank issues the same ones in the same order, each checked
# like any other ([Note: every rank in step]). Module order is a guess at what runs next; a model that runs its
# blocks in another order only gathers early (more memory held for a while, never a mismatch). A chunk in flight
# keeps its shard and its full buffer pinned where they are (`hetero/zero/param_gather.py`), and a release
# completes it first (so does anything else that reads, moves or writes that shard: the delayed update filling its
# master during forward, `write_shard`), which also bounds the host memory it holds: where gathers read their shards
# through host memory, gathering ahead needs every rank's host budget to hold three of the largest unit's shards
# (`ahead_fits`). One rank gathers nothing: the "gather" of a shard in host memory is a copy to the device, which,
# issued ahead, runs on the copy stream, and the compute stream waits for it at the chunk's first use
# (`Device.compute_waits`; before, the copy ran on the compute stream between two units' kernels: 32 ms a step on
# one H200 with the parameters in host memory, benchmarks/README.md, 2026-11-26). Tiles are never gathered ahead:
# each is gathered alone while it is computed on. The estimator counts the extra unit (`gathered_peak(ahead=True)`).
# `gather_ahead: false` turns it off. On the 2-core VM it did not change the step (three alternating pairs of the
# step_time race, 2026-11-27): both ranks compute on both cores, and gloo's transfers cost their CPU time wherever
# they fall; not yet measured on a GPU.


class Gathers:
    """Stage 3: gathers and releases chunks at unit events; see [Note: every rank in step].

    Two kinds of events drive it. A unit's start and end (every rank sees the same ones) decide what is gathered:
    every chunk the unit uses, in layout order, by its end at the latest. A module's use of its parameters (which
    a branch may skip on one rank) pins them to the device while it runs, and decides only *when* the gathers
    happen: a module needing chunk k gathers the unit's pending chunks up to k, in order, and the unit's end
    gathers the rest. Every rank therefore issues the same gathers in the same order, each as late as its own
    modules allow, which keeps the device's working set to what runs now rather than the whole unit. A module
    called outside its unit gathers on the spot, and the check covers that too.
    """

    def __init__(
        self,
        units: list[Unit],
        chunks: list[ZeroChunk],
        check: Checker,
        *,
        keep: int,
        may_pin_whole: bool = False,
        ahead: bool = False,
    ) -> None:
        self.units = units
        self.check = check
        self.keep = keep  # units kept gathered after their forward: the same on every rank (see unit_rules)
        self.ahead = ahead  # [Note: gathering ahead]: the same on every rank (see unit_rules)
        # A unit's backward pins all of its parameters ([Note: one backward hook per unit]): from the second backward
        # on, where the budgets allow it (`unit_rules`) and the first backward showed it safe (`learn`).
        self.whole = False
        self._may_pin_whole = may_pin_whole
        self._escaped = False  # a module's backward ran outside its unit's, where its unit's forward had run it
        self._users = {id(zc): [u for u in units if zc in u.chunks] for zc in chunks}  # units using each chunk
        self._window: deque[Unit] = deque()  # units done with forward and still gathered, oldest first
        self._done: dict[int, set[int]] = {FORWARD: set(), BACKWARD: set()}  # unit indices done this step
        self._active: dict[int, int] = {}  # unit index -> calls in progress (a unit may be running twice)
        self._held: dict[int, list[Entry]] = {}  # unit index -> parameters in use in its backward, until it ends
        self._pending: dict[int, list[ZeroChunk]] = {}  # unit index -> its chunks still to gather, in layout order
        self._pinned: dict[int, int] = {}  # unit index -> its forwards in progress that pinned the whole unit
        self._chunks = chunks
        self._groups: dict[int, tuple[list[Entry], list[tuple[ZeroChunk, list[Entry]]]]] = {}  # see _by_chunk
        # When every user of a chunk is done with backward ([Note: reductions at shared points] in protocol.py).
        self.on_done: Callable[[list[ZeroChunk]], None] | None = None  # told at a unit's backward end
        self._watch = {u.index: list(u.chunks) for u in units}  # unit index -> chunks whose users include it
        self._never: set[int] = set()  # chunk ids no unit's end covers (a tile of a module in no unit)
        self._calls: dict[int, int] = {}  # unit index -> forwards this step whose backward will end it
        self._ends: dict[int, int] = {}  # unit index -> its backwards ended this step
        self._endless: set[int] = set()  # units run with autograd whose backward has no end (no input needs a grad)
        self._fwd: list[Unit] = []  # units whose forward is running, innermost last
        self._callers: dict[int, list[Unit]] = {}  # chunk id -> units that ran its module outside its own unit
        self._late: dict[int, list[ZeroChunk]] = {}  # unit index -> chunks of such modules, seen at its end
        self._loose: set[int] = set()  # chunk ids whose module ran outside every unit this step
        self.turns: TileTurns | None = None  # over several ranks: [Note: tile gathers in turns] (`take_turns`)
        self.accumulating = False  # inside engine.backward (or train_batch's): set by `Engine.backward_open`

    # ---- unit events --------------------------------------------------------------------------------------
    def enter_unit(self, unit: Unit, *, backward: bool = False) -> None:
        """A unit starts (forward or a recomputation of it; backward: its backward): every chunk it uses will be
        gathered, in layout order; and the next unit's gathers are issued ([Note: gathering ahead])."""
        if backward and not self.accumulating and backwards.foreign():
            # [Note: a backward through another engine's model]: gathered as for our own, nothing reduced.
            backwards.touched(self, lambda retain_graph: self.release_foreign(retain_graph=retain_graph))
        elif backward and not self.accumulating and torch.is_grad_enabled():
            # [Note: backwards that are not the training one] in tiling.py: a first-order one gathers as the
            # training backward does and reduces nothing; a second derivative would keep released parameters.
            raise HeteroError(
                f"a backward with create_graph=True (a second derivative, as a gradient penalty takes) reached module "
                f"{unit.name or '(root)'!r} of a zero_stage 3 model: the graph it builds keeps the gathered "
                "parameters, which stage 3 releases as each unit's backward ends, so the second derivative would "
                "read released memory. Take it at zero_stage <= 2, where hetero computes it as PyTorch does"
            )
        if self.turns is not None:
            self.turns.begin(unit, backward=backward)
        self._pending[unit.index] = [zc for zc in unit.chunks if not zc.gathered]
        self._active[unit.index] = self._active.get(unit.index, 0) + 1
        phase = BACKWARD if in_backward() else FORWARD
        self.check.started.append((unit.index, phase))
        if phase == FORWARD:
            self._fwd.append(unit)
        if self.ahead:
            after = unit.index + (-1 if phase == BACKWARD else 1)
            if 0 <= after < len(self.units):
                for zc in self.units[after].chunks:
                    if not zc.gathered and not zc.spec.tile:
                        self.check(GATHER_AHEAD, chunk=zc.spec.index, unit=unit.index, phase=phase)
                        zc.start_gather()

    def exit_unit_forward(self, unit: Unit, *, training: bool) -> None:
        self._flush(unit, BACKWARD if in_backward() else FORWARD)
        if self.turns is not None:
            self.turns.end(unit, backward=False)
        self._leave(unit)
        if in_backward():
            return  # a checkpoint's recomputation: the unit's backward releases
        if unit in self._fwd:
            del self._fwd[len(self._fwd) - 1 - self._fwd[::-1].index(unit)]
        self._done[FORWARD].add(unit.index)
        if not training:
            self._release_idle(unit.chunks, FORWARD)
            return
        if unit in self._window:
            self._window.remove(unit)
        self._window.append(unit)
        while len(self._window) > self.keep:
            self._release_idle(self._window.popleft().chunks, FORWARD)

    def exit_unit_backward(self, unit: Unit) -> None:
        self._flush(unit, BACKWARD)
        if self.turns is not None:
            self.turns.end(unit, backward=True)
        for e in self._held.pop(unit.index, []):
            e.chunk.exit(e, TensorState.HOLD_AFTER_BWD)
        self._leave(unit)
        self._done[BACKWARD].add(unit.index)
        self._release_idle(unit.chunks, BACKWARD)
        self._ends[unit.index] = self._ends.get(unit.index, 0) + 1
        if self.on_done is not None:
            seen = self._watch[unit.index] + self._late.get(unit.index, [])
            done = [zc for zc in seen if self._finished(zc)]
            if done:
                self.on_done(done)

    def will_end(self, unit: Unit, *, ends: bool) -> None:
        """A forward of `unit` with autograd on: its backward will end with an event (ends), or never (no input of
        it needs a gradient): a chunk it uses is then reduced at the end of backward."""
        if ends:
            self._calls[unit.index] = self._calls.get(unit.index, 0) + 1
        else:
            self._endless.add(unit.index)

    def take_turns(self, runner: TileRunner) -> None:
        """Over several ranks: the tiled layers of each unit gather in turns ([Note: tile gathers in turns])."""
        if runner.layers:
            self.turns = TileTurns(runner.layers, self._around, check=self.check, flush=self._flush)
            runner.turn = self.turns.turn

    def watch_tile(self, zc: ZeroChunk, modules: list[str]) -> None:
        """A tile's chunk, computed on by `modules` (qualified names): its users are the units around them, whose
        backward holds theirs; a module in no unit leaves it to the end of backward."""
        around = [self._around(name) for name in modules]
        if not around or any(u is None for u in around):
            self._never.add(id(zc))
            return
        for u in around:
            if u not in self._users[id(zc)]:
                self._users[id(zc)].append(u)
                self._watch[u.index].append(zc)

    def _around(self, name: str) -> Unit | None:
        inside = [u for u in self.units if u.name == "" or name == u.name or name.startswith(u.name + ".")]
        return max(inside, key=lambda u: len(u.name), default=None)

    def _finished(self, zc: ZeroChunk) -> bool:
        """Whether every unit using `zc` this step has ended as many backwards as it ran forwards: shared state
        only ([Note: reductions at shared points])."""
        if id(zc) in self._never or id(zc) in self._loose:
            return False
        for u in self._users[id(zc)] + self._callers.get(id(zc), []):
            if u.index in self._endless or self._ends.get(u.index, 0) < self._calls.get(u.index, 0):
                return False
        return True

    def _called_outside(self, zc: ZeroChunk) -> None:
        """A module of `zc` runs in forward outside its unit's: its backward falls in the caller's."""
        if not self._fwd:
            self._loose.add(id(zc))
            return
        caller = self._fwd[-1]
        callers = self._callers.setdefault(id(zc), [])
        if caller not in callers:
            callers.append(caller)
            self._late.setdefault(caller.index, []).append(zc)

    def _leave(self, unit: Unit) -> None:
        n = self._active.get(unit.index, 0) - 1
        if n > 0:
            self._active[unit.index] = n
        else:
            self._active.pop(unit.index, None)

    # ---- a module's use of its parameters -------------------------------------------------------------------
    def use(self, entries: list[Entry], unit: Unit) -> None:
        """A module of `unit` starts using its parameters: resident on the device and pinned there."""
        phase = BACKWARD if in_backward() else FORWARD
        pending = self._pending.get(unit.index)
        outside = phase == FORWARD and unit.index not in self._active
        for zc, group in self._by_chunk(entries):
            if outside:
                self._called_outside(zc)
            if pending and zc in pending:  # the unit's gathers before this one come first, on every rank
                upto = pending.index(zc)
                for c in pending[: upto + 1]:
                    self._gather(c, unit, phase)
                del pending[: upto + 1]
            self._gather(zc, unit, phase)
            zc.unshard()  # resident on the device (if this rank moved it away since)
            for e in group:
                zc.enter(e)
        if phase == BACKWARD:
            self._held.setdefault(unit.index, []).extend(entries)  # until their gradients come, or the unit ends

    def _by_chunk(self, entries: list[Entry]) -> list[tuple[ZeroChunk, list[Entry]]]:
        """A module's parameters by chunk, in layout order; worked out once per list (a module's hooks keep theirs)."""
        got = self._groups.get(id(entries))
        if got is None or got[0] is not entries:
            groups: dict[int, tuple[ZeroChunk, list[Entry]]] = {}
            for e in entries:
                groups.setdefault(id(e.chunk), (e.chunk, []))[1].append(e)
            got = (entries, sorted(groups.values(), key=lambda g: g[0].spec.index))
            self._groups[id(entries)] = got
        return got[1]

    def pin_unit(self, unit: Unit) -> None:
        """A unit's forward starts: where units pin whole, gather its chunks and pin all of its parameters now, so
        that its modules need do nothing ([Note: one forward hook per unit] in hooks.py)."""
        if self.whole and not in_backward():
            self.use(unit.entries, unit)
            self._pinned[unit.index] = self._pinned.get(unit.index, 0) + 1

    def unpin_unit(self, unit: Unit) -> None:
        """A unit's forward ends: what `pin_unit` pinned is released (before the unit's end may release chunks)."""
        n = self._pinned.get(unit.index, 0)
        if n == 0:
            return
        self.done_using(unit.entries)
        if n > 1:
            self._pinned[unit.index] = n - 1
        else:
            del self._pinned[unit.index]

    def pinned(self, unit: Unit) -> bool:
        """Whether a forward of `unit` in progress pinned all of its parameters."""
        return unit.index in self._pinned

    def done_using(self, entries: list[Entry]) -> None:
        """A module's forward ended."""
        for e in entries:
            e.chunk.exit(e, TensorState.HOLD_AFTER_FWD)

    def grad_arrived(self, e: Entry, unit: Unit) -> None:
        """A parameter's gradient is complete: its backward use is over (the unit's end settles any other)."""
        held = self._held.get(unit.index)
        if held and e in held:
            held.remove(e)  # a list: a unit holds dozens, and a parameter used twice is held twice
            e.chunk.exit(e, TensorState.HOLD_AFTER_BWD)

    def running(self, unit: Unit) -> bool:
        """Whether the unit's forward (or a recomputation of it, or its backward) is in progress."""
        return unit.index in self._active

    def module_backward(self, unit: Unit) -> None:
        """A module that ran inside its unit's forward starts its backward: outside its unit's backward (its output
        kept aside and used later, past the unit's outputs), pinning the unit at its own backward would be too late."""
        if unit.index not in self._active:
            self._escaped = True

    def learn(self, comm: Comm) -> None:
        """After the first backward, on every rank: pin whole units from now on where the budgets allow it and no
        rank saw a module's backward outside its unit's (one all-reduce, once); the tiled layers' turns take their
        order from rank 0's first forward."""
        if self.turns is not None:
            self.turns.learn(comm)
        if not self._may_pin_whole:
            return
        self._may_pin_whole = False
        safe = torch.tensor([0 if self._escaped else 1], dtype=torch.int64)
        comm.control.all_reduce(safe, op="min")
        self.whole = bool(int(safe))
        if not self.whole:
            log.info("a module's backward ran outside its unit's: every module keeps a backward hook of its own")

    def _gather(self, zc: ZeroChunk, unit: Unit, phase: int) -> None:
        if not zc.gathered:
            self.check(GATHER, chunk=zc.spec.index, unit=unit.index, phase=phase)
            zc.unshard()

    def _flush(self, unit: Unit, phase: int) -> None:
        """The unit's gathers its modules did not need on this rank: another rank's modules may have."""
        for zc in self._pending.pop(unit.index, []):
            self._gather(zc, unit, phase)

    def _release_idle(self, chunks: Iterable[ZeroChunk], phase: int) -> None:
        """Release each chunk that no unit is using and that every unit using it has finished this phase with."""
        kept = {id(zc) for u in self._window for zc in u.chunks} if phase == FORWARD else set()
        for zc in chunks:
            users = self._users[id(zc)]
            if id(zc) in kept or any(u.index in self._active for u in users):
                continue
            if all(u.index in self._done[phase] for u in users):
                zc.reshard()

    # ---- step ends (the engine) ---------------------------------------------------------------------------
    def end_forward(self, *, training: bool) -> None:
        """After the model's forward: without autograd nothing will need the gathered chunks."""
        if not training:
            self.release_all()

    def abort_forward(self) -> None:
        """A forward raised ([Note: a forward that fails] in hetero/engine.py): the parameter uses its modules and
        units began end here, since their post-forward hooks never run, and the units it had started are left. What
        it gathered stays gathered: a forward before it in the same step (its backward not run yet) may need it, and
        the step's end releases it. Local: no collective."""
        for unit in self.units:
            for e in unit.entries:
                for _ in range(256):  # an exit per use in progress (nested calls); bounded: a use-less exit is a no-op
                    if e.slot.state is not TensorState.COMPUTE:
                        break
                    e.chunk.exit(e, TensorState.HOLD_AFTER_FWD)
        self._pending.clear()
        self._pinned.clear()
        self._active.clear()
        self._fwd.clear()

    def release_all(self, *, keep_forwards: bool = False) -> None:
        """End of backward (or of a forward without one): everything still gathered is released, in layout order;
        units whose backward never ended (no input needed a gradient) are left first. keep_forwards: the graph
        was retained for another backward (`retain_graph=True`), whose unit ends count against the same forwards."""
        for entries in self._held.values():
            for e in entries:
                e.chunk.exit(e, TensorState.HOLD_AFTER_BWD)
        self._held.clear()
        self._pending.clear()
        self._pinned.clear()
        if self.turns is not None:
            self.turns.clear()
        self._active.clear()
        self._window.clear()
        forwards = (self._calls, self._endless, self._callers, self._loose)
        for per_step in (self._ends, self._fwd, self._late, *(() if keep_forwards else forwards)):
            per_step.clear()
        for zc in self._chunks:
            zc.reshard()
        for done in self._done.values():
            done.clear()

    def release_foreign(self, *, retain_graph: bool) -> None:
        """End of another engine's backward that ran through this model ([Note: a backward through another engine's
        model] in backwards.py): what it gathered is released, and each unit's backward ends it saw answer as many of
        the unit's forwards (unless the graph is kept for another backward), so that our own backward still ends
        with every forward answered."""
        if not retain_graph:
            for index, ended in self._ends.items():
                left = self._calls.get(index, 0) - ended
                if left > 0:
                    self._calls[index] = left
                else:
                    self._calls.pop(index, None)
        self.release_all(keep_forwards=True)
