"""Tensor parallelism beyond the key/value heads: where a grouped-query attention has fewer key/value heads than
tensor ranks, each rank holds one whole key/value head ([Note: key/value heads replicated over tensor ranks] in
hetero/parallel/kv_replicas.py). Hugging Face Llama (4 query heads, 1 or 2 key/value heads) and Qwen3 (per-head q/k
norms) at tensor degrees 2 and 4, with and without Megatron-SP, and through the engine at ZeRO stages 0-3 with data
parallelism, against plain PyTorch: float64 as the exact run and plain fp32's distance from it as the scale
(tests/tolerance.py, [Note: tolerances from the arithmetic]). Also: the replicas stay the same bits after every
update; checkpoints, consolidation, `full_state_dict` and `save_16bit_model` hold one copy of each head; a
checkpoint resumes in its layout and its consolidated weights load at another degree; the estimator counts a whole
head per rank; what cannot be cut is refused, naming the degrees that work."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hetero
from hetero.comm import Comm
from hetero.errors import ConfigError
from hetero.parallel import apply_tensor_parallel, unshard
from hetero.parallel.plans import auto_plan
from tests.dist import NEEDS_DEGREES, ranks_apart
from tests.plain_loop import train_plain

try:
    from tests import tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, ROWS, STEPS = 64, 8, 8, 3
LR = 1e-3  # Adam turns rounding on near-zero gradients into lr-sized steps: see tests/test_tensor_parallel.py
CHUNK = 4096
F32 = torch.float32


def build(kv: int, family: str = "llama", *, bias: bool = False, seed: int = 0) -> torch.nn.Module:
    """4 query heads of 8 over `kv` key/value heads, 2 layers; Qwen3 normalises q and k per head."""
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv, head_dim=8, max_position_embeddings=16, attention_bias=bias,
    )  # fmt: skip
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        y = x.clone()  # transformers shift the labels themselves
        y[0, 2] = y[-1, 5] = -100
        out.append((x, y))
    return out


_REFERENCES: dict[tuple, Any] = {}


def reference(kv: int, dtype: torch.dtype, *, clip: float | None = None, steps: int = STEPS) -> tuple:
    """Plain PyTorch on the global batches (cached): losses, final weights, the last step's gradient norm."""
    key = (kv, dtype, clip, steps)
    if key not in _REFERENCES:
        model = build(kv).to(dtype)
        opt = optimizer(model)
        _REFERENCES[key] = train_plain(model, opt, batches(steps), clip)
    return _REFERENCES[key]


def first_grads(kv: int, family: str, dtype: torch.dtype) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain PyTorch's loss and gradients on the first batch (biases on, so the replicated biases are checked)."""
    model = build(kv, family, bias=True).to(dtype)
    x, y = batches(1)[0]
    loss = model(x, labels=y).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _same_head(cut: Any, a: int, b: int) -> bool:
    return hasattr(cut, "indices") and cut.indices[a] == cut.indices[b]


# ---- the layout itself, without the engine ---------------------------------------------------------------------
def _direct(rank: int, world: int, cases: list[tuple[str, int, bool]]) -> list[dict]:
    """Each case: apply the auto plan at degree `world`, one forward and backward; the loss, the gradients joined
    over the tensor ranks, whether replicas' gradients are the same bits, and what a rank's attention runs with."""
    torch.set_num_threads(1)
    comm = Comm.world()
    out = []
    for family, kv, sequence in cases:
        model = build(kv, family, bias=True)
        apply_tensor_parallel(model, "auto", comm, sequence=sequence)
        x, y = batches(1)[0]
        loss = model(x, labels=y).loss
        loss.backward()
        grads, replicas_equal, replicated = {}, True, []
        for name, p in model.named_parameters():
            every = comm.all_gather_object(p.grad.detach().clone())
            cut = getattr(p, "_hetero_tp", None)
            grads[name] = every[0] if cut is None else unshard(every, cut)
            if cut is not None and cut.replicas > 1:
                replicated.append(name)
                first = [dataclasses.replace(cut, rank=r).stored_rank for r in range(world)]
                replicas_equal &= all(torch.equal(every[r], every[first[r]]) for r in range(world))
        attn = model.model.layers[0].self_attn
        out.append({
            "loss": loss.item(), "grads": grads, "replicas_equal": replicas_equal, "replicated": replicated,
            "k_shape": tuple(attn.k_proj.weight.shape), "groups": attn.num_key_value_groups,
        })  # fmt: skip
    return out


