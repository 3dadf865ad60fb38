"""`train_batch` and `eval_batch` when a forward raises on some data-parallel ranks only, or on all of them
([Note: a batch that raises on some data-parallel ranks] in hetero/parallel/batches.py).

A micro-batch's forward that raised on one rank left its peers waiting in the next gather, the gradient reduction or
the loss's all-reduce until comm_timeout (60 s here, ten minutes by default); a loop that skipped the batch paired its
next batch's collectives with the others' current ones. Now every rank stops within seconds, with an error naming the
rank that raised, or, where every rank raised, all skip the batch together with nothing of it in the gradients. A
pipeline's replica whose stage raised does the same with its data-parallel peers. Each run's timeout is below
comm_timeout: before the fix these runs hung until it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

import hetero
from hetero.errors import CommError
from hetero.parallel.pipeline.runtime import PipelineError

try:
    from tests import parity, pipe_parity, tolerance
    from tests.dist import NEEDS_DEGREES, ONE_RANK_FAULTS, ranks_apart, run_distributed
    from tests.test_failed_backward import _FailingBackward  # the identity whose backward raises
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import NEEDS_DEGREES, ONE_RANK_FAULTS, ranks_apart, run_distributed  # type: ignore[no-redef]
    from test_failed_backward import _FailingBackward  # type: ignore[no-redef]

COMM_TIMEOUT = 60  # what a rank left waiting would wait; the runs' own timeouts end first
STOP_S = 15.0  # every rank has stopped within this (POLL_S and a loaded CI machine's slack)
ROWS, MICRO, BATCHES, ACCUM = 8, 2, 8, 2
FAILS = 3  # the batch whose last micro-batch raises: the second of the second accumulation


def _poison(x: torch.Tensor, microbatch: int) -> torch.Tensor:
    """Token ids past the embedding's 64 rows in one micro-batch of x: IndexError in its forward."""
    x = x.clone()
    rows = x.shape[0] // MICRO
    x[microbatch * rows : (microbatch + 1) * rows] += 1000
    return x


def _outcome(e: BaseException, start: float) -> tuple[str, str, float]:
    return type(e).__name__, "\n".join([str(e), *getattr(e, "__notes__", [])]), time.monotonic() - start


# ---- one rank raises: every rank stops at once --------------------------------------------------------------
CASES = {  # name: (call, zero stage, check_collectives, microbatches, grad_accumulation_steps)
    "train, micro-batches, stage 1": ("train_batch", 1, True, MICRO, 1),
    "train, micro-batches, stage 3, no checks": ("train_batch", 3, False, MICRO, 1),
    "train, one micro-batch, between updates": ("train_batch", 1, True, 1, 3),
    "eval with labels, micro-batches": ("eval_batch", 1, True, MICRO, 1),
    "train, micro-batches, a backward raises": ("backward", 1, True, MICRO, 1),
}


