"""[Note: gradients read inside train_batch]: `train_batch(..., on_grads=fn)` calls `fn(engine)` after the batch's
last backward and before its update, on every rank, and `engine.full_grads()` there gives the whole model's
gradients (every stage's parameters, tensor shards joined, the tied embedding under both its names) as a plain
single-process loop computes them for the mean loss over the same global batch: through pipeline stages (ZeRO 1 and
3, 2 or 4 micro-batches), pipeline x data and pipeline x tensor parallelism (world 4), Chimera, micro-batches
without stages, accumulation over several batches, and `train_batch` without a "parallel" section. Two updates
each, so that the second batch's gradients also say the update after a callback stepped on what it read (stage 1
over two data-parallel ranks reduces early for the callback: reduced twice, or not at all, the second update's
gradients are off). A callback that raises on one rank stops every rank within seconds, the raising rank with its
own error; on a one-rank job the batch is dropped and training goes on.

The model is the tiny pipelineable GPT of the pipeline tests with its embedding tied to the head (on the first and
the last stage). Tolerance (tests/tolerance.py): plain float64's gradients, within a factor of plain fp32's own
distance from them: hetero's are the same fp32 arithmetic summed in other orders (micro-batches, ranks, chunks).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import hetero
from hetero.models.gpt import GPTConfig
from hetero.models.gpt_pipe import TP_PLAN, GPTPipe

try:
    from tests import parity, pipe_parity, tolerance
    from tests.dist import NEEDS_DEGREES, ONE_RANK_FAULTS, ranks_apart, run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import NEEDS_DEGREES, ONE_RANK_FAULTS, ranks_apart, run_distributed  # type: ignore[no-redef]

ROWS, UPDATES = 8, 2  # rows of a global batch (data 2 x 4 micro-batches divide it), updates per run
COMM_TIMEOUT = 60  # what a rank left waiting would wait; the failure test's own timeout ends first
STOP_S = 15.0  # every rank has stopped within this (watch.POLL_S and a loaded CI machine's slack)


def _pipe(stage: int, micro: int, **more: Any) -> dict:
    return {"zero_stage": stage, "parallel": {"pipeline": 2, "microbatches": micro, **more}}


LAYOUTS: dict[str, tuple[int, dict]] = {  # name: (world, config)
    "pp2-z1-micro4": (2, _pipe(1, 4)),
    "pp2-z3-micro2": (2, _pipe(3, 2)),
    "pp2xdp2-z1-micro2": (4, _pipe(1, 2)),
    "pp2xtp2-z3-micro2": (4, _pipe(3, 2, tensor=2, tensor_plan=TP_PLAN)),
    "chimera-pp2-z1-micro2": (2, _pipe(1, 2, schedule="chimera")),  # both replicas' ranks in one ZeRO group
    "dp2-z1-micro2": (2, {"zero_stage": 1, "parallel": {"microbatches": 2}}),
}
ONE_RANK: dict[str, tuple[int, dict]] = {  # name: (grad_accumulation_steps, config), one process
    "micro2-z2-accum2": (2, {"zero_stage": 2, "parallel": {"microbatches": 2}}),
    "plain-z0": (1, {"zero_stage": 0}),
    "plain-z3-accum2": (2, {"zero_stage": 3}),
}


def _build() -> GPTPipe:
    torch.manual_seed(0)
    return GPTPipe(GPTConfig(**{**pipe_parity.CFG, "tie_weights": True}))


def _plain(dtype: torch.dtype, accum: int) -> list[dict[str, torch.Tensor]]:
    """A plain PyTorch loop's gradients of the mean loss at each update (`accum` global batches of ROWS rows each),
    under every name of each parameter (the tied one twice, as full_grads gives it)."""
    model = _build().to(dtype)
    opt = parity.make_optimizer(model)
    data = parity.batches(UPDATES * accum, ROWS)
    out = []
    for step in range(UPDATES):
        for x, y in data[step * accum : (step + 1) * accum]:
            (model(x, labels=y).loss / accum).backward()
        named = model.named_parameters(remove_duplicate=False)
        out.append({n: p.grad.detach().double().clone() for n, p in named if p.requires_grad})
        opt.step()
        opt.zero_grad()
    return out


def _train(rank: int, world: int, config: dict, accum: int = 1) -> dict[str, Any]:
    """UPDATES updates of `accum` batches each, reading the gradients in on_grads; what was read, per update."""
    torch.set_num_threads(1)
    model = _build()
    config = {"chunk_size": parity.CHUNK, "grad_accumulation_steps": accum, **config}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    dp, dpr = engine.data_parallel_size, engine.data_parallel_rank
    local = ROWS // dp
    reads: list[dict] = []

    def on_grads(e: hetero.Engine) -> str:
        assert e is engine
        reads.append({"all": e.full_grads(), "rank0": e.full_grads(rank0_only=True)})
        return "ignored"

    for x, y in parity.batches(UPDATES * accum, ROWS):
        engine.train_batch(x[dpr * local : (dpr + 1) * local], y[dpr * local : (dpr + 1) * local], on_grads=on_grads)
    engine.close()
    return {"reads": reads, "rank": rank}


def _check(results: list[dict], accum: int) -> None:
    exact, plain = _plain(torch.float64, accum), _plain(torch.float32, accum)
    for r in results:
        assert len(r["reads"]) == UPDATES, (r["rank"], len(r["reads"]))  # once per update, not per batch
    for step in range(UPDATES):
        got = results[0]["reads"][step]["all"]
        assert list(got) == list(exact[step]), (step, list(got))  # the plain model's names, in its order
        for k, e in exact[step].items():
            assert got[k].shape == e.shape and got[k].dtype == torch.float32, (step, k, got[k].shape, e.shape)
        tolerance.assert_weights(got, exact[step], plain[step], dtype=torch.float32)
        for r in results:  # every rank holds the same; rank0_only: rank 0 alone
            read = r["reads"][step]
            assert all(torch.equal(got[k], read["all"][k]) for k in got), (step, r["rank"])
            if r["rank"] == 0:
                assert all(torch.equal(got[k], read["rank0"][k]) for k in got), step
            else:
                assert read["rank0"] == {}, (step, r["rank"])


@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=ranks_apart(NEEDS_DEGREES) if "pp2" in k else ()) for k in LAYOUTS]
)
def test_on_grads_reads_a_plain_loops_gradients(layout):
    """Before: train_batch took no on_grads (TypeError), and nothing marked the batch's gradients readable."""
    world, config = LAYOUTS[layout]
    _check(run_distributed(_train, world, config, timeout=90), accum=1)


