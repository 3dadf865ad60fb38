"""Meetings in the job's store without checkpoint files: the roll call before save_model held as a Meeting with no
work ([Note: a roll call before save_model]), its limit kept to the poll, its numbering by name, and a late rank that
follows an outcome settled by a rank with another limit ([Note: patient meetings])."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.dist import ONE_RANK_FAULTS, ranks_apart, run_distributed

COMM_TIMEOUT_S = 60.0  # the group's timeout: its beat is the longest, 5 s (patience._MAX_BEAT_S)
LIMIT_S = 0.5  # rank 0's wait for the others
ADVICE = "Call f on every rank."


def _error(fn: Any) -> tuple[str, str, list[int], float]:
    """Run `fn`; what it raised (type, message, missing ranks) and how long it took."""
    start = time.monotonic()
    try:
        fn()
    except Exception as err:
        return type(err).__name__, str(err), list(getattr(err, "missing_ranks", [])), time.monotonic() - start
    return "", "", [], time.monotonic() - start


def _roll_call_alone_then_late_then_together(rank: int, world: int) -> dict[str, Any]:
    from hetero.comm import Comm
    from hetero.comm.watch import default_store
    from hetero.integrations.roll_call import roll_call

    comm = Comm.world().with_timeout(COMM_TIMEOUT_S)
    store = default_store()

    def call() -> None:
        roll_call(comm, "f", limit_s=LIMIT_S, advice=ADVICE)

    out: dict[str, Any] = {}
    if rank == 0:  # 1. alone: it gives up after its limit, not comm_timeout nor the next beat
        out["alone"] = _error(call)
        store.set("test/zero_gave_up", "1")
    else:  # 2. after rank 0 gave up: it raises at once instead of waiting for a rank that left
        store.wait(["test/zero_gave_up"])
        out["late"] = _error(call)
    # 3. every rank, rank 0 later than its own limit: the others wait for it
    if rank == 0:
        time.sleep(4 * LIMIT_S)
    out["together"] = _error(call)
    return out


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
def test_a_roll_call_one_rank_holds_alone_fails_it_within_its_limit_and_every_rank_that_comes_after() -> None:
    zero, one = run_distributed(_roll_call_alone_then_late_then_together, 2, timeout=90)
    kind, message, missing, seconds = zero["alone"]
    assert kind == "RankTimeoutError" and missing == [1], message
    said = f"global rank(s) 1 had not called f {LIMIT_S:g} s after global rank 0 did"
    assert message == f"f must be called on every rank: {said}. {ADVICE}", message
    # Kept to the poll (0.25 s), not to the next beat of the heartbeat scan (5 s at this comm_timeout): half a beat
    # parts the two with room for a loaded machine.
    assert LIMIT_S <= seconds < 5.0 / 2, seconds
    kind, message, missing, seconds = one["late"]
    assert kind == "RankTimeoutError" and missing == [1], message
    said = "global rank 1 called f after global rank 0 had given up waiting for it"
    assert message == f"f must be called on every rank: {said}. {ADVICE}", message
    assert seconds < 5.0 / 2, seconds  # the outcome was there already: read at the first poll
    assert zero["together"][0] == "" and one["together"][0] == "", (zero, one)


def _a_roll_call_alone_then_a_meeting_together(rank: int, world: int) -> dict[str, Any]:
    from hetero.comm import Comm
    from hetero.comm.patience import Meeting
    from hetero.integrations.roll_call import roll_call

    comm = Comm.world().with_timeout(3.0)
    out: dict[str, Any] = {}
    if rank == 0:  # the roll call only rank 0 holds (the `is_world_process_zero()` guard)
        out["alone"] = _error(lambda: roll_call(comm, "f", limit_s=LIMIT_S, advice=ADVICE))

    def meet() -> None:
        with Meeting(comm, "checkpoint-write", "writing a checkpoint"):
            pass

    out["meeting"] = _error(meet)
    return out


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
def test_a_roll_call_one_rank_held_alone_leaves_the_next_meetings_of_the_ranks_matched() -> None:
    """Meetings are numbered by name: the roll call rank 0 held alone does not put its next checkpoint meeting under
    another number than the other ranks' (which would fail it, each rank silent to the others)."""
    zero, one = run_distributed(_a_roll_call_alone_then_a_meeting_together, 2, timeout=90)
    assert zero["alone"][0] == "RankTimeoutError", zero
    assert zero["meeting"][0] == "" and one["meeting"][0] == "", (zero, one)


def _late_past_a_limit_only_rank_zero_has(rank: int, world: int) -> dict[str, Any]:
    from hetero.comm import Comm
    from hetero.comm.patience import Meeting

    comm = Comm.world().with_timeout(COMM_TIMEOUT_S)

    def meet() -> None:
        with Meeting(comm, "work", "its work", limit_s=LIMIT_S if rank == 0 else None):
            if rank == 1:  # far past rank 0's limit, so that ranks starting a second apart change nothing
                time.sleep(8 * LIMIT_S)

    return {"meeting": _error(meet)}


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
def test_a_rank_without_a_limit_late_past_another_ranks_raises_with_that_ranks_limit() -> None:
    """The late rank words the error with the limit of the rank that gave up, not its own (None here)."""
    for r in run_distributed(_late_past_a_limit_only_rank_zero_has, 2, timeout=90):
        kind, message, missing, _ = r["meeting"]
        assert kind == "RankTimeoutError" and missing == [1], message
        assert f"Global rank(s) 1 were still at it {LIMIT_S:g} s (checkpoint_patience)" in message, message


def test_a_roll_call_ends_at_once_on_a_rank_that_failed_before_it() -> None:
    """A rank whose failure is on the board does not come: the roll call names it and its cause at the first look,
    where a collective would wait comm_timeout."""
    from types import SimpleNamespace

    from torch.distributed import HashStore

    from hetero.comm.watch import post_failure
    from hetero.errors import RankFailedError
    from hetero.integrations.roll_call import roll_call

    store = HashStore()
    post_failure(OSError("a disk on rank 1"), store=store, me=1)
    comm = SimpleNamespace(global_ranks=[0, 1], rank=0, size=2, rules=SimpleNamespace(timeout_s=COMM_TIMEOUT_S))
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"global rank 1 left .*OSError: a disk on rank 1.*before f") as info:
        roll_call(comm, "f", limit_s=COMM_TIMEOUT_S, advice=ADVICE, store=store)  # type: ignore[arg-type]
    assert info.value.failed_rank == 1
    assert time.monotonic() - start < 5.0 / 2  # the board is read at the first scan, not a beat (5 s) later
