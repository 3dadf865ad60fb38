"""Gradients a loop takes itself with `torch.autograd.grad` beside hetero's training backward: input gradients for
an adversarial example (FGSM), and a gradient penalty (a second derivative, `create_graph=True`).

At stages 0-2 both train as plain PyTorch does, and the adversarial example at stage 3 too, tiled weights included
([Note: backwards that are not the training one] in hetero/zero/tiling.py); checked against the float64 run like
every parity test ([Note: tolerances from the arithmetic] in tests/tolerance.py). What hetero cannot compute says so
instead of training on something else: a second derivative through a tiled layer or a stage-3 model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hetero
from hetero.errors import HeteroError
from tests.dist import OWN_BATCHES, ranks_apart

try:
    from tests import tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

STEPS = 4


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Sequential(nn.Linear(32, 32), nn.Tanh()), nn.Linear(32, 1))


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=g) for _ in range(STEPS)]


def _adversarial(model, x: torch.Tensor) -> torch.Tensor:
    """FGSM: the loss at the input moved along the sign of the loss's gradient with respect to it."""
    x = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(model(x).pow(2).mean(), x)
    return model(x.detach() + 0.1 * gx.sign()).pow(2).mean()


def _penalty(model, x: torch.Tensor) -> torch.Tensor:
    """A gradient penalty (WGAN-GP's): the input gradient's norm pulled towards 1, differentiated again."""
    x = x.clone().requires_grad_(True)
    out = model(x).sum()
    (gx,) = torch.autograd.grad(out, x, create_graph=True)
    return out / x.shape[0] + (gx.norm(dim=1) - 1).pow(2).mean()


LOSSES = {"adversarial": _adversarial, "penalty": _penalty}


def _plain(loss_name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The global batch as each rank's half (each half's own input gradient), averaged: what two ranks compute."""
    model = _build().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x in _data():
        x = x.to(dtype)
        loss = sum(LOSSES[loss_name](model, x[2 * r : 2 * r + 2]) for r in range(2)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _hetero(rank: int, world: int, loss_name: str, runs: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    out = {}
    for run in runs:
        model = _build()
        engine = hetero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), run)
        for x in _data():
            engine.backward(LOSSES[loss_name](engine, x[2 * rank : 2 * rank + 2]))
            engine.step()
        out[hetero.Config.from_any(run).zero_stage, run["chunk_size"]] = {
            k: v.float() for k, v in engine.full_state_dict().items()
        }
        engine.close()
    return out


@ranks_apart(OWN_BATCHES)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("loss_name", ["adversarial", "penalty"])
def test_autograd_grad_beside_training_world2(loss_name):
    # chunk_size 512 splits the 32x32 weight into tiles; 4096 keeps every weight whole. Before, the adversarial
    # example's autograd.grad added the tiled weight's gradient of the first loss into its chunk, and at stage 3 its
    # unit ends reduced chunks before the training backward's gradients came (it was refused since).
    runs = [{"zero_stage": s, "chunk_size": 4096} for s in (0, 1, 2)]
    if loss_name == "adversarial":  # a second derivative through tiles, or at stage 3, is refused (below)
        runs += [{"zero_stage": s, "chunk_size": 512} for s in (0, 2, 3)] + [{"zero_stage": 3, "chunk_size": 4096}]
    results = run_distributed(_hetero, 2, loss_name, runs, timeout=240)[0]
    exact, plain = _plain(loss_name, torch.float64), _plain(loss_name, torch.float32)
    for key, state in results.items():
        try:
            tolerance.assert_weights(state, exact, plain, dtype=torch.float32)
        except AssertionError as e:
            raise AssertionError(f"stage, chunk_size {key}: {e}") from e


def test_a_second_derivative_through_tiles_is_refused():
    model = _build()
    engine = hetero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": 0, "chunk_size": 512})
    assert engine.tiles.tiled
    with pytest.raises(HeteroError, match=r"create_graph=True.*tiled.*chunk_size"):
        _penalty(engine, _data()[0])
    engine.close()


def test_a_second_derivative_at_stage_3_is_refused():
    model = _build()
    engine = hetero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": 3, "chunk_size": 4096})
    # Before: a read of released storage ("setStorage: ... out of bounds for storage of size 0").
    with pytest.raises(HeteroError, match=r"create_graph=True.*zero_stage 3.*zero_stage <= 2"):
        engine.backward(_penalty(engine, _data()[0]))
    engine.close()


def test_a_loops_own_backward_at_stage_3_names_engine_backward():
    model = _build()
    engine = hetero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": 3, "chunk_size": 4096})
    with pytest.raises(HeteroError, match=r"outside engine\.backward.*Call engine\.backward\(loss\)"):
        engine(_data()[0]).pow(2).mean().backward()
    engine.close()


def test_plain_reference_is_not_vacuous():
    # The adversarial step moves the weights differently from training on the clean inputs.
    clean = copy.deepcopy(_build())
    opt = torch.optim.AdamW(clean.parameters(), lr=1e-2)
    for x in _data():
        clean(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    adversarial = _plain("adversarial", torch.float32)
    assert not torch.allclose(clean.state_dict()["0.weight"], adversarial["0.weight"])
