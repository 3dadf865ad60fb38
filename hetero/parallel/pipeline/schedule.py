"""Pipeline schedules as per-rank lists of actions: pure data, unit-testable without any process.

An action is a forward (F) or backward (B) of one micro-batch through one of the rank's model chunks. The runtime
derives every transfer from the actions: F on virtual stage s > 0 first receives its input from stage s - 1, and
sends its output on unless s is the last; B on a stage below the last first receives its output's gradient, and
sends its input's gradient back unless s is the first. Rank r's chunk c is virtual stage c * p + r (Megatron's
interleaved layout; c = 0 for the non-interleaved schedules).

[Note: why these orders cannot deadlock]
Sends never block (they are isend, waited at the end of the batch), so a rank only ever waits in a receive, for a
send that an earlier action of another rank issues. `simulate` executes every rank's list against exactly these
dependencies; the schedules below are checked by it in the tests, and it also yields their idle ("bubble")
fraction for given forward and backward durations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Action:
    kind: Literal["F", "B"]
    microbatch: int
    chunk: int = 0  # which of the rank's model chunks (interleaved schedule); virtual stage = chunk * p + rank

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


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
    out = [forward(k) for k in range(warm)]
    f, b = warm, 0
    while f < total:
        out.append(forward(f))
        f += 1
        out.append(backward(b))
        b += 1
    out += [backward(k) for k in range(b, total)]
    return out


def build(name: str, p: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """The action list of `rank` for schedule `name` ("gpipe", "1f1b", "interleaved_1f1b")."""
    if name == "gpipe":
        return gpipe(p, m, rank)
    if name == "1f1b":
        return one_f_one_b(p, m, rank)
    if name == "interleaved_1f1b":
        return interleaved_1f1b(p, m, rank, v)
    raise ValueError(f"unknown schedule {name!r}: choose gpipe, 1f1b or interleaved_1f1b")


def transfers(a: Action, p: int, rank: int, v: int) -> tuple[tuple | None, tuple | None]:
    """(what `a` receives, what it sends) on `rank`: each (peer rank, (kind, micro-batch, destination stage)), or
    None. Kinds: 0 an activation, 1 a gradient."""
    s, last = a.chunk * p + rank, p * v - 1
    if a.kind == "F":
        recv = ((s - 1) % p, (0, a.microbatch, s)) if s > 0 else None
        send = ((s + 1) % p, (0, a.microbatch, s + 1)) if s < last else None
    else:
        recv = ((s + 1) % p, (1, a.microbatch, s)) if s < last else None
        send = ((s - 1) % p, (1, a.microbatch, s - 1)) if s > 0 else None
    return recv, send


def paired(lists: list[list[Action]], v: int = 1) -> list[set[int]]:
    """Per rank, the indices of actions whose send goes out together with the next action's receive.

    [Note: paired transfers]
    On NCCL a rank's sends and receives to one peer are queued on one stream and a large send waits until its
    receive is posted, so "send mine, then receive yours" on both sides of a link stalls (1F1B's steady state:
    activation forward, gradient back). Issuing the two as one group (Comm.batch_p2p) on both sides resolves it, as
    Megatron's send_forward_recv_backward does. Both sides must agree: action i's send is paired with action i + 1's
    receive only when they are on the same link and the peer, for the message it sends us, pairs it with the receive
    of ours in the same way. Everything else is sent and received on its own.
    """
    p = len(lists)
    moves = [[transfers(a, p, r, v) for a in lists[r]] for r in range(p)]

    def candidates(r: int) -> dict[tuple, tuple]:
        # (message sent, message received next) for every adjacent pair on one link
        out = {}
        for i in range(len(lists[r]) - 1):
            send, recv = moves[r][i][1], moves[r][i + 1][0]
            if send is not None and recv is not None and send[0] == recv[0]:
                out[(send[1], recv[1])] = i
        return out

    cands = [candidates(r) for r in range(p)]
    result: list[set[int]] = [set() for _ in range(p)]
    for r in range(p):
        for (sent, received), i in cands[r].items():
            peer = moves[r][i][1][0]
            if (received, sent) in cands[peer]:
                result[r].add(i)
    return result


def check_rendezvous(lists: list[list[Action]], v: int = 1) -> None:
    """Raise if the runtime's transfers for these lists can deadlock when every send waits for its receive and each
    rank's transfers run in order on one stream (NCCL's worst case). Paired transfers (see `paired`) are one group,
    which completes once both peers have reached it; a lone send or receive once its peer has reached its match."""
    p = len(lists)
    pairs = paired(lists, v)
    streams: list[list[set]] = []  # per rank: groups of ("send" | "recv", peer, message)
    for r in range(p):
        ops: list[set] = []
        held = None
        for i, a in enumerate(lists[r]):
            recv, send = transfers(a, p, r, v)
            group = set()
            if held is not None:
                group.add(("send", *held))
                held = None
            if recv is not None:
                group.add(("recv", *recv))
            if group:
                ops.append(group)
            if send is not None:
                if i in pairs[r]:
                    held = send
                else:
                    ops.append({("send", *send)})
        streams.append(ops)
    where = [{(kind, peer, msg): k for k, g in enumerate(streams[r]) for kind, peer, msg in g} for r in range(p)]
    pos = [0] * p
    while any(pos[r] < len(streams[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if pos[r] == len(streams[r]):
                continue
            ok = True
            for kind, peer, msg in streams[r][pos[r]]:
                match = where[peer].get(("recv" if kind == "send" else "send", r, msg))
                if match is None or match > pos[peer]:
                    ok = False
            if ok:
                pos[r] += 1
                moved = True
        if not moved:
            # Peers blocked in one group reached each other: let such groups complete together.
            done = [r for r in range(p) if pos[r] < len(streams[r]) and _reached(streams, where, pos, r)]
            if not done:
                stuck = {r: sorted(streams[r][pos[r]]) for r in range(p) if pos[r] < len(streams[r])}
                raise RuntimeError(f"transfers deadlock when sends wait for their receives: {stuck}")
            for r in done:
                pos[r] += 1


def _reached(streams: list, where: list, pos: list[int], r: int) -> bool:
    return all(
        where[peer].get(("recv" if kind == "send" else "send", r, msg), -1) == pos[peer]
        for kind, peer, msg in streams[r][pos[r]]
    )


def theory_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The idle fraction the literature gives: (p - 1) / (m + p - 1), divided by v for the interleaved schedule."""
    frac = (p - 1) / (m + p - 1)
    return frac / v if name == "interleaved_1f1b" else frac


