"""A backward that raises (out of memory, a check in a backward hook) and the loop that skips its batch, as plain
PyTorch loops do after `optimizer.zero_grad()` ([Note: a backward that fails] in hetero/engine.py). Before, the part
of the gradient the failed backward had added stayed in the chunks and the next update stepped on it.

Where every rank fails at the same micro-batch (a deterministic failure), the run must match plain PyTorch's loop
that drops the whole accumulation and starts it again, checked against the float64 run ([Note: tolerances from the
arithmetic] in tests/tolerance.py). Where one rank fails alone, every rank stops within seconds with an error naming
it: before, the failed rank ended its backward with the reductions its peers had already run, paired with their
update's or next batch's collectives (gloo aborted its process on the mismatched sizes), or, without the checks,
its peers waited until comm_timeout. A backward that raises on one rank of a tensor-parallel group (1D, with data or
pipeline parallelism) stops every rank within seconds too, naming it and its error; before, its tensor peers waited in
the block's backward all-reduce until comm_timeout. Its update and next batch are refused.
"""

from __future__ import annotations

import time

import pytest
import torch

import hetero
from hetero.errors import CommError

try:
    from tests import parity, tolerance
    from tests.dist import ONE_RANK_FAULTS, ranks_apart, run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import ONE_RANK_FAULTS, ranks_apart, run_distributed  # type: ignore[no-redef]

MICRO, ROWS = 8, 4
FAILS = 3  # the micro-batch whose backward raises: the second of the second accumulation at 2 a step
COMM_TIMEOUT = 60  # what a rank left waiting would wait; the runs' own timeouts end first
STOP_S = 15.0  # every rank has stopped within this (watch.POLL_S and a loaded CI machine's slack)


class _Boom(Exception):
    pass


class _FailingBackward(torch.autograd.Function):
    """The identity whose backward raises: a failure at the loss, before any gradient reaches the model."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        raise _Boom("out of memory at the loss (simulated)")


def _arm(model: torch.nn.Module) -> dict:
    """A backward hook on the first layer that raises while armed: late in backward, most reductions issued."""
    state = {"armed": False}

    def hook(module, grad_in, grad_out):
        if state["armed"]:
            raise _Boom("out of memory (simulated)")

    model.layers[0].register_full_backward_hook(hook)
    return state


def _reference(dtype: torch.dtype, accum: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: zero_grad at each accumulation's start; a failed backward's accumulation is dropped whole."""
    model = parity.build().to(dtype)
    opt = parity.make_optimizer(model)
    state = _arm(model)
    done = 0
    for i, (x, y) in enumerate(parity.batches(MICRO, ROWS)):
        state["armed"] = i == FAILS
        try:
            (model(x, labels=y).loss / accum).backward()
        except _Boom:
            opt.zero_grad()
            done = 0
            continue
        done += 1
        if done == accum:
            opt.step()
            opt.zero_grad()
            done = 0
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _run(
    rank: int, world: int, stage: int, accum: int, checks: bool = True, in_backward: bool = False, at_loss: bool = False
) -> dict[str, torch.Tensor]:
    """Every rank's backward of micro-batch FAILS raises (in the first layer's hook, or at the loss)."""
    torch.set_num_threads(1)
    model = parity.build()
    state = _arm(model)
    config = {
        "zero_stage": stage,
        "chunk_size": parity.CHUNK,
        "grad_accumulation_steps": accum,
        "check_collectives": checks,
        "update_in_backward": in_backward,
        "comm_timeout": COMM_TIMEOUT,
    }
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    local = ROWS // world
    for i, (x, y) in enumerate(parity.batches(MICRO, ROWS)):
        state["armed"] = i == FAILS and not at_loss
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        loss = engine(x, labels=y).loss
        try:
            engine.backward(_FailingBackward.apply(loss) if i == FAILS and at_loss else loss)
        except _Boom:
            continue  # the loop skips the batch: no step() for it
        engine.step()
    out = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    return out


# stage, accum, check_collectives, update_in_backward, failing at the loss (with update_in_backward: before any chunk
# steps; one that fails after some stepped is not undone, and its error says so)
ALL_FAIL = [
    (0, 2, True, False, False),
    (1, 1, True, False, False),
    (3, 2, True, False, False),
    (2, 2, False, False, False),
    (1, 1, False, True, True),
    (3, 1, True, True, True),
]


