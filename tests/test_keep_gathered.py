"""[Note: keeping the gathered model for backward]: where every rank's device budget holds the gathered model, a
ZeRO-3 step gathers each chunk once (forward) and backward gathers nothing; where it does not, backward gathers
again. Which one is decided from the smallest budget of the group, so ranks with different budgets agree."""

from __future__ import annotations

import pytest
import torch

import hetero
from hetero.zero.protocol import BACKWARD, FORWARD, KEEP_UNITS, keep_for

try:
    from tests import parity
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

CHUNK_BYTES = parity.CHUNK * 4


def test_keep_for_keeps_everything_only_where_it_fits_with_room():
    sizes = [10] * 6
    assert keep_for(sizes, 90) == 6  # the whole model, half as much again to spare
    assert keep_for(sizes, 89) == KEEP_UNITS  # the first units backward needs
    assert keep_for(sizes, 45) == KEEP_UNITS
    assert keep_for(sizes, 44) == 0


def _run(rank: int, world: int, device_chunks: tuple[int, int]) -> dict:
    torch.set_num_threads(1)
    model = parity.build()
    cfg = {
        "zero_stage": 3,
        "chunk_size": parity.CHUNK,
        "offload": {"optimizer": "host", "params": "host"},
        "memory": {"device_budget": device_chunks[rank] * CHUNK_BYTES, "host_budget": 200 * CHUNK_BYTES},
    }
    engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
    gathers = engine.gathers
    issued = {FORWARD: 0, BACKWARD: 0}
    inner = gathers._gather

    def counted(zc, unit, phase):  # noqa: ANN001, ANN202 - wraps Gathers._gather
        issued[phase] += not zc.gathered
        inner(zc, unit, phase)

    gathers._gather = counted
    losses = []
    for x, y in parity.batches(3, 4):
        local = x.shape[0] // world
        rows = slice(rank * local, (rank + 1) * local)
        loss = engine(x[rows], labels=y[rows]).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    out = {"keep": gathers.keep, "units": len(gathers.units), "issued": dict(issued), "losses": losses}
    out["chunks"] = len(engine.chunks)
    engine.close()
    return out


@pytest.mark.timeout(300)
def test_backward_gathers_nothing_where_every_budget_holds_the_model():
    ample = run_distributed(_run, 2, (400, 300), timeout=240)
    # Rank 1's budget holds the largest units but not the whole model: the group keeps what rank 1 can.
    mixed = run_distributed(_run, 2, (400, 3), timeout=240)
    for r in ample:
        assert r["keep"] == r["units"] > KEEP_UNITS
        assert r["issued"][BACKWARD] == 0 and r["issued"][FORWARD] > 0
    for r in mixed:
        assert r["keep"] < r["units"]
        assert r["issued"][BACKWARD] > 0  # backward gathers what forward released
    for r in range(2):
        assert ample[r]["losses"] == mixed[r]["losses"]  # gathering again changes no value
