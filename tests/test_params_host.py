"""Parameter shards kept on the host with parameters on NVMe (`offload.params_host_bytes`, [Note: parameter shards
kept on the host] in hetero/zero/stages.py): the chunks it names never write their shard to NVMe and the others do,
training matches plain PyTorch with any share kept (and with a host budget too small to keep them), a checkpoint
loads across shares, and DeepSpeed's `offload_param.max_in_cpu` translates to it."""

from __future__ import annotations

import os

import pytest
import torch

import hetero
from hetero.errors import ConfigError
from hetero.memory import Tier
from tests import parity
from tests.dist import run_distributed

NB = parity.CHUNK * 4  # bytes of one full fp32 chunk of the tiny model


def _config(host_bytes: int, nvme_dir: str | None = None, **memory: int) -> dict:
    config = {
        "zero_stage": 3,
        "chunk_size": parity.CHUNK,
        "offload": {"params": "nvme", "optimizer": "nvme", "params_host_bytes": host_bytes},
    }
    if nvme_dir is not None:
        os.makedirs(nvme_dir, exist_ok=True)
    if nvme_dir is not None or memory:
        config["memory"] = {**memory, **({"nvme_dir": nvme_dir} if nvme_dir else {})}
    return config


def _expected_homes(engine: hetero.Engine, host_bytes: int) -> list[Tier]:
    """Greedy in layout order, as the note says: each chunk whose shard still fits stays on the host."""
    homes, left = [], host_bytes
    for zc in engine.chunks:
        nbytes = zc.shard.nbytes
        homes.append(Tier.HOST if nbytes <= left else Tier.NVME)
        left -= nbytes if nbytes <= left else 0
    return homes


def _run(rank: int, world: int, tmp: str) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    shard = NB // world
    shares = {"none": 0, "some": 3 * shard, "all": 10**9}
    for name, host_bytes in shares.items():
        out[name] = parity.run_hetero(
            rank, world, steps=4, rows=4, config=_config(host_bytes), nvme_dir=f"{tmp}/{name}"
        )
    # A host budget of six chunks cannot keep every shard beside the update's states: kept ones are evicted to NVMe
    # like any host chunk, and read back.
    tight = _config(10**9, device_budget=4 * NB, host_budget=6 * NB)
    out["tight"] = parity.run_hetero(rank, world, steps=4, rows=4, config=tight, nvme_dir=f"{tmp}/tight")

    # Where each shard lives at every step's end, with "some" kept.
    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), _config(shares["some"], f"{tmp}/look{rank}"))
    homes = [zc.placement.params for zc in engine.chunks]
    expected = _expected_homes(engine, shares["some"])
    seen = []
    for x, y in parity.batches(3, 4):
        engine.backward(engine(x[rank * 2 : rank * 2 + 2], labels=y[rank * 2 : rank * 2 + 2]).loss)
        engine.step()
        engine.manager.synchronize()
        seen.append([(zc.shard.tier, zc.shard.on_nvme) for zc in engine.chunks])
    # A checkpoint saved with some shards on the host loads into an engine that keeps none there, and back.
    engine.save_checkpoint(f"{tmp}/ckpt")
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.close()
    restored = []
    for host_bytes in (0, 10**9):
        model = parity.build(seed=5)
        other = hetero.initialize(
            model, parity.make_optimizer(model), _config(host_bytes, f"{tmp}/load{host_bytes}_{rank}")
        )
        other.load_checkpoint(f"{tmp}/ckpt")
        after = other.full_state_dict()
        restored.append(all(torch.equal(before[k], after[k]) for k in before))
        other.close()
    return {**out, "homes": homes, "expected": expected, "seen": seen, "restored": restored}


def _nvme(result: dict, way: str) -> int:
    """Bytes a run wrote to NVMe ("->nvme") or read from it ("nvme->"), whichever tier was at the other end."""
    return sum(n for k, n in result["stats"]["moved"].items() if way in k)


