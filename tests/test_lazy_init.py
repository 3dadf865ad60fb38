"""Models built on the meta device are initialised straight into chunks, as their own initialiser would have made
them; pretrained weights stream in from safetensors; peak host memory while initialising a model larger than the
host budget stays near the budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import hetero
from hetero.models.gpt import GPT, GPTConfig
from tests import tolerance
from tests.dist import ONLY_SEVERAL, ranks_apart, run_distributed
from tests.parity import GPT_CFG, batches, cached_reference, make_optimizer

transformers = pytest.importorskip("transformers")


def _plain() -> nn.Module:
    # A plain module tree: default torch inits, a nested container, batch-norm buffers.
    return nn.Sequential(
        nn.Embedding(32, 16),
        nn.Linear(16, 32),
        nn.GELU(),
        nn.Sequential(nn.Linear(32, 16), nn.LayerNorm(16)),
        nn.Linear(16, 32),
    )


def _llama(tie: bool = True) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(cfg)


def _gpt() -> nn.Module:
    return GPT(GPTConfig(**GPT_CFG))


BUILDERS = {"gpt": _gpt, "plain": _plain, "llama": _llama}


def _build(kind: str, meta: bool) -> nn.Module:
    torch.manual_seed(0)
    if meta:
        with hetero.lazy_init():
            model = BUILDERS[kind]()
        assert all(p.is_meta for p in model.parameters())
        return model
    return BUILDERS[kind]()


def _loss(kind: str, model, ids: torch.Tensor) -> torch.Tensor:
    if kind == "gpt":
        return model(ids[:, :-1], labels=ids[:, 1:]).loss
    if kind == "llama":
        return model(input_ids=ids, labels=ids).loss
    return model(ids).float().pow(2).mean()


def _train(
    kind: str, model, config: dict | None, steps: int = 3, device: torch.device | str = "cpu"
) -> tuple[list[float], dict, torch.device]:
    """Losses per step, the first values (CPU tensors) and the device it ran on: hetero's engine with `config`, or
    plain PyTorch (config None) on `device`."""
    if config is None:
        first = {k: v.clone() for k, v in model.state_dict().items()}  # as built, on the CPU
        model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    runner = hetero.initialize(model, opt, {"chunk_size": 2048, **config}) if config is not None else model
    if config is not None:
        first, device = runner.full_state_dict(), runner.device.torch_device
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 32, (2, 9), generator=g)
        loss = _loss(kind, runner, ids if config is not None else ids.to(device))
        if config is None:
            loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            runner.backward(loss)
            runner.step()
        losses.append(loss.item())
    if config is not None:
        runner.close()
    return losses, first, torch.device(device)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_meta_model_trains_like_normally_built(kind):
    """The losses are checked as tests/tolerance.py checks them: within 8x plain PyTorch's fp32 distance from the
    float64 run. Plain PyTorch runs on the engine's device: its distance is the scale of the rounding of the kernels
    hetero ran (on a GPU: cuBLAS, CUDA's LayerNorm and GELU, other reduction orders), not of the CPU's. The plain
    model's loss, the mean square of its output, does not average a consistent rounding bias of a kernel away (two
    ulps of relative bias on every layer's output take its losses to 0.85 of that bound on the CPU, the GPT's to 0.06)
    and the CPU's fp32 lands within an ulp of the float64 losses, so a bound from the CPU leaves a GPU little room."""
    exact_losses, _, _ = _train(kind, _build(kind, meta=False).double(), None)  # exact on any device: the CPU
    plain: dict[torch.device, tuple[list[float], dict, torch.device]] = {}
    for cfg in ({"zero_stage": 0}, {"zero_stage": 3, "offload": {"params": "host", "optimizer": "host"}}):
        losses, first, device = _train(kind, _build(kind, meta=True), cfg)
        if device not in plain:
            plain[device] = _train(kind, _build(kind, meta=False), None, device=device)
        ref_losses, ref_first, _ = plain[device]
        # The same initialiser consuming the same random numbers: bit-identical first values, buffers included.
        assert first.keys() == ref_first.keys()
        for k, v in ref_first.items():
            assert torch.equal(first[k].float(), v.float()), f"{kind} {cfg}: {k} differs from normal construction"
        tolerance.assert_losses(losses, exact_losses, ref_losses, dtype=torch.float32)


def test_meta_tied_weights_stay_tied():
    model = _build("llama", meta=True)
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"chunk_size": 2048})
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    # The non-persistent rotary tables (not in state_dict) were computed as normal construction computes them.
    normal = _build("llama", meta=False).model.rotary_emb
    assert torch.equal(model.model.rotary_emb.inv_freq.cpu(), normal.inv_freq)
    assert torch.equal(model.model.rotary_emb.original_inv_freq.cpu(), normal.original_inv_freq)
    engine.close()


