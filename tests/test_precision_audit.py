"""Mixed precision against plain PyTorch: fp16 with dynamic loss scaling as a single-process loop with
torch.amp.GradScaler and fp32 master weights does it (tests/precision_ref.py), bf16 as fp32 masters cast down.

What a user must get from fp16, checked on every rank against that loop: a micro-batch that overflows on one rank only
(the last one of an accumulation included) skips the update on every rank, the scale halves, and it grows again
after `growth_interval` good steps, step for step as GradScaler's; across ZeRO stages 0-3, states on the host and
NVMe, clipping (the config's and the loop's own clip_grad_norm_), tensor parallel 2 and pipeline 2 on 2 and 4 ranks;
DeepSpeed's hysteresis as DeepSpeed's scaler keeps it; the scaler's state resumed from a checkpoint to the bit; a
Hugging Face Llama trained 20 steps. The weights and losses are within the bound of [Note: tolerances from the
arithmetic] (tests/tolerance.py): hetero may be FACTOR times as far from the float64 run (the same steps skipped) as
plain PyTorch in fp16 is, plus 4 units of fp16's epsilon (2**-10) of the value, on the weight deltas. A loss that is
nan from the start skips every step, as GradScaler does, and says why ([Note: overflows the scale cannot cure]).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import os
import types

import pytest
import torch

import hetero

try:
    from tests import grid_parity, parity, pipe_parity, tolerance
    from tests import precision_ref as ref
    from tests.dist import NEEDS_DEGREES, RANKS_DIFFER, ranks_apart, run_distributed
except ImportError:  # tests/ itself on sys.path
    import grid_parity  # type: ignore[no-redef]
    import parity  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]
    import precision_ref as ref  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import NEEDS_DEGREES, RANKS_DIFFER, ranks_apart, run_distributed  # type: ignore[no-redef]

FP16 = torch.float16
STEPS, ROWS = 8, 8
# (step, micro-batch, rank) boosted: the last micro-batch of an accumulation on rank 1, the first on rank 0, then two
# updates in a row, so the scale halves, grows back after growth_interval (2) good steps, halves twice and grows.
BOOSTS = frozenset({(1, 1, 1), (4, 0, 0), (5, 1, 1)})
SCALE = {"initial_scale": 2.0**10, "growth_interval": 2}


def _skipped(run: dict) -> tuple[int, ...]:
    return tuple(i for i, (applied, _) in enumerate(run["log"]) if not applied)


def _check(got: dict, plain: dict, exact: dict, initial: dict) -> None:
    """Losses and weight deltas within the bound of [Note: tolerances from the arithmetic]: plain PyTorch in fp16 is
    the scale of fp16's own error, the float64 run (the same steps skipped) the truth; the run must learn."""
    tolerance.assert_learns(exact["state"], plain["state"], initial)
    tolerance.assert_losses(got["losses"], exact["losses"], plain["losses"], dtype=FP16)
    tolerance.assert_weights(got["state"], exact["state"], plain["state"], dtype=FP16, initial=initial)


def _configs(clip: float | None) -> list[dict]:
    out = []
    for stage, tier in [(0, "device"), (1, "host"), (2, "nvme"), (3, "device"), (3, "nvme")]:
        cfg = {
            "zero_stage": stage,
            "precision": "fp16",
            "grad_accumulation_steps": 2,
            "loss_scale": SCALE,
            "offload": {"optimizer": tier, "params": tier if stage == 3 else "device"},
        }
        if clip is not None:
            cfg["grad_clip_norm"] = clip
        out.append(cfg)
    return out


