"""The collective protocol of ZeRO: which chunk is gathered, kept, released and reduced, and in which order.

[Note: every rank in step]
A collective completes only when every rank of the group issues it, with the same sizes, in the same order.
So every decision that issues one is taken from state every rank shares, never from a rank's own budget,
eviction, timing or data:
  - Gathers (stage 3) follow units (see [Note: units]): a unit's chunks are gathered when the unit starts, in
    layout order, unless they are gathered already; where the budgets allow, the start of a unit also issues the
    next unit's gathers ([Note: gathering ahead] in `hetero/zero/gathers.py`). "Gathered" is a logical state,
    changed only at unit events (which every rank sees in the same order) and at step ends. Where a gathered
    chunk's bytes sit is the rank's own business: under memory pressure the manager moves it to the host like any
    chunk (see [Note: transient chunks]) and brings it back at its next use without a collective.
  - Release after forward keeps the last `KEEP_UNITS` units gathered (backward starts with them) when every rank's
    device budget has room for them (`unit_rules` in `hetero/zero/gathers.py`: the smallest budget, agreed by a
    collective at initialisation); a chunk is released once every unit using it has finished the phase (or, for
    units that did not run, at the step's end). After backward everything is released: the update changes the
    shards. In backward a unit gathers its chunks all at its start where that budget has room for it and the first
    backward showed it safe (`Gathers.learn`, [Note: one backward hook per unit]), else each module as its own
    backward starts.
  - Gradient reduce-scatters (stages 2-3) go out in one fixed order of chunks (`reduce_order`, then the order the
    first backward made them ready in on rank 0: [Note: the reduce order learnt from a backward]); a chunk is
    issued once it is ready and every chunk before it in the order has been issued. Ready means: its gradients are
    all in where backward runs no other collective (stages 0-2, or one rank); at stage 3 over several ranks, every
    unit using it has ended its backward ([Note: reductions at shared points]). Chunks not ready by the end of
    backward (parameters this rank did not use) are completed with zeros then, in the same order.
  - Before each such collective, when `check_collectives` is on, the ranks compare what they are about to do (a
    tiny all-gather on the control group, [Note: data and control groups]): a rank that took another path (a
    block skipped by some ranks, a different number of forwards) stops with an error naming the units and chunks
    of every rank, before the collective's result is used, instead of hanging or mixing up data.

[Note: checks posted, verified at the wait]
A check that blocked where it was made held every rank at every collective until the slowest one came: a rendezvous
of the ranks' host threads at each gather and reduce-scatter, which a GPU's host thread otherwise runs ahead of, and
which on two CPU ranks of the race cost 4-5% of the step (1.43 s against 1.37 s with the checks off). So a check
is posted (its all-gather started) and the collective issued at once; it is compared when something waits for a
collective issued after it: the groups (data and control) hold the checker as a `Guard`, an asynchronous
collective's handle verifies the checks posted up to its own issue before its wait returns, and a blocking one all
of them. No rank uses a collective's result before the ranks were found to agree on it, which is what the check is
for; the error is raised there instead of at the issue, still naming every rank's collective. Each check's row
carries the units its rank started last, so the error needs no further exchange: after a divergence the ranks'
later operations no longer pair up, and a second collective to report it could itself hang. A rank that does not
come still times out on the check's all-gather, named as before.

[Note: a check verified before a collective of another size]
Posted checks let a rank issue its collective before the ranks were found to agree on it. Where ranks that took
other paths issue collectives of different sizes at the same point, gloo does not wait to be told: it ends the
process natively ("Received data size doesn't match", SIGABRT) before any check is compared, on every rank the
larger message reaches (a top-level module run by some ranks, its chunk 272 elements where the others' next one
held 300). So on a group whose backend aborts so (`Rules.sizes_abort`: gloo, and the stand-in's gloo data group;
NCCL does not), a check is verified where it is made, before its collective, unless every rank can tell that it
is the check they all expect next: the one that followed the previous check the last time that check was made
(`Checker._next_of`). Ranks that agree so far have posted the same checks, so they expect the same next one; a
rank whose next check is not that one verifies it first, so of two ranks about to issue different collectives at
least one compares the checks before issuing anything, raises the error naming both, and never issues its
collective; the other issued the expected one and raises at its wait. This needs ranks making the same check to
issue collectives of the same sizes after it, which holds: they follow from the chunk, or (an update, a read of
every chunk) from the layout, which every rank shares, and objects of other sizes agree on their size first
(`hetero/comm/objects.py`). After the first step the schedule repeats, so every check is posted as before; the
first step, and the first after a change of path (an evaluation), rendezvous at each check. (Verifying the update's
check first in every step as well, which a first version did, waits there for every collective queued before it:
on two CPU ranks of host_overhead's Llama the step's median was 131 ms against 114 ms without, six runs each, on a
shared machine; with the update predicted too, 119 ms against 119 ms.)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch

from hetero.comm import Comm
from hetero.comm.handles import Handle
from hetero.comm.rules import mark_failed
from hetero.errors import CollectiveMismatchError
from hetero.zero.units import Unit

if TYPE_CHECKING:
    from hetero.zero.zero_chunk import ZeroChunk


_FIELDS = 5  # a check's row: sequence number, operation, chunk, unit, phase; then the units started last
_STARTED = 6  # (unit, phase) pairs of the units this rank started last, sent with each check for the error
_ROW = _FIELDS + 2 * _STARTED


class _Posted(NamedTuple):
    seq: int
    row: torch.Tensor  # this rank's
    rows: torch.Tensor  # every rank's, once `work` is done
    work: Handle


OPS = (
    "?",
    "gather",
    "reduce-scatter",
    "update",
    "read (gathered_parameters, or a module's load_state_dict)",
    "batch reduce-scatter",
    "all-reduce",
    "gather ahead",
    "read gradients (full_grads or clip_grad_norm_)",
    "checkpoint (save_checkpoint or load_checkpoint)",
    "nothing: its forward raised, and it skips the batch (in train_batch, a micro-batch's forward or backward)",
    "nothing: its backward raised, and it drops the accumulation",
)
GATHER, REDUCE, UPDATE, SUMMON, BATCH_REDUCE, ALL_REDUCE, GATHER_AHEAD, READ_GRADS, CHECKPOINT = range(1, 10)
FORWARD_FAILED = 10  # [Note: a forward that fails] in hetero/engine.py
BACKWARD_FAILED = 11  # engine.backward's: [Note: a backward that fails] in hetero/engine.py
CALLS = (SUMMON, READ_GRADS, CHECKPOINT)  # the engine's collective methods a loop calls itself
PHASES = ("?", "forward", "backward", "outside a step")
FORWARD, BACKWARD, OUTSIDE = 1, 2, 3


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (a checkpoint's recomputation runs inside one)."""
    return torch._C._current_graph_task_id() != -1


