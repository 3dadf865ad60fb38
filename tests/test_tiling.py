"""Tiles: a weight larger than a chunk is split over chunks of its own, and its layer computes on one tile at a time
([Note: tiles], [Note: computing on tiles]). Tiled layers match untiled ones at every stage; a model whose largest
tensor is twice the device budget trains to plain PyTorch's losses; tiles go through lazy init, weights=,
checkpoints, consolidation and gathered_parameters; the automatic chunk size follows the budgets; budgets are
checked against the machine; out-of-memory errors point at the fix."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch import nn

import hetero
from hetero.errors import ConfigError, ReleasedParameterError, TierOutOfMemoryError
from hetero.memory import ChunkManager, TensorState, Tier
from hetero.memory.chunk_size import budget_cap, pack_tiled, packed_capacity
from hetero.zero.layout import build_layout
from tests import parity, tolerance
from tests.dist import RANKS_DIFFER, cpu_ranks_env, ranks_apart, run_distributed

V, D, H = 96, 16, 48  # vocabulary, width, hidden width of the tiled test model


class _Net(nn.Module):
    """An embedding, a Linear with bias and a head: each larger than the chunks the tests use."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D, padding_idx=3)
        self.up = nn.Linear(D, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.up(self.embed(ids) + x)))


def _net(dtype: torch.dtype = torch.float32) -> _Net:
    torch.manual_seed(0)
    return _Net().to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative distance, compared on the CPU: the engine's outputs are on its device (cuda:0 on a GPU machine)."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / b.norm())


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, 7), generator=g)
    ids[0, :2] = 3  # the padding row: its gradient stays zero
    return ids, torch.randn(3, 7, D, generator=g), torch.randn(3, 7, V, generator=g)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tiled_layers_match_untiled_forward_and_backward(stage):
    """fp32, rel 1e-5: outputs, the input's gradient, and every weight's gradient (read back as SGD's step)."""
    ids, x, w = _data()
    plain = _net()
    xp = x.clone().requires_grad_()
    out = plain(ids, xp)
    (out * w).sum().backward()
    model = _net()
    engine = hetero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=1.0), {"zero_stage": stage, "chunk_size": 256}
    )
    tiled = engine.memory_stats()["tiled"]
    assert set(tiled) == {"embed.weight", "up.weight", "head.weight"} and all(t["tiles"] > 1 for t in tiled.values())
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    xh = x.clone().requires_grad_()
    got = engine(ids, xh)  # on the engine's device: the weights of the loss go there
    engine.backward((got * w.to(got.device)).sum())
    engine.step()
    assert _rel(got.detach(), out.detach()) <= 1e-5
    assert _rel(xh.grad, xp.grad) <= 1e-5
    after = engine.full_state_dict()
    for name, p in plain.named_parameters():
        assert _rel(before[name] - after[name], p.grad) <= 1e-5, name
    assert torch.all(after["embed.weight"][3] == before["embed.weight"][3])  # padding_idx got no gradient
    engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_tile_gradients_are_computed_in_their_chunks(stage):
    """Stages 2-3 in fp32: each tile's weight gradient is computed straight into its region of the chunk's gradient
    buffer (no buffer of its own, no copy), and the step equals the plain one (the parity test above)."""
    ids, x, w = _data()
    model = _net()
    engine = hetero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=1.0), {"zero_stage": stage, "chunk_size": 256}
    )
    runner = engine.tiles
    seen = []
    deliver = runner._deliver

    def spy(e, grad, last):
        region = e.chunk.grad_full.payload.narrow(0, e.info.offset, e.info.numel)
        seen.append((e.info.name, grad.data_ptr() == region.data_ptr()))
        deliver(e, grad, last)

    runner._deliver = spy
    out = engine(ids, x)
    engine.backward((out * w.to(out.device)).sum())
    engine.step()
    assert len(seen) == sum(t["tiles"] for t in engine.memory_stats()["tiled"].values())
    assert all(in_place for _, in_place in seen), [n for n, ok in seen if not ok]
    engine.close()