def _each_config(rank: int, world: int, configs: list[dict], root: str, boosts: frozenset, loop_clip: float | None):
    out = []
    for i, cfg in enumerate(configs):
        nvme = os.path.join(root, str(i)) if "nvme" in repr(cfg) else None
        out.append(
            ref.run_hetero(
                rank, world, steps=STEPS, rows=ROWS, config=cfg, boosts=boosts, nvme_dir=nvme, loop_clip=loop_clip
            )
        )
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_tiled_layers_in_fp16_train_as_plain_pytorch(stage):
    """[Note: tiles summed in fp32] (hetero/zero/tile_autograd.py): at 2048-element chunks the parity GPT's 64 x 64
    projections are split into tiles, whose products are summed. Summed in fp32 and rounded once, the tiled layers
    do plain fp16 PyTorch's arithmetic but for the order of fp32 additions, whose rounding (2^-24) is 2^-13 of
    fp16's: so the tiled engine must stay as far from the float64 run as plain fp16 PyTorch is, within a quarter
    (measured: within 1%), not within the general FACTOR. Summed in fp16 (found by a fuzz of config combinations),
    layer 0's projections were 2.6-4.7x plain's distance here, and v_proj 11.7x in a fuzzed config."""
    plain = ref.reference(steps=STEPS, world=1, rows=ROWS)
    exact = ref.reference(steps=STEPS, world=1, rows=ROWS, precision="fp64", skipped=_skipped(plain))
    scale = {"initial_scale": 2.0**10, "growth_interval": 2000}  # the reference's GradScaler
    cfg = {"zero_stage": stage, "precision": "fp16", "chunk_size": 2048, "tiling": True, "loss_scale": scale}
    got = ref.run_hetero(0, 1, steps=STEPS, rows=ROWS, config=cfg)
    assert got["log"] == plain["log"]
    _check(got, plain, exact, parity.build().state_dict())
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        k = f"layers.0.attn.{name}.weight"
        ours, theirs = (float((r["state"][k].double() - exact["state"][k].double()).norm()) for r in (got, plain))
        assert ours <= 1.25 * theirs, f"{k}: {ours:.3g} from the float64 run, plain fp16 PyTorch {theirs:.3g}"


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("clip", [None, "config", "loop"])
def test_an_overflow_on_one_rank_skips_together_as_gradscaler(tmp_path, clip):
    """Stages 0-3, states on the device, host and NVMe, accumulation 2, world 2: a micro-batch overflowing on one
    rank (the accumulation's last, or its first) skips the update on both; the scale's path is GradScaler's; clipped
    by the config or by the loop's clip_grad_norm_, which returns inf for an overflowed update as torch's does after
    GradScaler.unscale_ (and the update is skipped, not made nan)."""
    max_norm = 0.05 if clip is not None else None
    plain = ref.reference(steps=STEPS, world=2, rows=ROWS, accum=2, clip=max_norm, boosts=BOOSTS, growth_interval=2)
    # halved at each overflow, grown after 2 good steps: the scenario reaches what it tests
    assert [s for _, s in plain["log"]] == [2.0**k for k in (10, 9, 9, 10, 9, 8, 8, 9)]
    exact = ref.reference(
        steps=STEPS, world=2, rows=ROWS, accum=2, clip=max_norm, precision="fp64", skipped=_skipped(plain)
    )
    configs = _configs(max_norm if clip == "config" else None)
    loop_clip = max_norm if clip == "loop" else None
    runs = run_distributed(_each_config, 2, configs, str(tmp_path), BOOSTS, loop_clip, timeout=560)
    initial = parity.initial_state()
    for cfg, got, peer in zip(configs, runs[0], runs[1]):
        where = f"stage {cfg['zero_stage']}, {cfg['offload']['optimizer']}"
        assert got["log"] == peer["log"] == plain["log"], where
        assert got["skipped"] == peer["skipped"] == 3, where
        _check(got, plain, exact, initial)
        if loop_clip is not None:
            applied = [n for i, n in enumerate(got["norms"]) if i not in _skipped(plain)]
            # inf or nan (inf - inf in the backward), as torch's clip_grad_norm_ after GradScaler.unscale_ returns
            assert not any(math.isfinite(n) for i, n in enumerate(got["norms"]) if i in _skipped(plain)), got["norms"]
            assert not any(math.isfinite(n) for i, n in enumerate(plain["norms"]) if i in _skipped(plain))
            tolerance.assert_losses(applied, exact["norms"], [plain["norms"][i] for i in range(STEPS) if i not in
                                    _skipped(plain)], dtype=FP16)  # fmt: skip


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(400)
def test_an_overflow_on_one_of_four_ranks_skips_together(tmp_path):
    """World 4: the last micro-batch of an accumulation overflowing on rank 3 alone, then rank 0's, at stage 1 with
    states on the host and stage 3 on the device: every rank skips those updates, with GradScaler's scale."""
    boosts = frozenset({(1, 1, 3), (4, 1, 0), (5, 1, 2)})
    plain = ref.reference(steps=STEPS, world=4, rows=ROWS, accum=2, boosts=boosts, growth_interval=2)
    assert _skipped(plain) == (1, 4, 5)
    exact = ref.reference(steps=STEPS, world=4, rows=ROWS, accum=2, precision="fp64", skipped=_skipped(plain))
    configs = [cfg for cfg in _configs(None) if (cfg["zero_stage"], cfg["offload"]["optimizer"]) in {(1, "host"),
               (3, "device")}]  # fmt: skip
    runs = run_distributed(_each_config, 4, configs, str(tmp_path), boosts, None, timeout=360)
    initial = parity.initial_state()
    for i in range(len(configs)):
        assert all(r[i]["log"] == plain["log"] for r in runs), [r[i]["log"] for r in runs]
        _check(runs[0][i], plain, exact, initial)