DIRECT = {
    2: [("llama", 1, False), ("llama", 1, True), ("qwen3", 1, False)],
    4: [("llama", 2, False), ("llama", 1, True), ("qwen3", 2, True)],
}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_replicated_heads_give_the_whole_models_loss_and_gradients(world):
    """Every gradient, joined over the tensor ranks (one copy of each key/value head), is the plain model's within
    fp32's own error, so the sum over a head's replicas is neither missing (each rank alone has the part from its
    query heads) nor doubled; replicas hold the same bits; each rank runs one key/value head for its query heads."""
    results = run_distributed(_direct, world, DIRECT[world], timeout=240)
    for i, (family, kv, _) in enumerate(DIRECT[world]):
        exact_loss, exact = first_grads(kv, family, torch.float64)
        plain_loss, plain = first_grads(kv, family, F32)
        for r in results:
            got = r[i]
            tolerance.assert_losses([got["loss"]], [exact_loss], [plain_loss], dtype=F32)
            assert got["grads"].keys() == plain.keys()
            tolerance.assert_weights(got["grads"], exact, plain, dtype=F32)
            # k_proj and v_proj's weights and biases in both layers: a whole head (8 rows) on every rank
            assert len(got["replicated"]) == 8 and got["replicas_equal"], got["replicated"]
            assert got["k_shape"] == (8, 32) and got["groups"] == 4 // world, (got["k_shape"], got["groups"])


# ---- through the engine ----------------------------------------------------------------------------------------
def _replicas_agree(engine: hetero.Engine, model: torch.nn.Module) -> int:
    """How many replicated tensors this rank's tensor group holds alike, bit for bit, after an update (raises on a
    difference); the local state is collective at stage 3, so every rank calls it."""
    local = engine.local_state_dict()
    cuts = {n: p._hetero_tp for n, p in model.named_parameters() if getattr(p, "_hetero_tp", None) is not None}
    cuts = {n: c for n, c in cuts.items() if c.replicas > 1}
    every = engine.mesh.tp.all_gather_object({n: local[n].detach().clone() for n in cuts})
    for n, cut in cuts.items():
        for r in range(len(every)):
            first = dataclasses.replace(cut, rank=r).stored_rank
            assert torch.equal(every[r][n], every[first][n]), f"{n}: tensor ranks {r} and {first} differ"
    return len(cuts)


