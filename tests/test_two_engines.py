"""Two engines in one loop, one's loss backpropagated through the other's model: a GAN's generator loss through its
discriminator, at every stage over two ranks, against plain PyTorch's loop ([Note: a backward through another
engine's model] in hetero/zero/backwards.py).

Plain PyTorch computes the discriminator's gradients in the generator's backward and the loop clears them
(`optimizer_D.zero_grad()`) before the discriminator's own backward; hetero drops them as they arrive. Both loops
below are plain PyTorch's, written once for either (`_Plain` / `_Hetero`), and checked against the float64 run as
every parity test is ([Note: tolerances from the arithmetic] in tests/tolerance.py). Before the Note, the first
such gradient stopped the loop, and at stage 3 the backward reaching the discriminator at all.

The loop orders: "detach" is DCGAN's (the discriminator's step on `fake.detach()`, then the generator's through it);
"frozen" freezes the discriminator for the generator's backward; "pending" runs the generator's backward between
the discriminator's forwards and its own backward (its forwards' accounting survives the foreign backward);
"retain" has no detach: the discriminator's backward runs into the generator, keeping the graph for the
generator's own backward after it (the generator's gathers keep their forwards).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hetero

try:
    from tests import tolerance
    from tests.dist import one_rank, run_distributed
except ImportError:  # tests/ itself on sys.path
    import tolerance  # type: ignore[no-redef]
    from dist import one_rank, run_distributed  # type: ignore[no-redef]

ORDERS = ("detach", "frozen", "pending", "retain")
STEPS = 3
ROWS = 8  # the whole batch; each of two ranks takes half
CHUNK = 1100  # elements: the discriminator in two chunks (its first layer; the other two), the generator in three


def _nets(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16))
    d = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    return g.to(dtype), d.to(dtype)


def _data(rank: int = 0, world: int = 1, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(1)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    out = []
    for _ in range(STEPS):
        z, real = torch.randn(ROWS, 8, generator=gen), torch.randn(ROWS, 16, generator=gen) + 1.0
        out.append((z[rows].to(dtype), real[rows].to(dtype)))
    return out


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


class _Plain:
    """Plain PyTorch: two optimizers, the discriminator's gradients from the generator's loss cleared by its
    zero_grad before its own backward."""

    def __init__(self, g: nn.Module, d: nn.Module) -> None:
        self.g, self.d = g, d
        self.opt_g = torch.optim.Adam(g.parameters(), lr=1e-2)
        self.opt_d = torch.optim.Adam(d.parameters(), lr=1e-2)

    def backward(self, which: str, loss: torch.Tensor, retain: bool = False) -> None:
        opt = self.opt_d if which == "d" else self.opt_g
        opt.zero_grad()
        loss.backward(retain_graph=retain)

    def step(self, which: str) -> None:
        (self.opt_d if which == "d" else self.opt_g).step()

    def states(self) -> tuple[dict, dict]:
        return self.g.state_dict(), self.d.state_dict()


class _Hetero:
    def __init__(self, g: nn.Module, d: nn.Module, config: dict) -> None:
        self.g = hetero.initialize(g, torch.optim.Adam(g.parameters(), lr=1e-2), config)
        self.d = hetero.initialize(d, torch.optim.Adam(d.parameters(), lr=1e-2), config)

    def backward(self, which: str, loss: torch.Tensor, retain: bool = False) -> None:
        (self.d if which == "d" else self.g).backward(loss, retain_graph=retain)

    def step(self, which: str) -> None:
        (self.d if which == "d" else self.g).step()

    def states(self) -> tuple[dict, dict]:
        return self.g.full_state_dict(), self.d.full_state_dict()


def _loop(t: _Plain | _Hetero, order: str, data: list) -> list[float]:
    """The same GAN loop for either: losses per step (the discriminator's, the generator's)."""
    g, d, d_params = t.g, t.d, list((t.d.module if isinstance(t, _Hetero) else t.d).parameters())
    losses = []
    for z, real in data:
        fake = g(z)
        if order == "retain":  # no detach: the discriminator's backward reaches the generator, graph kept
            loss_d = _bce(d(real), 1.0) + _bce(d(fake), 0.0)
            t.backward("d", loss_d, retain=True)
            t.step("d")
            loss_g = _bce(d(fake), 1.0)
            t.backward("g", loss_g)
            t.step("g")
        elif order == "pending":  # the generator's backward while the discriminator's forwards wait for theirs
            loss_d = _bce(d(real), 1.0) + _bce(d(fake.detach()), 0.0)
            loss_g = _bce(d(fake), 1.0)
            t.backward("g", loss_g)
            t.backward("d", loss_d)
            t.step("d")
            t.step("g")
        else:
            loss_d = _bce(d(real), 1.0) + _bce(d(fake.detach()), 0.0)
            t.backward("d", loss_d)
            t.step("d")
            if order == "frozen":
                for p in d_params:
                    p.requires_grad_(False)
            loss_g = _bce(d(fake), 1.0)
            t.backward("g", loss_g)
            t.step("g")
            if order == "frozen":
                for p in d_params:
                    p.requires_grad_(True)
        losses.extend([float(loss_d.detach()), float(loss_g.detach())])
    return losses


def _reference(order: str, dtype: torch.dtype) -> tuple[list[float], dict, dict]:
    t = _Plain(*_nets(dtype))
    losses = _loop(t, order, _data(dtype=dtype))
    g, d = t.states()
    return losses, {k: v.float() for k, v in g.items()}, {k: v.float() for k, v in d.items()}


def _worker(rank: int, world: int, stage: int) -> dict:
    out = {}
    for order in ORDERS:
        t = _Hetero(*_nets(), {"zero_stage": stage, "chunk_size": CHUNK})
        reducer, issued = t.d.reducer, []
        flush = reducer.flush

        def spy(reducer=reducer, issued=issued, flush=flush) -> None:
            issued.append((sum(reducer.sent(zc) for zc in reducer.order), len(reducer.order)))
            flush()

        reducer.flush = spy
        losses = _loop(t, order, _data(rank, world))
        out[f"{order} issued"] = issued
        g, d = t.states()
        t.g.close()
        t.d.close()
        out[order] = (losses, g, d)
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_gan_loop_trains_as_plain_pytorch_over_two_ranks(stage):
    results = run_distributed(_worker, 2, stage, timeout=240)
    for order in ORDERS:
        exact_losses, exact_g, exact_d = _reference(order, torch.float64)
        plain_losses, plain_g, plain_d = _reference(order, torch.float32)
        # Each rank's loss is its half's mean: the whole batch's is their average.
        got = [sum(r[order][0][i] for r in results) / 2 for i in range(len(exact_losses))]
        tolerance.assert_losses(got, exact_losses, plain_losses, dtype=torch.float32)
        for rank in (0, 1):
            _, g, d = results[rank][order]
            tolerance.assert_weights(g, exact_g, plain_g, dtype=torch.float32)
            tolerance.assert_weights(d, exact_d, plain_d, dtype=torch.float32)
    if stage == 3 and not one_rank():  # one rank reduces nothing: no reduction is issued early or late
        # The discriminator's own backward issues the reduction of its last layers' chunk as their units end,
        # before the end of backward, in every step (its first layer's input is data, which needs no gradient: that
        # unit's backward has no end, and its chunk waits for the end of backward). The generator's backward through
        # it answered its forwards there (`Gathers.release_foreign`); counted as still waiting, they left every
        # reduction to the end of backward. ("retain": the discriminator's own backward keeps its graph for a second
        # backward that never comes through it, so its forwards stay counted and its reductions wait for the end of
        # backward, as after any such backward: correct, with less overlap.)
        for order in ("detach", "frozen", "pending"):
            issued = results[0][f"{order} issued"]
            assert len(issued) == STEPS and all(sent == 1 and chunks == 2 for sent, chunks in issued), (order, issued)


def _judged(g: nn.Module, judge: nn.Module, data: list, backward, step) -> list[float]:
    """A model trained on a frozen model's verdict of its output (a reward or perceptual model as its loss)."""
    losses = []
    for z, real in data:
        out = g(z)
        loss = -judge(out).mean() + (out - real.to(out.device)).pow(2).mean()  # out: on the engine's device
        backward(loss)
        step()
        losses.append(float(loss.detach()))
    return losses


