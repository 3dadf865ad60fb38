"""The reduce order learnt from the first backward ([Note: the reduce order learnt from a backward]): chunks are
issued as soon as their gradients are in, also where a model registers its parameters out of compute order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hetero
from hetero.zero.protocol import reduce_order

DIM, LAYERS = 32, 3


class Layer(nn.Module):
    """Registers its norm after its linear layers and uses it first, as a Hugging Face Llama layer does."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, DIM)
        self.down = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _train(stage: int, steps: int, order_log: list | None = None) -> tuple[list[float], hetero.Engine]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # One chunk per weight or bias (DIM * DIM elements hold one weight): a layer's chunks complete one by one.
    config = {"zero_stage": stage, "chunk_size": DIM * DIM, "update_in_backward": True}
    engine = hetero.initialize(model, opt, config)
    reducer = engine.reducer if stage >= 2 else engine.dense.reducer
    if order_log is not None:
        issue, ready = reducer._issue, reducer.ready
        pending: list = []

        def on_ready(zc):  # noqa: ANN001, ANN202
            pending.append(zc)
            ready(zc)
            pending.pop()

        def on_issue(zc):  # noqa: ANN001, ANN202
            # Issued inside its own `ready` call: it did not wait for another chunk.
            order_log.append((engine.global_steps, bool(pending) and pending[-1] is zc))
            issue(zc)

        reducer.ready, reducer._issue = on_ready, on_issue
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, DIM, generator=g)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine


@pytest.mark.parametrize("stage", [1, 3])
def test_chunks_are_issued_as_soon_as_ready_after_the_first_backward(stage):
    log: list = []
    losses, engine = _train(stage, steps=3, order_log=log)
    reducer = engine.reducer if stage >= 2 else engine.dense.reducer
    # The first backward guessed (the norm's chunk, registered last, completes last but goes first): chunks waited.
    first = [prompt for step, prompt in log if step == 0]
    later = [prompt for step, prompt in log if step > 0]
    assert not all(first)
    assert reducer.order != reduce_order(reducer.order)
    assert later and all(later)  # from the second backward on every chunk goes out as its gradients are in
    assert engine.in_backward.order == reducer.order
    # The order changes nothing computed: the same losses as without update_in_backward's order being learnt.
    torch.manual_seed(0)
    ref = Net()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        loss = ref(torch.randn(8, DIM, generator=g))
        loss.backward()
        ropt.step()
        ropt.zero_grad()
        assert abs(loss.item() - losses[i]) <= 1e-5 * abs(loss.item())
    engine.close()