def _engine_run(rank: int, world: int, kv: int, config: dict) -> dict:
    """hetero on this rank's rows of each global batch; options (popped): `_checkpoint` a root to save to, then the
    run goes on one batch and a fresh engine loads the checkpoint and takes the same batch; `_estimate`: the
    estimator's model-state bytes against this rank's ledgers."""
    torch.set_num_threads(1)
    torch.manual_seed(1234 + rank)  # the model must not depend on a rank's RNG
    config = copy.deepcopy(config)
    config.setdefault("chunk_size", CHUNK)
    save_to, estimated = config.pop("_checkpoint", None), None
    if config.pop("_estimate", False):
        from hetero.profiler.estimator import estimate

        config.setdefault("prefetch_depth", 0)  # at rest: no chunk of the next step brought up early
        with torch.device("meta"):
            meta = build(kv)
        est = estimate(meta, config, world_size=world, batch_size=ROWS, seq_len=SEQ, optimizer=optimizer(meta),
                       machine=False)  # fmt: skip
        estimated = {t: est.model_state(t) for t in ("device", "host", "nvme")}
    model = build(kv)
    engine = hetero.initialize(model, optimizer(model), config)
    dp, dpr = engine.data_parallel_size, engine.data_parallel_rank
    mine = slice(dpr * ROWS // dp, (dpr + 1) * ROWS // dp)
    losses, agreed = [], []
    for x, y in batches():
        losses.append(float(engine.train_batch(x[mine], y[mine])))
        agreed.append(_replicas_agree(engine, model))
    engine.manager.synchronize()
    ledgers = {t: s["current"] for t, s in engine.memory_stats().items() if t in ("device", "host", "nvme")}
    mesh = engine.mesh
    state = {k: v.float().clone() for k, v in engine.local_state_dict().items()}
    full = engine.full_state_dict()
    out = {
        "losses": losses, "grad_norm": engine.last_grad_norm, "agreed": agreed,
        "coords": (mesh.tp_rank, mesh.dp_rank, mesh.pp_rank), "state": state if mesh.dp_rank == 0 else None,
        "shards": {n: p._hetero_tp for n, p in model.named_parameters() if hasattr(p, "_hetero_tp")},
        "full": full if rank == 0 else None, "estimate": estimated, "ledgers": ledgers,
    }  # fmt: skip
    if save_to is not None:
        engine.save_checkpoint(save_to)
        engine.save_16bit_model(save_to + "-16bit", "model.pt")
        x, y = batches(STEPS + 1)[-1]
        going_on = float(engine.train_batch(x[mine], y[mine]))
        engine.close()
        fresh = build(kv, seed=7)
        again = hetero.initialize(fresh, optimizer(fresh), config)
        again.load_checkpoint(save_to)
        loaded = {k: v.float().clone() for k, v in again.local_state_dict().items()}
        out["loaded_equal"] = loaded.keys() == state.keys() and all(torch.equal(v, state[k]) for k, v in loaded.items())
        out["resumed"] = (going_on, float(again.train_batch(x[mine], y[mine])))
        again.close()
        return out
    engine.close()
    return out


def _matrix(rank: int, world: int, cases: list[tuple[int, dict]]) -> list[dict]:
    return [_engine_run(rank, world, kv, config) for kv, config in cases]


def _merged(results: list[dict]) -> dict[str, torch.Tensor]:
    """The whole model from the first data-parallel rank's states, joined over the tensor ranks, stage by stage."""
    out: dict[str, torch.Tensor] = {}
    for stage in sorted({r["coords"][-1] for r in results}):
        ranks = [r for r in results if r["state"] is not None and r["coords"][-1] == stage]
        ranks.sort(key=lambda r: r["coords"][0])
        shards = ranks[0]["shards"]
        for n, v in ranks[0]["state"].items():
            out[n] = v if n not in shards else unshard([r["state"][n] for r in ranks], shards[n])
    return out


def _check(results: list[dict], kv: int, config: dict) -> None:
    clip = config.get("grad_clip_norm")
    exact_losses, exact, exact_norm = reference(kv, torch.float64, clip=clip)
    plain_losses, plain, plain_norm = reference(kv, F32, clip=clip)
    for r in results:
        tolerance.assert_losses(r["losses"], exact_losses, plain_losses, dtype=F32)
        tolerance.assert_losses([r["grad_norm"]], [exact_norm], [plain_norm], dtype=F32)  # replicas counted once
        # k_proj's and v_proj's weights in the 2 layers (a stage's share under a pipeline), after each update
        assert r["agreed"] == [4 // config["parallel"].get("pipeline", 1)] * STEPS, r["agreed"]
        if r["estimate"] is not None:
            assert r["estimate"] == r["ledgers"], (r["coords"], r["estimate"], r["ledgers"])
    merged = _merged(results)
    assert merged.keys() == plain.keys() and all(merged[k].shape == plain[k].shape for k in plain)
    tolerance.assert_weights(merged, exact, plain, dtype=F32)
    full = results[0]["full"]  # engine.full_state_dict(): the same join, one copy of each head
    assert full.keys() == plain.keys() and all(torch.equal(full[k].float(), merged[k]) for k in plain)


def _tp(tensor: int, stage: int, **extra: Any) -> dict:
    return {"zero_stage": stage, "parallel": {"tensor": tensor}, **extra}


ENGINE = {
    2: [
        *[(1, _tp(2, s)) for s in range(4)],  # one key/value head on both ranks
        (1, {"zero_stage": 3, "parallel": {"tensor": 2, "sequence": "megatron"}}),  # and the sequence split between
    ],
    4: [
        *[(1, _tp(2, s)) for s in range(4)],  # tensor 2 x data 2
        (2, _tp(4, 0, _estimate=True)),  # two heads, each on two ranks
        (2, _tp(4, 3, grad_clip_norm=0.5)),
        (1, _tp(4, 2, offload={"optimizer": "host"})),  # one head on all four
    ],
    8: [  # tensor 4 x data 2: each head's pair of ranks a subgroup of a tensor group smaller than the world
        (2, _tp(4, 1)),
        (2, {"zero_stage": 3, "parallel": {"tensor": 4, "pipeline": 2, "microbatches": 2}}),  # tensor 4 x pipeline 2
    ],
}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_engine_trains_replicated_heads_like_plain_pytorch(world):
    """ZeRO stages 0-3 (data parallelism too at worlds 4 and 8, a pipeline at 8): losses, the gradient norm (each
    replica counted once) and the weights joined over tensor ranks are plain PyTorch's within fp32's own error;
    replicas stay alike after every update; `full_state_dict` is the same join; the estimator's model-state bytes
    equal the ledgers."""
    cases = ENGINE[world]
    results = run_distributed(_matrix, world, cases, timeout=840)
    for i, (kv, config) in enumerate(cases):
        _check([r[i] for r in results], kv, config)


# ---- checkpoints -----------------------------------------------------------------------------------------------
def _from_weights(rank: int, world: int, path: str, tensors: list[int]) -> list[dict]:
    """Engines built from the consolidated file (`weights=`), at each tensor degree: their shards and the loss of
    the batch after the saved run's."""
    torch.set_num_threads(1)
    out = []
    for t in tensors:
        model = build(2, seed=7)
        engine = hetero.initialize(model, optimizer(model), {**_tp(t, 3), "chunk_size": CHUNK}, weights=path)
        dp, dpr = engine.data_parallel_size, engine.data_parallel_rank
        x, y = batches(STEPS + 1)[-1]
        state = {k: v.float().clone() for k, v in engine.local_state_dict().items()}
        mine = slice(dpr * ROWS // dp, (dpr + 1) * ROWS // dp)
        loss = float(engine.eval_batch(x[mine], y[mine]))
        out.append({
            "state": state if engine.mesh.dp_rank == 0 else None, "coords": (engine.mesh.tp_rank, engine.mesh.dp_rank),
            "shards": {n: p._hetero_tp for n, p in model.named_parameters() if hasattr(p, "_hetero_tp")}, "loss": loss,
        })  # fmt: skip
        engine.close()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(900)
def test_checkpoint_of_replicated_heads_consolidates_resumes_and_loads_at_another_degree(tmp_path):
    """Saved at tensor degree 4 with 2 key/value heads (each on two ranks): the checkpoint resumes bit-exactly in
    its layout; `python -m hetero.checkpoint consolidate` writes the plain model's state_dict (k_proj and v_proj of
    their full shape, one copy of each head), the same bits as `full_state_dict` and `save_16bit_model`, within
    fp32's error of plain PyTorch's weights; the consolidated file loads at degrees 2 (heads cut evenly) and 4
    (replicated again) with the plain model's next loss."""
    root = str(tmp_path / "ckpt")
    results = run_distributed(_engine_run, 4, 2, {**_tp(4, 3), "_checkpoint": root}, timeout=300)
    for r in results:
        assert r["loaded_equal"], f"rank {r['coords']}: the loaded weights differ from the saved ones"
        assert r["resumed"][0] == r["resumed"][1], (r["coords"], r["resumed"])  # bit-exact
    out = str(tmp_path / "full.safetensors")
    done = subprocess.run([sys.executable, "-m", "hetero.checkpoint", "consolidate", root, out],
                          capture_output=True, text=True, timeout=200, cwd=os.getcwd())  # fmt: skip
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    whole = load_file(out)
    _, exact, _ = reference(2, torch.float64)
    _, plain, _ = reference(2, F32)
    assert whole.keys() == plain.keys() and all(whole[k].shape == plain[k].shape for k in plain)
    assert whole["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)  # 2 heads of 8, not 4 copies
    assert all(torch.equal(whole[k], results[0]["full"][k]) for k in plain)
    saved16 = torch.load(str(tmp_path / "ckpt-16bit" / "model.pt"))
    assert all(torch.equal(whole[k], saved16[k]) for k in plain)
    tolerance.assert_weights(whole, exact, plain, dtype=F32)
    build(2).load_state_dict(whole, strict=True)

    exact_next = reference(2, torch.float64, steps=STEPS + 1)[0][-1]
    plain_next = reference(2, F32, steps=STEPS + 1)[0][-1]
    loaded = run_distributed(_from_weights, 4, out, [2, 4], timeout=300)
    for i, t in enumerate((2, 4)):
        got = [r[i] for r in loaded]
        for r in got:
            tolerance.assert_losses([r["loss"]], [exact_next], [plain_next], dtype=F32)
        ranks = sorted((r for r in got if r["state"] is not None), key=lambda r: r["coords"][0])
        cuts = ranks[0]["shards"]
        assert (cuts["model.layers.0.self_attn.k_proj.weight"].replicas == 2) == (t == 4)
        for n, cut in cuts.items():  # every shard read from the file is its part of the whole, bit for bit
            assert torch.equal(unshard([r["state"][n] for r in ranks], cut), whole[n]), (t, n)


# ---- estimator, planner, refusals ------------------------------------------------------------------------------
def test_estimator_and_cost_model_count_a_whole_head_per_rank():
    """The estimator's per-rank model holds one whole key/value head (8 rows of k_proj and v_proj) on every rank;
    its parameter count is the even cut's plus the replicated rows; the cost model computes every copy."""
    from hetero.config import Config
    from hetero.profiler import cost_model
    from hetero.profiler.parallel_shapes import per_rank_model
    from hetero.profiler.rates import Rates

    for kv, t in ((2, 4), (1, 4), (1, 2)):
        with torch.device("meta"):
            model = build(kv)
        per, _, zero_world = per_rank_model(model, optimizer(model), Config.from_dict(_tp(t, 0)), 2 * t)
        attn = per.model.layers[0].self_attn
        assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (8, 32) and zero_world == 2
        assert attn.k_proj.weight._hetero_tp.replicas == t // kv
        # q, o, the MLP, embedding and head cut t ways, norms whole; k and v one head of 8 rows each
        layer = (32 * 32 // t) * 2 + 2 * 8 * 32 + 3 * 64 * 32 // t + 2 * 32
        assert sum(p.numel() for p in per.parameters()) == 2 * layer + 2 * VOCAB * 32 // t + 32

        shape = cost_model.shape_of(model)
        lay = {"tensor": t, "tensor_mode": "1d", "sequence": None}
        assert cost_model.kv_replicas(shape, lay) == t // kv
        assert cost_model.replicated_kv_params(shape, t // kv) == 2 * 2 * kv * (t // kv - 1) * 8 * 32
        assert cost_model.kv_replicas(shape, {**lay, "tensor_mode": "2d"}) == 1
        # the step's compute counts every copy: 6 FLOPs per parameter and token, the replicated rows included
        rates = Rates.node(device_flops=1.0)
        lay |= {"pipeline": 1, "microbatches": 1, "rows": 1}
        args = (0, "device", "device", (1, 1), 1, 0.0, rates, F32, 8, 8, SEQ, 1, 1, False)
        extra = cost_model.step_cost(shape, lay, *args)["compute"]
        base = cost_model.step_cost(dataclasses.replace(shape, kv_heads=4), lay, *args)["compute"]
        assert extra - base == pytest.approx(6 * cost_model.replicated_kv_params(shape, t // kv) * SEQ)
    with torch.device("meta"):
        even = build(4)
    assert cost_model.kv_replicas(cost_model.shape_of(even), {"tensor": 4, "tensor_mode": "1d", "sequence": None}) == 1


def test_what_cannot_be_cut_is_refused_naming_the_degrees_that_work():
    """Key/value heads that neither divide the degree nor are divided by it, query heads the degree does not
    divide, and a plan that leaves no column-parallel key/value projection: refused before anything changes."""
    fake = types.SimpleNamespace(size=4, rank=0)  # the checks run before any communication
    cfg = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=1, head_dim=8)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**cfg, num_attention_heads=12, num_key_value_heads=3)
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"self_attn: num_key_value_heads = 3 does not divide by the tensor-parallel "
                       r"degree 4, nor the degree by it .* the degrees that work are 1, 3, 6, 12"):  # fmt: skip
        apply_tensor_parallel(model, "auto", fake)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model = build(2)
    with pytest.raises(ConfigError, match=r"num_attention_heads = 4 does not divide by the tensor-parallel degree 8; "
                       r"with 4 query and 2 key/value heads the degrees that work are 1, 2, 4"):  # fmt: skip
        apply_tensor_parallel(model, "auto", types.SimpleNamespace(size=8, rank=0))
    plan = {k: "rowwise" if k.endswith(("k_proj", "v_proj")) else v for k, v in auto_plan(build(1)).items()}
    with pytest.raises(ConfigError, match=r"no column-parallel \('colwise'\) key/value projection"):
        apply_tensor_parallel(build(1), plan, fake)


class _Attention(torch.nn.Module):
    """A user's grouped-query attention (not Hugging Face's) that runs with its own head counts."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = 4, 2, 8
        self.q_proj, self.o_proj = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.k_proj, self.v_proj = torch.nn.Linear(32, 16), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        assert q.shape[1] == self.num_heads and k.shape[1] == self.num_key_value_heads
        rep = self.num_heads // self.num_key_value_heads
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


def test_a_generic_attention_keeps_its_even_cut_and_holds_its_own_head_when_replicated():
    """A module with its own `num_heads` / `num_key_value_heads`: at degree 2 both are halved as before; at degree 4
    it runs one key/value head, rank r holding head r // 2's rows of k_proj and v_proj (weights and biases)."""
    from hetero.parallel.shape_comm import ShapeComm  # shapes only: every rank's cut without processes

    plan = {"attn": "heads", "attn.?_proj": "colwise", "attn.o_proj": "rowwise"}
    for degree, heads, kv_heads in ((2, 2, 1), (4, 1, 1)):
        for rank in range(degree):
            torch.manual_seed(0)
            model = torch.nn.Sequential()
            model.add_module("attn", _Attention())
            whole = {k: v.clone() for k, v in model.state_dict().items()}
            apply_tensor_parallel(model, plan, ShapeComm(rank, degree))
            attn = model.attn
            assert (attn.num_heads, attn.num_key_value_heads) == (heads, kv_heads)
            rows = slice(rank * 8, (rank + 1) * 8) if degree == 2 else slice(rank // 2 * 8, (rank // 2 + 1) * 8)
            for name in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
                assert torch.equal(model.state_dict()[f"attn.{name}"], whole[f"attn.{name}"][rows]), (degree, rank)
            assert model(torch.randn(2, 4, 32)).shape == (2, 4, 32)
