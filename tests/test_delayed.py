"""`delayed_param_update`: the update of step t runs during step t+1 and matches the delayed algorithm exactly
([Note: the delayed parameter update])."""

from __future__ import annotations

import copy

import pytest
import torch

import hetero
from hetero.errors import ConfigError

try:
    from tests import parity, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

STEPS, ROWS = 6, 4


def delayed_reference(dtype: torch.dtype, *, clip: float | None = None) -> tuple[list[float], dict]:
    """Plain PyTorch running the delayed algorithm: step t's gradient is taken at the parameters of update t-2.
    The forward model holds what the last completed update gave; the master weights run one update ahead."""
    model = parity.build().to(dtype)
    master = copy.deepcopy(model)
    opt = parity.make_optimizer(master)
    losses = []
    for x, y in parity.batches(STEPS, ROWS):
        loss = model(x, labels=y).loss
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():  # the boundary: the pending update's values reach the model, then the next is taken
            for p, pm in zip(model.parameters(), master.parameters()):
                p.copy_(pm)
                pm.grad, p.grad = p.grad, None
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().float().clone() for k, v in master.state_dict().items()}


CONFIGS = {
    "z0-host": {"zero_stage": 0, "offload": {"optimizer": "host"}},
    "z1-host-clip": {"zero_stage": 1, "offload": {"optimizer": "host"}, "grad_clip_norm": 0.05},
    "z2-nvme": {"zero_stage": 2, "offload": {"optimizer": "nvme"}},
    "z3-nvme": {"zero_stage": 3, "offload": {"optimizer": "nvme", "params": "nvme"}},
}


def _probe(rank: int, world: int) -> dict:
    """The update is pending after step() and steps its chunks while the next forward runs."""
    model = parity.build()
    cfg = {"zero_stage": 3, "offload": {"optimizer": "host"}, "delayed_param_update": True, "chunk_size": parity.CHUNK}
    engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
    (x, y), _ = parity.batches(2, ROWS)
    x, y = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
    engine.backward(engine(x, labels=y).loss)
    engine.step()
    delayed = engine.updater.delayed
    out = {"pending_after_step": delayed.pending, "applied_after_step": engine.global_steps}
    with torch.no_grad():
        engine(x, labels=y)
    out["stepped_during_forward"] = delayed._next
    out["chunks"] = len(engine.updater.chunks)
    engine.settle_update()
    out["applied_after_settle"] = engine.global_steps
    engine.close()
    return out


def _run(rank: int, world: int, names: list[str], nvme: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name in names:
        cfg = {**CONFIGS[name], "delayed_param_update": True}
        out[name] = parity.run_hetero(rank, world, steps=STEPS, rows=ROWS, config=cfg, nvme_dir=f"{nvme}/{name}")
    out["exact"] = parity.run_hetero(rank, world, steps=STEPS, rows=ROWS, config=CONFIGS["z0-host"])
    out["probe"] = _probe(rank, world)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("standin", [False, True], ids=["cpu", "standin"])
def test_delayed_update_matches_the_delayed_algorithm_and_runs_during_the_next_step(tmp_path, monkeypatch, standin):
    if standin:
        monkeypatch.setenv("HETERO_STANDIN", "1")
    names = ["z1-host-clip", "z3-nvme"] if standin else list(CONFIGS)
    results = run_distributed(_run, 2, names, str(tmp_path), timeout=240)[0]
    refs = {
        clip: (delayed_reference(torch.float64, clip=clip), delayed_reference(torch.float32, clip=clip))
        for clip in (None, 0.05)
    }
    for name in names:
        (exact_losses, exact), (plain_losses, plain) = refs[CONFIGS[name].get("grad_clip_norm")]
        tolerance.assert_losses(results[name]["losses"], exact_losses, plain_losses, dtype=torch.float32)
        tolerance.assert_weights(results[name]["state"], exact, plain, dtype=torch.float32)
    # The exact update is another trajectory: the check above tells the two apart.
    (exact_losses, _), (plain_losses, _) = refs[None]
    with pytest.raises(AssertionError):
        tolerance.assert_losses(results["exact"]["losses"], exact_losses, plain_losses, dtype=torch.float32)
    probe = results["probe"]
    assert probe["pending_after_step"] and probe["applied_after_step"] == 0
    assert probe["stepped_during_forward"] == probe["chunks"] > 2
    assert probe["applied_after_settle"] == 1


def test_delayed_update_needs_the_optimizer_off_the_device():
    with pytest.raises(ConfigError, match="delayed_param_update"):
        hetero.Config.from_dict({"delayed_param_update": True})
    with pytest.raises(ConfigError, match="delayed_param_update"):
        hetero.Config.from_dict({"delayed_param_update": "yes", "offload": {"optimizer": "host"}})
