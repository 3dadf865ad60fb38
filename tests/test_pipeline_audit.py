"""An audit of pipeline parallelism as a user meets it: GPTPipe through every schedule against a plain PyTorch loop
(micro-batch counts that do and do not divide by the stages, uneven stages, tied embeddings, accumulation over
train_batch calls, clipping), eval_batch, the activations each schedule keeps in flight, and what is refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import hetero
from hetero.models.gpt import GPTConfig
from hetero.models.gpt_pipe import GPTPipe
from tests.dist import NEEDS_DEGREES, ranks_apart

try:
    from tests import parity, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

BASE = dict(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16, bias=False, tie_weights=False)


def build(**model: Any) -> GPTPipe:
    torch.manual_seed(0)
    return GPTPipe(GPTConfig(**{**BASE, **model}))


def reference(
    model: dict, steps: int, rows: int, accum: int, clip: float | None, dtype: torch.dtype
) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """Plain PyTorch on each global batch: the loss of each batch, the final weights, the eval loss after training.
    With `accum`, the gradients of `accum` batches are summed (each loss / accum) before a step."""
    net = build(**model).to(dtype)
    opt = parity.make_optimizer(net)
    losses = []
    for i, (x, y) in enumerate(parity.batches(steps, rows)):
        loss = net(x, labels=y).loss
        (loss / accum).backward()
        losses.append(loss.item())
        if (i + 1) % accum == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            opt.step()
            opt.zero_grad()
    x, y = parity.batches(1, rows, seed=7)[0]
    with torch.no_grad():
        evaluated = net(x, labels=y).loss.item()
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}, evaluated


def train(rank: int, world: int, spec: dict) -> dict[str, Any]:
    """hetero's train_batch on this data-parallel rank's rows of each global batch."""
    torch.set_num_threads(1)
    net = build(**spec.get("model", {}))
    opt = parity.make_optimizer(net)
    config = copy.deepcopy(spec["config"])
    config.setdefault("chunk_size", parity.CHUNK)
    engine = hetero.initialize(net, opt, config)
    engine.pipeline_runtime().measure = True
    dp, dpr = engine.data_parallel_size, engine.data_parallel_rank
    rows = spec["rows"]
    local = rows // dp
    mine = slice(dpr * local, (dpr + 1) * local)
    losses, in_flight = [], 0
    for x, y in parity.batches(spec["steps"], rows):
        losses.append(float(engine.train_batch(x[mine], y[mine])))
        if spec.get("eval_between"):  # inside an accumulation too: a forward only, no gradient touched
            ex, ey = parity.batches(1, rows, seed=5)[0]
            engine.eval_batch(ex[mine], ey[mine])
        in_flight = max(in_flight, engine.pipeline_runtime().stats.peak_in_flight)
    x, y = parity.batches(1, rows, seed=7)[0]
    evaluated = float(engine.eval_batch(x[mine], y[mine]))
    state = {k: v.float() for k, v in engine.full_state_dict().items()}
    out = {
        "losses": losses,
        "eval": evaluated,
        "state": state if engine.mesh.dp_rank == 0 else None,
        "pp_rank": engine.mesh.pp_rank,
        "in_flight": in_flight,
    }
    engine.close()
    return out


def check(spec: dict, results: list[dict]) -> None:
    """Losses, eval loss and merged weights against plain PyTorch in float64, with plain fp32's own distance from it
    as the scale (tests/tolerance.py)."""
    args = (spec.get("model", {}), spec["steps"], spec["rows"], spec["config"].get("grad_accumulation_steps", 1))
    clip = spec["config"].get("grad_clip_norm")
    exact_losses, exact, exact_eval = reference(*args, clip, torch.float64)
    plain_losses, plain, plain_eval = reference(*args, clip, torch.float32)
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        tolerance.assert_losses(r["losses"], exact_losses, plain_losses, dtype=torch.float32)
        tolerance.assert_losses([r["eval"]], [exact_eval], [plain_eval], dtype=torch.float32)
        if r["state"] is not None:
            merged.update(r["state"])
    assert merged.keys() == exact.keys(), sorted(set(exact) ^ set(merged))
    tolerance.assert_weights(merged, exact, plain, dtype=torch.float32)


def _p(stage: int = 0, **parallel: Any) -> dict:
    return {"zero_stage": stage, "parallel": parallel}


# ---- parity with plain PyTorch -----------------------------------------------------------------------------------
def _matrix(rank: int, world: int, specs: list[dict]) -> list[dict]:
    return [train(rank, world, s) for s in specs]


WORLD2 = {
    # micro-batches that do not divide by the stages (1F1B and GPipe need no multiple), and one micro-batch
    "1f1b-m3": dict(config=_p(1, pipeline=2, schedule="1f1b", microbatches=3), steps=3, rows=6),
    "gpipe-m3": dict(config=_p(0, pipeline=2, schedule="gpipe", microbatches=3), steps=3, rows=6),
    "1f1b-m1": dict(config=_p(0, pipeline=2, schedule="1f1b", microbatches=1), steps=3, rows=4),
    # three blocks over two stages: balanced by parameters, and cut where the user says
    "1f1b-uneven-params": dict(
        model=dict(n_layer=3), config=_p(2, pipeline=2, microbatches=4, pipeline_split="params"), steps=3, rows=4
    ),
    "1f1b-uneven-given": dict(
        model=dict(n_layer=3), config=_p(3, pipeline=2, microbatches=4, pipeline_split=["layers.2"]), steps=3, rows=4
    ),
    # the embedding tied to the head across the first and last stage, with clipping
    "tied-1f1b-zero3-clip": dict(
        model=dict(tie_weights=True),
        config={**_p(3, pipeline=2, microbatches=2), "grad_clip_norm": 0.3},
        steps=3,
        rows=4,
    ),
    "tied-interleaved": dict(
        model=dict(tie_weights=True),
        config=_p(1, pipeline=2, schedule="interleaved_1f1b", microbatches=2),
        steps=3,
        rows=4,
    ),
    # accumulation over train_batch calls: each call returns its batch's loss, the step comes every second call
    "accum2-1f1b": dict(config={**_p(1, pipeline=2, microbatches=2), "grad_accumulation_steps": 2}, steps=4, rows=4),
    "accum2-gpipe-zero3-clip": dict(
        config={
            **_p(3, pipeline=2, schedule="gpipe", microbatches=2),
            "grad_accumulation_steps": 2,
            "grad_clip_norm": 0.3,
        },
        steps=4,
        rows=4,
        eval_between=True,  # eval_batch between the accumulation's batches leaves its gradients alone
    ),
    "chimera-m2": dict(config=_p(1, pipeline=2, schedule="chimera", microbatches=2), steps=3, rows=4),
    "interleaved-v3": dict(
        model=dict(n_layer=4),
        config=_p(0, pipeline=2, schedule="interleaved_1f1b", microbatches=4, virtual_stages=3),
        steps=3,
        rows=4,
    ),
}

WORLD4 = {
    "pp4-1f1b-m6": dict(config=_p(1, pipeline=4, microbatches=6), steps=2, rows=6),
    "pp4-1f1b-m2": dict(config=_p(0, pipeline=4, microbatches=2), steps=2, rows=4),  # fewer micro-batches than stages
    "pp4-1f1b-m8-zero3": dict(config=_p(3, pipeline=4, microbatches=8), steps=2, rows=8),
    "pp4-gpipe-m5-uneven": dict(
        model=dict(n_layer=3), config=_p(2, pipeline=4, schedule="gpipe", microbatches=5), steps=2, rows=5
    ),
    "pp4-interleaved-m8-tied": dict(
        model=dict(n_layer=6, tie_weights=True),
        config=_p(3, pipeline=4, schedule="interleaved_1f1b", microbatches=8),
        steps=2,
        rows=8,
    ),
    "pp4-chimera-tied": dict(
        model=dict(tie_weights=True), config=_p(1, pipeline=4, schedule="chimera", microbatches=4), steps=2, rows=4
    ),
    "pp2xdp2-1f1b-m3-tied-clip": dict(
        model=dict(tie_weights=True),
        config={**_p(3, pipeline=2, microbatches=3), "grad_clip_norm": 0.3},
        steps=2,
        rows=12,
    ),
    "pp4-1f1b-tied-accum2": dict(
        model=dict(tie_weights=True),
        config={**_p(2, pipeline=4, microbatches=4), "grad_accumulation_steps": 2},
        steps=4,
        rows=4,
    ),
}


def _check_matrix(table: dict[str, dict], results: list[list[dict]]) -> None:
    for i, (name, spec) in enumerate(table.items()):
        per_rank = [r[i] for r in results]
        try:
            check(spec, per_rank)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err
        parallel = spec["config"]["parallel"]
        p, m = parallel["pipeline"], parallel["microbatches"]
        flights = [r["in_flight"] for r in per_rank]
        schedule = parallel.get("schedule", "1f1b")
        # What each schedule promises to keep: 1F1B at most p - rank micro-batches (p on the first stage), GPipe all
        if schedule == "1f1b":
            assert all(f <= min(p - r["pp_rank"], m) for f, r in zip(flights, per_rank)), (name, flights)
            assert max(flights) == min(p, m), (name, flights)
        elif schedule == "gpipe":
            assert flights == [m] * len(flights), (name, flights)


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_every_schedule_trains_like_plain_pytorch_on_2_ranks():
    results = run_distributed(_matrix, 2, list(WORLD2.values()), timeout=240)
    _check_matrix(WORLD2, results)


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_every_schedule_trains_like_plain_pytorch_on_4_ranks():
    results = run_distributed(_matrix, 4, list(WORLD4.values()), timeout=240)
    _check_matrix(WORLD4, results)


# ---- checkpoints of another cut ------------------------------------------------------------------------------------
def _engine(model: dict, config: dict) -> hetero.Engine:
    net = build(**model)
    config = copy.deepcopy(config)
    config.setdefault("chunk_size", parity.CHUNK)
    return hetero.initialize(net, parity.make_optimizer(net), config)


def _batches(engine: hetero.Engine, batches: list) -> list[float]:
    dp, r = engine.data_parallel_size, engine.data_parallel_rank
    out = []
    for x, y in batches:
        local = x.shape[0] // dp
        out.append(float(engine.train_batch(x[r * local : (r + 1) * local], y[r * local : (r + 1) * local])))
    return out


def _resume_cut(rank: int, world: int, model: dict, saving: dict, loading: list[dict], root: str) -> dict:
    torch.set_num_threads(1)
    data = parity.batches(4, 4)
    a = _engine(model, saving)
    _batches(a, data[:2])
    a.save_checkpoint(root)
    out = {"after": _batches(a, data[2:]), "resumed": []}
    a.close()
    for config in loading:
        b = _engine(model, config)
        b.load_checkpoint(root)
        out["resumed"].append(_batches(b, data[2:]))
        b.close()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_a_checkpoint_resumes_under_another_cut_of_the_same_stages(tmp_path):
    """pipeline_split "auto" times the units, so two runs of one config can cut the model apart (the timing noise of
    one process moved a stage boundary in 1 of 12 cuts of a 6-block GPTPipe over 4 stages): a checkpoint of one cut
    must load into another. It was refused as a model that "does not fit" (the names saved on a stage that this cut
    places elsewhere), though tensors are read by name. Now the resumed losses are the uninterrupted run's, bit for
    bit, under another split and under the interleaved layout."""
    model = dict(n_layer=3)
    saving = _p(1, pipeline=2, microbatches=2, pipeline_split=["layers.1"])
    loading = [
        _p(1, pipeline=2, microbatches=2, pipeline_split=["layers.2"]),
        _p(
            1,
            pipeline=2,
            schedule="interleaved_1f1b",
            microbatches=2,
            pipeline_split=["layers.0", "layers.1", "layers.2"],
        ),
    ]
    results = run_distributed(_resume_cut, 2, model, saving, loading, str(tmp_path / "ckpt"), timeout=240)
    for r in results:
        assert r["resumed"] == [r["after"]] * len(loading), r


def _resume_mid_accumulation(rank: int, world: int, config: dict, root: str) -> dict:
    torch.set_num_threads(1)
    data = parity.batches(3, 4)
    a = _engine({"n_layer": 3}, config)  # stages of other chunk sizes
    _batches(a, data[:1])  # one batch of an accumulation of two: its gradients pending
    a.save_checkpoint(root)
    after = _batches(a, data[1:])
    a.close()
    b = _engine({"n_layer": 3}, config)
    b.load_checkpoint(root)
    resumed = _batches(b, data[1:])
    b.close()
    return {"after": after, "resumed": resumed}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 3])
def test_a_checkpoint_saved_mid_accumulation_resumes_in_its_pipeline(tmp_path, stage):
    """A checkpoint saved between the batches of an accumulation holds each rank's pending gradients, which load
    into the layout that saved it. Under a pipeline that was refused on every stage but the first, its chunks
    compared with rank 0's (another stage's). Now the resumed losses are the uninterrupted run's, bit for bit."""
    # A cut given: "auto" times the units, and a checkpoint with pending gradients loads into the same cut only
    config = {**_p(stage, pipeline=2, microbatches=2, pipeline_split=["layers.1"]), "grad_accumulation_steps": 2}
    results = run_distributed(_resume_mid_accumulation, 2, config, str(tmp_path / "ckpt"), timeout=240)
    for r in results:
        assert r["resumed"] == r["after"], r