def _loss(failing: bool):
    def loss_fn(out: object, labels: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
        return _FailingBackward.apply(loss) if failing else loss

    return loss_fn


def _engine(stage: int, checks: bool, micro: int, accum: int) -> hetero.Engine:
    """The parity model on this rank's engine, data parallel over the world."""
    torch.set_num_threads(1)
    model = parity.build()
    config = {
        "zero_stage": stage,
        "chunk_size": parity.CHUNK,
        "comm_timeout": COMM_TIMEOUT,
        "check_collectives": checks,
        "grad_accumulation_steps": accum,
        "parallel": {"microbatches": micro},
    }
    return hetero.initialize(model, parity.make_optimizer(model), config)


def _one_rank_raises(rank: int, world: int, case: str) -> list[tuple[str, str, float]]:
    """Rank 1's last micro-batch of batch 1 raises (its forward, or its backward); every loop skips a batch that
    raised and goes on. Each error, with the seconds from the start of batch 1."""
    call, stage, checks, micro, accum = CASES[case]
    engine = _engine(stage, checks, micro, accum)
    local = ROWS // world
    errors: list[tuple[str, str, float]] = []
    start = time.monotonic()
    for i, (x, y) in enumerate(parity.batches(3, ROWS)):
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        if i == 1:
            start = time.monotonic()
            if rank == 1 and call != "backward":
                x = _poison(x, micro - 1)
        try:
            if call == "backward":  # rank 1's backward of batch 1 raises
                engine.train_batch(x, y, loss_fn=_loss(i == 1 and rank == 1))
            else:
                getattr(engine, call)(x, y)
        except Exception as e:  # noqa: BLE001 (the type is part of what is checked)
            errors.append(_outcome(e, start))
            if isinstance(e, CommError):
                break
    engine.close()
    return errors


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_batch_failing_on_one_rank_stops_every_rank_at_once_world2(case):
    """Before: rank 0 waited in the gradient reduction (the update's, the batch's reduce-scatter or, between updates,
    the loss's all-reduce; at stage 3 in a gather) until comm_timeout, and rank 1, skipping the batch, paired its next
    batch's collectives with rank 0's current ones (at stage 3 it raised 'cannot be released while [...] are being
    computed on' instead of its own error). Now: with the collective schedule's checks each rank raises at its next
    check (a rank with no checked collective left in the batch posts one before the loss's all-reduce); without them
    the failure is posted for its forward and point, and rank 0 stops at its next wait."""
    checks = CASES[case][2]
    r0, r1 = run_distributed(_one_rank_raises, 2, case, timeout=45)
    assert r0 and r1, (r0, r1)
    kind, text, seconds = r0[0]
    assert seconds < STOP_S, r0
    if checks:
        assert kind == "CollectiveMismatchError" and "nothing: its forward raised, and it skips the batch" in text, r0
        assert "A forward raised on some ranks and not on others" in text, r0
        kind, text, seconds = r1[0]
        assert kind == "CollectiveMismatchError" and seconds < STOP_S, r1  # raised from its IndexError
    else:
        assert kind == "RankFailedError" and "global rank 1 failed with IndexError" in text, r0
        (kind, text, seconds), (then, refused, _) = r1
        assert kind == "IndexError" and seconds < STOP_S, r1
        assert "global rank(s) 0 of data-parallel group [0, 1] did not raise at this point" in text, r1
        assert then == "RankFailedError" and "refused" in refused, r1  # its next batch: it told every rank to stop


# ---- every rank raises: all skip the batch ----------------------------------------------------------------------
def _reference(dtype: torch.dtype, build: Callable[[], torch.nn.Module] = parity.build) -> dict[str, torch.Tensor]:
    """Plain PyTorch on the global batch: batch FAILS raises after its first micro-batch's backward; the loop drops
    the accumulation's gradients (that micro-batch's and the batch before it's: [Note: a batch that raises on some
    data-parallel ranks]) and starts the accumulation again with the next batch."""
    model = build().to(dtype)
    opt = parity.make_optimizer(model)
    done = 0
    for i, (x, y) in enumerate(parity.batches(BATCHES, ROWS)):
        if i == FAILS:
            opt.zero_grad()
            done = 0
            continue
        (model(x, labels=y).loss / ACCUM).backward()
        done += 1
        if done == ACCUM:
            opt.step()
            opt.zero_grad()
            done = 0
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _every_rank_raises(rank: int, world: int, stage: int, checks: bool) -> dict[str, torch.Tensor]:
    engine = _engine(stage, checks, MICRO, ACCUM)
    local = ROWS // world
    for i, (x, y) in enumerate(parity.batches(BATCHES, ROWS)):
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        if i == FAILS:
            with pytest.raises(IndexError):
                engine.train_batch(_poison(x, MICRO - 1), y)
            continue  # the loop skips the batch
        engine.train_batch(x, y)
    out = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    return out


@pytest.mark.parametrize("world,stage,checks", [(1, 3, True), (2, 3, True), (2, 1, False)])
def test_a_batch_failing_on_every_rank_is_skipped_by_all(world, stage, checks):
    """Before, at stage 3 the units the failed forward had started stayed pinned and train_batch raised 'chunk [...]
    cannot be released while [...] are being computed on' in place of the forward's own error, for good."""
    results = run_distributed(_every_rank_raises, world, stage, checks, timeout=45) if world > 1 else None
    exact, plain = _reference(torch.float64), _reference(torch.float32)
    for got in results or [_every_rank_raises(0, 1, stage, checks)]:
        tolerance.assert_weights(got, exact, plain, dtype=torch.float32)


# ---- pipeline x data parallelism ----------------------------------------------------------------------------------
def _replica_raises(rank: int, world: int, stage: int, call: str) -> dict:
    """Pipeline 2 x data parallel 2: the second replica's batch 1 holds token ids out of range (its first stage
    raises); every loop skips the batch and goes on."""
    torch.set_num_threads(1)
    model = pipe_parity.build()
    config = {
        "zero_stage": stage,
        "chunk_size": parity.CHUNK,
        "comm_timeout": COMM_TIMEOUT,
        "parallel": {"pipeline": 2, "microbatches": MICRO},
    }
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    dp, local = engine.data_parallel_rank, ROWS // engine.data_parallel_size
    out: dict = {"dp": dp, "pp": engine.mesh.pp_rank, "errors": [], "losses": []}
    start = time.monotonic()
    for i, (x, y) in enumerate(parity.batches(3, ROWS)):
        x, y = x[dp * local : (dp + 1) * local], y[dp * local : (dp + 1) * local]
        if i == 1:
            start = time.monotonic()
            if dp == 1:
                x = _poison(x, 0)
        try:
            out["losses"].append(float(getattr(engine, call)(x, y)))
        except Exception as e:  # noqa: BLE001 (the type is part of what is checked)
            out["errors"].append(_outcome(e, start))
            if isinstance(e, CommError):
                break
    engine.close()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.parametrize("stage", [1, 3])
def test_a_stage_failing_on_one_replica_stops_every_rank_at_once_world4(stage):
    """Before, the healthy replica went on past the batch and waited in the data-parallel gradient reduction (at
    stage 3 in a gather) until comm_timeout, while the stopped one, skipping the batch, paired its next batch's
    collectives with those. The replicas agree as engine(...)'s forwards do: the checks find them apart at the healthy
    replica's next collective (at stage 3 a gather inside the batch, which stops its pipeline: its other stage, and
    the stopped replica's rank of it waiting in the agreement, stop with it)."""
    results = run_distributed(_replica_raises, 4, stage, "train_batch", timeout=50)
    for r in results:
        assert r["errors"], r
        kind, text, seconds = r["errors"][0]
        assert seconds < STOP_S, r
        if stage == 1 or r["pp"] == 0:  # global ranks 1 and 3 hold the second replica
            assert kind == "CollectiveMismatchError" and "nothing: its forward raised" in text, r
        elif r["dp"] == 0:  # the healthy replica's second stage: its first stage's gather failed
            assert kind == "PipelineCommError" and "raised during this batch" in text, r
        else:  # the stopped replica's second stage, in the agreement with the healthy one's
            assert kind == "RankFailedError" and "global rank 2 failed with PipelineCommError" in text, r


def _every_replica_raises(rank: int, world: int, stage: int, microbatch: int) -> dict[str, torch.Tensor]:
    """Pipeline 2 x data parallel 2: batch FAILS raises in `microbatch` on every replica's first stage; the loop
    skips it."""
    torch.set_num_threads(1)
    model = pipe_parity.build()
    config = {
        "zero_stage": stage,
        "chunk_size": parity.CHUNK,
        "comm_timeout": COMM_TIMEOUT,
        "grad_accumulation_steps": ACCUM,
        "parallel": {"pipeline": 2, "microbatches": MICRO},
    }
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    dp, local = engine.data_parallel_rank, ROWS // engine.data_parallel_size
    for i, (x, y) in enumerate(parity.batches(BATCHES, ROWS)):
        x, y = x[dp * local : (dp + 1) * local], y[dp * local : (dp + 1) * local]
        if i == FAILS:
            with pytest.raises(IndexError if engine.mesh.pp_rank == 0 else PipelineError):
                engine.train_batch(_poison(x, microbatch), y)
            continue  # the loop skips the batch
        engine.train_batch(x, y)
    out = {k: v.float() for k, v in engine.full_state_dict().items()}  # this stage's
    engine.close()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.parametrize("stage,microbatch", [(1, 1), (3, 0), (3, 1)])
def test_a_stage_failing_on_every_replica_is_skipped_by_all_world4(stage, microbatch):
    """Before, at stage 3 every replica that stopped posted its failure for good, and the job stopped."""
    results = run_distributed(_every_replica_raises, 4, stage, microbatch, timeout=50)
    exact, plain = _reference(torch.float64, pipe_parity.build), _reference(torch.float32, pipe_parity.build)
    for got in results:
        tolerance.assert_weights(got, {k: exact[k] for k in got}, plain, dtype=torch.float32)
    assert set().union(*results) == set(exact), "the stages hold every weight"


@ranks_apart(NEEDS_DEGREES)
def test_a_stage_failing_on_one_replica_in_eval_batch_raises_on_every_rank_world4():
    """Below stage 3 the replicas share nothing inside an evaluation: the loss's average over them says which replica
    stopped, every rank raises at once, and all evaluate the next batch. Before, the healthy replica waited in that
    average until comm_timeout, and the stopped one, skipping the batch, averaged its next loss with the others'."""
    results = run_distributed(_replica_raises, 4, 1, "eval_batch", timeout=50)
    losses = {tuple(r["losses"]) for r in results}
    assert len(losses) == 1 and len(next(iter(losses))) == 2, results  # batches 0 and 2, the same on every rank
    for r in results:
        assert len(r["errors"]) == 1, r
        kind, text, seconds = r["errors"][0]
        assert seconds < STOP_S, r
        if r["dp"] == 1:  # the replica that raised: its own error on its first stage, a PipelineError on the next
            assert kind == ("IndexError" if r["pp"] == 0 else "PipelineError"), r
        else:
            stopped = 1 if r["pp"] == 0 else 3  # the other replica's rank of this stage
            assert kind == "PipelineError" and f"the pipeline of global rank(s) {stopped} " in text, r


def _pipeline_stage3_raises(rank: int, world: int) -> dict:
    """Pipeline 2 at stage 3, one replica: a batch with token ids out of range in eval_batch and in train_batch."""
    torch.set_num_threads(1)
    model = pipe_parity.build()
    config = {"zero_stage": 3, "chunk_size": parity.CHUNK, "comm_timeout": COMM_TIMEOUT}
    config["parallel"] = {"pipeline": 2, "microbatches": MICRO}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    (x, y), *_ = parity.batches(1, ROWS // 2)
    out: dict = {"pp": engine.mesh.pp_rank, "errors": []}
    before = float(engine.eval_batch(x, y))
    for call in (engine.eval_batch, engine.train_batch):
        try:
            call(_poison(x, 1), y)
        except Exception as e:  # noqa: BLE001 (the type is part of what is checked)
            out["errors"].append(type(e).__name__)
    out["after"] = (float(engine.eval_batch(x, y)), before)
    engine.close()
    return out


@ranks_apart(NEEDS_DEGREES)
def test_a_stage_that_raises_inside_a_module_at_stage_3_keeps_its_error_and_the_engine():
    """A module that raises in its forward (the embedding, given ids out of range) leaves its units in use: before,
    ending the batch's gathers raised 'chunk [...] cannot be released while [...] are being computed on' on the stage
    that raised, in place of its IndexError, and eval_batch failed so from then on."""
    for r in run_distributed(_pipeline_stage3_raises, 2, timeout=45):
        assert r["errors"] == (["IndexError"] * 2 if r["pp"] == 0 else ["PipelineError"] * 2), r
        assert r["after"][0] == r["after"][1], r  # the same weights evaluate alike: nothing of the batch stayed
