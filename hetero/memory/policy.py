"""The access trace: what the next step will touch, for prefetch and for eviction that knows the future.

[Note: replaying the trace]
Training repeats itself: every step touches the chunks in the same order. The first step (or any step after the
order changed) is *recorded*: the sequence of (chunk id, tier) accesses. Later steps are *replayed*: each access is
checked against the recorded one at the current position. While they match, the trace knows the future, so
 - prefetch starts moving the next `depth` chunks of the trace to the tier they will be wanted on, and
 - eviction picks the chunk whose next use lies furthest ahead (Belady's OPT, as PatrickStar and Gemini do),
   wrapping around into the next step for chunks not used again in this one.
The first mismatch (a module skipped this step, a different sequence length) stops the replay for the rest of the
step: eviction falls back to least-recently-used and prefetch stops, and the step is recorded afresh to become
the trace from the next step on. A mismatch never waits for an access that is not coming, so it cannot hang.

[Note: one trace per kind of step]
Training alternates kinds of step: a training step (forward, backward, update) and, every so often, evaluation
(forward only, no gradients). Each kind repeats itself, but they differ: an evaluation step is a training step's
forward and no more. With one trace, each evaluation became the trace (a replay that ends early is a change), and
the training step after it replayed the evaluation's forward, prefetched nothing for its backward and update and
evicted by an evaluation's future, then was recorded afresh (a tiny GPT at stage 3: 10 demand loads in the training
step after each evaluation, none in one after a training step). So the trace keeps one recording per kind, named by
the caller at `step_begin` (the engine: "train" for a forward with autograd, "eval" for one without), and a step
replays the last recording of its own kind; a mismatch re-records that kind only. Shapes are no kind: the chunks a
step touches follow the modules it runs, not the sizes of their inputs, and a key by shape would record a step
afresh for every new sequence length. The next use of a chunk wraps into a next step of the same kind. The traces
decide prefetch and eviction only, this rank's business: no collective reads them.

[Note: a step within a step]
With `grad_accumulation_steps` 1 a training step runs on through its update, so an evaluation between the backward
and the update (a metric on the batch under no_grad, `eval_batch`) came while it was open. Beginning the evaluation
ended it there: the update went unrecorded (no prefetch of what it reads, no OPT knowledge of it), and a loop that
evaluates only some steps broke the replay of the training step after each. So the engine begins such a step
`nested`: the open step of another kind is set aside as it stands (its recording, position and whether it still
matches) and resumes where the nested one ends, which replays and records its own trace in between. The caller's
state rides along (`carry`: the manager's last access, so that whether the next access repeats it is as if nothing
came between). A step begun not nested ends every open step first, the ones set aside too.

[Note: chunks of one step]
A chunk made and freed within one step (activation offload's host copy of a checkpointed block's inputs) has a new
id every step: recorded, its first access broke every replay (a stage-3 GPT with activation offload replayed no step,
prefetched nothing and loaded every chunk on demand). Its owner marks it `traced = False`: its accesses are not
recorded or matched, and the chunks around them replay as without it. It is pinned where it was made, so it is no
one's victim either.

[Note: an access repeated]
An access of the chunk the last recorded access was of, to the same tier, is not recorded: it tells the future
nothing the trace has not (no position moves, so prefetch would ask the same question again); with the chunk still
there and nothing in flight to or from it, it needs nothing done but marking the chunk written. A module's parameters, a
unit's gradients one parameter at a time, each access their chunk in turn: two thirds of a stage-3 step's accesses
repeat the one before on a 16-layer Llama (`benchmarks/host_overhead.py`). Whether an access repeats depends on the
sequence of accesses alone, so a replayed step skips the same accesses its recording did; the first access of a step
is always recorded, and so is the first after the caller moved a chunk (`ChunkManager.move`). Where the chunk is
decides only whether a repeat returns at once: one moved since by the manager itself (an eviction, a prefetch), or
with a copy landing, or owed a host trim put off while write-backs were in flight (`trim_idle`), takes the full
path, still unrecorded (deciding the record from what was in flight made a replay's accesses depend on the disk's
timing, and `tests/test_delayed.py`'s replay broke off under load). Automatic placement, which measures the device
at every access, turns this off.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from hetero.memory.tier import Tier

Access = tuple[int, Tier]  # (chunk id, tier it was wanted on)
Recorded = tuple[list[Access] | None, dict[int, list[int]], dict[int, list[Access]]]  # a trace and its indexes


class AccessTrace:
    def __init__(self) -> None:
        self.trace: list[Access] | None = None  # the last complete step's accesses; None before one is recorded
        self._positions: dict[int, list[int]] = {}  # chunk id -> sorted positions in `trace`
        self._ahead: dict[int, list[Access]] = {}  # position -> the distinct accesses from it on (memo of `upcoming`)
        self.kind = "train"  # the kind of step `trace` is of ([Note: one trace per kind of step])
        # The other kinds' (trace, _positions, _ahead), kept for their next step.
        self._shelved: dict[str, Recorded] = {}
        self._recording: list[Access] = []  # this step's accesses so far
        self.pos = 0  # index in `trace` of the next expected access
        self.matching = False  # replaying and every access so far matched
        self.in_step = False  # between step_begin and step_end
        self.mismatches = 0  # steps whose replay broke off (for stats and tests)
        self._aside: list[tuple[str, list[Access], int, bool, tuple]] = []  # steps set aside by nested ones, innermost
        # last: kind, recording, position, matching, and the caller's `carry`

    # ---- step boundaries ----------------------------------------------------------------------------------
    def step_begin(self, kind: str = "train", *, nested: bool = False, carry: tuple = ()) -> None:
        """A step of `kind` begins: it replays the last step of that kind ([Note: one trace per kind of step]).
        nested: a step open of another kind is set aside, not ended, and resumes where this one ends ([Note: a step
        within a step]); `step_end` hands its `carry` back then."""
        if self.in_step and nested and kind != self.kind:
            self._aside.append((self.kind, self._recording, self.pos, self.matching, carry))
        else:
            while self.in_step:  # a step left open (an update that never came) ends where the next begins
                self.step_end()
        self._switch(kind)
        self._recording = []
        self.pos = 0
        self.matching = self.trace is not None and len(self.trace) > 0
        self.in_step = True

    def _switch(self, kind: str) -> None:  # the trace of `kind` in front, the others shelved
        if kind != self.kind:
            self._shelved[self.kind] = (self.trace, self._positions, self._ahead)
            self.trace, self._positions, self._ahead = self._shelved.pop(kind, (None, {}, {}))
            self.kind = kind

    def step_end(self) -> tuple | None:
        """The step's accesses are over: a replay that did not match them all is replaced by them. A step set aside
        for this one resumes: returns the `carry` it was set aside with (None when none resumes)."""
        if not self.in_step:
            return None
        self.in_step = False
        # A replay that matched throughout but ended early also changed: the shorter sequence is the new trace.
        complete = self.matching and self.trace is not None and self.pos == len(self.trace)
        if not complete:
            if self.trace is not None and self.matching:
                self.mismatches += 1
            self._set_trace(self._recording)
        self._recording = []
        self.matching = False
        return self._resume()

    def _resume(self) -> tuple | None:  # the step set aside last, if any, open again; its carry
        if not self._aside:
            return None
        kind, self._recording, self.pos, self.matching, carry = self._aside.pop()
        self._switch(kind)
        self.in_step = True
        return carry

    def _set_trace(self, accesses: list[Access]) -> None:
        self.trace = list(accesses)
        positions: dict[int, list[int]] = defaultdict(list)
        for i, (cid, _) in enumerate(self.trace):
            positions[cid].append(i)
        self._positions = dict(positions)
        self._ahead = {}

    def forget(self) -> tuple | None:
        """End the step without keeping it, and drop the trace of its kind: the next step of that kind is recorded
        afresh instead of replayed. For a caller that knows the steps change shape here (a mismatch would stop the
        replay too, but only after prefetch and eviction acted on a future that is not coming, and this step would
        become the trace the next one is checked against). A step set aside for this one resumes, as at `step_end`."""
        self.in_step = False
        self._recording = []
        self.trace = None
        self._positions = {}
        self._ahead = {}
        self.matching = False
        return self._resume()

    # ---- during a step ------------------------------------------------------------------------------------
    def record(self, chunk_id: int, tier: Tier) -> None:
        """Note an access; advance the replay if it is the expected one, else stop replaying."""
        if not self.in_step:
            return
        self._recording.append((chunk_id, tier))
        if not self.matching:
            return
        assert self.trace is not None
        if self.pos < len(self.trace) and self.trace[self.pos] == (chunk_id, tier):
            self.pos += 1
        else:
            self.matching = False
            self.mismatches += 1

    def upcoming(self, depth: int, skip: Iterable[int] = ()) -> list[Access]:
        """The next `depth` distinct chunks the replay expects (wrapping into the next step), leaving out the chunks
        in `skip`; [] when not replaying."""
        if not self.matching or depth <= 0 or not self.trace:
            return []
        skip = set(skip)
        # Every access asks this, and the answer at a position never changes while the trace stands: walk the trace
        # once per position (for as many chunks as any caller wanted so far), not once per access.
        want = depth + len(skip)
        ahead = self._ahead.get(self.pos)
        if ahead is None or (len(ahead) < want and len(ahead) < len(self._positions)):
            ahead = self._distinct_from(self.pos, max(want, 2 * depth))
            self._ahead[self.pos] = ahead
        out = [a for a in ahead if a[0] not in skip]
        return out[:depth]

    def _distinct_from(self, pos: int, count: int) -> list[Access]:
        assert self.trace is not None
        seen: set[int] = set()
        out: list[Access] = []
        n = len(self.trace)
        for k in range(n):
            cid, tier = self.trace[(pos + k) % n]
            if cid in seen:
                continue
            seen.add(cid)
            out.append((cid, tier))
            if len(out) == count:
                break
        return out

    def next_use(self, chunk_id: int) -> float:
        """Accesses until chunk_id is next used (inf if never); only meaningful while replaying."""
        positions = self._positions.get(chunk_id)
        if not positions or self.trace is None:
            return math.inf
        i = bisect.bisect_left(positions, self.pos)
        if i < len(positions):
            return positions[i] - self.pos
        return len(self.trace) - self.pos + positions[0]  # first use in the next step

    @property
    def replaying(self) -> bool:
        return self.in_step and self.matching


def choose_victim(candidates: Sequence, trace: AccessTrace) -> object | None:
    """The chunk to evict: furthest next use while the trace is replaying (OPT), else least recently used.

    Ties in OPT (e.g. several chunks never used again) are broken by LRU, so the choice is deterministic. Either
    way a chunk prefetched and not yet used goes last (it was brought because it is wanted soon), and one whose
    eviction writes nothing (a clean swap copy exists, or it holds no data) is preferred: OPT counts its next use
    as twice as far, LRU takes it first; a wrong guess then costs one read, not a write and a read.
    """
    if not candidates:
        return None
    if trace.replaying:
        # Weighed by cost: evicting a dirty chunk writes it and reads it back, a clean one is only read back.
        # A chunk prefetched and not yet used goes last: its read would be wasted.
        return max(
            candidates,
            key=lambda c: (not c.prefetched, trace.next_use(c.id) * (2 if _free_to_evict(c) else 1), -c.last_access),
        )
    return min(candidates, key=lambda c: (c.prefetched, not _free_to_evict(c), c.last_access))


def _free_to_evict(chunk: object) -> bool:
    return chunk.transient or chunk.all_free or (chunk.on_nvme and not chunk.dirty)
