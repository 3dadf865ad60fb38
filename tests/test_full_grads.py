"""[Note: reading the gradients]: `engine.full_grads()` between the backward that ends an accumulation and `step()`
gives plain PyTorch's gradients of the same (mean) loss at every stage, with accumulation, host offload, tiled
weights and fp16 (unscaled), on one rank and two; reading them changes nothing that follows; asked at the wrong time,
it says when to ask.

Tolerance: the plain float64 run's gradients after the same steps, within a factor of plain fp32 PyTorch's own
distance from them (tests/tolerance.py). The fp16 run computes in fp16, which no plain run does without loss scaling
(its gradients overflow): there the norm the update reports, from the gradients it unscaled, is these gradients'."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import hetero
from tests import parity, tolerance
from tests.dist import run_distributed

STEPS, ROWS = 2, 4
CONFIGS = {
    "z0": {"zero_stage": 0},
    "z1-accum": {"zero_stage": 1, "grad_accumulation_steps": 2},
    "z2": {"zero_stage": 2},
    # tiles: the embedding (64 x 32) is larger than a chunk of 1024
    "z3-host-tiles-accum": {
        "zero_stage": 3,
        "chunk_size": 1024,
        "grad_accumulation_steps": 2,
        "offload": {"params": "host", "optimizer": "host"},
    },
    "z2-fp16": {"zero_stage": 2, "precision": "fp16"},
}


def _plain_grads(dtype: torch.dtype, accum: int) -> list[dict[str, torch.Tensor]]:
    """Plain PyTorch's gradients at each update of the same run (AdamW, STEPS updates of `accum` micro-batches)."""
    model = parity.build().to(dtype)
    opt = parity.make_optimizer(model)
    data = parity.batches(STEPS * accum, ROWS)
    out = []
    for step in range(STEPS):
        for micro in range(accum):
            x, y = data[step * accum + micro]
            (model(x, labels=y).loss / accum).backward()
        out.append({n: p.grad.detach().double().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return out


def _run(rank: int, world: int, config: dict, *, read: bool) -> dict:
    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {"chunk_size": parity.CHUNK, **config})
    accum = config.get("grad_accumulation_steps", 1)
    local = ROWS // world
    data = parity.batches(STEPS * accum, ROWS)
    grads, norms = [], []
    for step in range(STEPS):
        for micro in range(accum):
            x, y = data[step * accum + micro]
            engine.backward(
                engine(x[rank * local : (rank + 1) * local], labels=y[rank * local : (rank + 1) * local]).loss
            )
            if read and micro == accum - 1:
                grads.append(engine.full_grads())
            engine.step()
        norms.append(engine.last_grad_norm)
    state = engine.full_state_dict()
    engine.close()
    return {"grads": grads, "state": state, "norms": norms}


def _job(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {name: _run(rank, world, cfg, read=True) for name, cfg in CONFIGS.items()}


def _check(results: dict) -> None:
    for name, got in results.items():
        accum = CONFIGS[name].get("grad_accumulation_steps", 1)
        exact, plain = _plain_grads(torch.float64, accum), _plain_grads(torch.float32, accum)
        assert len(got["grads"]) == STEPS, name
        for g, e, p, norm in zip(got["grads"], exact, plain, got["norms"]):
            assert set(e) <= set(g) and all(v.dtype == torch.float32 for v in g.values()), name
            g = {n: g[n] for n in e}  # each tied parameter once
            # What the update stepped on: the norm it reported is these gradients' (unscaled in fp16)
            mine = sum(v.double().square().sum() for v in g.values()).sqrt().item()
            assert abs(mine - norm) <= 1e-6 * norm, (name, mine, norm)
            if CONFIGS[name].get("precision") != "fp16":  # fp16's forward is its own arithmetic: no plain match
                tolerance.assert_weights(g, e, p, dtype=torch.float32)


@pytest.mark.timeout(300)
def test_full_grads_one_rank():
    _check(_job(0, 1))


@pytest.mark.timeout(300)
def test_full_grads_two_ranks():
    r0, r1 = run_distributed(_job, 2, timeout=250)
    _check(r0)
    for name in CONFIGS:  # every rank returns the same whole gradients
        for a, b in zip(r0[name]["grads"], r1[name]["grads"]):
            assert all(torch.equal(a[k], b[k]) for k in a), name


def _unread(rank: int, world: int, monkeypatch_standin: bool) -> dict:
    """Each configuration's final weights with the gradients read and without (and, under the CPU stand-in of a GPU,
    where NCCL's rule sends host gradients through the device, the read gradients too)."""
    torch.set_num_threads(1)
    out = {}
    for name in ("z1-accum", "z3-host-tiles-accum"):
        read, unread = _run(rank, world, CONFIGS[name], read=True), _run(rank, world, CONFIGS[name], read=False)
        out[name] = (read, unread)
    return out


@pytest.mark.timeout(300)
def test_reading_changes_nothing_and_works_under_the_standin(monkeypatch):
    plain = run_distributed(_unread, 2, False, timeout=250)[0]
    for name, (read, unread) in plain.items():
        assert all(torch.equal(read["state"][k], unread["state"][k]) for k in read["state"]), name
    if os.environ.get("HETERO_TESTS_ONE_RANK") == "nccl":
        return  # the plain run above was on the GPU, the stand-in's is on the CPU: not the same bits by construction
    monkeypatch.setenv("HETERO_STANDIN", "1")
    strict = run_distributed(_unread, 2, True, timeout=250)[0]
    for name, (read, _) in strict.items():
        for a, b in zip(read["grads"], plain[name][0]["grads"]):
            assert all(torch.equal(a[k], b[k]) for k in a), name


def test_asked_at_the_wrong_time():
    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {"chunk_size": parity.CHUNK, "zero_stage": 2})
    x, y = parity.batches(1, ROWS)[0]
    with pytest.raises(RuntimeError, match="between the backward that ends an accumulation"):
        engine.full_grads()  # no backward yet
    engine.backward(engine(x, labels=y).loss)
    assert engine.full_grads()
    engine.step()
    with pytest.raises(RuntimeError, match="after it the update has consumed it"):
        engine.full_grads()
    engine.close()
    model = copy.deepcopy(parity.build())
    config = {"chunk_size": parity.CHUNK, "zero_stage": 2, "update_in_backward": True}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    engine.backward(engine(x, labels=y).loss)
    with pytest.raises(RuntimeError, match="update_in_backward"):
        engine.full_grads()
    engine.close()
