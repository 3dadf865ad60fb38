"""Stage 3 in fp32 on the device: the master weights are the parameter shard ([Note: the master is the shard])."""

from __future__ import annotations

import torch

import hetero

try:
    from tests import parity
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]


def _run(rank: int, world: int, tmp: str) -> dict:
    torch.set_num_threads(1)
    out = {"exact": parity.run_hetero(rank, world, steps=4, rows=4, config={"zero_stage": 3})}
    # The same model with the position embedding frozen: a frozen chunk has no master, so it keeps its own shard.
    model = parity.build()
    model.pos_embed.weight.requires_grad_(False)
    engine = hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": 3, "chunk_size": parity.CHUNK})
    for x, y in parity.batches(2, 4):
        engine.backward(engine(x[rank * 2 : rank * 2 + 2], labels=y[rank * 2 : rank * 2 + 2]).loss)
        engine.step()
    shards = [zc.shard is None for zc in engine.chunks]
    trainable = [zc.spec.trainable for zc in engine.chunks]
    # Between steps the device holds each trainable chunk's optim buffer (master + states), each frozen chunk's
    # shard, and nothing else: no second copy of the trainable parameters, no gradients (released after the update).
    held = sum(zc.optim.nbytes if zc.optim is not None else zc.shard.nbytes for zc in engine.chunks)
    current = engine.memory_stats()["device"]["current"]
    # A checkpoint round trip: parameters come back from the saved master.
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.save_checkpoint(tmp)
    with torch.no_grad(), engine.gathered_parameters(modify=True):
        for p in model.parameters():
            p.add_(1.0)
    engine.load_checkpoint(tmp)
    after = engine.full_state_dict()
    restored = all(torch.equal(before[k], after[k]) for k in before)
    engine.close()
    return {**out, "shards": shards, "trainable": trainable, "held": held, "current": current, "restored": restored}


def test_fp32_stage3_on_the_device_keeps_one_copy_of_the_parameter_shard(tmp_path):
    results = run_distributed(_run, 2, str(tmp_path), timeout=240)
    parity.check(results[0]["exact"], steps=4, rows=4)  # against the float64 reference
    for r in results:
        assert r["shards"] == r["trainable"]  # trainable chunks: the master is the shard; frozen ones keep theirs
        assert any(r["trainable"]) and not all(r["trainable"])
        assert r["current"] == r["held"]
        assert r["restored"]