@pytest.mark.parametrize("name", list(ONE_RANK))
def test_on_grads_on_one_rank_and_over_accumulations(name):
    """Micro-batches without stages, and train_batch without a "parallel" section (engine.backward, then the
    callback, then step()); with grad_accumulation_steps 2 the callback runs at the second batch only, on the mean
    of both."""
    accum, config = ONE_RANK[name]
    _check([_train(0, 1, config, accum)], accum=accum)


# ---- a callback that raises --------------------------------------------------------------------------------------
RAISES: dict[str, tuple[int, dict]] = {  # name: (the rank whose callback raises, config)
    "pp2-z1, the first stage raises": (0, _pipe(1, 2)),
    "dp2-z3 micro-batches, no checks, rank 1 raises": (
        1,
        {"zero_stage": 3, "check_collectives": False, "parallel": {"microbatches": 2}},
    ),
}


class _Broken(RuntimeError):
    pass


def _one_callback_raises(rank: int, world: int, case: str) -> list[tuple[str, str, float]]:
    """The second batch's callback raises on one rank, before its full_grads; the others read the gradients. Each
    rank's errors (type, message and notes, seconds from the start of that batch); a loop that catches one goes on."""
    raiser, config = RAISES[case]
    torch.set_num_threads(1)
    model = _build()
    config = {"chunk_size": parity.CHUNK, "comm_timeout": COMM_TIMEOUT, **config}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    dp, dpr = engine.data_parallel_size, engine.data_parallel_rank
    local = ROWS // dp
    batch = [0]

    def on_grads(e: hetero.Engine) -> None:
        if batch[0] == 1 and rank == raiser:
            raise _Broken("the callback's own bug")
        e.full_grads()

    errors = []
    start = time.monotonic()
    for i, (x, y) in enumerate(parity.batches(3, ROWS)):
        batch[0] = i
        start = time.monotonic() if i == 1 else start
        try:
            engine.train_batch(
                x[dpr * local : (dpr + 1) * local], y[dpr * local : (dpr + 1) * local], on_grads=on_grads
            )
        except Exception as e:  # noqa: BLE001 (the type is part of what is checked)
            notes = "\n".join([str(e), *getattr(e, "__notes__", [])])
            errors.append((type(e).__name__, notes, time.monotonic() - start))
    engine.close()
    return errors


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.parametrize("case", list(RAISES))
def test_a_callback_raising_on_one_rank_stops_every_rank(case):
    """The raising rank gets its own error with a note; the others, waiting in full_grads' gathers or further on,
    RankFailedError naming it within seconds, not comm_timeout; every later batch is refused on every rank."""
    raiser = RAISES[case][0]
    results = run_distributed(_one_callback_raises, 2, case, timeout=45)
    for rank, errors in enumerate(results):
        assert len(errors) == 2, (rank, errors)  # batch 1's error, then batch 2 refused
        (kind, text, seconds), (then, refused, _) = errors
        assert seconds < STOP_S, (rank, errors)
        if rank == raiser:
            assert kind == "_Broken" and "on_grads raised on this rank" in text, (rank, errors)
        else:
            assert kind == "RankFailedError" and f"global rank {raiser} failed with _Broken" in text, (rank, errors)
        assert then == "RankFailedError" and "refused" in refused, (rank, errors)


