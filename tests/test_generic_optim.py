"""Any elementwise torch optimizer trains through hetero's generic path to plain PyTorch's losses and weights; its
hyperparameters and states (per-element and per-parameter 0-d ones) survive a checkpoint; a non-elementwise one is
refused with the reason.

Tolerance: the generic path runs the optimizer class's own step() on flat views, the same per-element arithmetic as
on the whole tensors (torch's single-tensor loops are elementwise), so the only difference from the reference is
the order of the gradient reductions (fp32 rounding, ~1e-7 relative per step); rtol 1e-5 after a few steps. That
holds only with the reference on the engine's device: on a GPU the model's forward and backward run other kernels
than the CPU's (cuBLAS, other reduction orders), and RMSprop (centered), Adamax, NAdam and amsgrad Adam turn such
rounding differences into weight differences past rtol 1e-5 within these four steps (measured on the CPU: one ulp
changed in 1% of the Linear layers' outputs moves weights by up to 280, 200, 110 and 2 times the tolerance). So the
reference runs where the engine ran, and the two-rank run, whose gloo ranks are CPU ranks, against one on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import hetero
from hetero.errors import ConfigError
from tests import parity
from tests.dist import run_distributed

OPTIMIZERS = {
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, initial_accumulator_value=0.1, weight_decay=0.01),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.003, momentum=0.9, centered=True, weight_decay=0.01),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01, weight_decay=0.01),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.005, momentum_decay=0.004, weight_decay=0.01),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.005, weight_decay=0.01, decoupled_weight_decay=True),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.05, t0=2),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.005, amsgrad=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
}


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def _reference(name: str, steps: int, device: torch.device | str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on `device` (the engine's: see the tolerance above); the weights as CPU copies, as hetero's
    full_state_dict gives them."""
    model = parity.build().to(device)
    opt = OPTIMIZERS[name](_groups(model))
    losses = []
    for x, y in parity.batches(steps, 4):
        loss = model(x.to(device), labels=y.to(device)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _hetero(name: str, steps: int, stage: int, rank: int = 0, world: int = 1) -> tuple[list[float], dict]:
    model = parity.build()
    opt = OPTIMIZERS[name](_groups(model))
    engine = hetero.initialize(model, opt, {"zero_stage": stage, "chunk_size": parity.CHUNK})
    losses = []
    rows = 4 // world
    for x, y in parity.batches(steps, 4):
        loss = engine(x[rank * rows : (rank + 1) * rows], labels=y[rank * rows : (rank + 1) * rows]).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().to("cpu", copy=True)  # on a GPU the loss is on the device
        engine.comm.control.all_reduce(mean, op="avg")  # a host scalar: the control group
        losses.append(mean.item())
    state = engine.full_state_dict()
    algo = engine.algorithm
    device = engine.device.torch_device
    engine.close()
    return losses, {"state": state, "generic": algo.generic is not None, "states": algo.state_names, "device": device}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_matches_plain_pytorch(name):
    losses, out = _hetero(name, 4, stage=3)
    ref_losses, ref_state = _reference(name, 4, out["device"])  # the same kernels: see the tolerance above
    assert out["generic"] == (name != "sgd_nesterov")  # SGD keeps its fused path; amsgrad Adam goes generic
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, v in ref_state.items():
        torch.testing.assert_close(out["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("where", ["device", "host"])
def test_capturable_steps_wherever_the_shard_is(where):
    """[Note: capturable where the shard is]: NAdam built with capturable=True trains, its optimizer on the device
    or on the host (where torch refuses a capturable step), to the losses and weights of plain PyTorch's NAdam with
    capturable where the device takes it. Refused by the probe before (it steps small CPU tensors)."""
    model = parity.build()
    opt = torch.optim.NAdam(_groups(model), lr=0.005, momentum_decay=0.004, weight_decay=0.01, capturable=True)
    engine = hetero.initialize(
        model, opt, {"zero_stage": 3, "chunk_size": parity.CHUNK, "offload": {"optimizer": where}}
    )
    losses = []
    for x, y in parity.batches(4, 4):
        loss = engine(x, labels=y).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state, device = engine.full_state_dict(), engine.device.torch_device
    engine.close()
    ref = parity.build().to(device)
    # The reference steps where hetero's optimizer stepped, so both run the same NAdam kernels (module doc): with
    # the optimizer on the host of a GPU machine, plain PyTorch's own offload, fp32 CPU masters stepped on the
    # gradients copied down and copied back up (on one H100 the GPU's capturable NAdam as the reference missed by
    # more than rtol 1e-5 within the four steps).
    on_host = where == "host" and device.type != "cpu"
    masters = _Masters(ref) if on_host else None
    ref_opt = torch.optim.NAdam(
        _groups(masters.cpu if on_host else ref),
        lr=0.005,
        momentum_decay=0.004,
        weight_decay=0.01,
        capturable=device.type == "cuda" and not on_host,
    )
    ref_losses = []
    for x, y in parity.batches(4, 4):
        loss = ref(x.to(device), labels=y.to(device)).loss
        loss.backward()
        if masters is not None:
            masters.grads_down()
        ref_opt.step()
        ref_opt.zero_grad()
        if masters is not None:
            masters.weights_up()
        ref_losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-5)  # the tolerance of test_matches_plain_pytorch (module doc)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v.detach().cpu(), rtol=1e-5, atol=1e-6, msg=k)


class _Masters:
    """fp32 CPU copies of a device model's parameters for an optimizer stepped on the host, as plain PyTorch would
    offload one: gradients copied down before the step, weights copied up after it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.device_params = list(model.parameters())
        self.cpu = torch.nn.Module()
        self.cpu.params = torch.nn.ParameterList(
            torch.nn.Parameter(p.detach().to("cpu", copy=True)) for p in self.device_params
        )

    def grads_down(self) -> None:
        for p, m in zip(self.device_params, self.cpu.parameters()):
            m.grad = p.grad.detach().to("cpu", copy=True)
            p.grad = None

    def weights_up(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.device_params, self.cpu.parameters()):
                p.copy_(m)


def _two_ranks(rank: int, world: int, name: str) -> list[float]:
    return _hetero(name, 3, stage=2, rank=rank, world=world)[0]


@pytest.mark.timeout(120)
def test_two_ranks_shard_the_generic_states():
    """Stage 2 over 2 ranks: each rank steps its own shard (pieces of parameters cut anywhere)."""
    ref_losses, _ = _reference("nadam", 3, "cpu")  # gloo ranks run on the CPU, also on a GPU machine (tests/dist.py)
    results = run_distributed(_two_ranks, 2, "nadam", timeout=100)
    for losses in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_checkpoint_keeps_states_and_hyperparameters(tmp_path):
    """NAdam has per-element states (exp_avg, exp_avg_sq) and a per-parameter 0-d one (mu_product): a resume from
    a checkpoint continues exactly as the uninterrupted run."""
    steps = 5
    data = parity.batches(steps, 4)

    def make() -> tuple[hetero.Engine, torch.optim.Optimizer]:
        model = parity.build()
        opt = OPTIMIZERS["nadam"](_groups(model))
        return hetero.initialize(model, opt, {"zero_stage": 1, "chunk_size": parity.CHUNK}), opt

    def train(engine: hetero.Engine, batches: list) -> list[float]:
        out = []
        for x, y in batches:
            loss = engine(x, labels=y).loss
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    engine, _ = make()
    full = train(engine, data)
    engine.close()
    engine, opt = make()
    train(engine, data[:2])
    engine.optimizer.param_groups[0]["lr"] = 0.004  # a hyperparameter changed mid-run is saved too
    engine.save_checkpoint(tmp_path)
    after = train(engine, data[2:])
    engine.close()
    engine, opt = make()
    engine.load_checkpoint(tmp_path)
    assert engine.optimizer.param_groups[0]["lr"] == 0.004 and engine.algorithm.generic.scalars
    assert train(engine, data[2:]) == after
    assert after != full[2:]  # the changed learning rate mattered
    engine.close()


@pytest.mark.parametrize(
    ("name", "why"), [("Adafactor", "row and column"), ("LBFGS", "closure"), ("SparseAdam", "sparse")]
)
def test_non_elementwise_optimizers_are_refused(name, why):
    if not hasattr(torch.optim, name):
        pytest.skip(f"this torch has no torch.optim.{name}")
    model = parity.build()
    with pytest.raises(ConfigError, match=why) as refused:
        hetero.initialize(model, getattr(torch.optim, name)(list(model.parameters())), {})
    assert "Elementwise optimizers work: Adam, AdamW, SGD, Adagrad" in str(refused.value)  # what to use instead


class _RowNormalized(torch.optim.Optimizer):
    """A made-up optimizer whose update of an element depends on its row: the probe must catch it unnamed."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad.reshape(p.shape[0], -1) if p.dim() > 1 else p.grad.reshape(1, -1)
                p.add_((g / g.norm(dim=1, keepdim=True)).reshape(p.shape), alpha=-group["lr"])


def test_probe_catches_an_unknown_non_elementwise_optimizer():
    model = parity.build()
    with pytest.raises(ConfigError, match="depends on other elements.*Elementwise optimizers work"):
        hetero.initialize(model, _RowNormalized(model.parameters()), {})
