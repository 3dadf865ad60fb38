"""Pipelines given what goes wrong: a stage that raises in evaluation, inputs a pipeline cannot take, outputs that are
not tensors; each stops every stage at once with a clear error and leaves the engine usable."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import hetero
from tests.dist import NEEDS_DEGREES, ranks_apart

try:
    from tests import parity, pipe_parity
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

COMM_TIMEOUT = 20  # seconds: what a stage left waiting would wait before its RankTimeoutError


def _outcome(call) -> tuple[tuple[str, str] | None, float]:
    """(the error's type and text, or None; seconds until it came)."""
    start = time.monotonic()
    try:
        call()
        error = None
    except Exception as e:  # noqa: BLE001 (the type is part of what is checked)
        error = (type(e).__name__, str(e))
    return error, time.monotonic() - start


def _fails(message: str):
    def fail(*_: object) -> None:
        raise RuntimeError(message)

    return fail


def _eval_with_a_stage_that_raises(rank: int, world: int, stage: int) -> dict:
    """Pipeline 2 (ZeRO `stage`): eval_batch where the first stage raises (a forward hook), where the last stage's
    loss_fn raises, and where the last stage raises without labels (the outputs' path); each rank's error and how
    long it took, then eval_batch and train_batch run on."""
    torch.set_num_threads(1)
    model = pipe_parity.build()
    config = {"zero_stage": stage, "comm_timeout": COMM_TIMEOUT, "chunk_size": parity.CHUNK}
    config["parallel"] = {"pipeline": 2, "microbatches": 2, "pipeline_split": "params"}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    (x, y), _ = parity.batches(2, 4)
    pp = engine.mesh.pp_rank
    ce = nn.functional.cross_entropy

    def loss_fn(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ce(out.flatten(0, 1), labels.flatten())

    cases = {
        "first stage's hook": (0, "embed", lambda: engine.eval_batch(x, y)),
        "last stage's loss_fn": (None, None, lambda: engine.eval_batch(x, y, loss_fn=_fails("the loss failed"))),
        "last stage's hook, no labels": (1, "head", lambda: engine.eval_batch(x)),
    }
    out: dict = {"stage": pp, "errors": {}}
    before = float(engine.eval_batch(x, y))
    for name, (where, module, call) in cases.items():
        handle = None
        if where == pp:
            handle = getattr(engine.module, module).register_forward_hook(_fails(f"user code failed ({name})"))
        out["errors"][name] = _outcome(call)
        if handle is not None:
            handle.remove()
    out["after"] = [float(engine.eval_batch(x, y)), before, float(engine.train_batch(x, y, loss_fn=loss_fn))]
    engine.close()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 3])
def test_a_stage_that_raises_in_eval_batch_stops_every_stage_at_once(stage):
    """The rank that raised gets its own error, the other a PipelineError naming it, at once; eval_batch and
    train_batch then run on. Before, evaluation had no stop: the stage after the one that raised waited for its
    activation, the stage before it in its sends (the loss's or the outputs' collective after them) until
    comm_timeout, and the pipeline's transfers failed for good after ('Application timeout caused pair closure')."""
    results = run_distributed(_eval_with_a_stage_that_raises, 2, stage, timeout=200)
    for r in results:
        for name, (error, seconds) in r["errors"].items():
            assert error is not None and seconds < COMM_TIMEOUT / 2, (name, r)
            kind, message = error
            raiser = 0 if name.startswith("first") else 1
            if r["stage"] == raiser:
                assert kind == "RuntimeError" and "failed" in message, (name, r)
            else:
                assert kind == "PipelineError", (name, r)
                assert f"pipeline rank {raiser} (global rank {raiser}) raised" in message, (name, r)
        evaluated, before, _ = r["after"]
        assert evaluated == before, r  # the same weights evaluate alike: nothing of the failed batches stayed
    assert len({r["after"][2] for r in results}) == 1


def _inputs_and_losses_a_pipeline_cannot_take(rank: int, world: int) -> dict:
    """A pipelined Hugging Face Llama given a tokenizer's dict (input_ids and attention_mask), and loss_fns that return
    a pair or a per-token loss; each rank's error, then a batch of token ids that trains."""
    from tests import grid_parity

    torch.set_num_threads(1)
    model = grid_parity.build("llama")
    config = {"zero_stage": 1, "comm_timeout": COMM_TIMEOUT, "chunk_size": grid_parity.CHUNK}
    config["parallel"] = {"pipeline": 2, "microbatches": 2, "pipeline_split": ["model.layers.1"]}
    engine = hetero.initialize(model, grid_parity.optimizer(model), config)
    x, y = grid_parity.batches("llama")[0]

    def ce(out: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction=reduction)

    cases = {
        "a tokenizer's token types": lambda: engine.train_batch({"input_ids": x, "token_type_ids": 0 * x}, y),
        "a pair from loss_fn": lambda: engine.train_batch(x, y, loss_fn=lambda o, t: (ce(o, t), o)),
        "a per-token loss": lambda: engine.train_batch(x, y, loss_fn=lambda o, t: ce(o, t, "none")),
        "a per-token loss in eval": lambda: engine.eval_batch(x, y, loss_fn=lambda o, t: ce(o, t, "none")),
    }
    out: dict = {"stage": engine.mesh.pp_rank, "errors": {}}
    for name, call in cases.items():
        out["errors"][name] = _outcome(call)
    out["after"] = float(engine.train_batch(x, y))
    engine.close()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(240)
def test_inputs_and_losses_a_pipeline_cannot_take_are_named():
    """A dict with inputs the stages cannot take (token type ids) stops with a ConfigError saying what it takes
    (before: "'dict' object has no attribute 'shape'" from inside the embedding); a loss_fn whose loss is not one number
    stops with a PipelineError saying so (before: "'tuple' object has no attribute 'detach'", or a broadcast error
    summing a per-token loss); the other stage gets a PipelineError naming the rank; the next batch trains."""
    results = run_distributed(_inputs_and_losses_a_pipeline_cannot_take, 2, timeout=200)
    expected = {
        "a tokenizer's token types": (0, "ConfigError", "got keys token_type_ids besides"),
        "a pair from loss_fn": (1, "PipelineError", "loss_fn returned tuple; a micro-batch's loss must be a tensor"),
        "a per-token loss": (1, "PipelineError", "loss_fn returned a tensor of shape (28,); a micro-batch's loss must"),
        "a per-token loss in eval": (1, "PipelineError", "loss_fn returned a tensor of shape (28,)"),
    }
    for r in results:
        for name, (error, seconds) in r["errors"].items():
            raiser, kind, text = expected[name]
            assert error is not None and seconds < COMM_TIMEOUT / 2, (name, r)
            if r["stage"] == raiser:
                assert error[0] == kind and text in error[1], (name, error)
            else:
                assert error[0] == "PipelineError" and f"pipeline rank {raiser} (global rank {raiser})" in error[1]
    assert len({r["after"] for r in results}) == 1