# ---- what a stage holds --------------------------------------------------------------------------------------------
def _held(rank: int, world: int, schedule: str, counts: list[int]) -> dict:
    """The most bytes each stage's train_batch and eval_batch created and held at once, per micro-batch count, one
    row per micro-batch (so that what is in flight is the same at every count); the batch itself is made before."""
    from hetero.profiler.activations import LiveBytes

    torch.set_num_threads(1)
    out: dict = {"train": {}, "eval": {}}
    for m in counts:
        net = build(n_layer=2, n_embd=64, block_size=32)
        # the same cut at every count ("auto" times the units, which can cut them apart)
        parallel = dict(pipeline=2, schedule=schedule, microbatches=m, pipeline_split=["layers.1"])
        config = {**_p(0, **parallel), "chunk_size": parity.CHUNK}
        engine = hetero.initialize(net, parity.make_optimizer(net), config)
        for phase in ("warm-up", "train", "eval"):  # the first batch makes the optimizer's states
            x, y = parity.batches(1, m, seq=32)[0]
            live = LiveBytes("cpu")
            with live:
                (engine.eval_batch if phase == "eval" else engine.train_batch)(x, y)
            if phase != "warm-up":
                out[phase][m] = live.peak
        engine.close()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "chimera"])
def test_what_a_stage_holds_does_not_grow_with_the_micro_batches(schedule):
    """1F1B keeps at most p micro-batches forwarded and not yet backwarded on the first stage, and evaluation keeps
    none: at a given micro-batch size what a stage holds must not grow with their number. It did: every send's tensor
    (each micro-batch's output, each input gradient sent back) was held until the batch's end, which on the first
    stage at 8 micro-batches of one row was every one of the 8 outputs (in evaluation, all of what it held)."""
    counts = [2, 8]
    results = run_distributed(_held, 2, schedule, counts, timeout=240)
    for rank, r in enumerate(results):
        for phase in ("train", "eval"):
            few, many = (r[phase][m] for m in counts)
            assert many == few, f"pipeline rank {rank} {phase}: {few} B at {counts[0]} micro-batches, {many} B at 8"


