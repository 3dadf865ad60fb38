"""How a group's operations behave: NCCL's rule on data tensors, the control group, the timeout.

See [Note: data and control groups] in `group.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hetero import standin
from hetero.comm import cma


@dataclass(frozen=True)
class Rules:
    """How a group's operations behave; subgroups made by `split` inherit them."""

    timeout_s: float | None = None  # bound on every blocking operation; None: the process group's own timeout
    device_only: Callable[[torch.Tensor], str | None] | None = None  # why a data tensor is refused, or None
    separate_control: bool = False  # small host messages go through a gloo group of their own
    cma: bool = False  # CPU data within a host: [Note: collectives by cross-memory attach] (cma.py)
    # Whether ranks issuing collectives of different sizes at the same point end the process natively (gloo's
    # "Received data size doesn't match": SIGABRT), so that a check must be verified before its collective is issued
    # where ranks may diverge ([Note: a check verified before a collective of another size] in
    # hetero/zero/protocol.py). NCCL does not abort there; unknown backends are taken to.
    sizes_abort: bool = True


def _cuda_only(t: torch.Tensor) -> str | None:
    return None if t.is_cuda else f"a {t.device.type} tensor: NCCL takes CUDA tensors only"


def rules_for(backend: str, timeout_s: float | None) -> Rules:
    """NCCL's rules for an NCCL group; under the stand-in, the same rules for gloo."""
    if backend == "nccl":
        return Rules(timeout_s=timeout_s, device_only=_cuda_only, separate_control=True, sizes_abort=False)
    if standin.active():
        return Rules(timeout_s=timeout_s, device_only=standin.collective_rule, separate_control=True)
    cma.transport()  # a bad HETERO_CPU_TRANSPORT fails here, at the edge; each rank's choice is agreed at `Link.open`
    return Rules(timeout_s=timeout_s, cma=backend == "gloo")


# The control group made for each process group, so that wrapping the same group twice (Comm.world() again) does
# not make a second one: groups are made collectively and live as long as the job.
CONTROL_OF: dict[Any, Any] = {}
# The rules init_from_env chose for the world, reused by Comm.world() and inherited by every split.
WORLD_RULES: list[Rules] = [Rules()]


def world_rules(backend: str) -> Rules:
    """The world's rules: those init_from_env chose, else the backend's own."""
    chosen = WORLD_RULES[0]
    return rules_for(backend, chosen.timeout_s)


def set_world_rules(rules: Rules) -> None:
    """Called once by init_from_env: the rules (timeout, device rule) of the world it joined."""
    WORLD_RULES[0] = rules


# [Note: memory a failed collective may still write]
# A collective that failed at its wait (its checks disagreed, it timed out, a peer went) stays queued in the backend,
# and so may collectives issued after it (gathers issued ahead). On gloo a later operation of the group can complete
# one of them, long after the error, by writing into its output: a chunk's payload. The memory layer frees a dropped
# chunk's memory in place (a transient storage shrunk, or its borrowed pooled memory swapped back, `device.py`),
# which would leave that write landing in freed memory: a crash when the engine is closed after the error, or
# silently wrong values in a chunk that reused the memory. So the first failed wait of the process is recorded here
# (by `Comm._wait` and the checks' verification, where every wait fails), and from then on the memory layer leaves
# every dropped chunk's memory to its views (the backend's work holds one), neither shrinking nor reusing it
# (`Storage.free_buffer`). The group is unusable after such an error anyway.
FAILED: list[str] = []

# [Note: a group no collective may use after a failure]
# The collectives queued with a failed one stay queued, and the ranks no longer agree on where in their sequence they
# are, so a later collective on the group pairs with one of them: gloo ends the process natively when their sizes
# differ ("Received data size doesn't match", SIGABRT, no Python error), else mixes the data. A notebook or a retry
# loop that caught the error and built a new engine died so (the new engine's first collective met a gather one rank
# had issued before the mismatch). So each group whose wait failed is recorded here with what failed, and every later
# operation a `Comm` issues on it raises `GroupUnusableError` before anything is issued (`Comm.refuse_if_failed`),
# saying to restart every rank; where another rank's own failure broke it, `RankFailedError` again, naming that rank.
# The record is per group, not per process: a pipeline stage whose data-parallel gather failed still sends its
# stopped marks to the other stages through the pipeline's own group ([Note: a stage that raises] in
# hetero/parallel/pipeline/runtime.py), and a group made afterwards starts with nothing queued.
BROKEN: dict[Any, tuple[str, BaseException | None]] = {}  # process group -> what failed first on it, and its error
# What interrupted this process (Ctrl-C), once it was: no group takes an operation from it after that, and no wait
# waits ([Note: an interrupted rank] in interrupt.py).
INTERRUPTED: list[str] = []


def raise_if_interrupted() -> None:
    """KeyboardInterrupt again in a process interrupted in a job of several ranks: [Note: an interrupted rank]."""
    if INTERRUPTED:
        raise KeyboardInterrupt(f"{INTERRUPTED[0]}: this rank takes part in no further collective")


def mark_failed(what: str, *groups: Any, error: BaseException | None = None) -> None:
    """A wait on `what` failed (with `error`): collectives of this process may still write into their outputs, and
    `groups` (process groups) take no further operation ([Note: a group no collective may use after a failure])."""
    if not FAILED:
        FAILED.append(what)
    for g in groups:
        if g is not None:
            BROKEN.setdefault(g, (what, error))


def group_failed(group: Any) -> tuple[str, BaseException | None] | None:
    """What failed first on `group` in this process and its error, or None while the group is usable. In a process
    that was interrupted, KeyboardInterrupt: no operation is issued ([Note: an interrupted rank] in interrupt.py)."""
    raise_if_interrupted()
    return BROKEN.get(group) if group is not None else None


def collective_failed() -> str | None:
    """The first operation whose wait failed in this process, or None: see [Note: memory a failed collective may
    still write]."""
    return FAILED[0] if FAILED else None


def timed_out(err: BaseException) -> bool:
    """Whether a backend error is a wait that ran out of time."""
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def peer_gone(err: BaseException) -> bool:
    """Whether a backend error is a peer that closed its connection (it died, or gave up)."""
    text = str(err).lower()
    return any(s in text for s in ("connection closed", "connection reset", "broken pipe", "socket closed"))