@dataclass(frozen=True)
class Simulation:
    makespan: float  # time from the first action to the last
    idle_fraction: float  # idle time over all ranks / (ranks x makespan)
    peak_in_flight: list[int]  # per rank: most micro-batch chunks forwarded but not yet backwarded at once


def simulate(p: int, lists: list[list[Action]], v: int = 1, *, t_f: float = 1.0, t_b: float = 2.0) -> Simulation:
    """Run the ranks' action lists against the pipeline's data dependencies; raise if they deadlock."""
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, virtual stage) -> finish time
    last = p * v - 1
    pos, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    flight, peak = [0] * p, [0] * p
    remaining = sum(len(a) for a in lists)
    while remaining:
        progressed = False
        for r in range(p):
            if pos[r] == len(lists[r]):
                continue
            a = lists[r][pos[r]]
            s = a.chunk * p + r
            if a.kind == "F":
                deps = [("F", a.microbatch, s - 1)] if s > 0 else []
            else:
                deps = [("F", a.microbatch, s)] + ([("B", a.microbatch, s + 1)] if s < last else [])
            if not all(d in done for d in deps):
                continue
            start = max([clock[r]] + [done[d] for d in deps])
            dur = t_f if a.kind == "F" else t_b
            clock[r] = start + dur
            busy[r] += dur
            done[(a.kind, a.microbatch, s)] = clock[r]
            flight[r] += 1 if a.kind == "F" else -1
            peak[r] = max(peak[r], flight[r])
            pos[r] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            stuck = {r: lists[r][pos[r]] for r in range(p) if pos[r] < len(lists[r])}
            raise RuntimeError(f"pipeline schedule deadlocks: ranks wait on each other at {stuck}")
    makespan = max(clock)
    return Simulation(makespan, 1 - sum(busy) / (p * makespan), peak)


def _check(p: int, m: int, rank: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"stages p = {p} and micro-batches m = {m} must be >= 1")
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is not a pipeline rank of {p}")
