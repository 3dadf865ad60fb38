"""Host budgets that cannot hold what the device sheds: the update still runs, and the host's out-of-memory figure runs.

With `"optimizer": "auto"` at stage 0 and no NVMe, every chunk the device gives up for the activations goes to the host
tier. The first update used to fail halfway there ([Note: a target the tiers below cannot hold] in
hetero/memory/auto.py), and the host's error named a budget below the one that failed ([Note: the host's figure] in
hetero/memory/room.py). The tiny GPT's chunks take 640 KiB at stage 0 (48 KiB optimizer chunks under "auto").
"""

from __future__ import annotations

import re

import pytest
import torch

import hetero
from hetero.config import parse_size
from hetero.errors import TierOutOfMemoryError

try:
    from tests import parity
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]

KIB = 1 << 10


def _train(
    *, stage: int, optimizer: str, chunk_size: int | str, device: int, host: int, steps: int = 2
) -> dict[str, torch.Tensor]:
    """`steps` updates of the tiny GPT under these budgets (no NVMe); its weights after them."""
    model = parity.build()
    config = {
        "zero_stage": stage,
        "precision": "fp32",
        "offload": {"params": "device", "optimizer": optimizer},
        "chunk_size": chunk_size,
        "memory": {"device_budget": device, "host_budget": host},
    }
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    try:
        for x, y in parity.batches(steps, rows=2):
            engine.backward(engine(x, labels=y).loss)
            engine.step()
        return {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
    finally:
        engine.close()


def test_the_first_update_runs_where_the_host_holds_less_than_the_device_sheds():
    """640 KiB of device budget holds every chunk but not the activations beside them; 64 KiB of host takes one
    optimizer chunk. The update brought one up while another had to go down into the full host, and failed with some
    chunks stepped: now the device keeps what the host cannot, and the weights are those of a roomy host's run (the
    placement changes where the arithmetic's operands wait, not the arithmetic)."""
    tight = _train(stage=0, optimizer="auto", chunk_size="auto", device=640 * KIB, host=64 * KIB)
    roomy = _train(stage=0, optimizer="auto", chunk_size="auto", device=640 * KIB, host=4096 * KIB)
    assert tight.keys() == roomy.keys()
    for name in roomy:
        assert torch.equal(tight[name], roomy[name]), name


def _figure(error: TierOutOfMemoryError) -> int:
    found = re.search(r"A budget of ([0-9.]+) (\w+) would have been enough", str(error))
    assert found, str(error)
    raise_to = re.search(rf"raise memory.{error.tier}_budget to at least ([0-9.]+) (\w+)", str(error))
    assert raise_to and raise_to.groups() == found.groups(), str(error)  # the advice names the same figure
    return parse_size(found.group(1) + found.group(2), key="enough")


@pytest.mark.parametrize(
    ("stage", "optimizer", "chunk_size", "device", "host"),
    [
        (0, "auto", "auto", 512, 128),  # fails in the backward: named 96 KiB for a 128 KiB host
        (0, "auto", "auto", 512, 64),  # fails at initialize, loading the chunks the device cannot hold
        (0, "host", 1024, 256, 64),  # optimizer states placed on the host: gradients arrive there in the backward
        (2, "auto", "auto", 512, 128),  # stage 2: the per-micro-batch gradient buffers arrive in the backward
    ],
)
def test_the_host_figure_is_above_the_budget_and_the_step_runs_with_it(stage, optimizer, chunk_size, device, host):
    """The host's figure is more than the budget that failed (never below what it held and the request), and set as
    the host budget, the same training runs, at the first try."""
    sizes = dict(stage=stage, optimizer=optimizer, chunk_size=chunk_size, device=device * KIB)
    with pytest.raises(TierOutOfMemoryError) as info:
        _train(**sizes, host=host * KIB)
    assert info.value.tier == "host", str(info.value)
    enough = _figure(info.value)
    assert enough >= info.value.held + info.value.needed > host * KIB, str(info.value)
    _train(**sizes, host=enough)  # raises if the figure was not enough
