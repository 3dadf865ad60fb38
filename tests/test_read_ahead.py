"""With optimizer states on NVMe, the exact update's first states are read while the backward before it runs
([Note: the first states read in backward])."""

from __future__ import annotations

import pytest

import hetero
from hetero.memory import Tier

try:
    from tests import parity
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]


def _where_first_states_are(tmp_path, config: dict) -> list[tuple[str, bool]]:
    """Train two updates, then record where the first streamed chunk's states are after each forward of the third
    and as its backward starts (NVMe until that update's reads start; on their way up, or up, once they have)."""
    model = parity.build()
    cfg = {**config, "chunk_size": parity.CHUNK, "memory": {"nvme_dir": str(tmp_path)}}
    engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
    accum = cfg.get("grad_accumulation_steps", 1)
    data = parity.batches(3 * accum, 4)
    first = next(zc for zc in engine.updater.chunks if zc.placement.optim is Tier.NVME).optim
    seen = []
    try:
        for n, (x, y) in enumerate(data):
            out = engine(x, labels=y)
            if n >= 2 * accum:
                seen.append(("forward", first.tier is not Tier.NVME or first.moving))
                # Backward's first step: the trace's own prefetch, a few accesses ahead, reaches the update's states
                # only near backward's end.
                out.logits.register_hook(
                    lambda g: seen.append(("backward", first.tier is not Tier.NVME or first.moving))
                )
            engine.backward(out.loss)
            engine.step()
    finally:
        engine.close()
    return seen


@pytest.mark.parametrize("stage", [2, 3])
def test_the_first_states_are_read_during_the_backward_before_the_update(tmp_path, stage):
    seen = _where_first_states_are(tmp_path, {"zero_stage": stage, "offload": {"optimizer": "nvme"}})
    assert seen == [("forward", False), ("backward", True)]


def test_only_the_last_micro_batch_reads_them(tmp_path):
    """With accumulation the states are read in the backward of the micro-batch the update follows, not before:
    they would sit in host memory through the other micro-batches."""
    config = {"zero_stage": 3, "offload": {"optimizer": "nvme", "params": "nvme"}, "grad_accumulation_steps": 2}
    seen = _where_first_states_are(tmp_path, config)
    assert seen == [("forward", False), ("backward", False), ("forward", False), ("backward", True)]
