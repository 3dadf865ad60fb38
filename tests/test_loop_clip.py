"""The loop's own `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` between `engine.backward` and
`engine.step`, as loops written for plain PyTorch, DDP and FSDP2 clip ([Note: the loop's clip_grad_norm_] in
hetero/zero/loop_clip.py). It found no gradient in `param.grad` and clipped nothing before; it now clips the next
update as `grad_clip_norm` does: the same bits at every stage over two ranks, with accumulation."""

from __future__ import annotations

import math

import pytest
import torch

import hetero

try:
    from tests import parity
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

MAX_NORM = 0.05  # below the parity model's gradient norms (about 1-3): every update is clipped
STEPS, ACCUM, ROWS = 3, 2, 8


def _train(rank: int, world: int, stage: int, how: str) -> dict:
    """how: "config" (grad_clip_norm), "loop" (the loop's clip_grad_norm_ at each boundary) or "none"."""
    torch.set_num_threads(1)
    model = parity.build()
    config = {"zero_stage": stage, "chunk_size": parity.CHUNK, "grad_accumulation_steps": ACCUM}
    if how == "config":
        config["grad_clip_norm"] = MAX_NORM
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    data = parity.batches(STEPS * ACCUM, ROWS)
    local = ROWS // world
    norms, returned = [], []
    for i, (x, y) in enumerate(data):
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        engine.backward(engine(x, labels=y).loss)
        if how == "loop" and engine.is_gradient_accumulation_boundary():
            returned.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        engine.step()
        if (i + 1) % ACCUM == 0:
            norms.append(engine.last_grad_norm)
    state = {k: v.float().cpu() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {"state": state, "norms": norms, "returned": returned}


def _run(rank: int, world: int, stage: int) -> dict:
    return {how: _train(rank, world, stage, how) for how in ("config", "loop", "none")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_loops_clip_grad_norm_clips_as_grad_clip_norm_world2(stage):
    for out in run_distributed(_run, 2, stage, timeout=280):
        config, loop, none = out["config"], out["loop"], out["none"]
        assert all(torch.equal(loop["state"][k], config["state"][k]) for k in config["state"]), stage
        # what the loop got back is the norm before clipping that the engine reports, as a float32 tensor (torch's
        # is in the gradients' dtype)
        assert loop["norms"] == config["norms"]
        as_fp32 = [float(torch.tensor(n, dtype=torch.float32)) for n in config["norms"]]
        assert loop["returned"] == as_fp32, (loop["returned"], config["norms"])
        assert min(config["norms"]) > MAX_NORM  # every update was clipped ...
        # ... so without clipping the weights differ (what the loop's call amounted to before)
        assert any(not torch.allclose(none["state"][k], config["state"][k]) for k in config["state"])


def test_a_clip_the_engine_cannot_honour_is_refused_and_other_models_clip_as_before():
    model, other = parity.build(), torch.nn.Linear(4, 4)
    engine = hetero.initialize(model, parity.make_optimizer(model), {"chunk_size": parity.CHUNK})
    x, y = parity.batches(1, 4)[0]
    with pytest.raises(RuntimeError, match="after the backward that ends an accumulation"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # no backward yet
    engine.backward(engine(x, labels=y).loss)
    with pytest.raises(RuntimeError, match="part of the parameters"):
        torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], 1.0)
    with pytest.raises(RuntimeError, match="together with others"):
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *other.parameters()], 1.0)
    with pytest.raises(ValueError, match="2-norm"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=1.0)
    # torch's other clips of parameters found no .grad and clipped nothing, without a word: refused, naming the clip
    with pytest.raises(RuntimeError, match=r"clip_grad_value_ .*clip_grad_norm_\(model.parameters\(\), max_norm\)"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-4)
    with pytest.raises(RuntimeError, match="clip_grads_with_norm_ .*grad_clip_norm"):  # torchtitan's second half
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, torch.nn.utils.get_total_norm([]))
    # A model hetero does not hold: torch's own functions, unchanged
    other(torch.ones(2, 4)).sum().backward()
    before = torch.cat([p.grad.reshape(-1) for p in other.parameters()]).norm()
    assert torch.allclose(torch.nn.utils.clip_grad_norm_(other.parameters(), 1e-3), before)
    assert torch.cat([p.grad.reshape(-1) for p in other.parameters()]).norm() < 2e-3
    torch.nn.utils.clip_grads_with_norm_(other.parameters(), 1e-4, torch.tensor(1e-3))
    torch.nn.utils.clip_grad_value_(other.parameters(), 1e-5)
    assert max(float(p.grad.abs().max()) for p in other.parameters()) == pytest.approx(1e-5)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    engine.step()
    assert float(norm) == float(torch.tensor(engine.last_grad_norm, dtype=torch.float32))
    engine.close()
    # A closed engine's model is torch's again: no gradient in .grad, so nothing to clip
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0


