"""A forward that raises (token ids out of range, a shape error, an out-of-memory error, an interrupted evaluation)
and the loop that skips its batch, as plain PyTorch loops do ([Note: a forward that fails] in hetero/engine.py).
Before, at stage 3 the parameters the failing modules had pinned stayed pinned and the next step raised "cannot be
released while [...] are being computed on" for good; at every stage the failed forward's step stayed open and the
next forward joined it.

A forward adds no gradient: the accumulation keeps the micro-batches before the failure, as plain PyTorch does, and
the run must match plain PyTorch's loop that skips the batch, checked against the float64 run ([Note: tolerances
from the arithmetic] in tests/tolerance.py). Over two ranks a batch that fails on every rank is skipped by all, with
check_collectives on or off; one that fails on one rank only stops both with an error naming it, instead of hanging.
A forward that fails on one rank of a tensor-parallel group (1D, with data or pipeline parallelism) stops every rank
within seconds, naming it and its error; its own next batch is refused.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

import hetero
from hetero.comm.watch import POLL_S
from hetero.errors import CollectiveMismatchError, RankFailedError

try:
    from tests import parity, pipe_parity, tolerance
    from tests.dist import NEEDS_DEGREES, ONE_RANK_FAULTS, ranks_apart, run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import NEEDS_DEGREES, ONE_RANK_FAULTS, ranks_apart, run_distributed  # type: ignore[no-redef]

MICRO, ROWS, ACCUM = 8, 4, 2
FAILS = 3  # the micro-batch whose forward raises: the second of the second accumulation


def _bad(x: torch.Tensor) -> torch.Tensor:
    return x + 1000  # token ids past the embedding's 64 rows: IndexError in its forward


def _reference(dtype: torch.dtype, mode: str) -> dict[str, torch.Tensor]:
    """Plain PyTorch. mode "train": micro-batch FAILS's training forward raises and the batch is skipped (the
    accumulation goes on with the next one); "eval": an evaluation of a bad batch raises just before it."""
    model = parity.build().to(dtype)
    opt = parity.make_optimizer(model)
    done = 0
    for i, (x, y) in enumerate(parity.batches(MICRO, ROWS)):
        if i == FAILS:
            with torch.no_grad() if mode == "eval" else contextlib.nullcontext(), pytest.raises(IndexError):
                model(_bad(x), labels=y)
            if mode == "train":
                continue
        (model(x, labels=y).loss / ACCUM).backward()
        done += 1
        if done == ACCUM:
            opt.step()
            opt.zero_grad()
            done = 0
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _run(
    rank: int, world: int, stage: int, mode: str, failing: tuple[int, ...], extra: dict, late: float = 0.0
) -> dict:
    """late: rank 1 sleeps this long after the failed batch, so that rank 0's next collective waits for it."""
    torch.set_num_threads(1)
    model = parity.build()
    config = {"zero_stage": stage, "chunk_size": parity.CHUNK, "grad_accumulation_steps": ACCUM, **extra}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    local = ROWS // world
    for i, (x, y) in enumerate(parity.batches(MICRO, ROWS)):
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        if i == FAILS:
            try:
                with torch.no_grad() if mode == "eval" else contextlib.nullcontext():
                    engine(_bad(x) if rank in failing else x, labels=y)
            except IndexError:
                pass
            if rank == 1:
                time.sleep(late)
            if mode == "train":
                continue  # the loop skips the batch: no backward, no step() for it
        engine.backward(engine(x, labels=y).loss)
        engine.step()
    out = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    return out


@pytest.mark.parametrize(
    "stage,mode,extra",
    [
        (0, "train", {}),
        (1, "eval", {}),
        (2, "train", {}),
        (3, "train", {}),
        (3, "eval", {}),
        (3, "train", {"activation_checkpointing": True}),
    ],
)
def test_a_failed_forward_trains_as_if_its_batch_was_never_fed(stage, mode, extra):
    got = _run(0, 1, stage, mode, (0,), extra)
    exact, plain = _reference(torch.float64, mode), _reference(torch.float32, mode)
    tolerance.assert_weights(got, exact, plain, dtype=torch.float32)