def _rank_meta(rank: int, world: int) -> dict:
    cfg = {"zero_stage": 3, "chunk_size": 4096, "offload": {"params": "host", "optimizer": "host"}}
    # Ranks seeded differently would start from different weights: caught, as nothing is broadcast.
    torch.manual_seed(rank)
    with hetero.lazy_init():
        model = GPT(GPTConfig(**GPT_CFG))
    try:
        hetero.initialize(model, make_optimizer(model), cfg)
        error = None
    except hetero.WeightsError as e:
        error = str(e)
    # Rank 0 alone with real values (FSDP's sync_module_states idiom): each way of filling the chunks has its own
    # collectives, so every rank stops with the same error before any of them.
    torch.manual_seed(0)
    if rank == 0:
        model = GPT(GPTConfig(**GPT_CFG))
    else:
        with hetero.lazy_init():
            model = GPT(GPTConfig(**GPT_CFG))
    try:
        hetero.initialize(model, make_optimizer(model), {**cfg, "comm_timeout": 60})
        mixed = None
    except hetero.WeightsError as e:
        mixed = str(e)
    torch.manual_seed(0)
    with hetero.lazy_init():
        model = GPT(GPTConfig(**GPT_CFG))
    engine = hetero.initialize(model, make_optimizer(model), cfg)
    host = engine.memory_stats()["host"]["current"]
    rows, local = 4, 2
    losses = []
    for x, y in batches(3, rows):
        loss = engine(x[rank * local : (rank + 1) * local], labels=y[rank * local : (rank + 1) * local]).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        engine.comm.control.all_reduce(t, op="avg")
        losses.append(t.item())
    # At stage 3 a gradient chunk holds nothing until its first reduce-scatter: the share is shards and states.
    share = sum((zc.shard.nbytes if zc.shard is not None else 0) + zc.optim.nbytes for zc in engine.chunks)
    engine.close()
    return {"losses": losses, "host": host, "share": share, "error": error, "mixed": mixed}


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(240)
def test_meta_world_two_keeps_shards_and_matches_reference():
    exact, _ = cached_reference("fp64", steps=3, rows=4)
    plain, _ = cached_reference("fp32", steps=3, rows=4)
    for r in run_distributed(_rank_meta, 2, timeout=200):
        assert r["error"] is not None and "seed every rank the same" in r["error"]
        assert r["mixed"] is not None and "rank 0 built it with real values; rank 1 built it on the meta" in r["mixed"]
        tolerance.assert_losses(r["losses"], exact, plain, dtype=torch.float32)
        assert r["host"] == r["share"]  # after initialisation each rank holds its shards only: staging is freed


def test_initialiser_gaps_are_errors():
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))  # set in __init__ only: on meta it never gets a value
            self.lin = nn.Linear(4, 4)

    with hetero.lazy_init():
        model = Custom()
    with pytest.raises(hetero.WeightsError, match="never wrote parameters.*scale"):
        hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))


