"""A training loop's own in-place writes into the parameters at stages 0-2 (pruning with a mask, WGAN's weight
clipping) reach the master weights, as in plain PyTorch ([Note: the loop's writes into parameters] in
hetero/zero/loop_writes.py). Before, the next update brought the old values back from the masters.

The writes are continuous in the weights (a clamp, a fixed mask), so that fp32 and float64 runs stay comparable
([Note: tolerances from the arithmetic] in tests/tolerance.py).
"""

from __future__ import annotations

import pytest
import torch

import hetero
from hetero.errors import HeteroError

try:
    from tests import parity, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

STEPS, ROWS = 4, 4
MASK = torch.rand(128, 32, generator=torch.Generator().manual_seed(5)) > 0.5  # layers.0.mlp.fc.weight's shape


def _edit(model: torch.nn.Module) -> None:
    """What such loops do after each update, under no_grad: clip every matrix, prune one with a fixed mask."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.clamp_(-0.05, 0.05)
            if name == "layers.0.mlp.fc.weight":
                p.mul_(MASK.to(p.device, p.dtype))


def _reference(dtype: torch.dtype) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = parity.build().to(dtype)
    opt = parity.make_optimizer(model)
    losses = []
    for step, (x, y) in enumerate(parity.batches(STEPS, ROWS)):
        if step > 0:
            _edit(model)
        loss = model(x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    _edit(model)
    return losses, {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _run(rank: int, world: int, stage: int) -> dict:
    def on_step(engine: hetero.Engine, step: int) -> None:
        if step > 0:
            _edit(engine.module)

    out = parity.run_hetero(rank, world, steps=STEPS, rows=ROWS, config={"zero_stage": stage}, on_step=on_step)
    return out


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_pruning_and_clipping_in_place_train_as_plain_pytorch_world2(stage):
    results = run_distributed(_run, 2, stage, timeout=300)
    exact_losses, exact = _reference(torch.float64)
    plain_losses, plain = _reference(torch.float32)
    tolerance.assert_losses(results[0]["losses"], exact_losses, plain_losses, dtype=torch.float32)
    # The last edit comes after the last update in the reference: apply it to hetero's result too.
    model = parity.build()
    model.load_state_dict(results[0]["state"])
    _edit(model)
    tolerance.assert_weights(dict(model.state_dict()), exact, plain, dtype=torch.float32)


def test_a_write_then_a_read_only_gathered_block_keeps_the_write():
    # An EMA read through gathered_parameters() after the loop's pruning: the block must not pass the write over.
    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": 0, "chunk_size": parity.CHUNK})
    x, y = parity.batches(1, ROWS)[0]
    engine.backward(engine(x, labels=y).loss)
    engine.step()
    _edit(model)
    with engine.gathered_parameters():
        pass
    engine.backward(engine(x, labels=y).loss)
    engine.step()
    # Every clipped weight stayed within a step's reach of the clip (Adam moves each by about lr, 3e-3).
    assert all(v.abs().max() <= 0.05 + 0.01 for k, v in engine.full_state_dict().items() if v.dim() == 2)
    engine.close()


def test_a_write_with_the_delayed_update_is_refused_naming_the_block():
    model = parity.build()
    engine = hetero.initialize(
        model,
        parity.make_optimizer(model),
        {
            "zero_stage": 0,
            "chunk_size": parity.CHUNK,
            "offload": {"optimizer": "host"},
            "delayed_param_update": True,
            "delayed_param_update_warmup": 0,
        },
    )
    x, y = parity.batches(1, ROWS)[0]
    engine.backward(engine(x, labels=y).loss)
    engine.step()
    _edit(model)
    with pytest.raises(HeteroError, match=r"written in place outside hetero while delayed_param_update.*modify=True"):
        engine.backward(engine(x, labels=y).loss)
    engine.close()