def test_the_profiler_names_the_tiled_weights(tmp_path):
    ids, x, w = _data()
    model = _net()
    cfg = {"zero_stage": 3, "chunk_size": "auto", "memory": {"device_budget": 40 << 10, "host_budget": 1 << 20}}
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), cfg)
    with hetero.profile(engine, tmp_path / "prof", plot=False):
        out = engine(ids, x)
        engine.backward((out * w.to(out.device)).sum())
        engine.step()
    summary = json.loads((tmp_path / "prof" / "summary.json").read_text())
    tiled = engine.memory_stats()["tiled"]
    assert tiled and summary["tiled"] == tiled  # chosen by the budgets: no chunk_size was given
    assert summary["tiled"]["head.weight"]["modules"] == ["head"]
    assert "head.weight (96, 48):" in (tmp_path / "prof" / "summary.txt").read_text()
    engine.close()


def test_tiling_off_keeps_layers_whole():
    model = _net()
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), {"chunk_size": 256, "tiling": False})
    assert engine.memory_stats()["tiled"] == {} and type(model.head) is nn.Linear
    engine.close()


def test_largest_tensor_twice_the_device_budget_trains_like_pytorch(tmp_path):
    """The embedding (tied to the head) is 64 KiB of fp32, the device budget 32 KiB: the chunk size follows the
    budgets and the embedding, the head and every matrix compute tile by tile."""
    over = {"vocab_size": 512}
    budget = 32 << 10
    cfg = {
        "zero_stage": 3,
        "chunk_size": "auto",
        "offload": {"params": "host", "optimizer": "nvme"},
        "memory": {"device_budget": budget, "host_budget": 1 << 20, "nvme_dir": str(tmp_path)},
    }
    # SGD with momentum: the update is linear in the gradient, so the weights' rounding error is the gradients'
    # (tiles sum dx in another order; measured per tensor no larger than plain fp32's). Under Adam an element whose
    # gradient is at rounding level gets a +-lr step decided by that rounding ([Note: tolerances from the arithmetic]),
    # which in this 2-layer model can put one whole small matrix 10x further from float64 than plain fp32 by chance.
    r = parity.run_hetero(0, 1, steps=3, rows=4, config=cfg, model_overrides=over, optimizer="sgd")
    assert 2 * budget == 512 * 32 * 4 and "embed.weight" in r["stats"]["tiled"]
    assert r["stats"]["device"]["peak"] <= budget
    parity.check(r, steps=3, rows=4, model_overrides=over, optimizer="sgd")
    adam = parity.run_hetero(0, 1, steps=3, rows=4, config=cfg, model_overrides=over)  # AdamW: the losses
    exact, _ = parity.cached_reference("fp64", steps=3, rows=4, model_overrides=over)
    plain, _ = parity.cached_reference("fp32", steps=3, rows=4, model_overrides=over)
    tolerance.assert_losses(adam["losses"], exact, plain, dtype=torch.float32)


def _tiles_world2(rank: int, world: int, nvme_root: str) -> dict:
    cfg = {"zero_stage": 3, "chunk_size": 700, "offload": {"params": "nvme", "optimizer": "nvme"}}
    return parity.run_hetero(rank, world, steps=2, rows=4, config=cfg, nvme_dir=nvme_root)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("standin", [False, True])
def test_tiles_on_two_ranks(tmp_path, monkeypatch, standin):
    """Tile gathers are collectives decided by the model's program, the same on every rank; under the CPU stand-in
    every copy and collective of the tiled layers keeps a GPU's rules."""
    if standin:
        monkeypatch.setenv("HETERO_STANDIN", "1")
    r = run_distributed(_tiles_world2, 2, str(tmp_path), timeout=280)[0]
    assert len(r["stats"]["tiled"]) > 5
    parity.check(r, steps=2, rows=4)


