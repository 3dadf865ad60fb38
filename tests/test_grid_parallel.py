"""Grid tensor parallelism (2D, 2.5D, 3D) and the sequence-split modes (Ulysses, ring) through `hetero.initialize`:
the same losses, global gradient norm (clipping included) and weights after several AdamW steps as plain PyTorch on
the whole batch, for Hugging Face Llama and GPT-2 built from configs (and the pipelineable GPTPipe for the
pipeline, under every schedule, Ulysses and ring included); every layout's blocks cover each parameter exactly
once; checkpoints of 2D, 2.5D, 3D, Ulysses and ring resume bit-exactly and consolidate to the plain model's
state_dict; offloaded states (host, NVMe) train to the same weights under every mode; each rank's ledgers equal the
estimator's bytes under grid and sequence modes with a pipeline; ring attention's causal work is balanced; bad
layouts fail clearly before anything changes."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from hetero.config import ParallelConfig
from hetero.errors import ConfigError
from hetero.models.gpt import GPT, GPTConfig
from hetero.models.gpt_pipe import TP_PLAN
from hetero.parallel import unshard
from hetero.parallel.grid import Grid, apply_grid_parallel
from hetero.parallel.ring import _pairs
from tests.dist import NEEDS_DEGREES, RANKS_DIFFER, ranks_apart

try:
    from tests import grid_parity, pipe_parity, test_checkpoint_parallel, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import grid_parity  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]
    import test_checkpoint_parallel  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

transformers = pytest.importorskip("transformers")

MODES = [("2d", 4, None), ("2.5d", 8, 2), ("3d", 8, None)]


# ---- layouts, without processes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, tensor, depth", MODES, ids=[m for m, _, _ in MODES])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_blocks_cover_every_parameter_once(family, mode, tensor, depth):
    """Each rank's blocks, cut with the shape-only grid of its place, join back into every full parameter; blocks of
    different places never overlap (each element is held by exactly `replicas` ranks); parameter names and
    state_dict keys are unchanged."""
    full = grid_parity.build(family)
    names = [n for n, _ in full.named_parameters()]
    shards: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    cuts: dict[str, object] = {}
    for rank in range(tensor):
        model = copy.deepcopy(full)
        apply_grid_parallel(model, "auto", Grid.shape_only(mode, tensor, depth, rank))
        assert [n for n, _ in model.named_parameters()] == names
        assert list(model.state_dict()) == list(full.state_dict())
        for n, p in model.named_parameters():
            cut = p._hetero_tp
            assert tuple(p.shape) == cut.local_shape(), n
            shards[n].append(p.detach().clone())
            cuts[n] = cut
    for n, p in full.named_parameters():
        cut = cuts[n]
        torch.testing.assert_close(cut.join(shards[n]), p.detach(), rtol=0, atol=0, msg=n)
        held = torch.zeros(cut.full_shape)
        for r in range(tensor):
            for s in cut._slices(r):
                held[s] += 1
        assert bool((held == cut.replicas).all()), n  # 2.5D: depth layers hold the same blocks
    assert cut.replicas == (depth or 1)


def test_grid_errors_before_anything_changes():
    grid = Grid.shape_only("2d", 4, rank=1)
    # a module with parameters that no style partitions
    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=32, block_size=8))
    model.extra = nn.Linear(32, 32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"extra \(Linear\) holds parameters but no tensor_plan style partitions"):
        apply_grid_parallel(model, "auto", grid)
    # a width the grid does not divide: the norms' vectors are cut q x q = 4 ways
    odd = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=18, block_size=8))
    with pytest.raises(ConfigError, match=r"does not divide into 4 blocks, as tensor_mode '2d' with q = 2"):
        apply_grid_parallel(odd, "auto", grid)
    # heads that do not divide by q
    three = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=3, n_embd=24, block_size=8))
    with pytest.raises(ConfigError, match="n_head = 3 does not divide by the tensor-parallel degree 2"):
        apply_grid_parallel(three, "auto", grid)

    class Scale(nn.Module):  # a norm hetero does not know
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(32))

    unknown = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=32, block_size=8))
    unknown.ln_f = Scale()
    with pytest.raises(ConfigError, match="ln_f is a Scale: tensor_mode '2d' knows nn.LayerNorm and RMS norms"):
        apply_grid_parallel(unknown, "auto", grid)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]) and not hasattr(v, "_hetero_tp")
    assert all(not hasattr(p, "_hetero_tp") for m in (odd, three, unknown) for p in m.parameters())
    # degrees and modes, at the config's edge
    for kwargs, message in [
        ({"tensor": 8, "tensor_mode": "2d"}, r"tensor = 8 does not fit tensor_mode '2d': it must be q\^2"),
        ({"tensor": 4, "tensor_mode": "3d"}, r"tensor = 4 does not fit tensor_mode '3d': it must be q\^3"),
        ({"tensor": 8, "tensor_mode": "2.5d"}, "tensor_mode '2.5d' needs an integer depth"),
        ({"tensor": 12, "tensor_mode": "2.5d", "tensor_depth": 2}, r"q\^2 x tensor_depth 2"),
        ({"tensor": 4, "tensor_mode": "2d", "tensor_depth": 2}, "applies to tensor_mode '2.5d' only"),
        ({"tensor": 4, "tensor_mode": "2D"}, "did you mean '2d'"),
        ({"tensor": 4, "tensor_mode": "2d", "sequence": True}, "grid modes cut the batch, not the sequence"),
        ({"tensor": 4, "sequence": "rign"}, "did you mean 'ring'"),
        ({"tensor": 1, "sequence": "ulysses"}, "set tensor > 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            ParallelConfig(**kwargs)
    assert ParallelConfig(tensor=2, sequence=True).sequence == "megatron"  # true keeps meaning Megatron-SP
    assert ParallelConfig(tensor=2, sequence="ring", pipeline=2).split_sequence  # each stage splits the sequence
    # a split region's bounds are checked on the whole model's plan, before the pipeline cuts it
    from hetero.parallel.seq_split import check_regions

    with pytest.raises(ConfigError, match="needs a plan with a 'sequence_scatter' module"):
        check_regions({"layers.0.attn": "heads", "head.ln_f": "norm+sequence_gather"})
    check_regions({"embed.drop": "sequence_scatter", "layers.0.attn": "heads", "head.ln_f": "norm+sequence_gather"})


def test_a_fused_width_and_a_batch_the_grid_cannot_cut_are_config_errors():
    """A fused q/k/v projection's width must divide into 3 x q (it was floored to its thirds first: 98 outputs passed
    as 3 x 32, and the last 2 rows were dropped from every block); a batch of rows the grid cannot cut is a
    ConfigError saying what to feed (it was a bare ValueError from inside the embedding)."""

    class Fused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out = nn.Linear(32, 98), nn.Linear(98, 32)

    fused = Fused()
    with pytest.raises(
        ConfigError, match=r"qkv.weight: dimension 0 of shape \(98, 32\) does not divide into 3 parts x 2"
    ):
        apply_grid_parallel(fused, {"qkv": "colwise_qkv", "out": "rowwise"}, Grid.shape_only("2d", 4, rank=1))
    assert not hasattr(fused.qkv.weight, "_hetero_tp")
    model = grid_parity.build("llama")
    apply_grid_parallel(model, "auto", Grid.shape_only("2.5d", 8, 2, rank=5))
    with pytest.raises(ConfigError, match="cuts the batch into 4 parts, the input ids: 6 rows; give each data-paral"):
        model(torch.zeros(6, grid_parity.SEQ, dtype=torch.long))


def _padded_batch(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Rows 1 and 2 left-padded: a mask, positions counted from each row's first token, padding ignored by the loss."""
    x = torch.randint(1, grid_parity.VOCAB, (4, grid_parity.SEQ), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(x)
    mask[1, :3] = mask[2, :5] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return x.masked_fill(mask == 0, 0), mask, positions, x.masked_fill(mask == 0, -100)


def _padded_loss(model: nn.Module, positions: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and gradients of the padded batch, with its positions given or left to the model (counted from 0)."""
    x, mask, pos, y = _padded_batch()
    model.zero_grad()
    loss = model(x, attention_mask=mask, position_ids=pos if positions else None, labels=y).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _padded_job(rank: int, world: int, family: str) -> dict:
    from hetero.comm import Comm

    torch.set_num_threads(1)
    model = grid_parity.build(family)
    apply_grid_parallel(model, "auto", Grid.build(Comm.world(), "2d"))
    out: dict = {p: _padded_loss(model, p) for p in (False, True)}
    out["cuts"] = {n: p._hetero_tp for n, p in model.named_parameters()}
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_padded_batch_on_a_2d_grid_matches_the_plain_model(family, cpu_device):  # no engine: CPU tensors, CPU ranks
    """A padded batch's attention mask and position ids, given for the whole batch, are cut with it: the loss and
    every gradient are plain PyTorch's (within fp32's own distance from float64). The mask used to be read from its
    first b/B rows on every rank (another loss, with no error), and positions failed inside the model."""
    results = run_distributed(_padded_job, 4, family, timeout=170)
    for positions in (False, True):
        exact_loss, exact = _padded_loss(grid_parity.build(family).to(torch.float64), positions)
        plain_loss, plain = _padded_loss(grid_parity.build(family), positions)
        for r in results:
            tolerance.assert_losses([r[positions][0]], [exact_loss], [plain_loss], dtype=torch.float32)
        joined = {n: cut.join([r[positions][1][n] for r in results]) for n, cut in results[0]["cuts"].items()}
        assert joined.keys() == exact.keys()
        tolerance.assert_weights(joined, exact, plain, dtype=torch.float32)


def _gemma(family: str) -> nn.Module:
    """A tiny Gemma (1 or 2), its weights moved off their init (Gemma's norm weights start at 0, read as 1 + w)."""
    torch.manual_seed(0)
    kind = {"gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM)}
    kind["gemma2"] = (transformers.Gemma2Config, transformers.Gemma2ForCausalLM)
    config, cls = kind[family]
    model = cls(
        config(
            vocab_size=grid_parity.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=16,
        )
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _gemma_loss(model: nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    x = torch.randint(0, grid_parity.VOCAB, (4, grid_parity.SEQ), generator=torch.Generator().manual_seed(5))
    loss = model(x, labels=x).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _gemma_job(rank: int, world: int, family: str) -> dict:
    from hetero.comm import Comm

    torch.set_num_threads(1)
    model = _gemma(family)
    apply_grid_parallel(model, "auto", Grid.build(Comm.world(), "2d"))
    loss, grads = _gemma_loss(model)
    return {"loss": loss, "grads": grads, "cuts": {n: p._hetero_tp for n, p in model.named_parameters()}}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", ["gemma", "gemma2"])
def test_gemma_on_a_2d_grid_matches_the_plain_model(family, cpu_device):  # no engine: CPU tensors, CPU ranks
    """Gemma's RMS norms scale by (1 + weight) and its embedding by sqrt(hidden): the grid's norm used weight alone
    and its lookup skipped the class's scale, another loss with no error. Now the loss and every gradient are plain
    PyTorch's (within fp32's own distance from float64)."""
    results = run_distributed(_gemma_job, 4, family, timeout=170)
    exact_loss, exact = _gemma_loss(_gemma(family).to(torch.float64))
    plain_loss, plain = _gemma_loss(_gemma(family))
    for r in results:
        tolerance.assert_losses([r["loss"]], [exact_loss], [plain_loss], dtype=torch.float32)
    joined = {n: cut.join([r["grads"][n] for r in results]) for n, cut in results[0]["cuts"].items()}
    tolerance.assert_weights(joined, exact, plain, dtype=torch.float32)


def test_an_rms_norm_the_grid_does_not_compute_is_refused():
    """A module named like an RMS norm whose output is neither Llama's nor Gemma's norm is a ConfigError."""

    class OddRMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    model = grid_parity.build("llama")
    model.model.norm = OddRMSNorm()
    with pytest.raises(ConfigError, match=r"model.norm is a OddRMSNorm whose output is neither x / rms\(x\) \* weight"):
        apply_grid_parallel(model, "auto", Grid.shape_only("2d", 4, rank=0))


def _stage_job(rank: int, world: int) -> str:
    """initialize a one-layer Llama whose MLP width (49) a 2D grid cannot cut, over pipeline 2 x 2D (q = 2): the
    layer is on stage 0, the norm and head on stage 1."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=49, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    parallel = {"tensor": 4, "tensor_mode": "2d", "pipeline": 2, "microbatches": 2, "pipeline_split": "params"}
    import hetero

    try:
        engine = hetero.initialize(model, None, {"zero_stage": 1, "parallel": parallel})
    except ConfigError as err:
        return str(err)
    engine.close()
    return "initialized"


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
def test_a_width_the_grid_cannot_cut_stops_every_pipeline_stage():
    """The grid's checks run on the whole model before the pipeline cuts it: the stage without the layer used to
    initialize, and go on to wait for the stage that raised."""
    for r in run_distributed(_stage_job, 8, timeout=170):
        assert r.startswith("model.layers.0.mlp.gate_proj.weight: dimension 0 of shape (49, 32)"), r


def _replicas_job(rank: int, world: int) -> str:
    """A 2D grid over 4 ranks whose copies of the model differ: ranks 0 and 1 built it from seed 0, ranks 2 and 3
    from seed 1 (two of the grid's rows, each row alike)."""
    from hetero.comm import Comm

    torch.set_num_threads(1)
    model = grid_parity.build("llama", seed=rank // 2)
    grid = Grid.build(Comm.world(), "2d")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"different values of \d+ parameters \(model\.embed_tokens\.weight, "):
        apply_grid_parallel(model, "auto", grid)
    for k, v in model.state_dict().items():  # refused before anything was cut
        assert torch.equal(v, before[k]), k
    assert not any(hasattr(p, "_hetero_tp") for p in model.parameters())
    return "refused"


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(200)
def test_a_grid_of_models_built_differently_is_refused():
    """Each rank kept its blocks of its own copy: a grid built from models with different seeds trained one model
    stitched from pieces of several, without an error. 1D refused it; the grid now does too, on every rank."""
    assert run_distributed(_replicas_job, 4, timeout=170) == ["refused"] * 4


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_ring_zigzag_balances_the_causal_triangle(p):
    """Every rank computes two whole blocks' worth per ring step (a triangle is half), and every (query, key) chunk
    pair below the diagonal is computed exactly once, by the rank holding the queries."""
    seen = set()
    for r in range(p):
        for t in range(p):
            src = (r - t) % p
            pairs = _pairs(r, src, p, causal=True)
            assert sum(0.5 if tri else 1.0 for _, _, tri in pairs) == 2.0, (r, t, pairs)
            mine, theirs = (r, 2 * p - 1 - r), (src, 2 * p - 1 - src)
            for i, j, tri in pairs:
                assert (theirs[j] == mine[i]) == tri and theirs[j] <= mine[i]
                seen.add((mine[i], theirs[j]))
    assert seen == {(a, b) for a in range(2 * p) for b in range(a + 1)}


# ---- parity through hetero.initialize ----------------------------------------------------------------------------
GPT_PIPE_2D = {"tensor": 4, "tensor_mode": "2d", "tensor_plan": TP_PLAN, "pipeline": 2, "microbatches": 2}
D2 = {"tensor": 4, "tensor_mode": "2d"}
D25 = {"tensor": 8, "tensor_mode": "2.5d", "tensor_depth": 2}
D3 = {"tensor": 8, "tensor_mode": "3d"}
RING4, RING2, ULYSSES2 = ({"tensor": t, "sequence": m} for t, m in ((4, "ring"), (2, "ring"), (2, "ulysses")))


def _case(family: str, stage: int, parallel: dict, *, clip: bool = False, **extra: object) -> tuple[str, dict]:
    """A parity case: clipping at 0.5 clips (the tiny models' gradient norms are 1.2-1.6)."""
    config = {"zero_stage": stage, "parallel": parallel, **extra}
    if clip:
        config["grad_clip_norm"] = 0.5
    return family, config


WORLD4 = {
    "2d-llama-zero1-clip": _case("llama", 1, D2, clip=True),
    "2d-gpt2-zero3-host": _case("gpt2", 3, D2, offload={"params": "host", "optimizer": "host"}),
    "ring4-llama-zero3-clip": _case("llama", 3, RING4, clip=True),
    "ring4-gpt2-zero3-host": _case("gpt2", 3, RING4, offload={"params": "host", "optimizer": "host"}, _resume=True),
    "ulysses2xdp2-llama-zero1-nvme": _case("llama", 1, ULYSSES2, offload={"optimizer": "nvme"}, _resume=True),
}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(400)
def test_2d_and_ring_on_4_ranks(tmp_path, monkeypatch):
    """Under the CPU stand-in (NCCL's rules: collectives on device memory only; [Note: the CPU stand-in])."""
    monkeypatch.setenv("HETERO_STANDIN", "1")
    cases = copy.deepcopy(WORLD4)
    nvme = {"offload": {"params": "nvme", "optimizer": "nvme"}, "memory": {"nvme_dir": str(tmp_path)}}
    cases["2d-gpt2-zero3-nvme"] = _case("gpt2", 3, D2, **nvme)
    roots = {name: str(tmp_path / name) for name in ("ring4-gpt2-zero3-host", "ulysses2xdp2-llama-zero1-nvme")}
    for name, root in roots.items():
        cases[name][1].update(_checkpoint=root, memory={"nvme_dir": str(tmp_path)})
    results = run_distributed(grid_parity.matrix, 4, list(cases.values()), timeout=360)
    grid_parity.check_all(cases, results)  # parity, offloaded tiers in use, bit-exact resumption
    names = list(cases)
    for name, root in roots.items():
        _check_consolidated(root, cases[name][0], [r[names.index(name)] for r in results])
    assert [r[0]["coords"] for r in results] == [(t, 0, 0) for t in range(4)]  # 2D: the tensor group is the world
    assert [r[2]["coords"] for r in results] == [(0, d, 0) for d in range(4)]  # ring: ZeRO shards over all four
    assert "sp=1/2" in results[1][4]["mesh"] and "sp=0/2" in results[2][4]["mesh"]  # two sequence groups of two


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_ulysses_and_ring_on_2_ranks_zero0_to_2():
    cases = {
        "ulysses2-llama-zero2-clip": _case("llama", 2, ULYSSES2, clip=True),
        "ring2-llama-zero0": _case("llama", 0, RING2),
        "ring2-gpt2-zero1-clip": _case("gpt2", 1, RING2, clip=True),
    }
    results = run_distributed(grid_parity.matrix, 2, list(cases.values()), timeout=240)
    grid_parity.check_all(cases, results)


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(900)
def test_grid_modes_and_compositions_on_8_ranks(tmp_path):
    """2.5D (q=2, d=2) and 3D (q=2) on both families, with host and NVMe offload; 2D x data 2 at ZeRO-3; 2D x
    pipeline 2 under every schedule (1F1B, GPipe, interleaved, Chimera), and 2.5D (q=2, d=1: its depth groups and
    loss on a stage) x pipeline 2 under Chimera, GPipe and the interleaved schedule, each rank's ledgers equal to the
    estimator's bytes for its pipeline rank; 2.5D (blocks replicated over depth, stored once) and 3D checkpoints
    resume bit-exactly and consolidate to the plain model's weights. (2.5D with d=2 and 3D x pipeline 2 take 16
    ranks: the test on 16 ranks below.)"""
    roots = {"2.5d": str(tmp_path / "ckpt25"), "3d": str(tmp_path / "ckpt3")}
    nvme = {"memory": {"nvme_dir": str(tmp_path)}}
    host = {"params": "host", "optimizer": "host"}
    d25_1 = {**GPT_PIPE_2D, "tensor_mode": "2.5d", "tensor_depth": 1, "schedule": "chimera"}
    cases = {
        "2.5d-llama-zero3-clip-host-nvme": _case(
            "llama", 3, D25, clip=True, offload={"params": "host", "optimizer": "nvme"}, **nvme
        ),
        "2.5d-gpt2-zero0-resume": _case("gpt2", 0, D25, _checkpoint=roots["2.5d"], _resume=True),
        "3d-llama-zero2-nvme": _case("llama", 2, D3, offload={"optimizer": "nvme"}, **nvme),
        "3d-gpt2-zero3-clip-host-resume": _case(
            "gpt2", 3, D3, clip=True, offload=host, _checkpoint=roots["3d"], _resume=True
        ),
        "2dxdp2-llama-zero3": _case("llama", 3, D2),
        "2dxdp2-gpt2-zero3-clip": _case("gpt2", 3, D2, clip=True),
        "2dxpp2-1f1b-zero1-clip": _case("gpt_pipe", 1, {**GPT_PIPE_2D, "schedule": "1f1b"}, clip=True, _estimate=True),
        "2dxpp2-gpipe-zero2": _case("gpt_pipe", 2, {**GPT_PIPE_2D, "schedule": "gpipe"}, _estimate=True),
        "2dxpp2-interleaved-zero3-host": _case(
            "gpt_pipe", 3, {**GPT_PIPE_2D, "schedule": "interleaved_1f1b"}, offload=host, _estimate=True
        ),
        "2.5d(d=1)xpp2-chimera-zero2": _case("gpt_pipe", 2, d25_1, _estimate=True),
        "2dxpp2-chimera-zero0": _case("gpt_pipe", 0, {**GPT_PIPE_2D, "schedule": "chimera"}, _estimate=True),
        "2.5d(d=1)xpp2-gpipe-zero3": _case("gpt_pipe", 3, {**d25_1, "schedule": "gpipe"}, _estimate=True),
        "2.5d(d=1)xpp2-interleaved-zero1": _case("gpt_pipe", 1, {**d25_1, "schedule": "interleaved_1f1b"}),
    }
    results = run_distributed(grid_parity.matrix, 8, list(cases.values()), timeout=840)
    grid_parity.check_all(cases, results)
    assert [r[4]["coords"] for r in results] == [(t, d, 0) for d in range(2) for t in range(4)]
    assert [r[6]["coords"] for r in results] == [(t, 0, p) for p in range(2) for t in range(4)]
    _check_consolidated(roots["2.5d"], "gpt2", [r[1] for r in results], blocks=4 + 4)
    _check_consolidated(roots["3d"], "gpt2", [r[3] for r in results], clip=0.5)


SEQ_PIPE = {"tensor": 2, "tensor_plan": TP_PLAN, "pipeline": 2, "microbatches": 2}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(400)
def test_sequence_split_with_a_pipeline_on_4_ranks(tmp_path):
    """Ring and Ulysses (degree 2) inside each of 2 pipeline stages, under 1F1B, the interleaved schedule and
    Chimera, at ZeRO-3 with host offload, ZeRO-1 with the optimizer on NVMe, and ZeRO-2: parity with plain PyTorch;
    every rank's ledgers equal the estimator's bytes for its pipeline rank (ZeRO shards over the sequence ranks);
    a checkpoint resumes bit-exactly and consolidates to the plain model's weights ([Note: the sequence split
    across pipeline stages])."""
    root = str(tmp_path / "ckpt")
    cases = {
        "ring2xpp2-1f1b-zero3-host": _case(
            "gpt_pipe",
            3,
            {**SEQ_PIPE, "sequence": "ring"},
            offload={"params": "host", "optimizer": "host"},
            _estimate=True,
        ),  # fmt: skip
        "ulysses2xpp2-interleaved-zero1-nvme": _case(
            "gpt_pipe",
            1,
            {**SEQ_PIPE, "sequence": "ulysses", "schedule": "interleaved_1f1b"},
            clip=True,
            offload={"optimizer": "nvme"},
            memory={"nvme_dir": str(tmp_path)},
            _estimate=True,
            _checkpoint=root,
            _resume=True,
        ),  # fmt: skip
        "ring2xpp2-chimera-zero2": _case(
            "gpt_pipe", 2, {**SEQ_PIPE, "sequence": "ring", "schedule": "chimera"}, _estimate=True
        ),
    }
    results = run_distributed(grid_parity.matrix, 4, list(cases.values()), timeout=360)
    grid_parity.check_all(cases, results)
    # the sequence ranks are inside the data-parallel group of each stage
    assert [r[0]["coords"] for r in results] == [(0, d, p) for p in range(2) for d in range(2)]
    assert all("sp=" in r[0]["mesh"] for r in results)
    _check_consolidated(root, "gpt_pipe", [r[1] for r in results], clip=0.5)


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.skipif(bool(os.environ.get("HETERO_SKIP_16")), reason="16 processes: HETERO_SKIP_16 is set")
@pytest.mark.timeout(1200)
def test_grid_modes_with_a_pipeline_on_16_ranks(tmp_path):
    """2.5D (q=2, d=2) and 3D (q=2) x pipeline 2, the smallest grids of both, 3D under every schedule: parity,
    ledgers against the estimator, bit-exact resumption and consolidation. Sixteen tiny processes take about 100 s
    on a 2-core machine; HETERO_SKIP_16=1 leaves the test out."""
    root = str(tmp_path / "ckpt")
    d25 = {**GPT_PIPE_2D, "tensor": 8, "tensor_mode": "2.5d", "tensor_depth": 2}
    d3 = {**GPT_PIPE_2D, "tensor": 8, "tensor_mode": "3d", "schedule": "gpipe"}
    cases = {
        "2.5dxpp2-1f1b-zero1-clip-resume": _case(
            "gpt_pipe", 1, d25, clip=True, _estimate=True, _checkpoint=root, _resume=True
        ),
        "3dxpp2-gpipe-zero3-host": _case(
            "gpt_pipe", 3, d3, offload={"params": "host", "optimizer": "host"}, _estimate=True
        ),
        "3dxpp2-interleaved-zero2": _case("gpt_pipe", 2, {**d3, "schedule": "interleaved_1f1b"}, _estimate=True),
        "3dxpp2-chimera-zero1-clip": _case("gpt_pipe", 1, {**d3, "schedule": "chimera"}, clip=True, _estimate=True),
        "3dxpp2-1f1b-zero0": _case("gpt_pipe", 0, {**d3, "schedule": "1f1b"}),
    }
    results = run_distributed(grid_parity.matrix, 16, list(cases.values()), timeout=1140)
    grid_parity.check_all(cases, results)
    assert [r[0]["coords"] for r in results] == [(t, 0, p) for p in range(2) for t in range(8)]
    _check_consolidated(root, "gpt_pipe", [r[0] for r in results], clip=0.5)


def _check_consolidated(
    root: str, family: str, results: list[dict], blocks: int | None = None, clip: float | None = None
) -> None:
    """The consolidated export loads strictly into the plain model and holds, bit for bit, the blocks the tensor
    ranks trained, joined (a grid's blocks or a 1-D tensor cut's; a replicated 2.5D block is stored once: `blocks`
    distinct stored names for wte and ln_f.bias; Ulysses and ring: whole weights, stored whole); those are plain
    PyTorch's weights (tests/tolerance.py). Stages' results are merged (each rank's state holds its stage's
    weights)."""
    from safetensors.torch import load_file

    from hetero.checkpoint import consolidate
    from hetero.checkpoint import manifest as mf

    out = os.path.join(root, "full.safetensors")
    consolidate(root, out)
    state = load_file(out)
    grid_parity.build(family, seed=3).load_state_dict(state, strict=True)  # the plain model's state_dict
    held = [r for r in results if r["state"] is not None]
    for name, value in state.items():
        by_rank = sorted((r for r in held if name in r["state"]), key=lambda r: r["coords"][0])
        cut = by_rank[0]["shards"].get(name)
        saved = by_rank[0]["state"][name] if cut is None else unshard([r["state"][name] for r in by_rank], cut)
        assert torch.equal(value, saved), name
    exact, plain = grid_parity.reference(family, clip, torch.float64)[1], grid_parity.reference(family, clip)[1]
    tolerance.assert_weights(state, exact, plain, dtype=torch.float32)
    if blocks is not None:
        params = mf.read_manifest(mf.resolve(root))["model"]["params"]
        stored = [n for n in params if n.startswith(("transformer.wte.weight@", "transformer.ln_f.bias@"))]
        assert len(stored) == blocks


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_2d_checkpoint_resumes_bit_exactly_and_consolidates(tmp_path):
    """Saved by a 2D grid (q = 2) at ZeRO-1: a fresh engine loads it and continues with bit-identical losses and
    weights; the consolidated export is the plain model's state_dict holding, bit for bit, the blocks the four
    ranks saved, joined; and those are plain PyTorch's weights after the same batches (tests/tolerance.py)."""
    from safetensors.torch import load_file

    from hetero.checkpoint import consolidate

    root = str(tmp_path / "ckpt")
    config = {
        "zero_stage": 1,
        "parallel": {"tensor": 4, "tensor_mode": "2d", "tensor_plan": TP_PLAN, "microbatches": 2},
    }
    results = run_distributed(test_checkpoint_parallel._resume, 4, config, root, timeout=240)
    for r in results:
        assert r["client"] == {"batches": test_checkpoint_parallel.N}
        assert r["saved_equal"] and r["final_equal"], r["coords"]
        assert r["after"] == r["resumed"], (r["coords"], r["after"], r["resumed"])  # bit-exact losses
    out = os.path.join(root, "full.safetensors")
    consolidate(root, out)
    state = load_file(out)
    pipe_parity.build(seed=3).load_state_dict(state, strict=True)  # the plain model's state_dict
    cuts = []
    for rank in range(4):  # each rank's blocks, as the engine cut them
        model = pipe_parity.build()
        apply_grid_parallel(model, TP_PLAN, Grid.shape_only("2d", 4, rank=rank))
        cuts.append({n: p._hetero_tp for n, p in model.named_parameters()})
    by_rank = sorted(results, key=lambda r: r["coords"][0])
    for name, value in state.items():
        joined = cuts[0][name].join([r["state"][name] for r in by_rank])
        assert torch.equal(value, joined), name
    steps, rows = test_checkpoint_parallel.N, test_checkpoint_parallel.ROWS
    exact, plain = pipe_parity.reference(steps, rows, precision="fp64")[1], pipe_parity.reference(steps, rows)[1]
    tolerance.assert_weights(state, exact, plain, dtype=torch.float32)


def test_estimator_counts_each_modes_rank():
    """`hetero.estimate` builds the chunks of tensor rank 0's cut parameters (the same cut the engine applies, here
    with shape-only groups) and shards them over the data-parallel group; activations come from a meta forward
    through the layout's own layers."""
    from hetero.profiler.estimator import estimate

    def run(parallel: dict) -> object:
        return estimate(
            grid_parity.build("llama"),
            {"zero_stage": 1, "chunk_size": 1024, "parallel": parallel},
            world_size=8,
            batch_size=8,
            seq_len=16,
            machine=False,
        )

    whole = run({})
    for parallel, zero_world, share in [
        ({"tensor": 4, "tensor_mode": "2d"}, 2, 4),
        ({"tensor": 8, "tensor_mode": "2.5d", "tensor_depth": 2}, 1, 4),  # replicated over depth
        ({"tensor": 8, "tensor_mode": "3d"}, 1, 8),
        ({"tensor": 4, "sequence": "ring"}, 8, 1),  # weights whole; ZeRO over the sequence ranks too
    ]:
        est = run(parallel)
        assert est.parallel["zero_world"] == zero_world, parallel
        assert est.n_params == whole.n_params  # the whole model, whatever the layout
        assert est.chunk_params * share == whole.n_params, (parallel, est.chunk_params)  # rank 0's cut
        assert 0 < est.bytes("device", "activations") < whole.bytes("device", "activations"), parallel


@pytest.mark.timeout(240)
def test_tp_comm_measures_the_formulas(cpu_device):
    """benchmarks/tp_comm.py on tiny settings, 4 gloo ranks: for 2D and ring every layer's recorded bytes
    (both directions) equal the papers' formulas, and 2D holds a quarter of a layer's parameters. (The full run,
    every mode at 4 and 8 ranks on three models, is the benchmark's.)"""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["--json", "--model", "gpt", "--modes", "2d,ring", "--seq", "16", "--hidden", "32", "--heads", "4"]
    out = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks/tp_comm.py"), *args],
        capture_output=True,
        text=True,
        timeout=230,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert {r["mode"] for r in report["results"]} == {"2d", "ring"}
    for r in report["results"]:
        for phase in ("forward", "backward"):
            assert r[f"{phase}_ratio"] == pytest.approx(1.0, rel=1e-12), (r["mode"], phase, r[f"{phase}_bytes"])
    layer = 12 * 32 * 32 + 9 * 32 + 2 * 2 * 32  # a GPT block's elements: weights, biases (4h + 4h + h), two norms
    assert next(r for r in report["results"] if r["mode"] == "2d")["param_bytes"] == layer // 4 * 4  # fp32, 1/q^2
