"""`engine.full_state_dict()` under tensor and pipeline parallelism: every rank gets the whole model (all keys in the
unwrapped model's order, full shapes), bit for bit what `save_checkpoint` + `consolidate` write (fp32, so the compute
values are the master weights themselves). Models of tests/grid_parity.py: a tiny Hugging Face Llama (1D tensor
parallel, the user's case), GPT-2 (its head tied to the embedding, on a 2D grid: blocks), GPTPipe (tensor x
pipeline) and GPTPipe with the embedding tied to the head across pipeline stages."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import hetero
from hetero.checkpoint import consolidate
from hetero.models.gpt_pipe import TP_PLAN

try:
    from tests import grid_parity
    from tests.dist import NEEDS_DEGREES, ranks_apart, run_distributed
except ImportError:  # tests/ itself on sys.path
    import grid_parity  # type: ignore[no-redef]
    from dist import NEEDS_DEGREES, ranks_apart, run_distributed  # type: ignore[no-redef]

BATCHES, ROWS = 2, 4


def _save_and_gather(rank: int, world: int, family: str, config: dict, root: str) -> dict:
    torch.set_num_threads(1)
    model = grid_parity.build(family)
    config = {**copy.deepcopy(config), "chunk_size": grid_parity.CHUNK}
    engine = hetero.initialize(model, grid_parity.optimizer(model), config)
    dp, r = engine.data_parallel_size, engine.data_parallel_rank
    local = ROWS // dp
    for x, y in grid_parity.batches(family, BATCHES, ROWS):
        engine.train_batch(x[r * local : (r + 1) * local], y[r * local : (r + 1) * local])
    engine.save_checkpoint(root)
    full = engine.full_state_dict()
    only = engine.full_state_dict(rank0_only=True)
    assert engine.save_16bit_model(os.path.join(root, "16bit")) is True  # DeepSpeed's name, any layout
    engine.close()
    return {"full": full, "rank0_only": only, "world_rank": rank}


def _consolidated(root: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = os.path.join(root, "full.safetensors")
    consolidate(root, out)
    return load_file(out)


ONE_D = {"zero_stage": 1, "parallel": {"tensor": 2}}
GRID_2D = {"zero_stage": 3, "parallel": {"tensor": 4, "tensor_mode": "2d"}}
PP2_DP2 = {"zero_stage": 3, "parallel": {"pipeline": 2, "microbatches": 2, "schedule": "1f1b"}}
# Rank 0 holds virtual stages 0 and 2, rank 1 stages 1 and 3: stage order is not the model's ([Note: the whole
# model's order]).
INTERLEAVED = {
    "zero_stage": 3,
    "parallel": {"pipeline": 2, "virtual_stages": 2, "microbatches": 2, "schedule": "interleaved_1f1b"},
}
TP2_PP2 = {
    "zero_stage": 3,
    "parallel": {"tensor": 2, "tensor_plan": TP_PLAN, "pipeline": 2, "microbatches": 2, "schedule": "1f1b"},
}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "family, config, world",
    [
        ("llama", ONE_D, 2),
        ("gpt2", GRID_2D, 4),
        ("gpt_pipe_tied", PP2_DP2, 4),
        ("gpt_pipe", TP2_PP2, 4),
        ("gpt_pipe", INTERLEAVED, 2),
    ],
    ids=["llama-tp2-zero1", "gpt2-2d-zero3", "tied-pp2-dp2-zero3", "tp2-pp2-zero3", "interleaved-pp2-zero3"],
)
def test_every_rank_gets_the_whole_model(tmp_path, family, config, world):
    """Also: rank0_only gives global rank 0 the same dict and every other rank an empty one."""
    root = str(tmp_path / "ckpt")
    results = run_distributed(_save_and_gather, world, family, config, root, timeout=160)
    plain = grid_parity.build(family).state_dict()  # the model before initialize: its keys, in order, and shapes
    whole = _consolidated(root)
    assert list(whole) == list(plain), "consolidate's file is not in the model's key order"
    for res in results:
        full = res["full"]
        assert list(full) == list(plain), (res["world_rank"], sorted(set(plain) ^ set(full)))
        for k, v in full.items():
            assert v.shape == plain[k].shape, (res["world_rank"], k, tuple(v.shape), tuple(plain[k].shape))
            assert v.dtype == whole[k].dtype and torch.equal(v, whole[k]), (res["world_rank"], k)
        if res["world_rank"] == 0:
            saved = torch.load(os.path.join(root, "16bit", "pytorch_model.bin"), weights_only=True)
            assert list(saved) == list(full) and all(torch.equal(saved[k], v) for k, v in full.items())
            assert res["rank0_only"].keys() == full.keys()
            assert all(torch.equal(res["rank0_only"][k], v) for k, v in full.items())
        else:
            assert res["rank0_only"] == {}, res["world_rank"]


def test_a_cut_the_checkpoint_cannot_join_is_refused_naming_consolidate():
    """A tensor-parallel cut of a kind the checkpoint's merge does not know: a clear error before any collective,
    never this rank's shard passed off as the whole tensor."""
    from types import SimpleNamespace

    from hetero.parallel.full_state import gather_full_state

    layer = torch.nn.Linear(4, 4, bias=False)
    layer.weight._hetero_tp = SimpleNamespace(degree=2, rank=0, stored_rank=0)  # no dims, no block indices
    mesh = SimpleNamespace(tp_size=2, pp_size=1, dp_rank=0, tp_rank=0, world=SimpleNamespace(rank=0))
    with pytest.raises(hetero.CheckpointError, match="save_checkpoint.*consolidate"):
        gather_full_state(layer.state_dict(), layer, mesh)