class Checker:
    """Compares, across the ranks of a group, the next collective each is about to issue; see [Note: every rank in
    step] and [Note: checks posted, verified at the wait]."""

    def __init__(self, comm: Comm, *, enabled: bool, units: list[Unit], chunks: list[ZeroChunk]) -> None:
        self.comm = comm
        self.enabled = enabled and comm.size > 1
        self.seq = 0  # checks made: the same on every rank while they agree
        self._units = units
        self._chunks = chunks
        # The units this rank started last (index, phase), for the error: with gathers issued ahead, a unit some
        # ranks skip may issue nothing itself, and the first collective that differs is another unit's.
        self.started: deque[tuple[int, int]] = deque(maxlen=_STARTED)
        self._posted: deque[_Posted] = deque()  # checks sent, not yet compared, in order
        self._verifying = False
        # [Note: a check verified before a collective of another size]: whether a check whose collective the ranks
        # do not all expect is verified before it is issued; the check that followed each check the last time
        # (keyed by (operation, chunk, unit, phase)); and the last check made.
        self._verify_first = self.enabled and comm.rules.sizes_abort
        self._next_of: dict[tuple[int, int, int, int], tuple[int, int, int, int]] = {}
        self._last: tuple[int, int, int, int] | None = None
        self.verified_first = 0  # checks verified before their collective (each a rendezvous of the ranks)
        if self.enabled:
            for c in {id(c): c for c in (comm, comm.control)}.values():
                c.guards.append(self)

    def __call__(self, op: int, *, chunk: int = -1, unit: int = -1, phase: int = OUTSIDE) -> None:
        self.seq += 1
        if not self.enabled:
            return
        values = [self.seq, op, chunk, unit, phase, *(v for u, p in self.started for v in (u, p))]
        row = torch.tensor(values + [-1] * (_ROW - len(values)), dtype=torch.int64)
        rows = torch.empty(self.comm.size * _ROW, dtype=torch.int64)
        what = f"the collective schedule's check before {self._describe(op, chunk, unit, phase)}"
        work = self.comm.control.all_gather_async(rows, row, what=what)
        self._posted.append(_Posted(self.seq, row, rows, work))
        if self._verify_first:
            key = (op, chunk, unit, phase)
            expected = self._last is not None and self._next_of.get(self._last) == key
            if self._last is not None:
                self._next_of[self._last] = key
            self._last = key
            if not expected:
                self.verified_first += 1
                try:
                    self.verify(self.seq)
                except BaseException:
                    # [Note: memory a failed collective may still write] in hetero/comm/rules.py; the groups too
                    mark_failed(what, self.comm.group, self.comm.control.group)
                    raise

    def close(self) -> None:
        """Stop guarding the groups (the engine's close). What is posted is dropped unverified: after an error a
        rank may never come, and the engine's data is not used any more."""
        self._posted.clear()
        for c in (self.comm, self.comm.control):
            if self in c.guards:
                c.guards.remove(self)

    # ---- the Guard of the groups' waits -------------------------------------------------------------------
    def mark(self) -> int:
        return self.seq

    def verify(self, upto: int | None) -> None:
        """Wait for the checks posted up to `upto` (all, for None) and raise if any found the ranks apart."""
        if self._verifying:  # a check's own wait, or the error's report
            return
        self._verifying = True
        try:
            while self._posted and (upto is None or self._posted[0].seq <= upto):
                p = self._posted.popleft()
                p.work.wait()
                rows = p.rows.view(self.comm.size, _ROW)
                if not bool((rows[:, :_FIELDS] == p.row[:_FIELDS]).all()):
                    self._posted.clear()
                    raise CollectiveMismatchError(self._explain(rows))
        finally:
            self._verifying = False

    def _explain(self, rows: torch.Tensor) -> str:
        lines = [
            "the ranks of the data-parallel group are about to run different collectives (global ranks "
            f"{self.comm.global_ranks}):"
        ]
        for r, (seq, op, chunk, unit, phase) in enumerate(rows[:, :_FIELDS].tolist()):
            doing = self._describe(op, chunk, unit, phase)
            lines.append(f"  rank {self.comm.global_rank(r)}: collective #{seq}, {doing}")
        for r, flat in enumerate(rows[:, _FIELDS:].tolist()):
            units = [(u, p) for u, p in zip(flat[::2], flat[1::2]) if u >= 0]
            names = ", ".join(f"{self._units[u].name or '(root)'!r} ({PHASES[p]})" for u, p in units)
            lines.append(f"  rank {self.comm.global_rank(r)} started, last: {names or 'no unit'}")
        if {FORWARD_FAILED, BACKWARD_FAILED} & set(rows[:, 1].tolist()):
            lines.append(
                "A forward raised on some ranks and not on others, or a backward did, or ranks raised at different "
                "points (data only some ranks hold: token ids out of the embedding's range, a shape error, an "
                "out-of-memory error on one device): a rank cannot skip a batch alone, because the others' "
                "collectives wait for it. Check the batch before the forward on every rank, or skip it on every rank "
                "together."
            )
        elif any(op in CALLS for op in rows[:, 1].tolist()):
            lines.append(
                "save_checkpoint, load_checkpoint, full_state_dict, gathered_parameters, full_grads and the model's "
                "load_state_dict are collective: every rank calls them at the same point of its loop, not only rank "
                "0 (each writes its own part of a checkpoint; with full_state_dict, let rank 0 alone write the file "
                "it returns; every rank loads a state dict)."
            )
        else:
            lines.append(
                "At zero_stage 3 every rank must run the same units (blocks, and modules outside blocks) in the same "
                "order in every step, because each gathers its parameters collectively. Data-dependent code belongs "
                "inside a block (a child of a ModuleList, e.g. a transformer layer): branches and expert routing "
                "there are fine. A module that only some ranks run at the top level cannot be sharded at stage 3: "
                "move it into a block, make every rank call it, or use zero_stage <= 2. So must every rank run each "
                "forward: evaluation or generation under `if rank == 0` leaves the other ranks out of its gathers "
                "(let every rank evaluate its own part of the data, or evaluate the consolidated weights in a "
                "process of its own)."
            )
        chunks = rows[:, 2].tolist()
        if any(0 <= c < len(self._chunks) and self._chunks[c].spec.tile for c in chunks):
            lines.append(
                "Some of these chunks hold tiles of a weight larger than a chunk, gathered as its layer runs: inside "
                "a block every rank takes part in each tiled layer's gathers once per forward and once per backward, "
                "in turns ([Note: tile gathers in turns] in hetero/zero/turns.py). A tiled layer that some ranks run "
                "twice in one pass of its block, out of the order of the first step, or outside its block, breaks "
                "the turns: run it the same way on every rank, keep its weight whole (a larger chunk_size, or "
                '"tiling": false), or use zero_stage <= 2.'
            )
        return "\n".join(lines)

    def _describe(self, op: int, chunk: int, unit: int, phase: int) -> str:
        what = OPS[op] if 0 <= op < len(OPS) else f"operation {op}"
        if 0 <= chunk < len(self._chunks):
            names = [p.name for p in self._chunks[chunk].spec.params]
            what += f" of chunk {chunk} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
        if 0 <= unit < len(self._units):
            name = self._units[unit].name or "(root)"
            what += f" as module {name!r} starts" if op == GATHER_AHEAD else f" for module {name!r}"
        if 0 <= phase < len(PHASES):
            what += f", in {PHASES[phase]}"
        return what