def test_a_backward_after_the_clip_is_clipped_by_the_norm_it_makes():
    """The norm the loop's clip computed is kept for the update (not summed twice), and forgotten when a backward
    adds to the gradient after the clip: the update clips by the whole gradient's norm, as grad_clip_norm does."""

    def run(loop: bool) -> dict[str, torch.Tensor]:
        model = parity.build()
        config = {"chunk_size": parity.CHUNK, **({} if loop else {"grad_clip_norm": MAX_NORM})}
        engine = hetero.initialize(model, parity.make_optimizer(model), config)
        for x, y in parity.batches(2, 4):
            engine.backward(engine(x, labels=y).loss)
            if loop:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            engine.backward(engine(x, labels=y).loss)  # summed into the same update, as plain PyTorch allows
            engine.step()
        state = {k: v.clone() for k, v in engine.full_state_dict().items()}
        engine.close()
        return state

    clipped, config = run(True), run(False)
    assert all(torch.equal(clipped[k], config[k]) for k in config)


def _nan_in_one_gradient(model: torch.nn.Module) -> None:
    model.layers[0].attn.q_proj.weight.register_hook(lambda g: g * float("nan"))


@pytest.mark.parametrize("standin", [False, True], ids=["cpu", "standin"])
def test_a_nan_gradient_with_clipping_poisons_every_parameter_as_torchs(monkeypatch, standin):
    """One parameter's gradient NaN, clipping on: the norm is NaN and so is torch's clipping coefficient
    (`torch.clamp(nan, max=1)`), which multiplies every gradient, so torch's step leaves every parameter NaN. The
    chunks stepped on the host took min(1.0, nan), which is 1.0 in Python, and left all but the NaN parameter finite,
    where the same run on a device with memory of its own (the stand-in, a GPU) made every one NaN, as torch does."""
    if standin:
        monkeypatch.setenv("HETERO_STANDIN", "1")
    else:
        monkeypatch.delenv("HETERO_STANDIN", raising=False)  # the whole suite may run under it
    x, y = parity.batches(1, 4)[0]
    model = parity.build()
    _nan_in_one_gradient(model)
    model(x, labels=y).loss.backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).isnan()  # torch returns the NaN norm
    parity.make_optimizer(model).step()
    assert all(p.isnan().all() for p in model.parameters())  # torch's: every parameter
    for stage in (0, 3):
        for how in ("config", "loop"):
            model = parity.build()
            _nan_in_one_gradient(model)
            config = {"zero_stage": stage, "chunk_size": parity.CHUNK}
            if how == "config":
                config["grad_clip_norm"] = MAX_NORM
            engine = hetero.initialize(model, parity.make_optimizer(model), config)
            engine.backward(engine(x, labels=y).loss)
            if how == "loop":  # returns NaN as torch does (it returned inf)
                assert torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).isnan()
            engine.step()
            state = engine.full_state_dict()
            finite = sorted(k for k, v in state.items() if not v.isnan().all())
            assert finite == [], (stage, how, finite)
            assert math.isnan(engine.last_grad_norm)
            engine.close()