def _uneven_budgets(rank: int, world: int) -> dict:
    budget = (48 << 10) if rank == 0 else (1 << 20)  # rank 0's budget alone would take smaller chunks
    cfg = {"zero_stage": 3, "chunk_size": "auto", "memory": {"device_budget": budget, "host_budget": 4 << 20}}
    # SGD: weights checked where rounding is not amplified (see the test above with the device budget).
    return parity.run_hetero(
        rank, world, steps=2, rows=4, config=cfg, model_overrides={"vocab_size": 512}, optimizer="sgd"
    )


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(200)
def test_auto_chunk_size_is_agreed_by_ranks_with_different_budgets():
    """The automatic chunk size is the smallest rank's (an all-reduce every rank makes, since chunk_size is "auto"
    in the shared config): both ranks build one layout, tiles included, and train to plain PyTorch's losses."""
    r0, r1 = run_distributed(_uneven_budgets, 2, timeout=180)
    assert r0["stats"]["tiled"] == r1["stats"]["tiled"] and "embed.weight" in r0["stats"]["tiled"]
    assert r0["stats"]["device"]["budget"] != r1["stats"]["device"]["budget"]
    parity.check(r0, steps=2, rows=4, model_overrides={"vocab_size": 512}, optimizer="sgd")


# ---- the layout ------------------------------------------------------------------------------------------------
def test_pack_tiled_splits_whole_rows_and_wastes_nothing_on_tiles():
    # A small tensor, a 10-row tensor of rows of 30 (tileable), another small one, an untileable big one.
    numels, rows = [40, 300, 50, 500], [None, 30, None, None]
    packed = pack_tiled(numels, rows, 128)
    tiles = [p for p in packed if p.tile]
    assert [m for p in tiles for m in p.members] == [(1, 0, 120), (1, 120, 90), (1, 210, 90)]  # balanced, whole rows
    assert all(p.capacity == p.members[0][2] for p in tiles)
    assert [p.members for p in packed if not p.tile] == [((0, 0, 40),), ((2, 0, 50),), ((3, 0, 500),)]
    # Closed before tiles: trimmed; closed before an untileable oversize tensor (or the run's end): full; oversize:
    # exact.
    assert [p.capacity for p in packed if not p.tile] == [40, 128, 500]


def test_packed_capacity_counts_what_pack_tiled_allocates():
    """The chunk-size search counts capacities without packing (`packed_capacity`): the same sum as `pack_tiled`'s
    chunks, over random mixes of small, empty, tileable and untileable tensors, capacities and alignments."""
    rng = np.random.default_rng(3)
    for _ in range(400):
        k = int(rng.integers(1, 12))
        numels, rows = [], []
        for _ in range(k):
            row = int(rng.integers(1, 40))
            n = row * int(rng.integers(0, 30))
            numels.append(n)
            rows.append(row if rng.random() < 0.6 else None)
        chunk, align = int(rng.integers(1, 200)), int(rng.choice([1, 4, 16]))
        want = sum(p.capacity for p in pack_tiled(numels, rows, chunk, align=align))
        assert packed_capacity(numels, rows, chunk, align=align) == want, (numels, rows, chunk, align)


