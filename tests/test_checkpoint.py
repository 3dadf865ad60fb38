"""Checkpoints: bit-exact resume (stages 0-3, fp32/bf16, NVMe, world 1 and 2, mid-accumulation), resharding
checked against plain PyTorch continuing from the same state, and consolidation."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

import hetero
from hetero.checkpoint import consolidate
from hetero.checkpoint import manifest as mf

try:
    from tests import parity, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

ROWS = 4
N, M = 4, 3  # optimizer steps before the save, and after it


# ---- helpers (also used by the other checkpoint test files and by spawned ranks) ---------------------------------
def make_engine(
    rank: int, config: dict, nvme_root: str | None = None, optimizer: str = "adamw", **model_overrides
) -> hetero.Engine:
    model = parity.build(**model_overrides)
    opt = parity.make_optimizer(model, optimizer)
    config = copy.deepcopy(config)
    config.setdefault("chunk_size", parity.CHUNK)
    if "nvme" in repr(config.get("offload", {})):
        d = os.path.join(nvme_root, f"swap-rank{rank}")
        os.makedirs(d, exist_ok=True)
        config.setdefault("memory", {})["nvme_dir"] = d
    return hetero.initialize(model, opt, config)


def train(engine: hetero.Engine, rank: int, world: int, start: int, stop: int) -> list[float]:
    """Micro-batches [start, stop) of the fixed data stream; losses (mean over ranks) per micro-batch."""
    data = parity.batches(stop, ROWS)
    local = ROWS // world
    out = []
    for i in range(start, stop):
        x, y = data[i]
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        loss = engine(x, labels=y).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().reshape(1).clone()
        engine.comm.control.all_reduce(mean, op="avg")
        out.append(mean.item())
    return out


def resume_case(
    rank: int,
    world: int,
    config: dict,
    root: str,
    save_micro: int,
    total_micro: int,
    model: dict | None = None,
    optimizer: str = "adamw",
) -> dict:
    """Train to save_micro, save, train on to total_micro; then a fresh engine loads and trains the same tail."""
    a = make_engine(rank, config, root, optimizer, **(model or {}))
    head = train(a, rank, world, 0, save_micro)
    a.save_checkpoint(os.path.join(root, "ckpt"), client_state={"micro": save_micro, "note": "x"})
    tail = train(a, rank, world, save_micro, total_micro)
    state_a = a.full_state_dict()
    a.close()
    torch.manual_seed(1234)  # the load must restore the random state, whatever it is now
    b = make_engine(rank, config, root, optimizer, **(model or {}))
    cs = b.load_checkpoint(os.path.join(root, "ckpt"))
    tail_b = train(b, rank, world, cs["micro"], total_micro)
    state_b = b.full_state_dict()
    counters = (b.micro_steps, b.global_steps)
    b.close()
    same = all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    return {"head": head, "tail": tail, "tail_b": tail_b, "same_weights": same, "counters": counters, "cs": cs}


def plain_continue(ckpt: str, start_step: int, stop_step: int, precision: str = "fp32") -> tuple[list[float], dict]:
    """Plain PyTorch continuing from a checkpoint's fp32 master weights and optimizer states (the reference loop
    of tests/parity.py, full global batch, one process)."""
    directory = mf.resolve(ckpt)
    manifest = mf.read_manifest(directory)
    index = mf.Index(directory, manifest)
    dtype = parity.DTYPES[precision]
    full = dtype in (torch.float32, torch.float64)  # no separate master weights
    master = parity.build().to(torch.float64 if dtype == torch.float64 else torch.float32)
    opt = parity.make_optimizer(master)
    steps = manifest["engine"]["param_steps"]
    with torch.no_grad():
        for name, p in master.named_parameters():
            buf = torch.empty(p.numel(), dtype=torch.float32)
            index.fill("master", name, 0, buf)
            p.copy_(buf.view(p.shape))
            st = {"step": torch.tensor(float(steps[name]), dtype=p.dtype)}
            for s in ("exp_avg", "exp_avg_sq"):
                index.fill(f"state.{s}", name, 0, buf)
                st[s] = buf.view(p.shape).to(p.dtype).clone()
            opt.state[p] = st
    index.close()
    model = copy.deepcopy(master).to(dtype) if not full else master
    data = parity.batches(stop_step, ROWS)
    losses = []
    for i in range(start_step, stop_step):
        x, y = data[i]
        loss = model(x, labels=y).loss
        loss.backward()
        if not full:
            for pm, p in zip(master.parameters(), model.parameters()):
                pm.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        opt.step()
        opt.zero_grad()
        if not full:
            with torch.no_grad():
                for pm, p in zip(master.parameters(), model.parameters()):
                    p.copy_(pm)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() if full else v.detach().float() for k, v in model.state_dict().items()}


def assert_continues(r: dict, ckpt: str, start: int, stop: int, precision: str = "fp32") -> None:
    """A run resumed from `ckpt` against plain PyTorch resumed from it, in float64 (exact) and in `precision` (the
    scale of rounding error): tests/tolerance.py. Low precision compares what the resumed steps changed."""
    exact_losses, exact = plain_continue(ckpt, start, stop, "fp64")
    plain_losses, plain = plain_continue(ckpt, start, stop, precision)
    dtype = parity.DTYPES[precision]
    tolerance.assert_losses(r["losses"], exact_losses, plain_losses, dtype=dtype)
    initial = None if dtype == torch.float32 else plain_continue(ckpt, start, start, "fp64")[1]
    tolerance.assert_weights(r["state"], exact, plain, dtype=dtype, initial=initial)


def reshard_load(rank: int, world: int, config: dict, ckpt: str, scratch: str, stop_step: int) -> dict:
    engine = make_engine(rank, config, scratch)
    engine.load_checkpoint(ckpt)
    start = engine.global_steps
    loaded = {k: v.float() for k, v in engine.full_state_dict().items()}
    losses = train(engine, rank, world, start, stop_step)
    state = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {"losses": losses, "state": state if rank == 0 else None, "loaded": loaded if rank == 0 else None}


# ---- configurations ---------------------------------------------------------------------------------------------
def _cfg(stage: int, precision: str = "fp32", optim: str = "device", params: str = "device", accum: int = 1) -> dict:
    return {
        "zero_stage": stage,
        "precision": precision,
        "grad_accumulation_steps": accum,
        "offload": {"optimizer": optim, "params": params},
    }


# (config, save after micro-batch, total micro-batches): accum 2 with an odd save point saves mid-accumulation.
WORLD1 = [
    (_cfg(0), N, N + M),
    (_cfg(1), N, N + M),
    (_cfg(2), N, N + M),
    (_cfg(3), N, N + M),
    (_cfg(0, "bf16"), N, N + M),
    (_cfg(1, "bf16", optim="nvme"), N, N + M),
    (_cfg(2, "bf16"), N, N + M),
    (_cfg(3, "bf16", optim="nvme", params="nvme"), N, N + M),
    (_cfg(2, "fp16"), N, N + M),  # the loss scaler's state
    (_cfg(0, accum=2), 2 * N - 1, 2 * (N + M)),
    (_cfg(3, "bf16", optim="host", params="host", accum=2), 2 * N - 1, 2 * (N + M)),
]
WORLD2 = [
    (_cfg(0), N, N + M),
    (_cfg(1, optim="nvme"), N, N + M),
    (_cfg(2, "bf16"), N, N + M),
    (_cfg(3, optim="nvme", params="nvme"), N, N + M),
    (_cfg(3, "bf16"), N, N + M),
    (_cfg(1, accum=2), 2 * N - 1, 2 * (N + M)),
    (_cfg(2, accum=2), 2 * N - 1, 2 * (N + M)),
]


def _ids(cases: list) -> list[str]:
    return [
        f"s{c['zero_stage']}-{c['precision']}-{c['offload']['optimizer']}-acc{c['grad_accumulation_steps']}"
        for c, *_ in cases
    ]


def _check_resume(r: dict, save_micro: int, total_micro: int) -> None:
    assert r["tail_b"] == r["tail"], "losses after the resume differ"
    assert r["same_weights"], "weights after the resume differ"
    assert r["cs"] == {"micro": save_micro, "note": "x"}
    assert r["counters"][0] == total_micro


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", WORLD1, ids=_ids(WORLD1))
def test_resume_is_bit_exact_world1(case, tmp_path):
    config, save_micro, total = case
    r = resume_case(0, 1, config, str(tmp_path), save_micro, total)
    _check_resume(r, save_micro, total)


@pytest.mark.timeout(120)
def test_dropout_resumes_with_the_saved_random_state(tmp_path):
    r = resume_case(0, 1, _cfg(2), str(tmp_path), N, N + M, model={"dropout": 0.2})
    _check_resume(r, N, N + M)


@pytest.mark.timeout(120)
def test_sgd_momentum_resumes(tmp_path):
    r = resume_case(0, 1, _cfg(1), str(tmp_path), N, N + M, optimizer="sgd")
    _check_resume(r, N, N + M)


def _world2_job(rank: int, world: int, root: str, w1_ckpt: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    for i, (config, save_micro, total) in enumerate(WORLD2):
        out[i] = resume_case(rank, world, config, os.path.join(root, f"case{i}"), save_micro, total)
    # a checkpoint saved here for the parent to reshard (world 2, stage 3, params and optimizer on NVMe)
    e = make_engine(rank, _cfg(3, optim="nvme", params="nvme"), root)
    train(e, rank, world, 0, N)
    e.save_checkpoint(os.path.join(root, "w2s3"))
    state = e.full_state_dict()  # a collective at stage 3: every rank calls it
    out["w2s3_state"] = state if rank == 0 else None
    e.close()
    # world 1 stage 0 -> world 2 stage 3 on NVMe
    out["from_w1"] = reshard_load(rank, world, _cfg(3, optim="nvme", params="nvme"), w1_ckpt, root, N + M)
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("w2"))
    w1 = make_engine(0, _cfg(0), root)
    train(w1, 0, 1, 0, N)
    w1_ckpt = os.path.join(root, "w1s0")
    w1.save_checkpoint(w1_ckpt)
    w1.close()
    results = run_distributed(_world2_job, 2, root, w1_ckpt, timeout=600)
    yield root, w1_ckpt, results
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("i", range(len(WORLD2)), ids=_ids(WORLD2))
def test_resume_is_bit_exact_world2(world2, i):
    _, _, results = world2
    config, save_micro, total = WORLD2[i]
    for rank_result in results:
        _check_resume(rank_result[i], save_micro, total)


@pytest.mark.timeout(700)
def test_reshard_world2_stage3_nvme_to_world1_stage0(world2, tmp_path):
    root, _, results = world2
    ckpt = os.path.join(root, "w2s3")
    r = reshard_load(0, 1, _cfg(0), ckpt, str(tmp_path), N + M)
    assert all(torch.equal(r["loaded"][k], results[0]["w2s3_state"][k].float()) for k in r["loaded"])
    assert_continues(r, ckpt, N, N + M)


@pytest.mark.timeout(700)
def test_reshard_world1_stage0_to_world2_stage3_nvme(world2):
    _, w1_ckpt, results = world2
    r = results[0]["from_w1"]
    assert results[1]["from_w1"]["losses"] == r["losses"]
    assert_continues(r, w1_ckpt, N, N + M)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "src,dst,precision",
    [
        (_cfg(1), _cfg(3, optim="nvme", params="nvme"), "fp32"),  # stage 1 on the device -> stage 3 on NVMe
        (_cfg(2, optim="host"), _cfg(0), "fp32"),
        (_cfg(0), _cfg(2, "bf16"), "bf16"),  # fp32 -> bf16
        (_cfg(3, "bf16"), _cfg(1), "fp32"),  # bf16 -> fp32: the fp32 master carries over exactly
    ],
    ids=["s1-device-to-s3-nvme", "s2-host-to-s0", "fp32-to-bf16", "bf16-to-fp32"],
)
def test_reshard_world1(src, dst, precision, tmp_path):
    e = make_engine(0, src, str(tmp_path))
    train(e, 0, 1, 0, N)
    ckpt = str(tmp_path / "ckpt")
    e.save_checkpoint(ckpt)
    e.close()
    r = reshard_load(0, 1, dst, ckpt, str(tmp_path), N + M)
    assert_continues(r, ckpt, N, N + M, precision)


@pytest.mark.timeout(700)
def test_consolidate_world2_equals_full_state_dict(world2, tmp_path):
    root, _, results = world2
    want = results[0]["w2s3_state"]
    for out in (str(tmp_path / "model.safetensors"), str(tmp_path / "model.pt")):
        consolidate(os.path.join(root, "w2s3"), out)
        if out.endswith(".pt"):
            got = torch.load(out, weights_only=True)
        else:
            from hetero.checkpoint.format import TensorReader

            with TensorReader(out) as r:
                got = {k: r.read(k) for k in r.entries}
        assert list(got) == list(want), "keys and their order are the model's own state_dict's"
        for k in want:
            assert torch.equal(got[k], want[k]), k
        model = parity.build(seed=123)
        model.load_state_dict(got, strict=True)
        assert torch.equal(model.lm_head.weight, want["lm_head.weight"])


def _cnn_run(stage: int, root: str, load: bool, steps: tuple[int, int]) -> tuple[list[float], dict, list[float]]:
    """A BatchNorm CNN under a StepLR schedule: losses, state_dict (running stats included) and learning rates."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 36, 4),
    )
    engine = hetero.initialize(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), {"zero_stage": stage, "chunk_size": 1024}
    )
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(steps[1])]
    start = 0
    if load:
        start = engine.load_checkpoint(root, lr_scheduler=sched)["step"]
    losses, lrs = [], []
    for i in range(start, steps[1]):
        loss = engine.train_batch(data[i][0], data[i][1], loss_fn=torch.nn.functional.cross_entropy)
        sched.step()
        losses.append(loss.item())
        lrs.append(engine.optimizer.param_groups[0]["lr"])
        if not load and i + 1 == steps[0]:
            engine.save_checkpoint(root, {"step": i + 1}, lr_scheduler=sched)
    state = engine.full_state_dict()
    engine.close()
    return losses, state, lrs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 3])
