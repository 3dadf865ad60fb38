"""Fused gate/up projections under tensor parallelism, and Phi-3 under tensor_plan 'auto'.

Phi-3's MLP computes `gate, up = gate_up_proj(x).chunk(2, -1)`; its style 'colwise_gate_up' cuts gate and up each on
its own ([Note: fused gate/up projections] in hetero/parallel/fused_mlp.py). Tiny Hugging Face Phi-3 (hidden 32,
intermediate 64, 2 layers, 4 heads) at tensor degrees 2 and 4, with and without Megatron-SP, and through the engine
at ZeRO stages 3 and 1, against plain PyTorch: float64 as the exact run and plain fp32's distance from it as the
scale (tests/tolerance.py). Also: checkpoints consolidate to `full_state_dict`'s tensors and load back by shard
reads (`weights=`); the estimator holds half of gate and of up; a plain 'colwise' cut of gate_up_proj is refused
with the plan line that works (the check taken away, it trains another model: measured below), as is
'colwise_gate_up' where the layer is not twice down's input; Phi-3's attention runs with this rank's head counts."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

import hetero
from hetero.comm import Comm
from hetero.errors import ConfigError
from hetero.parallel import apply_tensor_parallel, unshard
from hetero.parallel.plans import auto_plan
from hetero.parallel.shape_comm import ShapeComm
from hetero.parallel.tensor import check_tensor_plan
from tests.dist import NEEDS_DEGREES, ranks_apart
from tests.plain_loop import train_plain
from tests.whole_grads import whole_grads

try:
    from tests import tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

transformers = pytest.importorskip("transformers")

# The replicated-heads tests' shapes, batches and optimizer: the same tiny decoder's training, another projection cut.
from tests.test_tp_kv_replicas import CHUNK, F32, VOCAB, batches, optimizer  # noqa: E402

FAKE = types.SimpleNamespace(size=2, rank=0)  # every check runs before any communication
GATE_UP = "model.layers.*.mlp.gate_up_proj"


def build(kv: int = 4, *, seed: int = 0, head: bool = True) -> torch.nn.Module:
    """4 query heads of 8 over `kv` key/value heads, an MLP of 64 (gate_up_proj 32 -> 128), 2 layers."""
    torch.manual_seed(seed)
    cfg = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv, max_position_embeddings=16, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.Phi3ForCausalLM(cfg) if head else transformers.Phi3Model(cfg)


_REFERENCES: dict[tuple, Any] = {}


def reference(dtype: torch.dtype) -> tuple:
    """Plain PyTorch on the batches (cached): losses, final weights, the last step's gradient norm."""
    if dtype not in _REFERENCES:
        model = build().to(dtype)
        _REFERENCES[dtype] = train_plain(model, optimizer(model), batches())
    return _REFERENCES[dtype]


def first_grads(dtype: torch.dtype) -> tuple[float, dict[str, torch.Tensor]]:
    model = build().to(dtype)
    x, y = batches(1)[0]
    loss = model(x, labels=y).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


# ---- the plan, its refusals, the cut itself (no processes) -----------------------------------------------------
def _refused(model: torch.nn.Module, plan: dict, line: str | None) -> str:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as caught:
        apply_tensor_parallel(model, plan, FAKE)
    message = str(caught.value)
    if line is not None:
        assert message.endswith("Fixed plan lines: {" + line + "}"), message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return message