@pytest.mark.parametrize("training", [False, True])
def test_a_failed_forward_ends_its_step(training):
    """The next forward begins a step of its own (the access trace's), not the failed one's."""
    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": 1, "chunk_size": parity.CHUNK})
    began: list[None] = []
    engine.manager.events.subscribe("step_begin", lambda *_: began.append(None))
    (x, y), *_ = parity.batches(1, ROWS)
    with torch.no_grad() if not training else contextlib.nullcontext():
        with pytest.raises(IndexError):
            engine(_bad(x), labels=y)
        engine(x, labels=y)
    engine.close()
    assert len(began) == 2


def test_a_failed_forward_leaves_the_earlier_forward_of_its_step_whole():
    """Two forwards before one backward (a contrastive pair): the second raising leaves the first's graph, whose
    backward runs as without the failure (stage 3: its gathered chunks kept, the failed one's pins ended)."""
    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": 3, "chunk_size": parity.CHUNK})
    (x, y), *_ = parity.batches(1, ROWS)
    loss = engine(x, labels=y).loss
    with pytest.raises(IndexError):
        engine(_bad(x), labels=y)
    engine.backward(loss)
    got = {k: v.float() for k, v in engine.full_grads().items()}
    engine.close()
    refs = []
    for dtype in (torch.float64, torch.float32):
        ref = parity.build().to(dtype)
        ref(x, labels=y).loss.backward()
        refs.append({n: p.grad for n, p in ref.named_parameters()})
    tolerance.assert_weights(got, *refs, dtype=torch.float32)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("checks", [True, False])
def test_a_forward_failing_on_every_rank_is_skipped_by_all_world2(stage, checks):
    """check_collectives off: before, each rank's failure was posted for good and stopped the other at its next
    wait longer than a second (RankFailedError), though every rank had raised at the same point."""
    late = 2.5 * POLL_S  # rank 0 waits for rank 1 longer than POLL_S, and reads the failure board
    results = run_distributed(_run, 2, stage, "train", (0, 1), {"check_collectives": checks}, late, timeout=300)
    exact, plain = _reference(torch.float64, "train"), _reference(torch.float32, "train")
    for got in results:
        tolerance.assert_weights(got, exact, plain, dtype=torch.float32)


def _one_rank_fails(rank: int, world: int, stage: int) -> str:
    torch.set_num_threads(1)
    model = parity.build()
    config = {"zero_stage": stage, "chunk_size": parity.CHUNK, "comm_timeout": 60}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    (x, y), *_ = parity.batches(1, ROWS)
    x, y = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
    try:
        try:
            engine.backward(engine(_bad(x) if rank == 1 else x, labels=y).loss)
            engine.step()
        except IndexError:
            pass  # the failing rank's loop skips the batch ...
        engine.backward(engine(x, labels=y).loss)  # ... and goes on: the other rank is a batch behind
        engine.step()
    except CollectiveMismatchError as e:
        return str(e)
    return "went on"


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.parametrize("stage", [1, 3])
def test_a_forward_failing_on_one_rank_stops_both_with_the_reason_world2(stage):
    for told in run_distributed(_one_rank_fails, 2, stage, timeout=120):
        assert "its forward raised, and it skips the batch" in told, told
        assert "Check the batch before the forward on every rank" in told


def _one_rank_fails_unchecked(rank: int, world: int, stage: int) -> tuple[float, str]:
    """check_collectives off: rank 1's forward raises, it skips the batch; rank 0 goes on with it."""
    torch.set_num_threads(1)
    model = parity.build()
    config = {"zero_stage": stage, "chunk_size": parity.CHUNK, "comm_timeout": 60, "check_collectives": False}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    (x, y), *_ = parity.batches(1, ROWS)
    x, y = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
    start = time.monotonic()
    try:
        try:
            engine.backward(engine(_bad(x) if rank == 1 else x, labels=y).loss)
            engine.step()
        except IndexError as e:
            if rank == 1:
                return time.monotonic() - start, "\n".join([str(e), *getattr(e, "__notes__", [])])
            raise
        engine.backward(engine(x, labels=y).loss)
        engine.step()
    except RankFailedError as e:
        return time.monotonic() - start, str(e)
    return time.monotonic() - start, "went on"


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.parametrize("stage", [1, 3])
def test_a_forward_failing_on_one_rank_stops_both_without_checks_world2(stage):
    """With check_collectives off the failure is posted for its forward and point only: the rank that went past that
    point stops at its next wait longer than POLL_S, and the rank that raised is told (its error's note)."""
    (took0, told0), (took1, told1) = run_distributed(_one_rank_fails_unchecked, 2, stage, timeout=50)
    assert took0 < STOP_S and took1 < STOP_S, (took0, took1)
    assert "global rank 1 failed with IndexError" in told0 and "check_collectives is off" in told0, told0
    assert "global rank(s) 0 of data-parallel group [0, 1] did not raise at this point" in told1, told1