# ---- pretrained weights -------------------------------------------------------------------------------------
def test_weights_stream_from_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    src = _build("llama", meta=False)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p))  # not what the initialiser would give
    state = {k: v.contiguous() for k, v in src.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
    # Hugging Face's sharded layout: two files and an index naming which holds what.
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for fname, ks in shards.items():
        safetensors_torch.save_file({k: state[k] for k in ks}, str(tmp_path / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for stage in (0, 3):
        model = _build("llama", meta=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = hetero.initialize(model, opt, {"zero_stage": stage, "chunk_size": 2048}, weights=tmp_path)
        got = engine.full_state_dict()
        for k, v in src.state_dict().items():
            assert torch.equal(got[k], v), k
        engine.close()

    # Mismatches are reported together, before anything is loaded.
    bad = dict(state)
    bad["extra.weight"] = torch.zeros(2)
    bad["model.norm.weight"] = torch.zeros(3)
    del bad["model.layers.0.mlp.up_proj.weight"]
    safetensors_torch.save_file(bad, str(tmp_path / "bad.safetensors"))
    model = _build("llama", meta=True)
    with pytest.raises(hetero.WeightsError) as err:
        hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), weights=tmp_path / "bad.safetensors")
    msg = str(err.value)
    assert "model.layers.0.mlp.up_proj.weight" in msg and "extra.weight" in msg and "model.norm.weight" in msg


# ---- peak host memory ---------------------------------------------------------------------------------------
_PEAK_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, torch
    import hetero
    from hetero.models.gpt import GPT, GPTConfig
    torch.set_num_threads(1)
    nvme_dir, budget, device_budget, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    with hetero.lazy_init():
        model = GPT(GPTConfig(vocab_size=256, n_layer=8, n_head=8, n_embd=512, block_size=64, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB; the high-water mark so far
    engine = hetero.initialize(model, opt, {
        "zero_stage": 3, "chunk_size": chunk, "offload": {"params": "nvme", "optimizer": "nvme"},
        "memory": {"host_budget": budget, "device_budget": device_budget, "nvme_dir": nvme_dir},
    })
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    n = sum(p.numel() for p in model.parameters())
    stats = engine.memory_stats()
    print(json.dumps({"params": n, "grew": peak - base, "host_peak": stats["host"]["peak"],
                      "device_peak": stats["device"]["peak"]}))
    engine.close()
    """
)
# What the interpreter, torch's allocator and hetero's threads may add beyond the ledgers while initialising.
_ALLOWANCE = 48 << 20


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss units are Linux's")
@pytest.mark.timeout(240)
def test_peak_host_memory_of_lazy_init_stays_near_budget(tmp_path):
    budget, device_budget, chunk = 32 << 20, 16 << 20, 1 << 20  # chunk: 1M elements, 4 MiB of fp32
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path), str(budget), str(device_budget), str(chunk)],
        capture_output=True,
        text=True,
        timeout=220,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    states = 16 * r["params"]  # fp32 params + master + two Adam moments... the model's training states
    assert states > 8 * (budget + device_budget)  # the model is far bigger than the memory it may use
    assert r["host_peak"] <= budget and r["device_peak"] <= device_budget
    # On the CPU the "device" tier is RAM as well: both budgets, one chunk of staging slack, the allowance.
    limit = budget + device_budget + 4 * chunk + _ALLOWANCE
    assert r["grew"] < limit, f"peak RSS grew {r['grew'] / 2**20:.1f} MiB, limit {limit / 2**20:.1f} MiB"


@pytest.mark.timeout(120)
def test_a_model_module_imported_first_inside_lazy_init_imports():
    """transformers imports a model's module on first use, so its first `LlamaForCausalLM` is often inside
    `hetero.lazy_init()`, and with it torch's dynamo (GenerationMixin); torch 2.6's dynamo failed to import on the
    meta device. A fresh interpreter, so that nothing imported dynamo before."""
    code = "import hetero\nwith hetero.lazy_init():\n    import torch._dynamo\nprint('imported')\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr[-3000:]


class _ZeroedOut(nn.Module):
    """A parent whose reset_parameters (at the end of its __init__, after its children's) zeroes one child weight."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.out.weight)  # the residual projection starts at zero; its bias keeps torch's default


class _TiedLM(nn.Module):
    """A weight tied at construction: one module's own default weight is drawn, then replaced by the other's."""

    def __init__(self, head_makes_it: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Sequential(_ZeroedOut(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 16)
        if head_makes_it:
            self.emb.weight = self.head.weight  # nanoGPT's direction: the later module's weight is kept
        else:
            self.head.weight = self.emb.weight  # Hugging Face's direction: the earlier module's


@pytest.mark.parametrize("stage,chunk,head_makes_it", [(0, 4096, False), (3, 128, False), (0, 4096, True)])
def test_meta_reset_walk_keeps_what_normal_construction_keeps(stage, chunk, head_makes_it):
    """Module order runs a parent's reset_parameters before its children's, and both tied modules' in module order;
    normal construction keeps the parent's writes (it ran last) and the values of the module that made the tied
    weight (lazy_init saw which). The other calls still draw their numbers, so every other tensor is bit-identical
    too."""
    torch.manual_seed(0)
    plain = _TiedLM(head_makes_it)
    torch.manual_seed(0)
    with hetero.lazy_init():
        model = _TiedLM(head_makes_it)
    # One chunk: the later calls overwrote the values (silently); 128 elements: the tied weight's chunk had loaded
    # before the head wrote it (an error).
    config = {"zero_stage": stage, "chunk_size": chunk}
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    got = engine.full_state_dict()
    assert got.keys() == plain.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(got[k], v), f"{k} differs from normal construction"
    assert not got["mid.0.out.weight"].any()
    assert model.head.weight is model.emb.weight
    engine.close()


class _Classifier(nn.Module):
    """The user's own module around a Hugging Face base model: a new head, as on a reward model."""

    def __init__(self, family: str) -> None:
        super().__init__()
        sizes = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
        if family == "Llama":
            sizes.update(num_key_value_heads=1, max_position_embeddings=32)
        cfg = getattr(transformers, f"{family}Config")(**sizes)
        self.backbone = getattr(transformers, f"{family}Model")(cfg)
        self.head = nn.Linear(16, 3)


@pytest.mark.parametrize("family", ["Llama", "Bert"])
def test_meta_hf_model_inside_the_users_module(family):
    """The backbone replays its own Hugging Face initialiser (_init_weights, then tying) where it sits in the tree,
    and the head its reset_parameters after it, as normal construction ran them: bit-identical values. Before, only
    a Hugging Face model at the root did; inside, Llama's RMSNorm weights (no reset_parameters) were never written
    and BERT's position_ids buffer never set."""
    torch.manual_seed(0)
    plain = _Classifier(family)
    torch.manual_seed(0)
    with hetero.lazy_init():
        model = _Classifier(family)
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"chunk_size": 2048})
    got = engine.full_state_dict()
    assert got.keys() == plain.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(got[k], v), f"{k} differs from normal construction"
    for name, b in plain.named_buffers():  # the non-persistent ones too (Llama's rotary tables)
        assert torch.equal(model.get_buffer(name).cpu(), b), name
    engine.close()