class Reducer:
    """Issues the chunks' gradient reductions in one fixed order; see [Note: every rank in step]. Stages 2-3
    reduce-scatter every micro-batch (the chunk's own `start_reduce` / `finish_reduce`); stages 0-1 pass their own
    `start` and `finish` (`hetero/zero/buckets.py`)."""

    def __init__(
        self,
        chunks: list[ZeroChunk],
        check: Checker,
        *,
        in_flight: Callable[[ZeroChunk], int],
        start: Callable[[ZeroChunk], None] | None = None,
        finish: Callable[[ZeroChunk], None] | None = None,
        op: int = REDUCE,
    ) -> None:
        self.order = reduce_order(chunks)  # the issue order, the same on every rank
        self.check = check
        self._in_flight = in_flight  # how many reduces may stay in flight, given the chunk about to be issued
        self._start = start or (lambda zc: zc.start_reduce())  # issues a chunk's collective
        self._finish = finish or (lambda zc: zc.finish_reduce())  # completes it
        self._op = op  # what the check calls the collective
        self.on_span: Callable[[str, str, float, float], None] | None = None  # (track, name, issued, completed)
        # update_in_backward ([Note: the update in backward]): told of each chunk as it is issued (every rank at the
        # same point of the control group's sequence) and as its reduced gradient is complete.
        self.on_issued: Callable[[ZeroChunk], None] | None = None
        self.on_reduced: Callable[[ZeroChunk], None] | None = None
        self._issued: dict[int, float] = {}  # chunk id -> when its collective was issued
        self._next = 0  # position in `order` of the next chunk to issue
        self._ready: set[int] = set()  # chunks whose gradients of this micro-batch are all in
        self._running: deque[ZeroChunk] = deque()  # issued, not yet completed
        # [Note: reductions at shared points]: at stage 3 over several ranks `ready` is told by the units' backward
        # ends (the same on every rank), not by this rank's gradients, which only accumulate.
        self.at_unit_ends = False
        self._sent: set[int] = set()  # chunk ids issued in this micro-batch
        # [Note: the reduce order learnt from a backward]: while `learning`, a backward records the order its chunks'
        # gradients were all in (`_seen`), and its end leaves the whole order in `observed` (chunks never ready come
        # last, in the issue order) for `adopt_observed_order`, which ends the learning.
        self.learning = True
        self._seen: list[ZeroChunk] = []
        self.observed: list[ZeroChunk] | None = None

    def ready(self, zc: ZeroChunk) -> None:
        """All of `zc`'s gradients of this micro-batch are in: issue what the order allows."""
        if self.learning and id(zc) not in self._ready:
            self._seen.append(zc)
        self._ready.add(id(zc))
        while self._next < len(self.order) and id(self.order[self._next]) in self._ready:
            self._issue(self.order[self._next])

    def sent(self, zc: ZeroChunk) -> bool:
        """Whether `zc`'s reduction of this micro-batch has been issued: a gradient arriving now would be lost."""
        return id(zc) in self._sent

    def flush(self) -> None:
        """End of backward: issue the rest in order (parameters without a gradient count as zero), complete all."""
        while self._next < len(self.order):
            self._issue(self.order[self._next])
        while self._running:
            self._complete(self._running.popleft())
        if self.learning and self.order:
            seen = {id(zc) for zc in self._seen}
            self.observed = self._seen + [zc for zc in self.order if id(zc) not in seen]
            self._seen = []
        self._next = 0
        self._ready.clear()
        self._sent.clear()

    def _issue(self, zc: ZeroChunk) -> None:
        # Every chunk, every micro-batch, also one no gradient of this rank reached: another rank's may have.
        self._next += 1
        self._sent.add(id(zc))
        self.check(self._op, chunk=zc.spec.index, phase=BACKWARD)
        self._issued[id(zc)] = time.perf_counter()
        if self.on_issued is not None:
            self.on_issued(zc)
        self._start(zc)
        self._running.append(zc)
        while len(self._running) > self._in_flight(zc):
            self._complete(self._running.popleft())

    def _complete(self, zc: ZeroChunk) -> None:
        waited = time.perf_counter()
        self._finish(zc)
        issued = self._issued.pop(id(zc), None)
        if self.on_span is not None and issued is not None:
            name, done = f"{OPS[self._op]} chunk {zc.spec.index}", time.perf_counter()
            self.on_span("collectives", name, issued, done)
            self.on_span("collectives waited", name, waited, done)  # the driving thread blocked on it
        if self.on_reduced is not None:
            self.on_reduced(zc)