# (world, config, {step: the (tensor, data, pipeline) rank whose embedding gradient alone overflows})
PARALLEL = [
    (2, {"parallel": {"tensor": 2}}, {1: (1, 0, 0), 3: (0, 0, 0)}),
    (2, {"parallel": {"pipeline": 2, "microbatches": 2}}, {1: (0, 0, 0), 4: (0, 0, 0)}),
    (4, {"parallel": {"tensor": 2}, "zero_stage": 3}, {1: (1, 1, 0), 3: (0, 0, 0)}),
    (4, {"parallel": {"pipeline": 2, "microbatches": 2}, "zero_stage": 1}, {1: (0, 1, 0), 4: (0, 0, 0)}),
    (4, {"parallel": {"pipeline": 2, "tensor": 2}, "zero_stage": 2, "grad_clip_norm": 0.05}, {2: (1, 0, 0)}),
]


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, config, overflows", PARALLEL, ids=["tp2", "pp2", "tp2-dp2", "pp2-dp2", "tp2-pp2"])
def test_tensor_and_pipeline_ranks_skip_together(world, config, overflows):
    """Tensor parallel 2 and pipeline 2 (and both), on 2 and 4 ranks: one tensor rank's or one stage's gradient
    overflowing skips the update on every rank, with GradScaler's scale after each step (growth_interval 1)."""
    steps, rows = 6, 4
    cfg = {**config, "precision": "fp16", "loss_scale": {"initial_scale": 2.0**10, "growth_interval": 1}}
    clip = cfg.get("grad_clip_norm")
    boosts = frozenset((s, 0, 0) for s in overflows)  # the global batch's step overflows: the reference's
    run = functools.partial(ref.reference, steps=steps, world=1, rows=rows, clip=clip, build=pipe_parity.build)
    plain = run(boosts=boosts, growth_interval=1)
    assert _skipped(plain) == tuple(sorted(overflows))
    exact = run(precision="fp64", skipped=_skipped(plain))
    results = run_distributed(
        ref.run_parallel, world, steps=steps, rows=rows, config=cfg, overflows=overflows, timeout=260
    )
    by_stage: dict[int, list[dict]] = {}
    for r in results:
        assert r["log"] == plain["log"], r["coords"]
        tolerance.assert_losses(r["losses"], exact["losses"], plain["losses"], dtype=FP16)
        if r["state"] is not None:
            by_stage.setdefault(r["coords"][2], []).append(r)
    initial = {k: v.detach().clone() for k, v in pipe_parity.build().state_dict().items()}
    merged = pipe_parity.merge_ranks(by_stage)
    tolerance.assert_learns(exact["state"], plain["state"], initial)
    tolerance.assert_weights(merged, exact["state"], plain["state"], dtype=FP16, initial=initial)


