"""ZeRO stages 0-3 on chunks train to the same losses and weights as plain PyTorch."""

from __future__ import annotations

import gc
import itertools
import math
import tempfile

import pytest
import torch

import hetero
from hetero.errors import ConfigError

try:
    from tests import parity
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

STEPS, ROWS = 10, 4
STAGES = (0, 1, 2, 3)
OFFLOADS = ("device", "host", "nvme")
PRECISIONS = ("fp32", "bf16")


def _config(stage: int, offload: str, precision: str) -> dict:
    return {
        "zero_stage": stage,
        "precision": precision,
        "offload": {"optimizer": offload, "params": offload if stage == 3 else "device"},
    }


MATRIX = [_config(s, o, p) for s, o, p in itertools.product(STAGES, OFFLOADS, PRECISIONS)]


def _run_matrix(rank: int, world: int, configs: list[dict], nvme_root: str) -> dict[str, dict]:
    torch.set_num_threads(1)
    out = {}
    for i, cfg in enumerate(configs):
        nvme = f"{nvme_root}/{i}" if "nvme" in repr(cfg) else None
        out[parity.key(cfg)] = parity.run_hetero(rank, world, steps=STEPS, rows=ROWS, config=cfg, nvme_dir=nvme)
    return out


_RESULTS: dict[int, dict] = {}


def _results(world: int) -> dict:
    """All of the matrix at one world size, in one spawn (processes cost seconds to start)."""
    if world not in _RESULTS:
        with tempfile.TemporaryDirectory() as d:
            if world == 1:
                _RESULTS[1] = _run_matrix(0, 1, MATRIX, d)
            else:
                _RESULTS[world] = run_distributed(_run_matrix, world, MATRIX, d, timeout=600)[0]
    return _RESULTS[world]


def _assert_parity(result: dict, precision: str, **kwargs: object) -> None:
    kwargs = {"steps": STEPS, "rows": ROWS, **kwargs}
    parity.check(result, precision, **kwargs)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(
    "cfg", MATRIX, ids=lambda c: f"z{c['zero_stage']}-{c['offload']['optimizer']}-{c['precision']}"
)
def test_parity_matrix(world, cfg):
    result = _results(world)[parity.key(cfg)]
    assert result["chunks"] > 2  # the model really spans several chunks
    _assert_parity(result, cfg["precision"])
    if cfg["offload"]["optimizer"] == "nvme":
        assert result["stats"]["moved"].get("host->nvme", 0) > 0  # the states really went to disk


def _run_world4(rank: int, world: int, nvme_root: str) -> dict:
    torch.set_num_threads(1)
    cfgs = [_config(1, "device", "fp32"), _config(3, "nvme", "fp32"), _config(2, "host", "fp32")]
    return _run_matrix(rank, world, cfgs, nvme_root)


@pytest.mark.timeout(600)
def test_parity_world4(tmp_path):
    results = run_distributed(_run_world4, 4, str(tmp_path), timeout=500)[0]
    for result in results.values():
        _assert_parity(result, "fp32")


