"""Checkpoints of tensor- and pipeline-parallel layouts: a bit-exact resume in the same layout, resharding of the
data-parallel degree at fixed tensor/pipeline degrees, consolidation to the full unsharded state_dict of the
unwrapped model, and a clear error for other tensor/pipeline degrees (tests/pipe_parity.py's tiny GPTPipe)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import hetero
from hetero.checkpoint import consolidate
from hetero.checkpoint import manifest as mf
from hetero.models.gpt_pipe import TP_PLAN
from tests.dist import NEEDS_DEGREES, ranks_apart

try:
    from tests import parity, pipe_parity, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

N, M = 2, 2  # batches before the save, and after it
ROWS = 4


def _engine(config: dict, seed: int = 0) -> hetero.Engine:
    model = pipe_parity.build(seed)
    config = copy.deepcopy(config)
    config.setdefault("chunk_size", parity.CHUNK)
    return hetero.initialize(model, parity.make_optimizer(model), config)


def _train(engine: hetero.Engine, start: int, stop: int) -> list[float]:
    dp, r = engine.data_parallel_size, engine.data_parallel_rank
    local = ROWS // dp
    out = []
    for x, y in parity.batches(stop, ROWS)[start:stop]:
        out.append(float(engine.train_batch(x[r * local : (r + 1) * local], y[r * local : (r + 1) * local])))
    return out


def _local_state(engine: hetero.Engine) -> dict[str, torch.Tensor]:
    """This rank's parameters (its stage's, its tensor shards) as plain fp32 copies."""
    return {k: v.float().clone() for k, v in engine.local_state_dict().items()}


def _resume(rank: int, world: int, config: dict, root: str, other: dict | None = None) -> dict:
    """N batches, save, M batches; then a fresh engine (other initial weights) loads and runs the same M. other: a
    config with other tensor/pipeline degrees, whose engine must refuse the checkpoint."""
    torch.set_num_threads(1)
    a = _engine(config)
    _train(a, 0, N)
    a.save_checkpoint(root, client_state={"batches": N})
    saved = _local_state(a)
    after = _train(a, N, N + M)
    final = _local_state(a)
    a.close()
    b = _engine(config, seed=7)
    client = b.load_checkpoint(root)
    loaded = _local_state(b)
    resumed = _train(b, N, N + M)
    out = {
        "client": client,
        "saved_equal": all(torch.equal(saved[k], loaded[k]) for k in saved) and saved.keys() == loaded.keys(),
        "after": after,
        "resumed": resumed,
        "final_equal": all(torch.equal(final[k], v) for k, v in _local_state(b).items()),
        "coords": (b.mesh.tp_rank, b.mesh.dp_rank, b.mesh.pp_rank),
        "state": saved,
    }
    b.close()
    if other is not None:
        c = _engine(other)
        with pytest.raises(hetero.CheckpointError) as err:
            c.load_checkpoint(root)
        out["refused"] = str(err.value)
        c.close()
    return out


def _check_resume(results: list[dict], root: str) -> None:
    for r in results:
        assert r["client"] == {"batches": N}
        assert r["saved_equal"], f"rank {r['coords']}: the loaded weights differ from the saved ones"
        assert r["after"] == r["resumed"], (r["coords"], r["after"], r["resumed"])  # bit-exact losses
        assert r["final_equal"], f"rank {r['coords']}: weights after the resumed batches differ"
    _check_consolidated(root)


def _check_consolidated(root: str) -> None:
    """The consolidated export is the full state_dict of the unwrapped model: it loads strictly, and its values are
    plain PyTorch's after N batches (within fp32's own error of the float64 run: tests/tolerance.py)."""
    out = os.path.join(root, "full.safetensors")
    consolidate(root, out)
    from safetensors.torch import load_file

    state = load_file(out)
    model = pipe_parity.build(seed=3)
    model.load_state_dict(state, strict=True)
    _, exact, _ = pipe_parity.reference(steps=N, rows=ROWS, precision="fp64")
    _, plain, _ = pipe_parity.reference(steps=N, rows=ROWS)
    tolerance.assert_weights(state, exact, plain, dtype=torch.float32)


TP2 = {"zero_stage": 1, "parallel": {"tensor": 2, "tensor_plan": TP_PLAN, "microbatches": 2}}
PP2 = {"zero_stage": 3, "parallel": {"pipeline": 2, "microbatches": 2, "schedule": "1f1b"}}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("config, other", [(TP2, PP2), (PP2, None)], ids=["tp2-zero1", "pp2-zero3"])
def test_resume_is_bit_exact_under_tensor_or_pipeline_parallelism(tmp_path, config, other):
    """Also: an engine with other tensor/pipeline degrees refuses the checkpoint, saying why and what to do."""
    root = str(tmp_path / "ckpt")
    results = run_distributed(_resume, 2, config, root, other, timeout=240)
    manifest = mf.read_manifest(mf.resolve(root))
    degrees = (manifest["layout"]["tensor_parallel"], manifest["layout"]["pipeline_parallel"])
    assert degrees == (config["parallel"].get("tensor", 1), config["parallel"].get("pipeline", 1))
    assert len([f for f in manifest["files"] if f.startswith("rank-")]) == 2  # one file per global rank
    _check_resume(results, root)
    for r in results if other is not None else []:
        assert "tensor x pipeline degrees 2 x 1" in r["refused"] and "1 x 2" in r["refused"], r["refused"]
        assert "consolidate" in r["refused"], r["refused"]


def _load_only(rank: int, world: int, config: dict, root: str) -> dict:
    torch.set_num_threads(1)
    e = _engine(config, seed=7)
    e.load_checkpoint(root)
    out = {"coords": (e.mesh.tp_rank, e.mesh.dp_rank, e.mesh.pp_rank), "state": _local_state(e)}
    out["losses"] = _train(e, N, N + 1)
    e.close()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(400)
def test_tp_pp_2x2x2_resumes_and_reshards_to_data_parallel_1(tmp_path):
    """Saved by tensor x pipeline x data = 2 x 2 x 2 at ZeRO-1: it resumes bit-exactly in that layout, and loads into
    2 x 2 x 1 at ZeRO-3, where each rank's parameters equal, bit for bit, those of the saving ranks with its tensor
    and pipeline coordinates."""
    root = str(tmp_path / "ckpt")
    parallel = {"tensor": 2, "tensor_plan": TP_PLAN, "pipeline": 2, "microbatches": 2}
    saved = run_distributed(_resume, 8, {"zero_stage": 1, "parallel": parallel}, root, timeout=360)
    _check_resume(saved, root)
    loaded = run_distributed(_load_only, 4, {"zero_stage": 3, "parallel": parallel}, root, timeout=240)
    by_coords = {(r["coords"][0], r["coords"][2]): r["state"] for r in saved if r["coords"][1] == 0}
    for r in loaded:
        ref = by_coords[(r["coords"][0], r["coords"][2])]
        assert r["state"].keys() == ref.keys()
        for k, v in ref.items():
            assert torch.equal(r["state"][k], v), (r["coords"], k)
    assert len({tuple(r["losses"]) for r in loaded}) == 1  # the same global loss on every rank
