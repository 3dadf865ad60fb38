"""[Note: hetero's hooks under torch.compile]: a model compiled in place (`model.compile()`) after
`hetero.initialize` trains through the engine as without the compiler, against plain PyTorch's float64 and fp32 runs
(tests/tolerance.py): stages 0 and 3, tiled weights with activation checkpointing, host offload, stage 3 over two
ranks, and tensor parallelism with Megatron's sequence parallelism over two. The `aot_eager` backend traces forward
and backward as inductor does and runs the traced graphs on torch's own kernels, so no C++ compiler is needed; the
compiled graphs are counted so the test cannot pass uncompiled."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import hetero
from hetero import standin
from tests import parity, tolerance
from tests.dist import OWN_BATCHES, ranks_apart, run_distributed

STEPS, ROWS = 3, 4
# The CPU stand-in of a GPU watches the compute through a dispatch mode, under which torch.compile runs the model
# eagerly (no graph to count): nothing of the compiler to check there.
pytestmark = pytest.mark.skipif(standin.active(), reason="torch.compile falls back to eager under the stand-in's mode")


def _train_whole_batches(engine: hetero.Engine) -> list[float]:
    """STEPS steps on whole batches (every rank the same rows); the losses."""
    losses = []
    for x, y in parity.batches(STEPS, ROWS):
        loss = engine(x, labels=y).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _compile(engine, step: int) -> None:
    if step == 0:
        engine.module.compile(backend="aot_eager")  # in place: parameter names unchanged


def _job(rank: int, world: int, configs: dict[str, dict]) -> dict[str, dict]:
    torch.set_num_threads(1)
    out = {}
    for name, cfg in configs.items():
        torch._dynamo.reset()
        result = parity.run_hetero(rank, world, steps=STEPS, rows=ROWS, config=cfg, on_step=_compile)
        result["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        out[name] = result
    return out


SINGLE = {
    "z0": {"zero_stage": 0},
    "z3": {"zero_stage": 3},
    # the embedding and head split into tiles, each block recomputed in backward
    "z3-tiles-ckpt": {"zero_stage": 3, "chunk_size": 1024, "activation_checkpointing": True},
    "z3-host": {"zero_stage": 3, "offload": {"params": "host", "optimizer": "host"}},
}


@pytest.mark.timeout(600)
def test_compiled_model_trains_as_plain_pytorch():
    results = _job(0, 1, SINGLE)
    for name, result in results.items():
        assert result["graphs"] > 0, name
        parity.check(result, "fp32", steps=STEPS, rows=ROWS)
    assert results["z3-tiles-ckpt"]["chunks"] > results["z3"]["chunks"]  # tiles: more chunks than weights would need


def _two_ranks(rank: int, world: int) -> dict:
    out = _job(rank, world, {"z3": {"zero_stage": 3}})
    # Tensor parallel: both ranks compute one model on the whole batch (parity.run_hetero splits rows by rank).
    torch._dynamo.reset()
    model = parity.build()
    config = {"zero_stage": 3, "chunk_size": parity.CHUNK, "parallel": {"tensor": 2, "sequence": "megatron"}}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    model.compile(backend="aot_eager")
    losses = _train_whole_batches(engine)
    engine.close()
    out["tp"] = {"losses": losses, "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}
    return out


@ranks_apart(OWN_BATCHES)
@pytest.mark.timeout(600)
def test_compiled_model_over_two_ranks():
    r0, r1 = run_distributed(_two_ranks, 2, timeout=500)
    for r in (r0, r1):
        assert r["z3"]["graphs"] > 0 and r["tp"]["graphs"] > 0
    parity.check(r0["z3"], "fp32", steps=STEPS, rows=ROWS)
    exact, _ = parity.cached_reference("fp64", steps=STEPS, rows=ROWS)
    plain, _ = parity.cached_reference("fp32", steps=STEPS, rows=ROWS)
    for r in (r0, r1):
        tolerance.assert_losses(r["tp"]["losses"], exact, plain, dtype=torch.float32)


@pytest.mark.timeout(300)
def test_compiled_model_with_the_delayed_update():
    """`delayed_param_update` hooks every module with parameters to pace the pending update over the step ([Note:
    pacing the delayed update]). Under the compiler that hook does nothing: traced, it took the tracer into the
    manager and the update's bookkeeping, recompiled as the update advanced and cut stage 0's one graph into 17. The
    compiled model trains the delayed algorithm (tests/test_delayed.py's reference), through the switch after the
    warm-up, with the graphs of the model alone and nothing compiled after the first steps."""
    from tests.test_delayed import delayed_reference

    torch.set_num_threads(1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    frames: list[int] = []

    def on_step(engine, step: int) -> None:
        _compile(engine, step)
        frames.append(torch._dynamo.utils.counters["frames"]["total"])

    cfg = {
        "zero_stage": 0,
        "offload": {"optimizer": "host"},
        "delayed_param_update": True,
        "delayed_param_update_warmup": 1,
    }
    steps = STEPS + 2
    result = parity.run_hetero(0, 1, steps=steps, rows=ROWS, config=cfg, on_step=on_step)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the model's forward, whole
    assert frames[2] == frames[-1], frames  # compiled in the first step, and once more where the delay starts at most
    exact_losses, exact = delayed_reference(torch.float64, warmup=1, steps=steps, rows=ROWS)
    plain_losses, plain = delayed_reference(torch.float32, warmup=1, steps=steps, rows=ROWS)
    tolerance.assert_losses(result["losses"], exact_losses, plain_losses, dtype=torch.float32)
    tolerance.assert_weights(result["state"], exact, plain, dtype=torch.float32)


@pytest.mark.timeout(300)
def test_a_model_compiled_before_initialize_trains_with_the_update_in_backward():
    """Compiled before `hetero.initialize`: `torch.compile(model)` returns a wrapper, which hetero takes as the model
    (its names gain `_orig_mod.`); hetero's hooks, registered after the compile, still run outside the graphs, here
    at stage 3 with each chunk stepping during backward (`update_in_backward`), as plain PyTorch trains."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = parity.build()
    opt = parity.make_optimizer(model)
    compiled = torch.compile(model, backend="aot_eager")
    cfg = {"zero_stage": 3, "chunk_size": parity.CHUNK, "offload": {"optimizer": "host"}, "update_in_backward": True}
    engine = hetero.initialize(compiled, opt, cfg)
    losses = _train_whole_batches(engine)
    state = {k.removeprefix("_orig_mod."): v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    parity.check({"losses": losses, "state": state}, "fp32", steps=STEPS, rows=ROWS)