@pytest.mark.parametrize("stage,accum,checks,in_backward,at_loss", ALL_FAIL)
def test_a_failed_backward_leaves_nothing_in_the_next_update_world2(stage, accum, checks, in_backward, at_loss):
    """Without the checks the ranks agree in the job's store that each raised at the same point
    ([Note: failures scoped to a point] in hetero/comm/watch.py), and go on together."""
    results = run_distributed(_run, 2, stage, accum, checks, in_backward, at_loss, timeout=COMM_TIMEOUT - 15)
    exact, plain = _reference(torch.float64, accum), _reference(torch.float32, accum)
    for got in results:
        tolerance.assert_weights(got, exact, plain, dtype=torch.float32)


# ---- one rank's backward raises: every rank stops at once ----------------------------------------------------------
ONE_FAILS = {  # name: (zero stage, check_collectives, grad_accumulation_steps, update_in_backward, the failing batch)
    "stage 0, between updates": (0, True, 2, False, 2),
    "stage 1, train_batch, no checks": (1, False, 1, False, 1),
    "stage 1, train_batch": (1, True, 1, False, 1),
    "stage 2, update in backward, no checks": (2, False, 2, True, 3),
    "stage 3, no checks, between updates": (3, False, 2, False, 2),
    "stage 3, update in backward": (3, True, 1, True, 1),
}


def _one_rank_fails(rank: int, world: int, case: str) -> list[tuple[str, str, float]]:
    """Rank 1's backward of one batch raises in the first layer's hook; the loop skips a batch that raised and goes
    on (engine.backward and step, or train_batch with one micro-batch, which calls engine.backward). Each error,
    with the seconds from the start of the failing batch."""
    stage, checks, accum, in_backward, fails = ONE_FAILS[case]
    torch.set_num_threads(1)
    model = parity.build()
    state = _arm(model)
    config = {
        "zero_stage": stage,
        "chunk_size": parity.CHUNK,
        "comm_timeout": COMM_TIMEOUT,
        "check_collectives": checks,
        "grad_accumulation_steps": accum,
        "update_in_backward": in_backward,
    }
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    local = ROWS // world
    errors: list[tuple[str, str, float]] = []
    start = time.monotonic()
    for i, (x, y) in enumerate(parity.batches(6, ROWS)):
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        if i == fails:
            start = time.monotonic()
        state["armed"] = i == fails and rank == 1
        try:
            if "train_batch" in case:
                engine.train_batch(x, y)
            else:
                engine.backward(engine(x, labels=y).loss)
                engine.step()
        except Exception as e:  # noqa: BLE001 (the type is part of what is checked)
            errors.append(
                (type(e).__name__, "\n".join([str(e), *getattr(e, "__notes__", [])]), time.monotonic() - start)
            )
            if isinstance(e, CommError):
                break
    engine.close()
    return errors


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.parametrize("case", list(ONE_FAILS))
def test_a_backward_failing_on_one_rank_stops_every_rank_at_once_world2(case):
    """Before: the failed rank ended its backward (the reductions its peers had run already) and paired them with
    its peers' update or next batch: gloo aborted a process ("Received data size doesn't match expected size"), or,
    without the checks, rank 0 waited until comm_timeout. Now: with the checks the failed rank posts a check before
    ending its backward, which meets rank 0's next collective; without them it posts its failure for that backward
    and point, and rank 0 stops at its next wait."""
    checks = ONE_FAILS[case][1]
    r0, r1 = run_distributed(_one_rank_fails, 2, case, timeout=COMM_TIMEOUT - 15)
    assert r0 and r1, (r0, r1)
    kind, text, seconds = r0[0]
    assert seconds < STOP_S, r0
    if checks:
        assert kind == "CollectiveMismatchError", r0
        assert "rank 1: collective #" in text and "nothing: its backward raised, and it drops the accumulation" in text
        assert "or a backward did" in text, r0
        kind, text, seconds = r1[0]
        assert kind == "CollectiveMismatchError" and seconds < STOP_S, r1  # raised from its own error
    else:
        assert kind == "RankFailedError" and "global rank 1 failed with _Boom" in text, r0
        assert "in its backward" in text, r0
        (kind, text, seconds), (then, refused, _) = r1
        assert kind == "_Boom" and seconds < STOP_S, r1
        assert "global rank(s) 0 of data-parallel group [0, 1] did not raise at this point of engine.backward" in text
        assert then == "RankFailedError" and "refused" in refused, r1  # its next batch: it told every rank to stop