def test_only_tileable_layers_are_split():
    model = nn.ModuleDict(
        {
            "lin": nn.Linear(64, 64),
            "norm": nn.LayerNorm(4096),  # 1-D: never split (its own chunk)
            "mha": nn.MultiheadAttention(64, 2),  # out_proj's weight is read by its parent: never split
            "bag": nn.Embedding(64, 64, max_norm=1.0),  # changes its weight in forward
        }
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    specs = build_layout(model, opt, chunk_numel=1024, world=2)
    tiled = {s.params[0].name for s in specs if s.tile}
    assert tiled == {"lin.weight"}
    assert sum(s.capacity for s in specs) >= sum(p.numel() for p in model.parameters())
    for s in specs:
        assert s.capacity % 2 == 0 and sum(i.numel for i in s.params) <= s.capacity


def test_auto_chunk_size_tiles_only_what_the_budgets_cannot_hold():
    """[Note: tiling only what the budgets need]: the automatic size leaves a weight whole when the budgets hold its
    own chunk, though it is larger than the chunk chosen for low padding; it tiles it when they do not; an explicit
    chunk size tiles whatever is larger than a chunk."""
    # Eight 50 x 100 layers (5000 elements each) and a 512 x 64 head (32768): the automatic size packs the layers
    # two or three to a chunk for low padding, far smaller than the head (shapes only: the model never runs).
    model = nn.Sequential(*[nn.Linear(100, 50, bias=False) for _ in range(8)], nn.Linear(64, 512, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def tiled(**kw: int | None) -> set[str]:
        specs = build_layout(model, opt, world=2, **kw)
        assert sum(s.capacity for s in specs) >= sum(p.numel() for p in model.parameters())
        return {s.params[0].name for s in specs if s.tile}

    loose = build_layout(model, opt, chunk_numel=None, world=2, max_chunk_numel=1 << 20)
    assert loose[0].chunk_numel < 512 * 64  # the head is larger than a chunk...
    assert tiled(chunk_numel=None, max_chunk_numel=1 << 20) == set()  # ...but the budgets hold it whole
    assert tiled(chunk_numel=None, max_chunk_numel=None) == set()  # no budget: up to 64M elements stay whole
    assert tiled(chunk_numel=None, max_chunk_numel=8192) == {"8.weight"}  # the budgets cannot: tiles
    assert tiled(chunk_numel=8192) == {"8.weight"}  # an explicit size: larger than a chunk is tiled


def test_auto_chunk_size_follows_the_budgets():
    model = parity.build(vocab_size=512)
    cfg = {"zero_stage": 3, "memory": {"device_budget": 64 << 10, "host_budget": 1 << 20}}
    engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
    cap = budget_cap(
        device_budget=64 << 10,
        host_budget=1 << 20,
        stage=3,
        param_bytes=4,
        n_states=2,
        params_tier="device",
        optim_tier="device",
        prefetch_depth=2,
        world=1,
    )
    # The chunks in use, the prefetched ones and the one leaving, with the gradient buffers, fit half the budget.
    assert cap is not None and (4 * 4 + 16) * cap <= (64 << 10) // 2
    assert max(zc.spec.capacity for zc in engine.chunks) <= cap
    other = parity.build(vocab_size=512)
    est = hetero.estimate(other, cfg, optimizer=parity.make_optimizer(other), machine=False)
    assert est.chunk_numel == engine.chunks[0].spec.chunk_numel <= cap
    assert est.n_chunks == len(engine.chunks) and est.chunk_elements == sum(zc.spec.capacity for zc in engine.chunks)
    engine.close()


@pytest.mark.parametrize(
    "config",
    [
        {"zero_stage": 1, "offload": {"optimizer": "host"}},
        {"zero_stage": 3, "offload": {"params": "nvme", "optimizer": "nvme"}},
    ],
    ids=["z1-host", "z3-nvme"],
)
def test_estimate_equals_the_ledgers_with_tiles(config, tmp_path):
    from tests.test_estimator import BATCH, SEQ, _check, _gpt, _measure

    config = {**config, "chunk_size": 700}
    if "nvme" in config["offload"].values():
        config["memory"] = {"nvme_dir": str(tmp_path)}
    meta = _gpt(meta=True)
    est = hetero.estimate(
        meta, config, batch_size=BATCH, seq_len=SEQ, optimizer=parity.make_optimizer(meta), machine=False
    )
    assert len(est.tiled) > 5
    _check(est, _measure(_gpt(meta=False), config), f"tiles {config}")


# ---- states streamed tile by tile ------------------------------------------------------------------------------
def test_lazy_init_and_weights_through_tiles(tmp_path):
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    for stage in (0, 3):
        torch.manual_seed(0)
        with hetero.lazy_init():
            model = transformers.LlamaForCausalLM(cfg)
        model.model.embed_tokens.weight.tag = "kept"  # an attribute of the user's (or a tensor-parallel cut)
        engine = hetero.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": stage, "chunk_size": 256}
        )
        assert "model.embed_tokens.weight" in engine.memory_stats()["tiled"]
        assert getattr(model.model.embed_tokens.weight, "tag", None) == "kept"  # swap_tensors swapped it away
        got = engine.full_state_dict()
        for k, v in ref.state_dict().items():
            assert torch.equal(got[k], v), k  # bit-identical to normal construction, tiles included
        engine.close()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p))
    state = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    with hetero.lazy_init():
        model = transformers.LlamaForCausalLM(cfg)
    engine = hetero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": 3, "chunk_size": 256}, weights=tmp_path
    )
    got = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), k
    engine.close()