@pytest.mark.timeout(300)
def test_kept_shards_stay_on_the_host_and_training_matches(tmp_path):
    results = run_distributed(_run, 2, str(tmp_path), timeout=280)
    for name in ("none", "some", "all", "tight"):
        parity.check(results[0][name], steps=4, rows=4)  # against the float64 reference
    for r in results:
        homes, expected = r["homes"], r["expected"]
        assert homes == expected and Tier.HOST in homes and Tier.NVME in homes
        for step in r["seen"]:
            for home, (tier, on_nvme) in zip(homes, step):
                if home is Tier.HOST:
                    # Never written to NVMe (with separate device memory it may sit on the device, read up for a
                    # gather, as host shards do).
                    assert tier is not Tier.NVME and not on_nvme
                else:
                    assert tier is Tier.NVME or on_nvme
        # Less written to NVMe the more is kept: the kept shards' write-backs (and their reads) are gone.
        written = [_nvme(r[name], "->nvme") for name in ("none", "some", "all")]
        read = [_nvme(r[name], "nvme->") for name in ("none", "some", "all")]
        assert written[0] > written[1] > written[2] and read[0] > read[1] > read[2]
        assert _nvme(r["tight"], "->nvme") > written[2]  # the budget sent kept shards down
        assert r["restored"] == [True, True]


def test_config_and_errors():
    cfg = hetero.Config.from_dict(_config("1GiB", "/tmp"))
    assert cfg.offload.params_host_bytes == 1 << 30
    assert hetero.Config.from_dict({"zero_stage": 3}).offload.params_host_bytes == 0
    with pytest.raises(ConfigError, match="params_host_bytes.*offload.params is 'host'"):
        hetero.Config.from_dict({"zero_stage": 3, "offload": {"params": "host", "params_host_bytes": 1024}})
    with pytest.raises(ConfigError, match="offload.params_host_bytes: a size cannot be negative"):
        hetero.Config.from_dict(_config(-1, "/tmp"))
    with pytest.raises(ConfigError, match="offload.params_host_bytes: cannot read 'lots'"):
        hetero.Config.from_dict(_config("lots", "/tmp"))


def _ds(offload_param: dict, precision: str | None = None) -> dict:
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"nvme_path": "/tmp", **offload_param}}}
    if precision:
        ds[precision] = {"enabled": True}
    return ds


def test_deepspeed_max_in_cpu_translates():
    # DeepSpeed keeps up to max_in_cpu 16-bit parameter elements (1e9 unless set) in CPU memory: so does hetero.
    assert hetero.Config.from_deepspeed(_ds({"device": "nvme"}, "bf16")).offload.params_host_bytes == 2 * 10**9
    assert hetero.Config.from_deepspeed(_ds({"device": "nvme"})).offload.params_host_bytes == 4 * 10**9  # fp32
    got = hetero.Config.from_deepspeed(_ds({"device": "nvme", "max_in_cpu": 1e6}, "fp16"), strict=True)
    assert got.offload.params_host_bytes == 2 * 10**6  # translated: strict finds nothing left over
    assert hetero.Config.from_deepspeed(_ds({"device": "nvme", "max_in_cpu": 0})).offload.params_host_bytes == 0
    with pytest.raises(ConfigError, match="pin_memory: hetero pins"):  # what hetero does otherwise is still named
        hetero.Config.from_deepspeed(_ds({"device": "nvme", "max_in_cpu": 0, "pin_memory": False}), strict=True)
    with pytest.raises(ConfigError, match="max_in_cpu: expected a number of parameter elements"):
        hetero.Config.from_deepspeed(_ds({"device": "nvme", "max_in_cpu": "lots"}))
    # Parameters on the host: max_in_cpu means nothing there, in DeepSpeed as in hetero.
    host = hetero.Config.from_deepspeed(_ds({"device": "cpu", "max_in_cpu": 1e6}))
    assert host.offload.params == "host" and host.offload.params_host_bytes == 0
