"""The ranks of a tensor-parallel or sequence-parallel group must feed the same batch; when one does not (a loader
sharded by global rank, a last partial batch on one rank, another sequence length), every rank of the group stops
with the same `BatchMismatchError` naming each rank's shapes, before any collective could hang or mix up data
([Note: a batch agreed over the model-parallel group] in hetero/parallel/agree.py)."""

from __future__ import annotations

import pytest
import torch

from hetero.models.gpt_pipe import TP_PLAN
from tests.dist import NEEDS_DEGREES, ranks_apart

try:
    from tests import parity, pipe_parity
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

TP2 = {"tensor": 2, "tensor_plan": TP_PLAN}
ULYSSES2 = {"tensor": 2, "tensor_plan": TP_PLAN, "sequence": "ulysses"}
RING2 = {"tensor": 2, "tensor_plan": TP_PLAN, "sequence": "ring"}

# name: (config, call, what rank 1 is given instead of rank 0's batch)
CASES = {
    "tp2-train_batch-seq": ({"zero_stage": 1, "parallel": TP2}, "train_batch", "seq"),
    "tp2-micro2-train_batch-rows": (
        {"zero_stage": 3, "parallel": {**TP2, "microbatches": 2}},
        "train_batch",
        "rows",
    ),
    "tp2-forward-rows": ({"zero_stage": 2, "parallel": TP2}, "forward", "rows"),
    "tp2-eval_batch-seq": ({"zero_stage": 1, "parallel": TP2}, "eval_batch", "seq"),
    "tp2-train_batch-values": ({"zero_stage": 1, "parallel": TP2}, "train_batch", "values"),
    "tp2-megatron-sp-seq": ({"zero_stage": 1, "parallel": {**TP2, "sequence": True}}, "train_batch", "seq"),
    "ulysses2-train_batch-seq": ({"zero_stage": 1, "parallel": ULYSSES2}, "train_batch", "seq"),
    "ring2-forward-seq": ({"zero_stage": 3, "parallel": RING2}, "forward", "seq"),
}


def _batch(rank: int, change: str) -> tuple[torch.Tensor, torch.Tensor]:
    (x, y), (x2, y2) = parity.batches(2, 4, seq=16)
    if rank == 1 and change == "seq":
        return x[:, :8], y[:, :8]  # another sequence length
    if rank == 1 and change == "rows":
        return x[:2], y[:2]  # a last partial batch
    if rank == 1 and change == "values":
        return x2, y2  # the same shapes, other samples
    return x, y


def _run(engine, call: str, x: torch.Tensor, y: torch.Tensor) -> float:
    if call == "train_batch":
        return float(engine.train_batch(x, y))
    if call == "eval_batch":
        return float(engine.eval_batch(x, y))
    loss = engine(x, labels=y).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _cases(rank: int, world: int, cases: dict) -> dict:
    import hetero

    torch.set_num_threads(1)
    out = {}
    for name, (config, call, change) in cases.items():
        model = pipe_parity.build()
        engine = hetero.initialize(
            model, parity.make_optimizer(model), {**config, "chunk_size": parity.CHUNK, "comm_timeout": 60}
        )
        try:
            _run(engine, call, *_batch(rank, change))
            error = None
        except Exception as err:  # every rank must raise, and the same error
            error = (type(err).__name__, str(err))
        # Nothing ran: the engine goes on with batches that agree, on every rank.
        after = _run(engine, call, *_batch(0, "none"))
        engine.close()
        out[name] = {"error": error, "after": after}
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(240)
def test_a_rank_given_another_batch_stops_every_rank_of_its_group():
    results = run_distributed(_cases, 2, CASES, timeout=200)
    for name, (_, _, change) in CASES.items():
        errors = [r[name]["error"] for r in results]
        assert all(e is not None for e in errors), f"{name}: a rank did not raise: {errors}"
        assert errors[0] == errors[1], f"{name}: the ranks raised different errors: {errors}"
        kind, message = errors[0]
        assert kind == "BatchMismatchError", (name, message)
        group = "sequence-parallel" if name.startswith(("ulysses", "ring")) else "tensor-parallel"
        assert group in message, (name, message)
        if change == "values":
            assert "values" in message and "check_collectives" in message, message
        else:  # each rank's shapes, and what to do
            rows, seq = (4, 8) if change == "seq" else (2, 16)
            mine = [line for line in message.splitlines() if line.startswith("  rank ")]
            assert len(mine) == 2 and "torch.int64 (4, 16)" in mine[0], message
            assert f"torch.int64 ({rows}, {seq})" in mine[1] and "(4, 16)" not in mine[1], message
            assert "data_parallel_rank" in message and "drop_last" in message, message
        assert results[0][name]["after"] == results[1][name]["after"], name


def _values_unchecked(rank: int, world: int) -> float:
    import hetero

    torch.set_num_threads(1)
    model = pipe_parity.build()
    config = {"zero_stage": 1, "parallel": TP2, "check_collectives": False, "chunk_size": parity.CHUNK}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    loss = float(engine.train_batch(*_batch(rank, "values")))  # shapes agree: only the values' check would stop it
    assert engine.agree.checks == 1  # one per batch: the forward inside train_batch is covered by its check
    engine.close()
    return loss


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(120)
def test_values_are_compared_only_with_check_collectives():
    results = run_distributed(_values_unchecked, 2, timeout=90)
    assert all(r == r for r in results)  # ran (garbage in, but no error and no hang)