def adopt_observed_order(reducers: Iterable[Reducer], comm: Comm) -> list[ZeroChunk] | None:
    """Every reducer that reduced in the backward just ended takes the order its chunks completed in on rank 0
    (broadcast on the control group: every rank calls this at the same backward). Returns the new order of the one
    reducer that changed, or None if none did; see [Note: the reduce order learnt from a backward]."""
    adopted = None
    for reducer in reducers:
        observed = reducer.observed
        if observed is None:
            continue
        index = {id(zc): i for i, zc in enumerate(reducer.order)}
        perm = torch.tensor([index[id(zc)] for zc in observed], dtype=torch.int64)
        comm.control.broadcast(perm, src=0)
        if sorted(perm.tolist()) != list(range(len(reducer.order))):
            raise RuntimeError(f"reduce order from rank 0 is not a permutation of {len(reducer.order)} chunks")
        reducer.order = [reducer.order[i] for i in perm.tolist()]
        reducer.observed, reducer.learning = None, False
        adopted = reducer.order
    return adopted


# [Note: the reduce order learnt from a backward]
# The first backward can only guess when each chunk's gradients will all be in: by its earliest-registered
# parameter (`reduce_order`). Models do not always register in the order they compute: a Hugging Face Llama layer
# registers its norms after its attention and MLP but uses them first, so the chunk holding a layer's norms is the
# first of its layer in that order yet completes last in backward, and every other chunk of the layer waited for
# it (0.11-0.17 s each on the 416M Llama of benchmarks/bigger_than_ram.py): their updates under
# update_in_backward then came in one burst per layer, I/O-bound while compute stood still, and compute ran on
# without I/O in between. After the first backward that reduced, every rank adopts the order in which rank 0's
# chunks completed (one broadcast of a permutation on the control group, at the same backward on every rank:
# whether a backward reduced is shared state), so from then on a chunk is issued as soon as it is ready. A rank
# whose chunks complete in another order only waits, as under any order; the order stays fixed afterwards.
# Where no other collective of the group runs in backward (one rank, or stages 0-2: only the reductions and their
# checks, in the order, whatever the timing), ready is this rank's gradients being in. At stage 3 over several
# ranks it is a unit event ([Note: reductions at shared points]), so the order learnt is the order every rank's
# units ended in, the same on each.

