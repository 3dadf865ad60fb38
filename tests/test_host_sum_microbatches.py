"""[Note: a micro-batch's sum on the device goes down at its end] (hetero/zero/host_grads.py): `train_batch`'s
micro-batches at stages 0-1, the gradients on the host, under the stand-in (a device with memory of its own, where
each chunk's gradients of a micro-batch are summed on the device before going down). A parameter the batch never
uses leaves its chunk's sum on the device unless the micro-batch's end sends it down: the update stepped without it
and the next batch's gradient carried it. Against plain PyTorch (float64 reference, fp32's own distance:
tests/tolerance.py), and a batch that raises in its second micro-batch drops that sum with the rest."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hetero

try:
    from tests import tolerance
except ImportError:  # tests/ itself on sys.path
    import tolerance  # type: ignore[no-redef]

STEPS, ROWS, MICRO = 3, 4, 2


class Net(nn.Module):
    """Two layers used and one never used, all in one chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    fail_at: int | None = None  # the forward call whose backward raises, after b's gradients went into the chunk
    calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor | dict:
        h = self.a(x)
        self.calls += 1
        if self.calls == self.fail_at:
            h.register_hook(_raise)
        y = self.b(torch.tanh(h)).squeeze(-1)
        return y if labels is None else {"loss": mse(y, labels)}


def _raise(grad: torch.Tensor) -> None:
    raise ValueError("a bad micro-batch")


def mse(y: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return ((y - labels) ** 2).mean()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, generator=g)) for _ in range(STEPS)]


def _reference(base: nn.Module, dtype: torch.dtype, skip: int | None = None) -> tuple[list[float], dict]:
    """Plain PyTorch: each batch's micro-batches' mean loss, one backward each, one step; batch `skip` left out."""
    model = copy.deepcopy(base).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for i, (x, y) in enumerate(_batches()):
        if i == skip:
            continue
        total = 0.0
        for xs, ys in zip(x.to(dtype).chunk(MICRO), y.to(dtype).chunk(MICRO)):
            loss = model(xs, ys)["loss"] / MICRO
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine(base: nn.Module, stage: int) -> hetero.Engine:
    model = copy.deepcopy(base)
    config = {"zero_stage": stage, "offload": {"optimizer": "host"}, "parallel": {"microbatches": MICRO}}
    return hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), config)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_parameter_no_micro_batch_uses_leaves_nothing_on_the_device(monkeypatch, stage):
    monkeypatch.setenv("HETERO_STANDIN", "1")
    torch.manual_seed(0)
    base = Net()
    engine = _engine(base, stage)
    assert engine.device.separate_memory  # the stand-in: sums formed on the device
    losses = [float(engine.train_batch(x, y)) for x, y in _batches()]
    state = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    exact, plain = _reference(base, torch.float64), _reference(base, torch.float32)
    tolerance.assert_losses(losses, exact[0], plain[0], dtype=torch.float32)
    tolerance.assert_weights(state, exact[1], plain[1], dtype=torch.float32)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_backward_that_raises_drops_its_sums_on_the_device(monkeypatch, stage):
    """The second batch's last backward raises midway, b's gradients summed on the device already: dropped with the
    batch, as plain PyTorch's loop drops a batch whose backward raised (zero_grad), and the next batch is its own."""
    monkeypatch.setenv("HETERO_STANDIN", "1")
    torch.manual_seed(0)
    base = Net()
    engine = _engine(base, stage)
    engine.module.fail_at = 2 * MICRO
    losses = []
    for i, (x, y) in enumerate(_batches()):
        if i == 1:
            with pytest.raises(ValueError, match="a bad micro-batch"):
                engine.train_batch(x, y, mse)
            continue
        losses.append(float(engine.train_batch(x, y, mse)))
    state = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    exact, plain = _reference(base, torch.float64, skip=1), _reference(base, torch.float32, skip=1)
    tolerance.assert_losses(losses, exact[0], plain[0], dtype=torch.float32)
    tolerance.assert_weights(state, exact[1], plain[1], dtype=torch.float32)