def _deepspeed_scaler(fp16: dict, monkeypatch: pytest.MonkeyPatch):
    """DeepSpeed's DynamicLossScaler as its ZeRO optimizers make it for an fp16 section, keeping the minimum (as
    tests/test_loss_scale.py makes it); its update_scale asks deepspeed.comm for the rank: rank 0 of one, stubbed."""
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    precision_config = pytest.importorskip("deepspeed.runtime.precision_config")
    monkeypatch.setattr(loss_scaler, "dist", types.SimpleNamespace(get_rank=lambda: 0))
    args = precision_config.DeepSpeedFP16Config(**fp16).dynamic_loss_scale_args()
    return loss_scaler.DynamicLossScaler(**args, raise_error_at_min_scale=False)


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(300)
def test_hysteresis_as_deepspeeds_scaler_keeps_it(tmp_path, monkeypatch):
    """A translated DeepSpeed fp16 section with hysteresis 2, stage 3 on NVMe over 2 ranks, overflows on one rank:
    the first overflow after a growth is let through (its step skipped all the same), the next halves, step for step
    as DeepSpeed's own scaler keeps the scale for the same overflows."""
    fp16 = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 2, "hysteresis": 2}
    plain = ref.reference(
        steps=STEPS, world=2, rows=ROWS, accum=2, boosts=BOOSTS, deepspeed_scaler=_deepspeed_scaler(fp16, monkeypatch)
    )
    assert _skipped(plain) == (1, 4, 5)
    assert [s for _, s in plain["log"]][1] == 2.0**10  # the first overflow held the scale
    cfg = hetero.Config.from_deepspeed({"fp16": fp16}, strict=True)
    config = {"zero_stage": 3, "precision": "fp16", "grad_accumulation_steps": 2, "offload": {"optimizer": "nvme"}}
    config["loss_scale"] = dataclasses.asdict(cfg.loss_scale)
    runs = run_distributed(_each_config, 2, [config], str(tmp_path), BOOSTS, None, timeout=260)
    exact = ref.reference(steps=STEPS, world=2, rows=ROWS, accum=2, precision="fp64", skipped=_skipped(plain))
    assert runs[0][0]["log"] == runs[1][0]["log"] == plain["log"]
    _check(runs[0][0], plain, exact, parity.initial_state())


def _resumed(rank: int, world: int, config: dict, root: str, split: int | None) -> dict:
    """Train STEPS updates with overflows on one rank; with `split`, save before that step, close, and go on in a
    fresh engine from the checkpoint."""
    count = [0]

    def make() -> hetero.Engine:
        cfg = copy.deepcopy(config)
        cfg["chunk_size"] = parity.CHUNK
        cfg["memory"] = {"nvme_dir": os.path.join(root, f"nvme{rank}-{count[0]}")}
        os.makedirs(cfg["memory"]["nvme_dir"])
        count[0] += 1
        model = parity.build()
        return hetero.initialize(model, parity.make_optimizer(model), cfg)

    engine, log = make(), []
    local = ROWS // world
    for step, (x, y) in enumerate(parity.batches(STEPS, ROWS)):
        if step == split:
            saved = engine.save_checkpoint(os.path.join(root, "ckpt"))
            engine.close()
            engine = make()
            engine.load_checkpoint(saved)
        rows = slice(rank * local, (rank + 1) * local)
        loss = engine(x[rows], labels=y[rows]).loss
        engine.backward(loss * (ref.BOOST if (step, 0, rank) in BOOSTS_RESUME else 1.0))
        engine.step()
        log.append((engine.was_step_applied(), engine.scaler.scale, engine.skipped_steps, engine.global_steps))
    out = {"log": log, "state": engine.full_state_dict(), "scaler": engine.scaler.state_dict()}
    engine.close()
    return out