PIPE = {"zero_stage": 1, "parallel": {**TP2, "pipeline": 2, "microbatches": 2}, "chunk_size": parity.CHUNK}


def _pipeline(rank: int, world: int) -> dict:
    import hetero

    torch.set_num_threads(1)
    model = pipe_parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {**PIPE, "comm_timeout": 60})
    x, y = _batch(0, "none")
    stage = engine.mesh.pp_rank
    try:  # rank 1 (stage 0, tensor rank 1) is given a shorter sequence: stage 1 would wait for it
        engine.train_batch(*_batch(rank, "seq"))
        error = None
    except Exception as err:
        error = (type(err).__name__, str(err))
    # Each stage's ranks agree among themselves: a later stage may be given no inputs, an earlier one no labels.
    loss = float(engine.train_batch(x if stage == 0 else None, y if stage == 1 else None))
    engine.close()
    return {"error": error, "loss": loss, "stage": stage}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(120)
def test_a_mismatch_on_one_stage_stops_every_stage():
    results = run_distributed(_pipeline, 4, timeout=100)
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    errors = [r["error"] for r in results]
    assert all(e is not None and e == errors[0] for e in errors), errors  # stage 1's ranks too, the same error
    kind, message = errors[0]
    assert kind == "BatchMismatchError" and "tensor-parallel group of pipeline stage 0 (global ranks [0, 1])" in message
    assert "torch.int64 (4, 8)" in message and "global ranks [0, 1, 2, 3]) stops with this error" in message, message
    assert len({r["loss"] for r in results}) == 1


SPLITS = {  # a sequence split over a pipeline, every rank given the same batch of a length the split cannot cut
    "megatron-seq15": ({**TP2, "sequence": True}, 15, "2 equal parts"),
    "ring-seq6": (RING2, 6, "4 equal parts"),  # ring cuts 2 x 2 zig-zag chunks: 6 divides by 2, not by 4
}


def _split_lengths(rank: int, world: int) -> dict:
    import time

    import hetero

    torch.set_num_threads(1)
    out = {}
    for name, (parallel, seq, _) in SPLITS.items():
        model = pipe_parity.build()
        config = {"zero_stage": 1, "parallel": {**parallel, "pipeline": 2, "microbatches": 2}}
        engine = hetero.initialize(model, parity.make_optimizer(model), {**config, "chunk_size": parity.CHUNK})
        (x, y), _ = parity.batches(2, 4, seq=16)
        start = time.monotonic()
        try:
            engine.train_batch(x[:, :seq], y[:, :seq])
            error = None
        except Exception as err:
            error = (type(err).__name__, str(err))
        # Refused before stage 0 scattered the sequence: the engine goes on with a length that divides.
        out[name] = {"error": error, "seconds": time.monotonic() - start, "after": float(engine.train_batch(x, y))}
        engine.close()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(180)
def test_a_sequence_length_the_split_cannot_cut_stops_every_stage_at_once():
    """Without the check stage 0 raised in its scatter and stage 1 waited for its activations until comm_timeout
    (600 s by default), then blamed stage 0 as dead or hung."""
    results = run_distributed(_split_lengths, 4, timeout=150)
    for name, (_, seq, parts) in SPLITS.items():
        errors = [r[name]["error"] for r in results]
        assert all(e is not None and e == errors[0] for e in errors), (name, errors)
        kind, message = errors[0]
        assert kind == "ConfigError" and f"length {seq}" in message and parts in message, message
        assert "pad" in message and "global ranks [0, 1, 2, 3]" in message, message
        assert all(r[name]["seconds"] < 30 for r in results), (name, [r[name]["seconds"] for r in results])
        assert len({r[name]["after"] for r in results}) == 1, name


MESHES = [  # (tensor, pipeline, sequence)
    (2, 2, 1),
    (1, 2, 2),
    (2, 1, 1),
    (1, 2, 1),
    (2, 4, 1),
]


def _meshes(rank: int, world: int) -> list[list[int]]:
    from hetero.comm import Comm
    from hetero.parallel.mesh import Mesh

    out = []
    for t, p, s in MESHES:
        mesh = Mesh.build(Comm.world(), tensor=t, pipeline=p, sequence=s)
        out.append(mesh.batch_group.global_ranks)
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(120)
def test_the_batch_group_is_every_rank_reading_one_batch_in_stage_order():
    results = run_distributed(_meshes, 8, timeout=100)
    expected = [
        [[0, 1, 4, 5], [2, 3, 6, 7]],  # tensor 2 x pipeline 2 (x data 2): a data rank's tensor ranks on both stages
        [[0, 1, 4, 5], [2, 3, 6, 7]],  # sequence groups of 2 in data 4, on both stages
        [[0, 1], [2, 3], [4, 5], [6, 7]],  # no pipeline: the tensor group itself
        [],  # no tensor or sequence split: no group (a group-less Comm, which names its one rank 0)
        [list(range(8))],  # tensor 2 x pipeline 4: the world
    ]
    for i, parts in enumerate(expected):
        for rank, r in enumerate(results):
            assert r[i] == next((p for p in parts if rank in p), [0]), (MESHES[i], rank, r[i])
