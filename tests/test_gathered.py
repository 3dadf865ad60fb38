"""Parameters outside forward and backward: `engine.gathered_parameters()` makes them readable (and writable from
rank 0) on every rank; outside it, a ZeRO-3 parameter's values are not on the rank, and reading one is a Python
error that says what to do, never a crash."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import hetero
from hetero.errors import ReleasedParameterError

try:
    from tests import parity, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

WEIGHT = "layers.0.attn.q_proj.weight"


def _step(engine: hetero.Engine, batch: tuple, rank: int, world: int) -> None:
    x, y = batch
    local = x.shape[0] // world
    engine.backward(engine(x[rank * local : (rank + 1) * local], labels=y[rank * local : (rank + 1) * local]).loss)
    engine.step()


def _run_gathered(rank: int, world: int, stage: int) -> dict:
    torch.set_num_threads(1)
    model = parity.build()
    cfg = {"zero_stage": stage, "chunk_size": parity.CHUNK, "offload": {"optimizer": "host"}}
    engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
    data = parity.batches(4, 4)
    for batch in data[:2]:
        _step(engine, batch, rank, world)
    full = engine.full_state_dict()
    out: dict = {}
    with engine.gathered_parameters():
        seen = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["equal_to_full_state_dict"] = all(torch.equal(seen[n].cpu(), full[n].cpu()) for n in seen)
        out["state_dict_inside"] = sorted(model.state_dict()) == sorted(full)
    weight = dict(model.named_parameters())[WEIGHT]
    try:
        weight.sum()
        out["read_outside"] = "no error"
    except ReleasedParameterError as err:
        out["read_outside"] = str(err)
    out["repr_outside"] = repr(weight)  # a debugger's or a log's view of it: what it is, no error
    # Rank 0 halves one weight; the others write junk that must not survive.
    with engine.gathered_parameters([weight], modify=True), torch.no_grad():
        if rank == 0:
            weight.mul_(0.5)
        else:
            weight.fill_(123.0)
    out["after_modify"] = engine.full_state_dict()[WEIGHT]
    for batch in data[2:]:
        _step(engine, batch, rank, world)
    out["final"] = engine.full_state_dict()
    engine.close()
    return out


def _reference_with_halving() -> dict[str, torch.Tensor]:
    """Plain PyTorch: two steps, halve the weight, two more steps (Adam's state carries on)."""
    out = {}
    for name, dtype in (("exact", torch.float64), ("plain", torch.float32)):
        model = parity.build().to(dtype)
        opt = parity.make_optimizer(model)
        for i, (x, y) in enumerate(parity.batches(4, 4)):
            if i == 2:
                with torch.no_grad():
                    dict(model.named_parameters())[WEIGHT].mul_(0.5)
            model(x, labels=y).loss.backward()
            opt.step()
            opt.zero_grad()
        out[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 3])
def test_gathered_parameters_read_and_modify(stage):
    results = run_distributed(_run_gathered, 2, stage, timeout=240)
    ref = _reference_with_halving()
    for r in results:
        assert r["equal_to_full_state_dict"] and r["state_dict_inside"]
        if stage == 3:
            assert "gathered_parameters" in r["read_outside"], r["read_outside"]
            assert WEIGHT in r["repr_outside"] and "released" in r["repr_outside"], r["repr_outside"]
        else:
            assert r["read_outside"] == "no error"  # stages 0-2 keep full parameters on every rank
        assert torch.equal(r["after_modify"], results[0]["after_modify"])  # every rank holds rank 0's values
        assert not (r["after_modify"] == 123.0).any()
        # Training went on from the halved weight: the master weights took it.
        tolerance.assert_weights(r["final"], ref["exact"], ref["plain"], dtype=torch.float32)


_READ_AFTER_STEP = textwrap.dedent(
    """
    import sys, torch, hetero
    sys.path.insert(0, {tests!r})
    import parity
    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {{"zero_stage": 3, "chunk_size": parity.CHUNK}})
    x, y = parity.batches(1, 2)[0]
    engine.backward(engine(x, labels=y).loss)
    engine.step()
    {read}
    """
)


