"""[Note: a chunk's sum flushed twice in one backward] (hetero/zero/host_grads.py): stages 0-1, the gradients on the
host, under the stand-in (sums formed on the device), two ranks: a tiled embedding tied to the output head gets its
gradient in two parts, one per use. The chunk counts as complete after the first part; the backward that reduces
keeps its sum on the device for the reduction, and the second part's sum replaced the first's, so the update
stepped on the head's gradient alone. Found by tools/fuzz_parity.py (seed 2, world 2, case 12). Against plain
PyTorch on the global batch (float64 reference, fp32's own distance: tests/tolerance.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hetero

try:
    from tests import tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

VOCAB, DIM, SEQ, ROWS, STEPS, WORLD = 32, 16, 6, 2, 3, 2
CHUNK = 256  # elements: the 32x16 embedding is tiled ([Note: computing on tiles])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.lin = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: two uses, two parts of one gradient

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.head(torch.tanh(self.lin(self.emb(ids))))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def _build() -> Net:
    torch.manual_seed(0)
    return Net()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (ROWS * WORLD, SEQ), generator=g)
        out.append((x, (3 * x + 1) % VOCAB))
    return out


def _reference(dtype: torch.dtype) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = copy.deepcopy(_build()).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _batches():
        loss = model(x, y)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank: int, world: int, stage: int) -> dict:
    model = _build()
    config = {"zero_stage": stage, "offload": {"optimizer": "host"}, "chunk_size": CHUNK, "tiling": True}
    engine = hetero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    assert engine.device.separate_memory  # the stand-in: sums formed on the device
    losses = []
    for x, y in _batches():
        x, y = x[rank * ROWS : (rank + 1) * ROWS], y[rank * ROWS : (rank + 1) * ROWS]
        loss = engine(x, y)["loss"]
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().cpu()
        engine.comm.control.all_reduce(total, op="avg")
        losses.append(total.item())
    state = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {"losses": losses, "state": state}


@pytest.mark.parametrize("stage", [0, 1])
def test_a_tied_tiled_weight_keeps_both_parts_of_its_gradient(monkeypatch, stage):
    monkeypatch.setenv("HETERO_STANDIN", "1")
    got = run_distributed(_train, WORLD, stage, timeout=90)[0]
    exact, plain = _reference(torch.float64), _reference(torch.float32)
    tolerance.assert_losses(got["losses"], exact[0], plain[0], dtype=torch.float32)
    tolerance.assert_weights(got["state"], exact[1], plain[1], dtype=torch.float32)