# [Note: reductions at shared points]
# At stage 3 over several ranks backward gathers on the data group unit by unit (at a unit's start, ahead of the
# next, at its end for what its modules did not need), and the checks and update_in_backward's used-flags go out on
# the control group at the same points: a reduction must fall between the same two of them on every rank. Whether a
# parameter gets a gradient is the rank's own data (a branch taken, the experts a router picked), so "all of the
# chunk's gradients are in" is not shared: a chunk of rank 1's branch was in mid-way through a block's backward on
# rank 1 and never on rank 0, and its reduce-scatter met rank 0's next gather. So there a chunk is ready when every
# unit using it has ended as many backwards as it ran forwards with autograd in this step (`Gathers._finished`,
# told by each unit's end): unit events, which every rank sees in the same order, as its gathers already assume.
# Gradients arriving only accumulate; a parameter without one counts as zero. Which units use a chunk: the units
# listing its parameters; for a tile's chunk, the units around the modules computing on it; and, per step, the unit
# whose forward was running when a module ran outside its own unit's forward (its backward falls in that unit's).
# A unit whose inputs need no gradient (the embedding) has no backward end: its chunks wait for the end of
# backward, and so does a chunk whose module ran outside every unit. The end comes after the gradients: a unit's
# end is the backward of its inputs' identity, created before anything in the unit in forward, so autograd runs it
# after every node of the unit that can run (parameters' gradient accumulation first of all), and a checkpoint's
# recomputation runs inside the unit's backward. A gradient that still comes after the reduction went out (a
# parameter read directly, outside any module, before its unit in forward) is an error naming it, never lost.
# Overlap stays: a block's chunks go out as its backward ends (on branchy's model, every chunk but the embedding's).


def reduce_order(chunks: list[ZeroChunk]) -> list[ZeroChunk]:
    """The order gradients are reduced in: backward finishes a chunk when its earliest-registered parameter gets its
    gradient (models register parameters in forward order, and backward runs it in reverse), so chunks go by that
    parameter's position, latest first. Computed from the layout alone: the same on every rank."""
    first = {id(zc): min(info.registered for info in zc.spec.params) for zc in chunks}
    return sorted(chunks, key=lambda zc: (-first[id(zc)], zc.spec.index))