@pytest.mark.parametrize(
    "read",
    [
        "print(model.layers[0].attn.q_proj.weight.sum())",
        "print(model.layers[0].attn.q_proj.weight.tolist())",  # print(weight) itself says it is released (repr)
        "model.state_dict()['embed.weight'].numpy()",
        "ema = [p.detach().clone() for p in model.parameters()]",
    ],
)
def test_reading_a_released_parameter_is_a_python_error_not_a_crash(read):
    """In a subprocess: a crash would be a signal (negative exit status), a Python error exits 1 with a traceback."""
    tests = str(__import__("pathlib").Path(__file__).parent)
    code = _READ_AFTER_STEP.format(tests=tests, read=read)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "ReleasedParameterError" in proc.stderr and "gathered_parameters" in proc.stderr, proc.stderr[-2000:]


class _Hooked(nn.Module):
    """A model whose hooks, registered by `_hook` (after `initialize` for hetero), read weights: of their own module
    (forward hooks plain, with kwargs and always_call, a forward pre-hook with kwargs, a full backward hook) and, on
    the root, the head's and the embedding's (a forward hook, and a pre-hook prepended before hetero's own)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 20)
        self.scale: torch.Tensor | None = None  # set by the root's pre-hook for this forward

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.scale is not None:
            h = h * self.scale
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def _hook(model: _Hooked) -> None:
    b0, b1, b2 = model.blocks
    b0.register_forward_hook(lambda m, args, out: out + 0.1 * nn.functional.linear(args[0], m.weight))
    b1.register_forward_hook(lambda m, args, kwargs, out: out * (1 + m.weight.mean()), with_kwargs=True)
    b1.register_forward_hook(lambda m, args, out: out - 0.05 * m.bias, always_call=True)
    b2.register_forward_pre_hook(lambda m, a, kw: ((a[0] * m.weight.norm().tanh(),), kw), with_kwargs=True)
    model.head.register_full_backward_hook(lambda m, gin, gout: (gin[0] * (1 + m.weight.mean().tanh()),))

    def scale(m: _Hooked, args: tuple) -> None:
        m.scale = 1 + 0.1 * m.embed.weight.mean().tanh()

    model.register_forward_pre_hook(scale, prepend=True)
    model.register_forward_hook(lambda m, args, out: out + 0.01 * m.head.weight.sum())


def _train_hooked(dtype: torch.dtype | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch in `dtype`, or hetero at stage 3 (None) with chunks small enough to release each layer."""
    model = _Hooked()
    if dtype is not None:
        model = model.to(dtype)
        _hook(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = hetero.initialize(model, opt, {"zero_stage": 3, "chunk_size": 400}) if dtype is None else None
    if engine is not None:
        _hook(model)  # after initialize: hetero's own hooks come first on every module
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, 20, (2, 6), generator=g)
        out = (engine or model)(ids)
        loss = nn.functional.cross_entropy(out.flatten(0, 1), ids.to(out.device).flatten())
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    state = engine.full_state_dict() if engine is not None else model.state_dict()
    if engine is not None:
        engine.close()
    return losses, {k: v.detach().cpu().clone() for k, v in state.items() if k != "scale"}


def test_hooks_registered_after_initialize_read_their_weights():
    """At stage 3 hooks registered after `initialize` run after hetero's (or, prepended, before them) and read the
    weights as in plain PyTorch: the same losses and weights. The root's forward hook and prepended pre-hook ran
    outside the root's count of forwards in progress and raised ReleasedParameterError ([Note: a parameter read
    outside its module] in hetero/zero/hooks.py)."""
    (exact_losses, exact), (plain_losses, plain) = _train_hooked(torch.float64), _train_hooked(torch.float32)
    losses, state = _train_hooked(None)
    tolerance.assert_losses(losses, exact_losses, plain_losses, dtype=torch.float32)
    tolerance.assert_weights(state, exact, plain, dtype=torch.float32)