# ---- a rank that dies --------------------------------------------------------------------------------------------
DEATH_TIMEOUT = 20  # comm_timeout: the survivors must stop by then (plus the diagnosis' grace), naming the dead rank


def _a_rank_dies(rank: int, world: int, victim: int, root: str) -> None:
    """Pipeline `world` under 1F1B: after one good batch, pipeline rank `victim` ends its process in the middle of the
    next (its second forward); every other rank writes what train_batch raised and how long it took."""
    import os
    import time

    torch.set_num_threads(1)
    engine = _engine({}, {**_p(1, pipeline=world, microbatches=4), "comm_timeout": DEATH_TIMEOUT})
    data = parity.batches(2, 4)
    _batches(engine, data[:1])
    if rank == victim:
        calls = [0]

        def die(*_: Any) -> None:
            calls[0] += 1
            if calls[0] == 2:
                os._exit(7)

        engine.stages[0].units[0][1].register_forward_hook(die)
    start = time.monotonic()
    try:
        _batches(engine, data[1:])
        outcome = "no error"
    except Exception as e:  # noqa: BLE001 (what it raised is what is checked)
        outcome = f"{type(e).__name__}: {e}"
    with open(os.path.join(root, f"rank-{rank}.txt"), "w") as f:
        f.write(f"{time.monotonic() - start:.1f}\n{outcome}")