BOOSTS_RESUME = frozenset({(2, 0, 1), (5, 0, 0), (6, 0, 0)})


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage, tier", [(3, "nvme"), (1, "host"), (2, "device")])
def test_the_scaler_resumes_bit_exact(tmp_path, stage, tier):
    """Saved between two overflows (the hysteresis count down to 1, the growth window part counted) and resumed in a
    fresh engine: the run goes on to the same bits as one never interrupted, scale and counters included (on the
    device under HETERO_STANDIN=1 or a GPU, the overflow checked there: [Note: the overflow check on the device])."""
    config = {
        "zero_stage": stage,
        "precision": "fp16",
        "loss_scale": {"initial_scale": 2.0**10, "growth_interval": 2, "hysteresis": 2},
        "offload": {"optimizer": tier, "params": tier if stage == 3 else "device"},
    }
    whole = run_distributed(_resumed, 2, config, str(tmp_path / "a"), None, timeout=180)
    split = run_distributed(_resumed, 2, config, str(tmp_path / "b"), 6, timeout=180)
    assert [row[:2] for row in whole[0]["log"]] == [
        (True, 2.0**10), (True, 2.0**11), (False, 2.0**11), (True, 2.0**11),
        (True, 2.0**12), (False, 2.0**12), (False, 2.0**11), (True, 2.0**11),
    ]  # fmt: skip
    assert whole[0]["scaler"]["hysteresis_left"] == 1  # mid-count at the end too
    for a, b in zip(whole, split):
        assert a["log"] == b["log"] and a["scaler"] == b["scaler"]
        assert a["state"].keys() == b["state"].keys()
        assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


def _llama() -> torch.nn.Module:
    return grid_parity.build("llama")


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(400)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_hf_llama_trains_20_steps_as_plain_pytorch(precision):
    """A tiny transformers Llama, stage 3 over 2 ranks, 20 steps: fp16 at hetero's default scale (2**16) with two
    one-rank overflows and growth every 5 good steps, bf16 with fp32 masters; the losses and weight deltas within
    the bound argued from the arithmetic (FACTOR x plain PyTorch's own distance from float64 + 4 eps of the value,
    eps = 2**-10 for fp16, 2**-7 for bf16), the skipped steps and the scale GradScaler's."""
    steps, rows = 20, 8
    boosts = frozenset({(4, 0, 1), (11, 0, 0)}) if precision == "fp16" else frozenset()
    run = functools.partial(ref.reference, steps=steps, world=2, rows=rows, build=_llama, hf=True)
    plain = run(precision=precision, scale=2.0**16, growth_interval=5, boosts=boosts)
    assert _skipped(plain) == tuple(sorted(s for s, _, _ in boosts))
    exact = run(precision="fp64", skipped=_skipped(plain))
    config = {"zero_stage": 3, "precision": precision, "loss_scale": {"growth_interval": 5}}
    if precision == "bf16":
        del config["loss_scale"]
    results = run_distributed(
        ref.run_hetero, 2, steps=steps, rows=rows, config=config, boosts=boosts, build=_llama, hf=True, timeout=360
    )
    dtype = parity.DTYPES[precision]
    initial = {k: v.detach().clone() for k, v in _llama().state_dict().items()}
    tolerance.assert_learns(exact["state"], plain["state"], initial)
    for got in results:
        assert got["log"] == plain["log"]
        tolerance.assert_losses(got["losses"], exact["losses"], plain["losses"], dtype=dtype)
    tolerance.assert_weights(results[0]["state"], exact["state"], plain["state"], dtype=dtype, initial=initial)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_clipping_inf_gradients_makes_the_weights_nan_as_torch_does(precision):
    """Without a loss scale nothing skips: an inf gradient's norm is inf, torch's clip coefficient 0, and inf * 0
    makes every parameter nan through Adam. hetero does the same, rather than stepping some parameters only."""
    model = parity.build()
    config = {"zero_stage": 2, "precision": precision, "chunk_size": parity.CHUNK, "grad_clip_norm": 0.05}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    x, y = parity.batches(1, 4)[0]
    engine.backward(engine(x, labels=y).loss * float("inf"))
    engine.step()
    state = engine.full_state_dict()
    assert engine.last_grad_norm != engine.last_grad_norm  # nan, as torch's clip_grad_norm_ of inf * 0 gradients
    engine.close()
    assert all(bool(v.isnan().all()) for v in state.values())
    torch_model = parity.build().to(parity.DTYPES[precision])
    torch_master = copy.deepcopy(torch_model).float()
    opt = parity.make_optimizer(torch_master)
    (torch_model(x, labels=y).loss * float("inf")).backward()
    for pm, p in zip(torch_master.parameters(), torch_model.parameters()):
        pm.grad = p.grad.float()
    torch.nn.utils.clip_grad_norm_(torch_master.parameters(), 0.05)
    opt.step()
    assert all(bool(p.isnan().all()) for p in torch_master.parameters())