def test_a_callback_raising_on_a_one_rank_job_drops_the_batch():
    """The error reaches the caller, the accumulation's gradients are dropped (as a batch that raises drops them),
    and the next batch's gradients are that batch's alone, from the weights as they were: a plain loop that skips
    the batch. Before the drop, the dropped batch's gradients stayed and were added to the next one's."""
    torch.set_num_threads(1)
    model = _build()
    config = {"chunk_size": parity.CHUNK, "zero_stage": 2, "parallel": {"microbatches": 2}}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    (x0, y0), (x1, y1) = parity.batches(2, ROWS)
    with pytest.raises(_Broken):
        engine.train_batch(x0, y0, on_grads=lambda e: (_ for _ in ()).throw(_Broken("bug")))
    read: dict[str, torch.Tensor] = {}
    engine.train_batch(x1, y1, on_grads=lambda e: read.update(e.full_grads()))
    assert engine.global_steps == 1
    engine.close()
    grads = {}
    for dtype in (torch.float64, torch.float32):
        plain = _build().to(dtype)
        plain(x1, labels=y1).loss.backward()
        grads[dtype] = {n: p.grad for n, p in plain.named_parameters(remove_duplicate=False)}
    assert list(read) == list(grads[torch.float64])
    tolerance.assert_weights(read, grads[torch.float64], grads[torch.float32], dtype=torch.float32)


def test_on_grads_must_be_callable():
    model = _build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {"chunk_size": parity.CHUNK})
    x, y = parity.batches(1, ROWS)[0]
    with pytest.raises(TypeError, match="on_grads must be a callable taking the engine"):
        engine.train_batch(x, y, on_grads=True)
    engine.close()