# ---- train_batch's loss_fn raises (one micro-batch): agreed as the forward is ------------------------------------
def _loss_fn_fails(rank: int, world: int, stage: int, checks: bool, failing: tuple[int, ...]) -> dict:
    """train_batch with a loss_fn given, one micro-batch: the ranks in `failing` pass labels out of the vocabulary
    to it in batch FAILS (cross_entropy raises IndexError); the loop skips a batch that raised and goes on. Each
    error with the seconds from the start of that batch, and the weights at the end where no rank stopped."""
    torch.set_num_threads(1)
    model = parity.build()
    config = {
        "zero_stage": stage,
        "chunk_size": parity.CHUNK,
        "comm_timeout": COMM_TIMEOUT,
        "check_collectives": checks,
    }
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    local = ROWS // world
    errors: list[tuple[str, str, float]] = []
    start = time.monotonic()
    for i, (x, y) in enumerate(parity.batches(MICRO, ROWS)):
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        if i == FAILS:
            start = time.monotonic()
            y = y + 1000 if rank in failing else y
        try:
            engine.train_batch(x, y, loss_fn=lambda out, labels: model.loss_function(out.logits, labels))
        except Exception as e:  # noqa: BLE001 (the type is part of what is checked)
            errors.append(
                (type(e).__name__, "\n".join([str(e), *getattr(e, "__notes__", [])]), time.monotonic() - start)
            )
            if isinstance(e, CommError):
                break
    stopped = any(kind != "IndexError" for kind, _, _ in errors)
    weights = None if stopped else {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {"errors": errors, "weights": weights}


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.parametrize("stage,checks", [(1, True), (2, False)])
def test_a_loss_fn_failing_on_one_rank_stops_every_rank_at_once_world2(stage, checks):
    """Before: train_batch with one micro-batch computed loss_fn outside any agreement: rank 1 skipped the batch
    while rank 0 went into its backward's reductions, which rank 1's next batch met (with the checks too: the same
    collectives, a batch apart), and rank 0 waited for the last ones until comm_timeout."""
    r0, r1 = run_distributed(_loss_fn_fails, 2, stage, checks, (1,), timeout=COMM_TIMEOUT - 15)
    (kind, text, seconds) = r0["errors"][0]
    assert seconds < STOP_S, r0
    if checks:
        assert kind == "CollectiveMismatchError" and "nothing: its forward raised" in text, r0
        assert r1["errors"][0][0] == "CollectiveMismatchError" and r1["errors"][0][2] < STOP_S, r1
    else:
        assert kind == "RankFailedError" and "global rank 1 failed with IndexError" in text, r0
        (kind, text, seconds), (then, refused, _) = r1["errors"]
        assert kind == "IndexError" and seconds < STOP_S and "did not raise at this point" in text, r1
        assert then == "RankFailedError" and "refused" in refused, r1


@pytest.mark.parametrize("stage,checks", [(1, False), (3, True)])
def test_a_loss_fn_failing_on_every_rank_skips_the_batch_world2(stage, checks):
    """Every rank's loss_fn raises in batch FAILS: all skip it together, with nothing of it in the weights (plain
    PyTorch skipping that batch; with one micro-batch a step, the same as dropping its accumulation)."""
    results = run_distributed(_loss_fn_fails, 2, stage, checks, (0, 1), timeout=COMM_TIMEOUT - 15)
    exact, plain = _reference(torch.float64, 1), _reference(torch.float32, 1)
    for got in results:
        assert [kind for kind, _, _ in got["errors"]] == ["IndexError"], got["errors"]
        tolerance.assert_weights(got["weights"], exact, plain, dtype=torch.float32)


# ---- tensor parallelism: one tensor rank's backward raises ---------------------------------------------------------
TP_LAYOUTS = {  # name: (world size, zero stage, check_collectives, parallel)
    "tp2": (2, 1, True, {"tensor": 2}),
    "tp2, no checks": (2, 0, False, {"tensor": 2}),
    "tp2-dp2": (4, 3, True, {"tensor": 2}),
    "tp2-dp2, no checks": (4, 1, False, {"tensor": 2}),
    # Global ranks 0 and 1 are the first stage (the embedding and layers.0); the backward raises inside train_batch.
    "tp2-pp2": (4, 1, True, {"tensor": 2, "pipeline": 2, "microbatches": 2, "pipeline_split": ["layers.1"]}),
}


def _tensor_rank_fails(rank: int, world: int, layout: str) -> dict:
    """Global rank 1's backward raises at the output of a tensor-parallel block's row-parallel layer (o_proj), before
    the block's backward all-reduce (its column-parallel input's); its loop skips the batch and goes on."""
    from hetero.models.gpt_pipe import TP_PLAN

    try:
        from tests import pipe_parity
    except ImportError:  # tests/ itself on sys.path
        import pipe_parity  # type: ignore[no-redef]

    torch.set_num_threads(1)
    _, stage, checks, parallel = TP_LAYOUTS[layout]
    model = pipe_parity.build()
    config = {"zero_stage": stage, "chunk_size": parity.CHUNK, "comm_timeout": COMM_TIMEOUT}
    config["check_collectives"] = checks
    engine = hetero.initialize(
        model, parity.make_optimizer(model), {**config, "parallel": {**parallel, "tensor_plan": TP_PLAN}}
    )
    if rank == 1:
        o_proj = next(m for n, m in model.named_modules() if n.endswith("attn.o_proj"))
        o_proj.register_forward_hook(lambda module, args, out: _FailingBackward.apply(out))
    (x, y), *_ = parity.batches(1, ROWS, seq=16)
    if "dp2" in layout:  # data-parallel groups [0, 2] and [1, 3]
        local = ROWS // 2
        x, y = x[(rank // 2) * local : (rank // 2 + 1) * local], y[(rank // 2) * local : (rank // 2 + 1) * local]
    out: dict = {}
    start = time.monotonic()
    for attempt in ("first", "step", "next"):  # a loop that steps after a failed backward, then goes on
        try:
            if attempt == "step":
                if rank != 1:
                    continue
                engine.step()
            elif engine.stages is not None:
                engine.train_batch(x, y)
            else:
                engine.backward(engine(x, labels=y).loss)
                engine.step()
        except Exception as e:  # noqa: BLE001 (the type is part of what is checked)
            out[attempt] = (type(e).__name__, "\n".join([str(e), *getattr(e, "__notes__", [])]))
            if attempt == "first" and rank != 1:
                break  # a peer stops at its error
    out["seconds"] = time.monotonic() - start
    engine.close()
    return out


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_a_backward_failing_on_one_tensor_rank_stops_every_rank_at_once(layout):
    """Before, its tensor peers waited inside the block's backward all-reduce until comm_timeout, while the rank that
    raised went on to its next batch."""
    world = TP_LAYOUTS[layout][0]
    results = run_distributed(_tensor_rank_fails, world, layout, timeout=COMM_TIMEOUT - 15)
    where = "train_batch" if "pp2" in layout else "engine.backward"
    for rank, r in enumerate(results):
        assert r["seconds"] < STOP_S, (rank, r)
        kind, text = r["first"]
        if rank == 1:
            assert kind == "_Boom" and "cannot skip a batch, not even when every rank" in text, text
            assert f"({where} raised here)" in text, text
            # Its update (part of a gradient in the chunks) and its next batch are refused: their collectives would
            # pair with those its peers left waiting.
            for attempt, what in (("step", "engine.step"), ("next", "train_batch" if "pp2" in layout else "a forward")):
                kind, text = r[attempt]
                assert kind == "RankFailedError" and f"{what} on global rank 1 refused" in text, text
                assert "out of memory at the loss" in text, text
        elif kind == "RankFailedError":
            assert "global rank 1 failed with _Boom: out of memory at the loss (simulated)" in text, (rank, text)
            assert f"in {where} of tensor-parallel group [0, 1]" in text, (rank, text)
        else:  # the other stage of a pipeline: stopped by the stage that raised
            assert "pp2" in layout and kind == "PipelineError" and "raised during this batch" in text, (rank, r)
