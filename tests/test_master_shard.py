"""Stage 3 in fp32 on the device: the master weights are the parameter shard ([Note: the master is the shard]). With
the optimizer states on NVMe: the master follows the shard and is not stored ([Note: the master follows the shard])."""

from __future__ import annotations

import os

import pytest
import torch

import hetero
from hetero.memory import TensorState, Tier
from hetero.zero import master as master_weights

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


def _run_nvme(rank: int, world: int, tmp: str, update_in_backward: bool) -> dict:
    torch.set_num_threads(1)
    nb = parity.CHUNK * 4
    os.makedirs(f"{tmp}/swap{rank}", exist_ok=True)
    config = {
        "zero_stage": 3,
        "offload": {"params": "nvme", "optimizer": "nvme"},
        "update_in_backward": update_in_backward,
        # States several times the host budget: optimizer chunks and shards leave for NVMe between uses.
        "memory": {"device_budget": 4 * nb, "host_budget": 6 * nb, "nvme_dir": f"{tmp}/swap{rank}"},
    }
    out = {"exact": parity.run_hetero(rank, world, steps=4, rows=4, config=config)}
    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {**config, "chunk_size": parity.CHUNK})
    # The update steps each shard in place of its FREE master ([Note: stepping the shard in place]): no master is
    # filled from its shard (and copied back) while training.
    fills = []
    fill = master_weights.fill
    master_weights.fill = lambda zc: (fills.append(zc.optim.slots[0].state is TensorState.FREE), fill(zc))
    try:
        for x, y in parity.batches(2, 4):
            engine.backward(engine(x[rank * 2 : rank * 2 + 2], labels=y[rank * 2 : rank * 2 + 2]).loss)
            engine.step()
    finally:
        master_weights.fill = fill
    engine.manager.synchronize()
    trainable = engine.trainable
    follows = [zc.master_follows for zc in trainable]
    # Between steps every master slot is FREE (its values are the shard's), and what NVMe stores of an optimizer
    # chunk starts after it.
    free = [zc.optim.slots[0].state.name for zc in trainable]
    stored_from = [(zc.optim.stored_from, zc.shard_numel) for zc in trainable if zc.optim.on_nvme]
    # A checkpoint round trip: the master is saved from the shard and comes back, and two more batches (the second
    # one's loss follows the first one's update, from the master) give the same losses bit for bit.
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    for zc in trainable:  # the save reads every optimizer chunk back from NVMe, its master slot unfilled
        if zc.optim.tier is not Tier.NVME:
            engine.manager.move(zc.optim, Tier.NVME)
    engine.save_checkpoint(f"{tmp}/ckpt")
    more = parity.batches(4, 4)[2:]

    def go_on() -> list[float]:
        return [float(engine.train_batch(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2])) for x, y in more]

    first = go_on()
    engine.load_checkpoint(f"{tmp}/ckpt")
    after = engine.full_state_dict()
    restored = all(torch.equal(before[k], after[k]) for k in before)
    again = go_on()
    # Whoever asks for the master gets the shard's values.
    equal = []
    for zc in trainable:
        master, _ = zc.optimizer_views()
        shard = engine.manager.access(zc.shard, Tier.HOST, write=False)
        equal.append(torch.equal(master, shard))
    engine.close()
    return {
        **out,
        "follows": follows,
        "filled_in_training": sum(fills),
        "free": free,
        "stored_from": stored_from,
        "equal": equal,
        "restored": restored,
        "losses": (first, again),
    }


@pytest.mark.parametrize("update_in_backward", [False, True], ids=["after", "in_backward"])
def test_fp32_stage3_with_states_on_nvme_stores_the_master_once(tmp_path, monkeypatch, update_in_backward):
    # Under the strict stand-in a buffer given back to a pool is poisoned: a master slot read back from NVMe holds
    # poison, not a stale copy of the right values, wherever it is used without being filled from the shard.
    monkeypatch.setenv("HETERO_STANDIN", "1")
    results = run_distributed(_run_nvme, 2, str(tmp_path), update_in_backward, timeout=300)
    parity.check(results[0]["exact"], steps=4, rows=4)  # against the float64 reference
    for r in results:
        assert r["follows"] and all(r["follows"])
        assert r["filled_in_training"] == 0
        assert set(r["free"]) == {"FREE"}, r["free"]
        assert r["stored_from"] and all(a == n for a, n in r["stored_from"]), r["stored_from"]
        assert all(r["equal"])
        assert r["restored"]
        assert r["losses"][0] == r["losses"][1]  # bit for bit
