"""`engine.optimizer.zero_grad(set_to_none=False)` steps what torch steps: a parameter that once had a gradient keeps
a zero one, so every later update moves it (Adam's moments, weight decay), used or not ([Note: zero gradients kept]
in hetero/zero/segments.py); `zero_grad()` (set_to_none=True) skips it again.

The model has a branch only odd steps use. Tolerance ([Note: tolerances from the arithmetic] in tests/tolerance.py):
hetero in fp32 within 8x plain fp32's distance from the same loop in float64. The two zeroing modes end far apart
(checked), so matching the wrong one fails.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hetero
from tests import tolerance

STEPS = 6


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)  # only odd steps call it
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + torch.tanh(self.b(h))
        return self.head(h).pow(2).mean()


def _model(dtype: torch.dtype) -> Branchy:
    torch.manual_seed(0)
    return Branchy().to(dtype)


def _data(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=g).to(dtype) for _ in range(STEPS)]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _plain(set_to_none: bool, dtype: torch.dtype) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(dtype)
    opt = _optimizer(model)
    losses = []
    for i, x in enumerate(_data(dtype)):
        opt.zero_grad(set_to_none=set_to_none)
        loss = model(x, use_b=i % 2 == 1)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _hetero(set_to_none: bool, config: dict, tmp_path=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(torch.float32)
    engine = hetero.initialize(model, _optimizer(model), config)
    losses = []
    for i, x in enumerate(_data(torch.float32)):
        if tmp_path is not None and i == 2:  # resume before a step without b: only the saved flags step it
            engine.save_checkpoint(tmp_path)
            engine.close()
            model = _model(torch.float32)
            engine = hetero.initialize(model, _optimizer(model), config)
            engine.load_checkpoint(tmp_path)
        engine.optimizer.zero_grad(set_to_none=set_to_none)
        loss = engine(x, use_b=i % 2 == 1)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    engine.close()
    return losses, state


CONFIGS = {
    "stage0": {"zero_stage": 0},
    "stage1": {"zero_stage": 1},
    "stage2": {"zero_stage": 2},
    "stage3": {"zero_stage": 3},
    "stage3_host": {"zero_stage": 3, "offload": {"optimizer": "host", "params": "host"}},
}


@pytest.mark.parametrize("set_to_none", [False, True], ids=["zeros_kept", "set_to_none"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_steps_what_torch_steps(name, set_to_none):
    exact_losses, exact = _plain(set_to_none, torch.float64)
    plain_losses, plain = _plain(set_to_none, torch.float32)
    losses, got = _hetero(set_to_none, CONFIGS[name])
    tolerance.assert_losses(losses, exact_losses, plain_losses, dtype=torch.float32)
    tolerance.assert_weights(got, exact, plain, dtype=torch.float32)


def test_the_modes_differ_and_a_checkpoint_keeps_the_mode(tmp_path):
    _, kept = _plain(False, torch.float64)
    _, none = _plain(True, torch.float64)
    # Even steps move b only where its zero gradient is kept: the two runs end far apart, b most of all.
    assert (kept["b.weight"] - none["b.weight"]).norm() > 1e-2 * none["b.weight"].norm()
    exact_losses, exact = _plain(False, torch.float64)
    plain_losses, plain = _plain(False, torch.float32)
    losses, got = _hetero(False, {"zero_stage": 3}, tmp_path=tmp_path / "ckpt")
    tolerance.assert_losses(losses, exact_losses, plain_losses, dtype=torch.float32)
    tolerance.assert_weights(got, exact, plain, dtype=torch.float32)
