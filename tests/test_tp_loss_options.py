"""The vocabulary-parallel cross entropy (1D, over 2 ranks) and the grid's (2D, 4 ranks) take torch's options:
`label_smoothing=` and `weight=`, with `ignore_index` and every reduction; loss and logit gradients equal
`F.cross_entropy` on the whole logits, all in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetero.comm import Comm
from hetero.parallel import vocab_parallel_cross_entropy
from hetero.parallel.grid import Grid, grid_cross_entropy
from tests.dist import NEEDS_DEGREES, ranks_apart, run_distributed

ROWS, SEQ, VOCAB = 4, 5, 12
# float64 on both sides: the sharded sums add the same terms in another order, so they differ by a few ulps of the
# largest partial sum (|logit| <= ~16, V = 12 terms): 1e-12 absolute leaves orders of magnitude for that.
TOL = dict(rtol=1e-12, atol=1e-12)
OPTIONS = [
    dict(label_smoothing=e, weight=w, reduction=r)
    for e in (0.0, 0.1, 1.0)
    for w in (False, True)
    for r in ("mean", "sum", "none")
]


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(ROWS, SEQ, VOCAB, generator=g, dtype=torch.float64) * 4
    target = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    target[0, 1] = target[2, 4] = target[3, 0] = -100
    weight = torch.rand(VOCAB, generator=g, dtype=torch.float64) + 0.5
    return logits, target, weight


def _reference(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, **options):
    whole = logits.clone().requires_grad_()
    loss = F.cross_entropy(whole.flatten(0, 1), target.flatten(), weight=weight, ignore_index=-100, **options)
    loss.sum().backward()
    return loss, whole.grad


def _one_d(rank: int, world: int) -> int:
    comm = Comm.world()
    logits, target, weight = _data()
    for options in OPTIONS:
        w = weight if options["weight"] else None
        kwargs = {**options, "weight": w}
        ref, ref_grad = _reference(logits, target, **kwargs)
        local = logits.chunk(world, -1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, comm, **kwargs)
        loss.sum().backward()
        torch.testing.assert_close(loss.flatten(), ref.flatten(), **TOL, msg=lambda m, o=options: f"{o}: {m}")
        torch.testing.assert_close(
            local.grad, ref_grad.chunk(world, -1)[rank], **TOL, msg=lambda m, o=options: f"grad {o}: {m}"
        )
    # Hugging Face's count replaces the denominator, smoothed or not
    count = torch.tensor(9)
    smoothed = vocab_parallel_cross_entropy(
        logits.chunk(world, -1)[rank], target, comm, label_smoothing=0.2, num_items=count
    )
    ref = F.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=0.2, reduction="sum") / 9
    torch.testing.assert_close(smoothed, ref, **TOL)
    for bad, match in ((dict(label_smoothing=1.5), "between 0.0 and 1.0"), (dict(weight=weight[:5]), "one weight per")):
        with pytest.raises(ValueError, match=match):
            vocab_parallel_cross_entropy(logits.chunk(world, -1)[rank], target, comm, **bad)
    return len(OPTIONS)


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(120)
def test_vocab_parallel_cross_entropy_smoothing_and_weights(cpu_device):  # no engine: CPU tensors, CPU ranks
    assert run_distributed(_one_d, 2, timeout=100) == [len(OPTIONS)] * 2


def _grid(rank: int, world: int) -> int:
    grid = Grid.build(Comm.world(), "2d")
    logits, target, weight = _data()
    checked = 0
    for options in OPTIONS:
        if options["reduction"] != "mean":  # the grid's loss is the language model's mean
            continue
        w = weight if options["weight"] else None
        ref, ref_grad = _reference(logits, target, w, label_smoothing=options["label_smoothing"])
        rows = grid.batch_index
        mine = logits.chunk(grid.batch_parts, 0)[rows].chunk(grid.main.hidden.size, -1)[grid.main.hidden.rank]
        mine = mine.clone().requires_grad_()
        loss = grid_cross_entropy(mine, target, grid, label_smoothing=options["label_smoothing"], weight=w)
        loss.backward()
        torch.testing.assert_close(loss, ref, **TOL, msg=lambda m, o=options: f"{o}: {m}")
        want = ref_grad.chunk(grid.batch_parts, 0)[rows].chunk(grid.main.hidden.size, -1)[grid.main.hidden.rank]
        torch.testing.assert_close(mine.grad, want, **TOL, msg=lambda m, o=options: f"grad {o}: {m}")
        checked += 1
    return checked


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(150)
def test_grid_cross_entropy_smoothing_and_weights(cpu_device):  # no engine: CPU tensors, CPU ranks
    assert run_distributed(_grid, 4, timeout=130) == [6] * 4
