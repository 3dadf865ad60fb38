"""Ranks whose paths diverge so that they issue collectives of different sizes at the same point stop with hetero's
error, on every rank, instead of gloo ending the process natively ("Received data size doesn't match", SIGABRT):
[Note: a check verified before a collective of another size] in hetero/zero/protocol.py.

The model runs a top-level module `extra` on some steps of some ranks only. Its chunk holds 272 elements where the
chunks of `head`, which the other rank gathers instead, hold 256 and 300 (chunk_size 300), so the gathers differ in
size; without gathering ahead, nothing issued earlier makes the ranks' next gathers the same chunk.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

try:
    from tests.dist import RANKS_DIFFER, ranks_apart, run_distributed
except ImportError:  # tests/ itself on sys.path
    from dist import RANKS_DIFFER, ranks_apart, run_distributed  # type: ignore[no-redef]

CONFIG = {"zero_stage": 3, "chunk_size": 300, "gather_ahead": False, "comm_timeout": 60}
GOOD_STEPS = 3  # steps every rank runs alike before one diverges: the schedule is learnt by then


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.extra = nn.Linear(16, 16)  # 272 elements: a chunk of its own
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor, skip: bool) -> torch.Tensor:
        x = self.embed(ids)
        if not skip:
            x = x + self.extra(x)
        return self.head(x).pow(2).mean()


def _run(rank: int, world: int, mode: str) -> dict:
    import hetero

    torch.manual_seed(0)
    model = Net()
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), dict(CONFIG))
    sizes = sorted({zc.spec.capacity for zc in engine.chunks})
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))
    verified: list[int] = []
    try:
        for i in range(GOOD_STEPS + (2 if mode == "step" else 1)):
            before = engine.check.verified_first
            diverge = i == GOOD_STEPS or mode == "first"
            engine.backward(engine(ids, skip=diverge and rank == 1 and mode != "step"))
            if not (mode == "step" and diverge and rank == 1):
                engine.step()  # rank 1 goes on to the next forward where rank 0 steps
            verified.append(engine.check.verified_first - before)
    except hetero.errors.CollectiveMismatchError as err:
        return {"error": str(err), "sizes": sizes, "verified": verified}
    finally:
        engine.close()
    return {"error": None, "sizes": sizes, "verified": verified}


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "mode, standin",
    [("first", False), ("late", False), ("late", True), ("step", False)],
    ids=["first-step", "after-learning", "after-learning-standin", "step-where-forward"],
)
def test_ranks_issuing_collectives_of_different_sizes_both_raise_naming_them(monkeypatch, mode, standin):
    if standin:
        monkeypatch.setenv("HETERO_STANDIN", "1")
    else:
        monkeypatch.delenv("HETERO_STANDIN", raising=False)  # the data group on gloo with host tensors
    results = run_distributed(_run, 2, mode, timeout=200)
    assert len(results[0]["sizes"]) > 1, results[0]["sizes"]  # the gathers do differ in size
    for r in results:
        message = r["error"]
        assert message is not None and "different collectives" in message, r
        assert "rank 0: collective #" in message and "rank 1: collective #" in message, message
        if mode != "step":
            assert "'extra'" in message and "move it into a block" in message, message
    if mode != "first":
        # Once learnt (the first step teaches a step's checks, the second the one after the update), a step
        # verifies no check before its collective: all are posted ([Note: checks posted, verified at the wait]).
        for r in results:
            good = r["verified"][:GOOD_STEPS]
            assert len(good) == GOOD_STEPS and good[0] > good[-1] == 0, r