@ranks_apart("one rank fails, hangs, dies or runs late: another must see it")
@pytest.mark.timeout(200)
@pytest.mark.parametrize("world, victim", [(2, 1), (4, 2)])
def test_a_stage_whose_process_dies_stops_every_other_stage_naming_it(tmp_path, world, victim):
    """A stage's process ending mid-batch (killed, out of memory): every other pipeline rank raises, within
    comm_timeout and the diagnosis' grace, an error naming the dead rank; none waits on."""
    from tests.dist import DistributedTestError

    with pytest.raises(DistributedTestError, match=f"rank {victim}"):
        run_distributed(_a_rank_dies, world, victim, str(tmp_path), timeout=150, report_grace=2 * DEATH_TIMEOUT + 30)
    for rank in range(world):
        if rank == victim:
            continue
        seconds, outcome = (tmp_path / f"rank-{rank}.txt").read_text().split("\n", 1)
        assert outcome.startswith("RankTimeoutError"), (rank, outcome)
        assert f"Global rank(s) {victim}" in outcome or f", {victim} did not arrive" in outcome, (rank, outcome)
        assert float(seconds) <= DEATH_TIMEOUT + 15, (rank, seconds, outcome)
        # A transfer's peer waiting on its own transfer is no divergence, and a rank no party to it is not "missing"
        # ([Note: diagnosing a transfer] in hetero/comm/watch.py).
        if "did not arrive" in outcome:
            assert "different sequences of collectives" not in outcome, (rank, outcome)
            named = outcome.split("did not arrive")[0].rsplit("Global rank(s)", 1)[-1]
            assert [int(r) for r in named.replace(",", " ").split()] == [victim], (rank, outcome)