def test_buffers_and_lr_scheduler_resume(stage, tmp_path):
    root = str(tmp_path / "ckpt")
    losses, state, lrs = _cnn_run(stage, root, False, (3, 6))
    losses_b, state_b, lrs_b = _cnn_run(stage, root, True, (3, 6))
    assert losses_b == losses[3:] and lrs_b == lrs[3:]
    assert state.keys() == state_b.keys() and "1.running_mean" in state
    assert all(torch.equal(state[k], state_b[k]) for k in state)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 3])
def test_frozen_parameters_resume_and_consolidate(stage, tmp_path):
    def engine() -> hetero.Engine:
        model = parity.build()
        model.embed.weight.requires_grad_(False)  # tied to lm_head: both frozen, in a frozen chunk
        model.layers[0].attn.q_proj.weight.requires_grad_(False)
        opt = parity.make_optimizer(model)
        return hetero.initialize(model, opt, {"zero_stage": stage, "precision": "bf16", "chunk_size": parity.CHUNK})

    a = engine()
    train(a, 0, 1, 0, N)
    ckpt = a.save_checkpoint(str(tmp_path / "ckpt"))
    saved = a.full_state_dict()
    tail = train(a, 0, 1, N, N + M)
    final = a.full_state_dict()
    a.close()
    b = engine()
    b.load_checkpoint(ckpt)
    assert train(b, 0, 1, N, N + M) == tail
    got = b.full_state_dict()
    b.close()
    assert all(torch.equal(got[k], final[k]) for k in final)
    out = str(tmp_path / "model.pt")
    consolidate(ckpt, out, dtype="bf16")
    exported = torch.load(out, weights_only=True)
    assert list(exported) == list(saved)
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