def test_checkpoints_and_consolidation_with_tiles(tmp_path, monkeypatch):
    import importlib

    cons = importlib.import_module("hetero.checkpoint.consolidate")

    data = parity.batches(4, 2)

    def train(engine, batches):
        for x, y in batches:
            engine.backward(engine(x, labels=y).loss)
            engine.step()

    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": 3, "chunk_size": 700})
    train(engine, data[:2])
    engine.save_checkpoint(tmp_path / "ck")
    train(engine, data[2:])
    want = engine.full_state_dict()
    engine.close()
    for cfg in ({"zero_stage": 1, "chunk_size": 4096}, {"zero_stage": 2, "chunk_size": 300}):  # untiled; other tiles
        model = parity.build()
        engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
        engine.load_checkpoint(tmp_path / "ck")
        train(engine, data[2:])
        got = engine.full_state_dict()
        for k, v in want.items():
            assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), (cfg, k)
        engine.close()
    monkeypatch.setattr(cons, "PART_NUMEL", 500)  # several parts per tensor: written part by part
    out = tmp_path / "model.safetensors"
    cons.consolidate(tmp_path / "ck", out)
    from safetensors.torch import load_file

    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": 0, "chunk_size": 4096})
    engine.load_checkpoint(tmp_path / "ck")
    full = engine.full_state_dict()
    assert load_file(str(out)).keys() == full.keys()
    for k, v in load_file(str(out)).items():
        assert torch.equal(v, full[k]), k
    engine.close()


def test_gathered_parameters_assembles_tiled_weights():
    model = _net()
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), {"zero_stage": 3, "chunk_size": 256})
    full = engine.full_state_dict()
    with pytest.raises(ReleasedParameterError, match="tiles"):
        model.head.weight.sum()
    with engine.gathered_parameters([model.head.weight], modify=True):
        assert torch.equal(model.head.weight.detach().cpu(), full["head.weight"])
        with torch.no_grad():
            model.head.weight[5].fill_(2.0)
    after = engine.full_state_dict()
    assert torch.all(after["head.weight"][5] == 2.0) and torch.equal(after["head.weight"][6], full["head.weight"][6])
    engine.close()


def test_update_streams_tiles_through_a_host_smaller_than_the_largest_tensor(tmp_path):
    """The embedding's fp32 master and two moments (3 x 64 KiB) do not fit the 96 KiB host budget at once: its
    tiles stream through the host one after another."""
    over = {"vocab_size": 512}
    cfg = {
        "zero_stage": 3,
        "chunk_size": 2048,
        "offload": {"params": "nvme", "optimizer": "nvme"},
        "memory": {"host_budget": 96 << 10, "device_budget": 64 << 10, "nvme_dir": str(tmp_path)},
    }
    r = parity.run_hetero(0, 1, steps=2, rows=4, config=cfg, model_overrides=over)
    assert r["stats"]["host"]["peak"] <= 96 << 10 < 3 * 512 * 32 * 4
    parity.check(r, steps=2, rows=4, model_overrides=over)