# ---- a stage without parameters ------------------------------------------------------------------------------------
def _sequential() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4), torch.nn.ReLU())


def test_balanced_stages_avoid_units_without_parameters():
    """'params' and 'auto' never leave a stage only parameterless units where another cut gives each some."""
    from hetero.parallel.pipeline.split import balanced, boundaries, units_of

    # a costly unit without parameters (timed by "auto") would be a stage of its own: it goes with a neighbour
    assert balanced([1.0, 10.0, 1.0, 1.0], 3) == [0, 1, 2]
    assert balanced([1.0, 10.0, 1.0, 1.0], 3, empty=[False, True, False, False]) in ([0, 2, 3], [0, 1, 3])
    units = units_of(_sequential())
    assert boundaries(units, 2, "auto", [1.0, 1.0, 1.0, 5.0]) == [0, 2]  # the ReLU goes with the last Linear
    with pytest.raises(hetero.ConfigError, match="stage 1 would hold only the units '3', without parameters"):
        boundaries(units, 2, ["3"])
    with pytest.raises(hetero.ConfigError, match="lower pipeline"):
        boundaries(units, 3, "params")


def _parameterless_stage(rank: int, world: int) -> str:
    torch.set_num_threads(1)
    net = _sequential()
    config = {"parallel": {"pipeline": 2, "microbatches": 2, "pipeline_split": ["3"]}, "comm_timeout": 20}
    try:
        engine = hetero.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), config)
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        engine.train_batch(x, y, loss_fn=torch.nn.functional.mse_loss)
    except Exception as e:  # noqa: BLE001 (what it raised is what is checked)
        return f"{type(e).__name__}: {e}"
    return "no error"


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
def test_a_stage_without_parameters_is_refused_on_every_rank():
    """An nn.Sequential cut so that the last stage holds only its ReLU: the stage's rank alone raised in initialize
    (a ValueError: "the model has no parameters to place"), while the other went on into the first batch and failed
    there on a closed connection (or waited comm_timeout). Now every rank raises the same ConfigError, naming the stage
    and its units."""
    results = run_distributed(_parameterless_stage, 2, timeout=150)
    for r in results:
        assert r.startswith("ConfigError: parallel.pipeline_split: stage 1 would hold only the units '3'"), results
