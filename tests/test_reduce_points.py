"""Where a stage-3 reduction is issued over several ranks: at a point every rank shares ([Note: reductions at shared
points] in `hetero/zero/protocol.py`), never when this rank's gradients happen to be in.

`branchy`'s block with every expert used by some rank (`every_expert`): rank 0 takes branch a and experts 0-1, rank 1
branch b and experts 1-3. A chunk holding only rank 1's parameters has all of its gradients in, on rank 1, in the
middle of block 1's backward; on rank 0 never. Issued there, its reduce-scatter met rank 0's next all-gather (block
0's): a CollectiveMismatchError with check_collectives, a hang or mixed data on NCCL without.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import RANKS_DIFFER, ranks_apart

try:
    from tests import branchy, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import branchy  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

STEPS = 4
CHUNK = 512  # an expert's weight: each branch and each expert in chunks apart from the others

CONFIGS = {
    "plain": {"zero_stage": 3, "chunk_size": CHUNK},
    "no gather ahead": {"zero_stage": 3, "chunk_size": CHUNK, "gather_ahead": False},
    "update in backward": {"zero_stage": 3, "chunk_size": CHUNK, "update_in_backward": True},
    "checkpointing": {"zero_stage": 3, "chunk_size": CHUNK, "activation_checkpointing": True},
}


def _issued_in_backward(rank: int, world: int) -> list[tuple[int, int]]:
    """Per step: (reductions issued before the end of backward, chunks reduced)."""
    import hetero

    model = branchy.build()
    engine = hetero.initialize(model, branchy.make_optimizer(model), dict(CONFIGS["plain"]))
    reducer, counts = engine.reducer, []
    flush = reducer.flush

    def spy() -> None:
        counts.append((sum(reducer.sent(zc) for zc in reducer.order), len(reducer.order)))
        flush()

    reducer.flush = spy
    for per_rank in branchy.batches(STEPS, world, every_expert=True):
        x, y = per_rank[rank]
        engine.backward(engine(x, y).loss)
        engine.step()
    engine.close()
    return counts


def _run(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {name: branchy.run(rank, world, cfg, steps=STEPS, every_expert=True) for name, cfg in CONFIGS.items()}
    out["issued"] = _issued_in_backward(rank, world)
    return out


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(300)
def test_experts_every_rank_uses_some_of_reduce_at_shared_points_and_match_plain_pytorch():
    results = run_distributed(_run, 2, timeout=240)
    exact_losses, exact = branchy.reference(STEPS, 2, torch.float64, every_expert=True)
    plain_losses, plain = branchy.reference(STEPS, 2, every_expert=True)
    init = branchy.build().state_dict()
    for name in CONFIGS:
        got = results[0][name]
        assert got["losses"] == results[1][name]["losses"], name
        tolerance.assert_losses(got["losses"], exact_losses, plain_losses, dtype=torch.float32)
        tolerance.assert_weights(got["state"], exact, plain, dtype=torch.float32)
        for param in ("blocks.0.a.weight", "blocks.0.b.weight", "blocks.1.experts.0.0.weight"):
            assert not torch.equal(got["state"][param], init[param]), (name, param)
        assert not torch.equal(got["state"]["blocks.1.experts.3.2.weight"], init["blocks.1.experts.3.2.weight"])
    # The reductions still overlap backward: all but the embedding's (its unit's backward has no end: no input
    # needs a gradient) go out as their blocks' backward ends, the same number on both ranks.
    assert results[0]["issued"] == results[1]["issued"]
    assert all(issued == chunks - 1 for issued, chunks in results[0]["issued"]), results[0]["issued"]


# ---- a module run from another block's forward ---------------------------------------------------------------------
DIM = 16


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, borrowed: torch.nn.Module | None = None) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return h + borrowed(h) if borrowed is not None else h


class Borrowing(torch.nn.Module):
    """Block 0 runs block 1's layer: that layer's gradient comes in block 0's backward, after block 1's ended."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x, borrowed=self.blocks[1].lin)
        return self.blocks[1](x).square().mean()


def _borrowing_data(world: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [[torch.randn(4, DIM, generator=g) for _ in range(world)] for _ in range(STEPS)]


def _borrowing_reference(dtype: torch.dtype) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = Borrowing().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return branchy.plain(model, opt, _borrowing_data(2), lambda m, x: m(x.to(dtype)))


def _run_borrowing(rank: int, world: int) -> dict:
    import hetero

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Borrowing()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = hetero.initialize(model, opt, {"zero_stage": 3, "chunk_size": 300})
    losses = []
    for per_rank in _borrowing_data(world):
        loss = engine(per_rank[rank])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().reshape(1)
        engine.comm.control.all_reduce(mean, op="avg")
        losses.append(float(mean))
    state = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {"losses": losses, "state": state}


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(120)
def test_a_layer_run_from_an_earlier_block_is_reduced_after_that_block():
    got = run_distributed(_run_borrowing, 2, timeout=100)[0]
    exact_losses, exact = _borrowing_reference(torch.float64)
    plain_losses, plain = _borrowing_reference(torch.float32)
    tolerance.assert_losses(got["losses"], exact_losses, plain_losses, dtype=torch.float32)
    tolerance.assert_weights(got["state"], exact, plain, dtype=torch.float32)