# ---- budgets and errors ----------------------------------------------------------------------------------------
def test_default_budgets_are_a_share_of_the_node(monkeypatch):
    import psutil

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with ChunkManager() as m:
        avail = psutil.virtual_memory().available
        assert m.ledgers[Tier.HOST].budget <= avail // 8 * 1.2  # a quarter of the half a single rank would take


def test_a_budget_larger_than_the_machine_is_an_error_before_anything(tmp_path, monkeypatch):
    import psutil

    ram = psutil.virtual_memory().total
    nvme = tmp_path / "swap"
    nvme.mkdir()
    cfg = {"memory": {"host_budget": ram + (1 << 30), "nvme_dir": str(nvme)}}
    model = parity.build()
    with pytest.raises(ConfigError, match=r"memory.host_budget: .* is more than the .* of RAM"):
        hetero.initialize(model, parity.make_optimizer(model), cfg)
    assert list(nvme.iterdir()) == []  # nothing was made
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match=r"x 8 ranks on this node is more than"):
        ChunkManager(host_budget=ram // 4)
    with pytest.raises(ConfigError, match=r"memory.nvme_budget: .* free in"):
        ChunkManager(nvme_dir=str(nvme), nvme_budget=1 << 60)


def test_out_of_memory_names_the_tensor_and_the_budget_and_never_nvme_dir_when_set(tmp_path):
    with ChunkManager(device_budget=1 << 20, host_budget=64 << 10, nvme_dir=str(tmp_path)) as m:
        big = m.new_chunk(dtype=torch.float32, capacity=32 << 10, kind="optim")  # 128 KiB: more than the host
        slot = big.add_tensor("model.embed_tokens.weight..master", (32 << 10,))
        with pytest.raises(TierOutOfMemoryError) as err:
            m.access(big, Tier.HOST)
        msg = str(err.value)
        assert "model.embed_tokens.weight" in msg and "would have been enough" in msg and "128.00 KiB" in msg
        assert "nvme_dir" not in msg and "chunk_size" in msg and "tiles" in msg
        del slot
    with ChunkManager(device_budget=1 << 20, host_budget=64 << 10) as m:
        c = m.new_chunk(dtype=torch.float32, capacity=8 << 10, kind="grad")
        s = c.add_tensor("g", (8 << 10,))
        m.access(c, Tier.HOST)
        c.set_state(s, TensorState.HOLD)
        m.pin(c)
        c2 = m.new_chunk(dtype=torch.float32, capacity=12 << 10, kind="grad")
        c2.add_tensor("h", (12 << 10,))
        with pytest.raises(TierOutOfMemoryError, match=r"set memory.nvme_dir") as err:
            m.access(c2, Tier.HOST)
        # What it holds (32), the request (48) and room for one move of the largest (48): [Note: the host's figure].
        assert "128.00 KiB would have been enough" in str(err.value)
        m.unpin(c)


def test_padding_of_small_hugging_face_shapes_and_the_estimate_keys():
    pytest.importorskip("transformers")
    import argparse
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks import padding

    args = argparse.Namespace(world_size=8, device_budget=None, host_budget=None)
    for model in padding.MODELS:
        if model[1] in ("124M", "125M", "160M"):
            r = padding.row(*model, args)
            assert r["padding"] <= padding.TARGET, r
    est = hetero.estimate(parity.build(), {"zero_stage": 3}, machine=False)
    d = json.loads(json.dumps(est.to_dict()))  # tools/estimate.py --json prints this object
    assert d["n_params"] == sum(p.numel() for p in parity.build().parameters()) and d["chunk_elements"] >= d["n_params"]


_HEAP_PROBE = """
import torch
from hetero.memory import ChunkManager

def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) << 10

ChunkManager(device_budget=1 << 20, host_budget=1 << 20).close()
warm = torch.ones(8 << 20, dtype=torch.uint8)
del warm  # glibc's dynamic threshold rises to 8 MiB here unless it was fixed
before = rss()
big, small = [], []
for _ in range(24):  # 8 MiB buffers interleaved with small ones that stay: holes if the buffers came from the heap
    big.append(torch.ones(8 << 20, dtype=torch.uint8))
    small.append(torch.ones(64 << 10, dtype=torch.uint8))
held = rss() - before
del big
print(held, rss() - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS (Linux)")
def test_freed_buffers_leave_the_process(cpu_device):
    """[Note: the heap keeps what the budgets free]: with malloc's threshold fixed (HETERO_MALLOC_MMAP_THRESHOLD), 192
    MiB of freed buffers go back to the system; with glibc's own dynamic threshold (the default) they stay resident.
    The C heap of a process on the CPU device: the probe runs with the GPUs hidden, so its manager takes the CPU and
    no CUDA driver or context (its threads, its own host memory) is in the process whose RSS is measured."""
    import subprocess
    import sys

    def kept(env: dict) -> int:
        env = {k: v for k, v in cpu_ranks_env({**os.environ, **env}).items() if k != "MALLOC_MMAP_THRESHOLD_"}
        out = subprocess.run([sys.executable, "-c", _HEAP_PROBE], env=env, capture_output=True, text=True, check=True)
        held, after = (int(v) for v in out.stdout.split()[-2:])
        if held < 160 << 20:  # 192 MiB written and held: a VmRSS that does not show them cannot show them freed
            pytest.skip(f"VmRSS grew by {held >> 20} MiB for 192 MiB held: this machine does not count them")
        return after

    assert kept({"HETERO_MALLOC_MMAP_THRESHOLD": str(1 << 20)}) < 16 << 20  # the small buffers (1.5 MiB) and noise
    default = kept({})
    if default < 16 << 20:
        # Seen on one H100's image (glibc 2.39, torch 2.11.0+cu130): freed buffers left the process without the
        # knob too, so there the knob has nothing to change; on glibc 2.36 (this project's CI) they stay.
        pytest.skip(f"this process's allocator returned the freed buffers without the knob ({default >> 20} MiB kept)")
    assert default > 128 << 20  # the knob is what returns them
    assert kept({"HETERO_MALLOC_MMAP_THRESHOLD": "0"}) > 128 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_tiles_without_nonzero_give_the_same_rows_and_gradients(dtype):
    """On a GPU the tiled embedding finds its rows with no `nonzero` (a wait for the GPU): lookups clamped into the
    tile and a select, gradients with zero rows added. Both ways give the same bits, tile by tile."""
    from hetero.zero.tile_rows import embedding_grad_rows, embedding_rows

    torch.manual_seed(0)
    vocab, dim, n = 50, 8, 200
    weight = torch.randn(vocab, dim).to(dtype)
    ids = torch.randint(0, vocab, (n,))
    ids[:5] = torch.tensor([0, 19, 20, 39, 49])  # the tiles' edges
    dy = torch.randn(n, dim).to(dtype)
    outs, grads = [], []
    for sync_free in (False, True):
        out = torch.zeros(n, dim, dtype=dtype)
        tile_grads = []
        for lo in (0, 20, 40):  # three tiles of 20, 20 and 10 rows
            w = weight[lo : lo + 20]
            out = embedding_rows(out, w, ids, lo, sync_free=sync_free)
            g = torch.zeros_like(w)
            tile_grads.append(embedding_grad_rows(g, dy, ids, lo, sync_free=sync_free))
        outs.append(out)
        grads.append(torch.cat(tile_grads))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], torch.nn.functional.embedding(ids, weight))
    assert torch.equal(grads[0], grads[1])
    expected = torch.zeros(vocab, dim, dtype=torch.float64).index_add_(0, ids, dy.double())
    torch.testing.assert_close(grads[0].double(), expected, rtol=0.02 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
