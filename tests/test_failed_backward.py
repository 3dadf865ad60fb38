"""A backward that raises (out of memory, a check in a backward hook) and the loop that skips its batch, as plain
PyTorch loops do after `optimizer.zero_grad()` ([Note: a backward that fails] in hetero/engine.py). Before, the part
of the gradient the failed backward had added stayed in the chunks and the next update stepped on it.

Both ranks fail at the same micro-batch (a deterministic failure); the run must then match plain PyTorch's loop
that drops the whole accumulation and starts it again, checked against the float64 run ([Note: tolerances from the
arithmetic] in tests/tolerance.py).
"""

from __future__ import annotations

import pytest
import torch

import hetero

try:
    from tests import parity, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

MICRO, ROWS = 8, 4
FAILS = 3  # the micro-batch whose backward raises: the second of the second accumulation at 2 a step


class _Boom(Exception):
    pass


def _arm(model: torch.nn.Module) -> dict:
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


def _run(rank: int, world: int, stage: int, accum: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    model = parity.build()
    state = _arm(model)
    config = {"zero_stage": stage, "chunk_size": parity.CHUNK, "grad_accumulation_steps": accum}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    local = ROWS // world
    for i, (x, y) in enumerate(parity.batches(MICRO, ROWS)):
        state["armed"] = i == FAILS
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        try:
            engine.backward(engine(x, labels=y).loss)
        except _Boom:
            continue  # the loop skips the batch: no step() for it
        engine.step()
    out = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    return out


@pytest.mark.parametrize("stage,accum", [(0, 2), (1, 1), (3, 2)])
def test_a_failed_backward_leaves_nothing_in_the_next_update_world2(stage, accum):
    results = run_distributed(_run, 2, stage, accum, timeout=300)
    exact, plain = _reference(torch.float64, accum), _reference(torch.float32, accum)
    for got in results:
        tolerance.assert_weights(got, exact, plain, dtype=torch.float32)
