"""Pipeline schedules as per-rank lists of actions and the transfers between them: pure data, unit-testable
without any process.

An action is a forward (F) or backward (B) of one micro-batch through one of the rank's model chunks. The transfers
follow from the actions: F on virtual stage s > 0 needs its input from stage s - 1, and passes its output on unless
s is the last; B on a stage below the last needs its output's gradient, and passes its input's gradient back unless
s is the first. Rank r's chunk c is virtual stage c * p + r (Megatron's interleaved layout; c = 0 for the
non-interleaved schedules). Chimera's second pipeline runs the other way (`Action.up`): there stage s sits on rank
p - 1 - s, as the rank's chunk 1 (see chimera.py).

[Note: steps and exchanges]
A rank's actions are cut into steps: one action each, except the interleaved schedule's steady state, where a
forward and the backward after it form one step (Megatron's). A rank's `program` is its steps with one `Exchange`
between consecutive steps: the sends of the step just computed and the receives of the step about to run, posted
together as one group (NCCL: one batched group; gloo: tagged sends and receives started together). The runtime
waits for the receives before the step and for the sends at the next exchange (runtime.py).

Why groups of this shape: on NCCL a rank's transfers share one stream and a large send does not finish until its
receive is posted, so "send mine, then receive yours" on both sides of a link deadlocks (1F1B's steady state sends
an activation forward while the next stage sends a gradient back). Posting the next step's receives with the
current step's sends resolves that for GPipe and 1F1B; the interleaved schedule also routes activations and
gradients of different chunks around the ring, and only the merged forward+backward step lines its groups up on
both sides of every link. `check_rendezvous` replays a program under that worst case (every send waits for its
receive, each rank's groups in order, header then payload), and also checks that every link carries its messages
in the same order on both sides (NCCL matches by order, not by tag). `simulate` runs the programs against time to
give the idle ("bubble") fraction and the micro-batches in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Action:
    kind: Literal["F", "B"]
    microbatch: int
    chunk: int = 0  # which of the rank's model chunks (interleaved schedule); virtual stage = chunk * p + rank
    up: bool = False  # Chimera's reverse pipeline: stage p - 1 - rank, on the rank's chunk 1

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + ("^" if self.up else f".{self.chunk}" if self.chunk else "")


def stage(a: Action, p: int, rank: int) -> int:
    """The (virtual) stage `a` runs on `rank`."""
    return p - 1 - rank if a.up else a.chunk * p + rank


def _rank_of(s: int, p: int, up: bool) -> int:
    return p - 1 - s if up else s % p


def gpipe(p: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards: m micro-batches' activations alive at the peak."""
    _check(p, m, rank)
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b(p: int, m: int, rank: int) -> list[Action]:
    """PipeDream-flush 1F1B: p - rank - 1 warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards. At most p - rank micro-batches are in flight on a rank."""
    _check(p, m, rank)
    warm = min(p - rank - 1, m)
    out = [Action("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        out.append(Action("F", f))
        f += 1
        out.append(Action("B", b))
        b += 1
    out += [Action("B", i) for i in range(b, m)]
    return out


def interleaved_1f1b(p: int, m: int, rank: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B: v model chunks per rank, micro-batches taken in groups of p through each chunk
    in turn, which shrinks the bubble by about v. Needs m to be a multiple of p."""
    return [a for step in interleaved_steps(p, m, rank, v) for a in step]


def interleaved_steps(p: int, m: int, rank: int, v: int) -> list[tuple[Action, ...]]:
    """`interleaved_1f1b` cut into steps: warm-up forwards one by one, then (forward, backward) pairs, then the
    remaining backwards one by one ([Note: steps and exchanges])."""
    _check(p, m, rank)
    if v < 1:
        raise ValueError(f"virtual stages v = {v} must be >= 1")
    if m % p:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) to be a multiple of stages ({p})")
    total = m * v

    def forward(k: int) -> Action:
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k: int) -> Action:
        return Action("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    warm = total if m == p else min(total, (p - rank - 1) * 2 + (v - 1) * p)
    out: list[tuple[Action, ...]] = [(forward(k),) for k in range(warm)]
    out += [(forward(warm + k), backward(k)) for k in range(total - warm)]
    out += [(backward(k),) for k in range(total - warm, total)]
    return out


def build(name: str, p: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """The action list of `rank` for schedule `name` ("gpipe", "1f1b", "interleaved_1f1b", "chimera")."""
    return [a for step in build_steps(name, p, m, rank, v) for a in step]


def build_steps(name: str, p: int, m: int, rank: int, v: int = 1) -> list[tuple[Action, ...]]:
    """The actions of `rank` for schedule `name`, cut into the steps its transfers are grouped by."""
    if name == "gpipe":
        return [(a,) for a in gpipe(p, m, rank)]
    if name == "1f1b":
        return [(a,) for a in one_f_one_b(p, m, rank)]
    if name == "interleaved_1f1b":
        return interleaved_steps(p, m, rank, v)
    if name == "chimera":
        from hetero.parallel.pipeline.chimera import chimera

        return [(a,) for a in chimera(p, m, rank)]
    raise ValueError(f"unknown schedule {name!r}: choose gpipe, 1f1b, interleaved_1f1b or chimera")


def forward_only(p: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """Evaluation: every micro-batch's forward through the rank's chunks, in stage order, nothing saved for a
    backward (Chimera's, in both directions: `chimera.chimera_programs(forward=True)`)."""
    _check(p, m, rank)
    if v > 1:
        # Megatron's order (groups of p micro-batches through each chunk in turn), which needs m % p == 0.
        if m % p:
            raise ValueError(f"the interleaved layout needs micro-batches ({m}) to be a multiple of stages ({p})")
        return [Action("F", (k // (p * v)) * p + k % p, (k // p) % v) for k in range(m * v)]
    return [Action("F", i) for i in range(m)]


Message = tuple[int, int, int]  # (0 an activation | 1 a gradient, micro-batch, destination virtual stage)


def transfers(a: Action, p: int, rank: int, v: int) -> tuple[tuple[int, Message] | None, tuple[int, Message] | None]:
    """(what `a` receives, what it sends) on `rank`: each (peer rank, message), or None."""
    s, last = stage(a, p, rank), p * v - 1
    before, after = _rank_of(s - 1, p, a.up), _rank_of(s + 1, p, a.up)
    if a.kind == "F":
        recv = (before, (0, a.microbatch, s)) if s > 0 else None
        send = (after, (0, a.microbatch, s + 1)) if s < last else None
    else:
        recv = (after, (1, a.microbatch, s)) if s < last else None
        send = (before, (1, a.microbatch, s - 1)) if s > 0 else None
    return recv, send


@dataclass(frozen=True)
class Exchange:
    """Transfers started together as one group: each (peer rank, message), in message order (on NCCL the order of
    transfers between two ranks in one direction is how they are matched)."""

    sends: tuple[tuple[int, Message], ...]
    recvs: tuple[tuple[int, Message], ...]


Item = Action | Exchange


def program(steps: list[tuple[Action, ...] | Action], p: int, rank: int, v: int = 1) -> list[Item]:
    """One rank's actions with an Exchange between consecutive steps: the sends of the step before and the receives
    of the step after ([Note: steps and exchanges]). A bare Action in `steps` is a step of its own."""
    steps = [st if isinstance(st, tuple) else (st,) for st in steps]
    moves = [[transfers(a, p, rank, v) for a in st] for st in steps]
    out: list[Item] = []
    for j in range(len(steps) + 1):
        sends = [mv[1] for mv in moves[j - 1] if mv[1] is not None] if j > 0 else []
        recvs = [mv[0] for mv in moves[j] if mv[0] is not None] if j < len(steps) else []
        if sends or recvs:
            out.append(Exchange(tuple(sorted(sends, key=_order)), tuple(sorted(recvs, key=_order))))
        if j < len(steps):
            out += steps[j]
    return out


def programs(name: str, p: int, m: int, v: int = 1) -> list[list[Item]]:
    """Every pipeline rank's program for schedule `name`, replayed free of deadlock (see `split_until_free`).
    Chimera's programs are built in rounds (chimera.py, [Note: Chimera's exchanges]) and replayed the same way."""
    if name == "chimera":
        from hetero.parallel.pipeline.chimera import chimera_programs

        progs = chimera_programs(p, m)
    else:
        progs = [program(build_steps(name, p, m, r, v), p, r, v) for r in range(p)]
    return split_until_free(name, progs, p, m, v)


def split_until_free(name: str, progs: list[list[Item]], p: int, m: int, v: int = 1) -> list[list[Item]]:
    """These programs, with exchanges split until `check_rendezvous` finds no deadlock; raise if that is not enough.

    [Note: split exchanges]
    An exchange whose receives wait on a peer that first needs one of the exchange's own payloads deadlocks: the
    headers go first, and the payloads only once all headers, ours included, have arrived (GPipe's last forward
    sends its activation and receives the first gradient, which the next stage computes from that activation).
    Where the replay finds ranks stuck in such an exchange, it is split in two, sends first; this repeats until
    nothing is stuck. Exchanges where both sides send and receive to each other (1F1B's steady state, the
    interleaved steps) stay whole, which is what keeps them from deadlocking.
    """
    while True:
        stuck = _replay(progs)
        if not stuck:
            return progs
        split = False
        for r, (i, _) in stuck.items():
            ex = progs[r][i]
            assert isinstance(ex, Exchange)
            if ex.sends and ex.recvs:
                progs[r][i : i + 1] = [Exchange(ex.sends, ()), Exchange((), ex.recvs)]
                split = True
                break  # one split at a time, then replay: it may free the other stuck ranks as well
        if not split:
            raise RuntimeError(f"schedule {name} (p={p}, m={m}, v={v}): transfers deadlock: {stuck}")


def _order(transfer: tuple[int, Message]) -> tuple:
    return transfer[1]


def check_rendezvous(progs: list[list[Item]]) -> None:
    """Raise if these programs can deadlock or mismatch when every send waits for its receive and each rank's groups
    run in order on one stream (NCCL's worst case; [Note: steps and exchanges])."""
    stuck = _replay(progs)
    if stuck:
        raise RuntimeError(f"transfers deadlock when sends wait for their receives: {stuck}")


def _streams(progs: list[list[Item]]) -> list[list[tuple[int, list[tuple]]]]:
    """Per rank, the groups of transfers the runtime issues, in order: (index of the Exchange in the program, its
    operations ("send" | "recv", peer, (phase, message))). An exchange is two groups: the headers (micro-batch,
    stage, dtype, shape), then the payloads, which the receiver can only allocate once it has the headers."""
    out = []
    for prog in progs:
        groups = []
        for i, item in enumerate(prog):
            if isinstance(item, Exchange):
                for phase in ("header", "payload"):
                    ops = [("send", peer, (phase, msg)) for peer, msg in item.sends]
                    groups.append((i, ops + [("recv", peer, (phase, msg)) for peer, msg in item.recvs]))
        out.append(groups)
    return out


def _replay(progs: list[list[Item]]) -> dict[int, tuple[int, list[tuple]]]:
    """Replay the transfers under NCCL's worst case; return {rank: (exchange index, stuck group)} of the ranks that
    cannot go on, or {} if every rank finishes. An operation completes once its peer has posted the matching one; a
    group once all of its operations have (so a group may finish its operations at different moments, as NCCL's
    grouped point-to-point calls do). Raise if the two sides of a link issue their messages in different orders
    (NCCL matches them by order, not by tag)."""
    p = len(progs)
    streams = _streams(progs)
    for r in range(p):
        for peer in range(p):
            sent = [op[2] for _, g in streams[r] for op in g if op[0] == "send" and op[1] == peer]
            received = [op[2] for _, g in streams[peer] for op in g if op[0] == "recv" and op[1] == r]
            if sent != received:
                raise RuntimeError(
                    f"rank {r} sends {sent} to rank {peer}, which receives {received} from it: the orders differ"
                )
    where = [{(kind, peer, msg): k for k, (_, g) in enumerate(streams[r]) for kind, peer, msg in g} for r in range(p)]
    pos = [0] * p
    while any(pos[r] < len(streams[r]) for r in range(p)):
        moved = False
        for r in range(p):
            # The current group completes once every operation's match has been posted by its peer (in the peer's
            # current group or in one the peer has finished).
            if pos[r] < len(streams[r]) and all(
                where[peer][("recv" if kind == "send" else "send", r, msg)] <= pos[peer]
                for kind, peer, msg in streams[r][pos[r]][1]
            ):
                pos[r] += 1
                moved = True
        if not moved:
            return {r: streams[r][pos[r]] for r in range(p) if pos[r] < len(streams[r])}
    return {}


def theory_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The idle fraction the literature gives: (p - 1) / (m + p - 1), divided by v for the interleaved schedule;
    Chimera's (p - 2) / (2m + p - 2) (Li and Hoefler, 2021; forward and backward counted as equal slots)."""
    if name == "chimera":
        return (p - 2) / (2 * m + p - 2)
    frac = (p - 1) / (m + p - 1)
    return frac / v if name == "interleaved_1f1b" else frac


@dataclass(frozen=True)
class Simulation:
    makespan: float  # time from the first action to the last
    idle_fraction: float  # idle time over all ranks / (ranks x makespan)
    peak_in_flight: list[int]  # per rank: most micro-batch chunks forwarded but not yet backwarded at once


def simulate(
    p: int, steps: list[list[tuple[Action, ...] | Action]], v: int = 1, *, t_f: float = 1.0, t_b: float = 2.0
) -> Simulation:
    """Run the ranks' programs (from their steps, or plain action lists) against time as the runtime does: sends
    leave when their exchange is reached, an exchange waits until the messages it receives were sent, a backward
    follows its own forward. Raise if they deadlock. (An exchange that `programs` splits, sends first, times the
    same here: sends never wait in this model.)"""
    return simulate_programs(p, [program(steps[r], p, r, v) for r in range(p)], t_f=t_f, t_b=t_b)


def simulate_programs(p: int, progs: list[list[Item]], *, t_f: float = 1.0, t_b: float = 2.0) -> Simulation:
    """`simulate` on programs as given (e.g. from `programs`, Chimera's rounds included)."""
    sent: dict[tuple[int, int, Message], float] = {}  # (from, to, message) -> when it left
    done: set[tuple[int, int]] = set()  # forwards done: (micro-batch, virtual stage)
    pos, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    flight, peak = [0] * p, [0] * p
    while any(pos[r] < len(progs[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(progs[r]):
                item = progs[r][pos[r]]
                if isinstance(item, Exchange):
                    for peer, msg in item.sends:
                        sent.setdefault((r, peer, msg), clock[r])
                    arrivals = [sent.get((peer, r, msg)) for peer, msg in item.recvs]
                    if any(t is None for t in arrivals):
                        break
                    clock[r] = max([clock[r], *arrivals])
                else:
                    s = stage(item, p, r)
                    if item.kind == "B" and (item.microbatch, s) not in done:
                        break  # a backward before its own forward: waits forever
                    dur = t_f if item.kind == "F" else t_b
                    clock[r] += dur
                    busy[r] += dur
                    if item.kind == "F":
                        done.add((item.microbatch, s))
                    flight[r] += 1 if item.kind == "F" else -1
                    peak[r] = max(peak[r], flight[r])
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: progs[r][pos[r]] for r in range(p) if pos[r] < len(progs[r])}
            raise RuntimeError(f"pipeline schedule deadlocks: ranks wait on each other at {stuck}")
    makespan = max(clock)
    return Simulation(makespan, 1 - sum(busy) / (p * makespan), peak)


def _check(p: int, m: int, rank: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"stages p = {p} and micro-batches m = {m} must be >= 1")
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is not a pipeline rank of {p}")