def _judged_reference(dtype: torch.dtype) -> tuple[list[float], dict]:
    g, judge = _nets(dtype)
    judge.requires_grad_(False)
    opt = torch.optim.Adam(g.parameters(), lr=1e-2)

    def backward(loss: torch.Tensor) -> None:
        opt.zero_grad()
        loss.backward()

    losses = _judged(g, judge, _data(dtype=dtype), backward, opt.step)
    return losses, {k: v.float() for k, v in g.state_dict().items()}


def _judged_worker(rank: int, world: int) -> dict:
    out = {}
    for stage in (0, 3):
        g, judge = _nets()
        judging = hetero.initialize(judge, None, {"zero_stage": stage, "chunk_size": CHUNK})  # inference: no update
        frozen = not any(p.requires_grad for p in judge.parameters())
        engine = hetero.initialize(
            g, torch.optim.Adam(g.parameters(), lr=1e-2), {"zero_stage": stage, "chunk_size": CHUNK}
        )
        losses = _judged(engine, judging, _data(rank, world), engine.backward, engine.step)
        out[stage] = (losses, engine.full_state_dict(), frozen)
        engine.close()
        judging.close()
        out[f"{stage} restored"] = all(p.requires_grad for p in judge.parameters())
    return out


def test_a_model_trained_on_an_inference_engines_verdict_gets_its_gradient():
    # An inference engine ran its forward under no_grad whatever its input: the verdict's term of the loss gave the
    # trained model no gradient, without a word (measured: weights 0.011 off plain PyTorch's after one SGD step). Its
    # parameters are now frozen while it holds them, and its forward records autograd for inputs that need it.
    results = run_distributed(_judged_worker, 2, timeout=240)
    exact_losses, exact = _judged_reference(torch.float64)
    plain_losses, plain = _judged_reference(torch.float32)
    for stage in (0, 3):
        got = [sum(r[stage][0][i] for r in results) / 2 for i in range(STEPS)]
        tolerance.assert_losses(got, exact_losses, plain_losses, dtype=torch.float32)
        for r in results:
            losses, weights, frozen = r[stage]
            assert frozen, "an inference engine's parameters take no gradient while it holds them"
            assert r[f"{stage} restored"], "close gives the parameters their requires_grad back"
            tolerance.assert_weights(weights, exact, plain, dtype=torch.float32)


def test_an_input_gradient_through_a_stage3_model_outside_every_engines_backward():
    # A first-order backward of the loop's own (torch.autograd.grad, no engine's backward open) gathers along the
    # units and reduces nothing: the input gradient is plain PyTorch's.
    g, d = _nets()
    reference = _nets()[1]
    engine = hetero.initialize(d, torch.optim.Adam(d.parameters(), lr=1e-2), {"zero_stage": 3, "chunk_size": CHUNK})
    x = torch.randn(4, 16, requires_grad=True)
    (got,) = torch.autograd.grad(engine(x).sum(), x)
    (want,) = torch.autograd.grad(reference(x).sum(), x)
    torch.testing.assert_close(got, want)
    engine.close()
