"""A forward that raises (token ids out of range, a shape error, an out-of-memory error, an interrupted evaluation)
and the loop that skips its batch, as plain PyTorch loops do ([Note: a forward that fails] in hetero/engine.py).
Before, at stage 3 the parameters the failing modules had pinned stayed pinned and the next step raised "cannot be
released while [...] are being computed on" for good; at every stage the failed forward's step stayed open and the
next forward joined it.

A forward adds no gradient: the accumulation keeps the micro-batches before the failure, as plain PyTorch does, and
the run must match plain PyTorch's loop that skips the batch, checked against the float64 run ([Note: tolerances
from the arithmetic] in tests/tolerance.py). Over two ranks a batch that fails on every rank is skipped by all; one
that fails on one rank only stops both with an error naming it, instead of hanging.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import hetero
from hetero.errors import CollectiveMismatchError

try:
    from tests import parity, tolerance
    from tests.dist import ONE_RANK_FAULTS, ranks_apart, run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import ONE_RANK_FAULTS, ranks_apart, run_distributed  # type: ignore[no-redef]

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


def _run(rank: int, world: int, stage: int, mode: str, failing: tuple[int, ...], extra: dict) -> dict:
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
def test_a_forward_failing_on_every_rank_is_skipped_by_all_world2(stage):
    results = run_distributed(_run, 2, stage, "train", (0, 1), {}, timeout=300)
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