def _run_variants(rank: int, world: int, nvme_root: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    for stage in STAGES:
        cfg = {"zero_stage": stage, "grad_accumulation_steps": 2, "grad_clip_norm": 0.05}
        out[f"accum-clip-{stage}"] = parity.run_hetero(rank, world, steps=6, rows=4, config=cfg)
        cfg = {"zero_stage": stage, "offload": {"optimizer": "host"}}
        out[f"frozen-{stage}"] = parity.run_hetero(
            rank, world, steps=6, rows=4, config=cfg, freeze=("layers.0.", "pos_embed")
        )
        out[f"sgd-{stage}"] = parity.run_hetero(
            rank, world, steps=6, rows=4, config={"zero_stage": stage}, optimizer="sgd"
        )
    return out


@pytest.mark.timeout(600)
def test_accumulation_clipping_frozen_and_sgd_world2(tmp_path):
    results = run_distributed(_run_variants, 2, str(tmp_path), timeout=500)[0]
    for stage in STAGES:
        _assert_parity(results[f"accum-clip-{stage}"], "fp32", steps=6, rows=4, accum=2, clip=0.05)
        _assert_parity(results[f"frozen-{stage}"], "fp32", steps=6, rows=4, freeze=("layers.0.", "pos_embed"))
        _assert_parity(results[f"sgd-{stage}"], "fp32", steps=6, rows=4, optimizer="sgd")
    # Frozen parameters really stayed put.
    init = parity.build().state_dict()
    assert torch.equal(results["frozen-3"]["state"]["layers.0.attn.q_proj.weight"], init["layers.0.attn.q_proj.weight"])


def test_tied_weights_stay_tied():
    model = parity.build()
    assert model.lm_head.weight is model.embed.weight
    engine = hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": 3, "chunk_size": parity.CHUNK})
    x, y = parity.batches(1, 2)[0]
    engine.backward(engine(x, labels=y).loss)
    engine.step()
    assert model.lm_head.weight is model.embed.weight
    assert "lm_head.weight" not in dict(model.named_parameters())  # still one parameter under its first name
    engine.close()


def _fp16_run(steps: int, scale: float) -> tuple:
    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": 2, "precision": "fp16"})
    engine.scaler.scale = scale
    before = engine.full_state_dict()
    losses = []
    for x, y in parity.batches(steps, 4):
        loss = engine(x, labels=y).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, before, losses


def test_fp16_overflow_skips_the_step_and_backs_off():
    engine, before, _ = _fp16_run(1, scale=2.0**120)  # any gradient times 2**120 overflows fp16
    assert engine.skipped_steps == 1 and engine.global_steps == 0
    assert engine.scaler.scale == 2.0**119
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was updated
    engine.close()
    engine, before, losses = _fp16_run(6, scale=2.0**10)
    assert engine.skipped_steps == 0 and engine.global_steps == 6
    _assert_parity({"losses": losses, "state": engine.full_state_dict()}, "fp16", steps=6, rows=4)
    engine.close()


def test_device_budget_holds_at_stage3(tmp_path):
    model = parity.build()
    nbytes = parity.CHUNK * 4
    budget = 12 * nbytes
    cfg = {
        "zero_stage": 3,
        "offload": {"params": "host", "optimizer": "host"},
        "memory": {"device_budget": budget},
        "chunk_size": parity.CHUNK,
    }
    engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
    total = sum(zc.spec.capacity for zc in engine.chunks) * 4
    assert total * 3 > budget  # params + grads + states would not fit on the device
    for x, y in parity.batches(4, 4):
        engine.backward(engine(x, labels=y).loss)
        engine.step()
        assert engine.memory_stats()["device"]["peak"] <= budget
    assert engine.memory_stats()["device"]["peak"] > 0
    engine.close()


def test_lr_scheduler_drives_the_update():
    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": 1})
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(engine.optimizer, T_max=4)
    lrs = []
    for x, y in parity.batches(4, 4):
        engine.backward(engine(x, labels=y).loss)
        engine.step()
        sched.step()
        lrs.append(engine.optimizer.param_groups[0]["lr"])
    assert lrs[-1] < lrs[0] and math.isclose(lrs[1], 3e-3 * (1 + math.cos(math.pi * 2 / 4)) / 2)
    engine.close()


def test_engine_output_matches_model_and_names_unchanged():
    model = parity.build()
    names = [n for n, _ in model.named_parameters()]
    x, y = parity.batches(1, 2)[0]
    expected = model(x, labels=y).loss.item()
    engine = hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": 3})
    assert engine(x, labels=y).loss.item() == pytest.approx(expected, rel=1e-6)
    assert [n for n, _ in engine.module.named_parameters()] == names
    assert engine.module is model
    engine.close()


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({"zero_stage": 2, "offload": {"params": "host"}}, "offload.params: 'host' needs zero_stage 3"),
        ({"zero_stage": 5}, "zero_stage: must be one of"),
        ({"zero_stage": 1, "precison": "bf16"}, "did you mean 'precision'"),
    ],
)
def test_bad_config_is_refused(cfg, match):
    model = parity.build()
    with pytest.raises(ConfigError, match=match):
        hetero.initialize(model, parity.make_optimizer(model), cfg)


def test_unsupported_optimizer_is_named():
    # Elementwise optimizers (RMSprop, ...) take the generic path (tests/test_generic_optim.py); one that needs a
    # closure cannot run on flat shards, and the error names it and says why.
    model = parity.build()
    with pytest.raises(ConfigError, match=r"optimizer LBFGS cannot run on hetero's flat shards: .*closure"):
        hetero.initialize(model, torch.optim.LBFGS(model.parameters()), {})


def test_two_engines_in_one_process_and_release(tmp_path):
    a, b = parity.build(), parity.build(seed=1)
    cfg = {"zero_stage": 3, "offload": {"optimizer": "nvme"}, "memory": {"nvme_dir": str(tmp_path)}}
    ea = hetero.initialize(a, parity.make_optimizer(a), cfg)
    eb = hetero.initialize(b, parity.make_optimizer(b), cfg)
    x, y = parity.batches(1, 2)[0]
    for engine in (ea, eb):
        engine.backward(engine(x, labels=y).loss)
        engine.step()
    assert len(list(tmp_path.iterdir())) == 2  # a private swap directory each
    ea.close()
    del engine, eb
    gc.collect()
    assert not list(tmp_path.iterdir())  # a dropped engine removes its swap files


def test_tight_budgets_on_every_tier_with_nvme(tmp_path):
    """Everything spills: a device of 4 chunks, a host of 10, the rest on NVMe; still plain PyTorch's losses."""
    nb = parity.CHUNK * 4
    cfg = {
        "zero_stage": 3,
        "offload": {"params": "nvme", "optimizer": "nvme"},
        "memory": {"device_budget": 4 * nb, "host_budget": 10 * nb},
    }
    result = parity.run_hetero(0, 1, steps=5, rows=4, config=cfg, nvme_dir=str(tmp_path))
    _assert_parity(result, "fp32", steps=5, rows=4)
    stats = result["stats"]
    assert stats["device"]["peak"] <= 4 * nb and stats["host"]["peak"] <= 10 * nb
    assert stats["moved"]["nvme->host"] > 0 and stats["counters"]["prefetch_hits"] > 0