def test_phi3_has_a_plan_and_a_plain_cut_of_gate_up_is_refused():
    """'auto' knows Phi-3 with and without its LM head; gate_up_proj styled 'colwise' is refused naming the plan
    line that works; 'colwise_gate_up' on a layer that is not twice down's input (Llama's gate_proj, Phi-3's
    qkv_proj) is refused; an MLP declaring its gate and up interleaved takes the plain cut; Phi-3 with fewer
    key/value heads than query heads takes the auto plan too (tests/test_tp_fused_gqa.py trains it)."""
    plan = auto_plan(build())
    assert plan[GATE_UP] == "colwise_gate_up" and plan["model.layers.*.self_attn.qkv_proj"] == "colwise_qkv"
    assert plan["lm_head"] == "vocab_head" and plan["model.norm"] == "norm+sequence_gather"
    bare = auto_plan(build(head=False))
    assert bare["layers.*.mlp.gate_up_proj"] == "colwise_gate_up" and "lm_head" not in bare
    check_tensor_plan(build(), "auto", 2, sequence=True)
    check_tensor_plan(build(head=False), "auto", 4, sequence=True)

    message = _refused(build(), plan | {GATE_UP: "colwise"}, f"'{GATE_UP}': 'colwise_gate_up'")
    assert "gate_up_proj (Linear 32 -> 128) is a fused gate/up projection (its 128 outputs are twice the 64" in message
    assert message.count("gate_up_proj") == 2  # one entry per pattern, and its fix

    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=4)
    )  # fmt: skip
    wrong = auto_plan(llama) | {"model.layers.*.mlp.gate_proj": "colwise_gate_up"}
    message = _refused(llama, wrong, "'model.layers.*.mlp.gate_proj': 'colwise'")
    assert "gate_proj (Linear 32 -> 48) is styled 'colwise_gate_up'" in message and "not twice the 48" in message
    message = _refused(build(), plan | {"model.layers.*.self_attn.qkv_proj": "colwise_gate_up"}, None)
    assert "inside the attention model.layers.0.self_attn: a fused layer there holds q, k and v" in message

    interleaved = build()
    for layer in interleaved.model.layers:
        layer.mlp.gate_up_layout = "interleaved"
    check_tensor_plan(interleaved, plan | {GATE_UP: "colwise"}, 2)
    _refused(interleaved, plan, f"'{GATE_UP}': 'colwise'")

    check_tensor_plan(build(kv=2), plan, 2)


def test_each_rank_holds_its_slice_of_gate_and_of_up():
    """At tensor 2 rank r's gate_up_proj is [gate rows r; up rows r] (a 2-part cut whose shards unshard to the
    whole); its attention runs with 2 query heads from a config of its own, the model's config keeps 4; the
    estimator's rank holds the same shapes."""
    from hetero.config import Config
    from hetero.profiler.parallel_shapes import per_rank_model

    whole = build().model.layers[0].mlp.gate_up_proj.weight.detach().clone()
    gate, up = whole.chunk(2)
    shards = []
    for rank in range(2):
        model = build()
        apply_tensor_parallel(model, "auto", ShapeComm(rank, 2))
        w = model.model.layers[0].mlp.gate_up_proj.weight
        rows = slice(rank * 32, (rank + 1) * 32)
        assert torch.equal(w, torch.cat([gate[rows], up[rows]])) and w._hetero_tp.parts == 2
        shards.append(w.detach())
        attn = model.model.layers[0].self_attn
        assert attn.config.num_attention_heads == 2 and model.config.num_attention_heads == 4
        assert attn.config._attn_implementation == model.config._attn_implementation
    assert torch.equal(unshard(shards, model.model.layers[0].mlp.gate_up_proj.weight._hetero_tp), whole)
    with torch.device("meta"):
        meta = build()
    per, _, _ = per_rank_model(meta, optimizer(meta), Config.from_dict({"parallel": {"tensor": 2}}), 2)
    assert per.model.layers[0].mlp.gate_up_proj.weight.shape == (64, 32)
    assert per.model.layers[0].mlp.gate_up_proj.weight._hetero_tp.parts == 2


# ---- the layout itself, without the engine ---------------------------------------------------------------------
def _direct(rank: int, world: int, cases: list[tuple[bool, bool]]) -> list[dict]:
    """Each case (sequence, unchecked): the auto plan at degree `world` (unchecked: gate_up_proj cut plainly, its
    refusal taken away), one forward and backward; the loss and the gradients joined over the tensor ranks."""
    from hetero.parallel import plan_checks

    torch.set_num_threads(1)
    comm = Comm.world()
    out = []
    for sequence, unchecked in cases:
        model = build()
        keep = plan_checks.check_gate_up
        if unchecked:
            plan_checks.check_gate_up = lambda *a: []
        try:
            apply_tensor_parallel(model, auto_plan(model) | ({GATE_UP: "colwise"} if unchecked else {}), comm,
                                  sequence=sequence)  # fmt: skip
        finally:
            plan_checks.check_gate_up = keep
        x, y = batches(1)[0]
        loss = model(x, labels=y).loss
        loss.backward()
        out.append({"loss": loss.item(), "grads": whole_grads(model, comm)})
    return out