def test_a_nan_loss_from_the_start_skips_every_step_and_says_why(caplog):
    """A loss that is nan from the first step: GradScaler skips every step (halving on towards 0); hetero skips
    every step too, the scale down to its minimum, and then warns, naming the minimum and what to check, at the
    first overflow there and as their run doubles (not every step). A clean step ends the run."""
    model = parity.build()
    config = {"zero_stage": 2, "precision": "fp16", "chunk_size": parity.CHUNK}
    config["loss_scale"] = {"initial_scale": 4.0, "min_scale": 1.0}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    before = engine.full_state_dict()
    warned = []
    batches = parity.batches(12, 4)
    with caplog.at_level(logging.WARNING, logger="hetero.zero"):
        for x, y in batches[:10]:
            engine.backward(engine(x, labels=y).loss * float("nan"))
            engine.step()
            assert not engine.was_step_applied()
            warned.append(sum("overflowed" in r.getMessage() for r in caplog.records))
    assert [engine.scaler.scale, engine.skipped_steps, engine.global_steps] == [1.0, 10, 0]
    # scale 4 -> 2 -> 1 -> 1 ...: the third step is the first at the minimum, then 2, 4 and 8 in a row warn
    assert warned == [0, 0, 1, 2, 2, 3, 3, 3, 3, 4], warned
    first = next(r.getMessage() for r in caplog.records if "overflowed" in r.getMessage())
    assert "at the minimum loss scale 1 (loss_scale.min_scale), 1 step(s) in a row" in first
    assert "a nan or inf loss" in first
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing stepped
    x, y = batches[10]
    engine.backward(engine(x, labels=y).loss)
    engine.step()
    assert engine.was_step_applied() and engine.scaler.floor_overflows == 0
    engine.close()


def test_a_static_scale_that_overflows_says_so(caplog):
    """A static scale never falls: the first overflow already warns, naming loss_scale.static."""
    from hetero.config import LossScaleConfig
    from hetero.zero.precision import LossScaler

    scaler = LossScaler.configured(LossScaleConfig(static=2.0**12))
    with caplog.at_level(logging.WARNING, logger="hetero.zero"):
        scaler.update(True)
        scaler.log_skipped()
    assert "the static loss scale 4096 (loss_scale.static)" in caplog.text
    dynamic = LossScaler(scale=8.0, min_scale=2.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hetero.zero"):
        for _ in range(2):  # 8 -> 4 -> 2: above the minimum, a smaller scale may still cure it
            dynamic.update(True)
            dynamic.log_skipped()
    assert caplog.text == "" and dynamic.scale == 2.0