# ---- tensor parallelism ------------------------------------------------------------------------------------------
STOP_S = 15.0  # every rank has stopped within this (POLL_S and a loaded CI machine's slack); comm_timeout is 60 s
LAYOUTS = {  # name: (world size, zero stage, parallel)
    "tp2": (2, 1, {"tensor": 2}),
    "tp2-dp2": (4, 3, {"tensor": 2}),
    # The cut given: a split balanced by time may leave a stage without attention (global rank 1 holds no o_proj).
    "tp2-pp2": (4, 1, {"tensor": 2, "pipeline": 2, "microbatches": 2, "pipeline_split": ["layers.1"]}),
}


def _tensor_rank_fails(rank: int, world: int, layout: str) -> dict:
    """Global rank 1's forward raises inside a tensor-parallel block, before the block's all-reduce; its loop skips
    the batch and goes on."""
    from hetero.models.gpt_pipe import TP_PLAN

    torch.set_num_threads(1)
    _, stage, parallel = LAYOUTS[layout]
    model = pipe_parity.build()
    config = {"zero_stage": stage, "chunk_size": parity.CHUNK, "comm_timeout": 60}
    engine = hetero.initialize(
        model, parity.make_optimizer(model), {**config, "parallel": {**parallel, "tensor_plan": TP_PLAN}}
    )
    if rank == 1:

        def boom(module: torch.nn.Module, args: tuple) -> None:
            raise RuntimeError("out of memory on this rank's device")

        next(m for n, m in model.named_modules() if n.endswith("attn.o_proj")).register_forward_pre_hook(boom)
    (x, y), *_ = parity.batches(1, ROWS, seq=16)
    out: dict = {}
    start = time.monotonic()
    for attempt in ("first", "next"):  # the loop skips a batch that raised and goes on with the next
        try:
            if engine.stages is not None:
                engine.train_batch(x, y)
            else:
                engine.backward(engine(x, labels=y).loss)
                engine.step()
        except Exception as e:
            out[attempt] = (type(e).__name__, "\n".join([str(e), *getattr(e, "__notes__", [])]))
            if attempt == "first" and rank != 1:
                break  # a peer stops at its error
    out["seconds"] = time.monotonic() - start
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_forward_failing_on_one_tensor_rank_stops_every_rank_at_once(layout):
    """Before, its tensor peers waited inside the block's all-reduce until comm_timeout (600 s by default) and then
    blamed global rank 1 as dead or hung (the run's timeout here ends first); the rank that raised went on to pair
    its next collectives with those its peers had left waiting."""
    world = LAYOUTS[layout][0]
    results = run_distributed(_tensor_rank_fails, world, layout, timeout=50)
    for rank, r in enumerate(results):
        assert r["seconds"] < STOP_S, (rank, r)
        kind, text = r["first"]
        if rank == 1:
            assert kind == "RuntimeError" and "cannot skip a batch, not even when every rank" in text, text
            kind, text = r["next"]  # the next batch is refused: its collectives would pair with the stale ones
            assert kind == "RankFailedError" and "refused" in text and "out of memory" in text, text
        elif kind == "RankFailedError":
            assert "global rank 1 failed with RuntimeError: out of memory on this rank's device" in text, text
            assert "tensor-parallel group [0, 1]" in text, text
        else:  # the other stage of a pipeline: stopped by the stage that raised; PipelineCommError where that stage
            # stopped in a failed collective (global rank 0, whose all-reduce its tensor peer left: [Note: a stage that
            # raises]), PipelineError from the rank that raised itself
            expected = "PipelineCommError" if rank == 2 else "PipelineError"
            assert layout == "tp2-pp2" and kind == expected and "raised during this batch" in text, (rank, r)