DIRECT = {2: [(False, False), (True, False), (False, True)], 4: [(False, False), (True, False)]}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_the_gate_up_cut_gives_the_whole_models_loss_and_gradients(world):
    """Loss and every gradient, joined over the tensor ranks, are plain PyTorch's within fp32's own error, with and
    without Megatron-SP; gate_up_proj cut plainly (what the refusal prevents) is off by far more."""
    results = run_distributed(_direct, world, DIRECT[world], timeout=200)
    exact_loss, exact = first_grads(torch.float64)
    plain_loss, plain = first_grads(F32)
    for r in results:
        for (_, unchecked), got in zip(DIRECT[world], r):
            if unchecked:  # measured: 4.18838 against 4.18991 ([Note: fused gate/up projections])
                assert abs(got["loss"] - exact_loss) > 1e-4, got["loss"]
                off = max(float((got["grads"][n].double() - exact[n]).norm() / exact[n].norm()) for n in exact)
                assert off > 1e-2, off
                continue
            tolerance.assert_losses([got["loss"]], [exact_loss], [plain_loss], dtype=F32)
            assert got["grads"].keys() == plain.keys()
            tolerance.assert_weights(got["grads"], exact, plain, dtype=F32)


# ---- through the engine ----------------------------------------------------------------------------------------
def _engine(rank: int, world: int, root: str) -> dict:
    """ZeRO-3 then ZeRO-1 at tensor 2: losses and full_state_dict after STEPS; the ZeRO-3 run saves a checkpoint,
    rank 0 consolidates it, and an engine built from the file (`weights=`) returns its shards."""
    from hetero.checkpoint.consolidate import consolidate

    torch.set_num_threads(1)
    comm = Comm.world()
    out: dict[str, Any] = {}
    for stage in (3, 1):
        model = build()
        engine = hetero.initialize(model, optimizer(model), {"zero_stage": stage, "parallel": {"tensor": 2},
                                                             "chunk_size": CHUNK})  # fmt: skip
        losses = [float(engine.train_batch(x, y)) for x, y in batches()]
        full = engine.full_state_dict()
        out[stage] = {"losses": losses, "full": full if rank == 0 else None}
        if stage == 3:
            engine.save_checkpoint(root)
        engine.close()
    path = root + ".safetensors"
    if rank == 0:
        consolidate(root, path)
    comm.all_gather_object(None)  # the file is written
    model = build(seed=7)
    engine = hetero.initialize(model, optimizer(model), {"zero_stage": 3, "parallel": {"tensor": 2},
                                                         "chunk_size": CHUNK}, weights=path)  # fmt: skip
    local = engine.local_state_dict()
    out["read"] = {n: (local[n].float().clone(), p._hetero_tp) for n, p in model.named_parameters()
                   if hasattr(p, "_hetero_tp")}  # fmt: skip
    engine.close()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_engine_trains_phi3_at_tensor_2_like_plain_pytorch(tmp_path):
    """Through hetero.initialize with "parallel": {"tensor": 2} (the auto plan): losses and full_state_dict's
    weights are plain PyTorch's within fp32's error at ZeRO-3 and ZeRO-1; the ZeRO-3 checkpoint consolidates to
    full_state_dict's tensors bit for bit, and read back from that file each rank's shards (gate_up_proj's two
    halves among them) are their part of it."""
    root = str(tmp_path / "ckpt")
    results = run_distributed(_engine, 2, root, timeout=260)
    exact_losses, exact, _ = reference(torch.float64)
    plain_losses, plain, _ = reference(F32)
    for stage in (3, 1):
        for r in results:
            tolerance.assert_losses(r[stage]["losses"], exact_losses, plain_losses, dtype=F32)
        full = results[0][stage]["full"]
        assert full.keys() == plain.keys() and all(full[k].shape == plain[k].shape for k in plain)
        tolerance.assert_weights(full, exact, plain, dtype=F32)
    from safetensors.torch import load_file

    whole = load_file(root + ".safetensors")
    full = results[0][3]["full"]
    assert whole.keys() == full.keys() and all(torch.equal(whole[k], full[k].float()) for k in full)
    assert (
        results[0]["read"].keys() == results[1]["read"].keys()
        and f"{GATE_UP}.weight".replace("*", "0") in (results[0]["read"])
    )
    for n, (_, cut) in results[0]["read"].items():
        assert torch.equal(unshard([r["read"][n][0] for r in results], cut), whole[n]), n
