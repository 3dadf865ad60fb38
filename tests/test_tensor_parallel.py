"""Tensor parallelism (without and with Megatron-SP) and Ulysses sequence parallelism over 2 ranks match the
single-process model: losses, every gradient (unsharded) and the weights after several AdamW steps, for hetero's GPT
and Hugging Face GPT-2 and Llama; the vocabulary-parallel cross entropy equals F.cross_entropy; bad plans fail
clearly; and a TP model trains through the engine at ZeRO stage 3."""

from __future__ import annotations

import inspect
import types

import pytest
import torch
import torch.nn.functional as F

import hetero
from hetero.comm import Comm
from hetero.errors import ConfigError
from hetero.models.gpt import GPT, GPTConfig
from hetero.parallel import (
    apply_ring,
    apply_tensor_parallel,
    apply_ulysses,
    resolve_plan,
    unshard,
    vocab_parallel_cross_entropy,
)
from hetero.parallel.plans import auto_plan
from tests.dist import NEEDS_DEGREES, RANKS_DIFFER, ranks_apart

try:
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    from dist import run_distributed  # type: ignore[no-redef]

VOCAB, SEQ, ROWS, STEPS = 64, 8, 2, 3
# Attention key biases get exactly zero gradient in exact arithmetic, so Adam turns rounding noise into lr-sized
# steps there (see test_unmodified_models): lr 1e-3 and an absolute 1e-5 on weights catch any wrong update.
LR, ATOL_W = 1e-3, 1e-5
TOL = dict(rtol=1e-5, atol=1e-6)


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt":
        cfg = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, block_size=16, bias=True)
        return GPT(cfg)
    import transformers

    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )
        model = transformers.GPT2LMHeadModel(cfg)
        assert model.lm_head.weight is model.transformer.wte.weight  # the tied head this test is about
        return model
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: 2 query heads per key/value head
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(cfg)


def _batches(family: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
        if family == "gpt":  # hetero's GPT takes aligned labels
            x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
        else:  # Hugging Face shifts labels itself
            x, y = ids[:, :-1].clone(), ids[:, :-1].clone()
        y[0, 2] = y[1, 5] = -100
        out.append((x, y))
    return out


def _full(t: torch.Tensor, param: torch.nn.Parameter, comm: Comm) -> torch.Tensor:
    """The whole tensor: unsharded from every rank's shard, or a replica checked identical on every rank."""
    shards = comm.all_gather_object(t.detach().clone())
    info = getattr(param, "_hetero_tp", None)
    if info is None:
        for s in shards[1:]:
            torch.testing.assert_close(s, shards[0], rtol=0, atol=0)  # replicated: the same bits everywhere
        return shards[0]
    assert info.degree == comm.size and tuple(t.shape) != info.full_shape
    return unshard(shards, info)


def _tp_parity(rank: int, world: int, family: str) -> list[str]:
    comm = Comm.world()
    checked = []
    for sequence in (False, True, "ulysses"):
        ref, tp = _model(family), _model(family)
        if sequence == "ulysses":
            apply_ulysses(tp, comm)  # weights whole, the sequence split, all-to-all around attention
        else:
            apply_tensor_parallel(tp, "auto", comm, sequence=sequence)
        assert [n for n, _ in tp.named_parameters()] == [n for n, _ in ref.named_parameters()]
        assert list(tp.state_dict()) == list(ref.state_dict())
        sharded = [n for n, p in tp.named_parameters() if hasattr(p, "_hetero_tp")]
        assert len(sharded) >= (0 if sequence == "ulysses" else 6), sharded
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
        tp_opt = torch.optim.AdamW(tp.parameters(), lr=LR, weight_decay=0.1)
        for step, (x, y) in enumerate(_batches(family)):
            ref_loss = ref(x, labels=y).loss
            ref_loss.backward()
            loss = tp(x, labels=y).loss
            loss.backward()
            torch.testing.assert_close(loss, ref_loss, **TOL)
            if step == 0:
                # The engine's global norm: sum over tensor ranks of sharded squares + replicated squares / degree.
                sq = torch.zeros((), dtype=torch.float64)
                for p in tp.parameters():
                    sq += p.grad.double().square().sum() / (1 if hasattr(p, "_hetero_tp") else comm.size)
                comm.all_reduce(sq)
                ref_sq = sum(p.grad.double().square().sum() for p in ref.parameters())
                torch.testing.assert_close(sq, ref_sq, rtol=1e-6, atol=0)
                ref_params = dict(ref.named_parameters())
                for name, p in tp.named_parameters():
                    torch.testing.assert_close(
                        _full(p.grad, p, comm), ref_params[name].grad, **TOL, msg=lambda m, n=name: f"grad {n}: {m}"
                    )
            ref_opt.step()
            ref_opt.zero_grad()
            tp_opt.step()
            tp_opt.zero_grad()
        ref_params = dict(ref.named_parameters())
        for name, p in tp.named_parameters():
            torch.testing.assert_close(
                _full(p.data, p, comm), ref_params[name].data, rtol=1e-5, atol=ATOL_W, msg=lambda m, n=name: f"{n}: {m}"
            )
        checked.append(f"{family} sequence={sequence}: {len(sharded)} sharded")
    return checked


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["gpt", "gpt2", "llama"])
def test_tp2_matches_single_process(family, cpu_device):
    if family != "gpt":
        pytest.importorskip("transformers")
    out = run_distributed(_tp_parity, 2, family, timeout=240)
    assert len(out[0]) == 3


def _cross_entropy(rank: int, world: int) -> None:
    comm = Comm.world()
    g = torch.Generator().manual_seed(5)
    full = torch.randn(3, 7, 10, generator=g) * 4
    target = torch.randint(0, 10, (3, 7), generator=g)
    target[0, 0] = target[2, 6] = -100
    ref_logits = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.flatten(0, 1), target.flatten(), ignore_index=-100)
    ref.backward()
    local = full.chunk(world, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, comm)
    loss.backward()
    torch.testing.assert_close(loss, ref, **TOL)
    torch.testing.assert_close(local.grad, ref_logits.grad.chunk(world, -1)[rank], **TOL)
    # reduction "sum" and "none" agree too
    per = vocab_parallel_cross_entropy(local.detach(), target, comm, reduction="none")
    ref_per = F.cross_entropy(full.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="none")
    torch.testing.assert_close(per.flatten(), ref_per, **TOL)
    # the mean over a given count (Hugging Face's num_items_in_batch), as a number or as a tensor
    total = F.cross_entropy(full.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
    for count in (40, torch.tensor(40)):
        given = vocab_parallel_cross_entropy(local.detach(), target, comm, num_items=count)
        torch.testing.assert_close(given, total / 40, **TOL)
    # the along-a-dimension collectives under it all
    mine = torch.arange(24.0).view(2, 3, 4) + 100 * rank
    parts = [torch.arange(24.0).view(2, 3, 4) + 100 * r for r in range(world)]
    assert torch.equal(comm.all_gather_dim(mine, 1), torch.cat(parts, 1))
    assert torch.equal(comm.reduce_scatter_dim(mine, 2), sum(parts).chunk(world, 2)[rank])
    sent = comm.all_to_all_dim(mine, 2, 1)  # part r of every rank's dim 2, concatenated along dim 1
    assert torch.equal(sent, torch.cat([p.chunk(world, 2)[rank] for p in parts], 1))


@pytest.mark.timeout(120)
def test_vocab_parallel_cross_entropy_and_collectives(cpu_device):
    run_distributed(_cross_entropy, 2, timeout=100)


def test_plan_errors():
    fake = types.SimpleNamespace(size=2, rank=0)  # checks run before any communication
    model = _model("gpt")
    with pytest.raises(ConfigError, match=r"layers\.\*\.atn\.q_proj.*matches no module.*layers\.0\.attn\.q_proj"):
        apply_tensor_parallel(model, {"layers.*.atn.q_proj": "colwise"}, fake)
    assert resolve_plan(model, {"layers.*.atn.q_proj": "colwise", "lm_head": "vocab_head"}, strict=False) == {
        "lm_head": "vocab_head"
    }
    with pytest.raises(ConfigError, match=r"unknown tensor-parallel style 'colwsie' \(did you mean 'colwise'\?\)"):
        resolve_plan(model, {"layers.*.attn.q_proj": "colwsie"})
    with pytest.raises(ConfigError, match="recognises no known layout in Linear"):
        resolve_plan(torch.nn.Linear(2, 2), "auto")
    torch.manual_seed(0)
    odd = GPT(GPTConfig(vocab_size=VOCAB, n_layer=1, n_head=3, n_embd=24, block_size=8))
    before = {k: v.clone() for k, v in odd.state_dict().items()}
    with pytest.raises(ConfigError, match=r"layers\.0\.attn: n_head = 3 does not divide by the tensor-parallel degree"):
        apply_tensor_parallel(odd, "auto", fake)
    for k, v in odd.state_dict().items():  # checked before anything changed
        assert torch.equal(v, before[k]) and v.shape == before[k].shape
    with pytest.raises(ConfigError, match="style 'vocab' needs an Embedding"):
        apply_tensor_parallel(model, {"lm_head": "vocab"}, fake)
    one = _model("gpt")
    apply_tensor_parallel(one, "auto", Comm())  # degree 1: nothing to cut, but marked
    with pytest.raises(ConfigError, match="sharded or sequence-parallel already"):
        apply_tensor_parallel(one, "auto", Comm())
    # the resolved plan: later patterns override earlier ones
    plan = resolve_plan(model, "auto")
    assert plan["layers.1.attn.o_proj"] == "rowwise" and plan["layers.1.attn.k_proj"] == "colwise"
    assert plan["ln_f"] == "norm+sequence_gather" and plan["pos_embed"] == "embedding"


def test_llama_kv_heads_not_divisible():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=6,
        num_key_value_heads=3,
    )  # fmt: skip
    # kv 1 at degree 2 is replicated now (tests/test_tp_kv_replicas.py); 3 neither divides 2 nor is divided by it.
    refused = "num_key_value_heads = 3 does not divide by the tensor-parallel degree 2, nor the degree by it"
    with pytest.raises(ConfigError, match=refused):
        apply_tensor_parallel(transformers.LlamaForCausalLM(cfg), "auto", types.SimpleNamespace(size=2, rank=0))


def test_clipping_a_model_cut_by_hand_is_refused():
    """By hand (no "parallel" section) the engine cannot know the tensor ranks to sum the norm over: each clipped by
    its own shards' norm and the replicated weights drifted apart (measured: 8.6e-4 between tensor ranks)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    apply_tensor_parallel(model, "auto", types.SimpleNamespace(size=2, rank=0))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match=r"grad_clip_norm with a model made tensor-parallel by hand.*\"parallel\""):
        hetero.initialize(model, opt, {"grad_clip_norm": 1.0})


def _engine(rank: int, world: int) -> None:
    tensor = Comm.world()
    data = tensor.split([[0], [1]])  # a data-parallel group of one per tensor rank
    for sequence in (False, True):
        ref, model = _model("gpt"), _model("gpt")
        apply_tensor_parallel(model, "auto", tensor, sequence=sequence)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
        engine = hetero.initialize(
            model,
            torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1),
            {"zero_stage": 3, "chunk_size": 4096, "offload": {"optimizer": "host", "params": "host"}},
            comm=data,
        )
        for x, y in _batches("gpt"):
            ref_loss = ref(x, labels=y).loss
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            loss = engine(x, labels=y).loss
            engine.backward(loss)
            engine.step()
            torch.testing.assert_close(loss.detach(), ref_loss.detach(), **TOL)
        state = engine.full_state_dict()
        params = dict(model.named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(
                _full(state[name], params[name], tensor),
                p.data,
                rtol=1e-5,
                atol=ATOL_W,
                msg=lambda m, n=name: f"{n}: {m}",
            )
        engine.close()


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_engine_zero3_on_tensor_parallel_model():
    run_distributed(_engine, 2, timeout=240)


def test_auto_plan_is_keyed_by_layout_not_class():
    """A relative with Llama's layout (Mistral, Qwen2) and a subclass of hetero's GPT get the built-in plans."""
    transformers = pytest.importorskip("transformers")
    cfg = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    for cls, conf in (
        (transformers.MistralForCausalLM, transformers.MistralConfig),
        (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
    ):
        plan = resolve_plan(cls(conf(**cfg, num_key_value_heads=1)), "auto")
        assert plan["model.layers.0.self_attn.q_proj"] == "colwise" and plan["lm_head"] == "vocab_head"

    class MyGPT(GPT):
        pass

    plan = resolve_plan(MyGPT(GPTConfig(vocab_size=16, n_layer=1, n_head=2, n_embd=8, block_size=8)), "auto")
    assert plan["layers.0.mlp.fc"] == "colwise"


def _generate(rank: int, world: int) -> dict:
    """Hugging Face's generate on a tensor-parallel Llama through the engine, at stages 1 and 3 (whose instance
    generate keeps ranks in step: hetero/zero/generate.py), against the unsharded model's greedy tokens."""
    torch.set_num_threads(1)
    out: dict = {}
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    want = _model("llama").eval().generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    for stage in (1, 3):
        model = _model("llama")
        name = type(model).__name__
        engine = hetero.initialize(
            model,
            torch.optim.AdamW(model.parameters(), lr=LR),
            {"zero_stage": stage, "chunk_size": 4096, "parallel": {"tensor": 2}},
        )
        model.eval()
        with torch.no_grad():
            # The prompt on the compute device, as on a GPU, where NCCL's collectives take device tensors; and under
            # the device's compute, where the stand-in counts what the model makes as device memory, as a GPU would.
            with engine.device.compute_context():
                got = model.generate(engine.to_device(prompt), max_new_tokens=4, do_sample=False, pad_token_id=0)
            got = got.cpu()
            logits = engine(prompt).logits  # a forward outside generate keeps its logits cut by vocabulary
        out[stage] = {"same": torch.equal(got, want), "got": got.tolist(), "cut": logits.shape[-1]}
        out[stage]["name"] = type(model).__name__ == name  # save_pretrained writes the class name as the architecture
        # ZeRO-3 over data-parallel ranks gives generate synced_gpus=True when the class's generate takes it
        out[stage]["synced"] = "synced_gpus" in inspect.signature(type(model).generate).parameters
        engine.close()
    out["want"] = want.tolist()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(240)
def test_generate_on_a_tensor_parallel_model_picks_from_the_whole_vocabulary():
    """Each rank used to pick the next token from its own part of the vocabulary: other tokens on every rank, by
    their index in the part, with no error."""
    pytest.importorskip("transformers")
    for r in run_distributed(_generate, 2, timeout=200):
        for stage in (1, 3):
            assert r[stage]["same"], (stage, r[stage]["got"], r["want"])
            assert r[stage]["cut"] == VOCAB // 2 and r[stage]["name"] and r[stage]["synced"], r[stage]


# ---- Llama's relatives, padding masks, float64 ------------------------------------------------------------------
# Float64, and an objective without the fp32 cross entropy (a fixed weighting of the logits; vocabulary-sharded
# logits sum their parts through the head's f). transformers' RMSNorms still compute in fp32 whatever the model's
# dtype (x.float()), so the two models agree to fp32 rounding (6e-8 relative per operation, a few hundred deep):
# 1e-5 relative to each gradient's largest entry (its entries are sums of terms that large, rounded in fp32). Every
# error this catches is O(1): a missing sqrt(hidden) scale, half a gradient, a mask ignored.
F32_ROUNDING = 1e-5


def _relative(family: str) -> torch.nn.Module:
    """Gemma 3 (its embedding scales its output, four norms per layer, q/k norms per head, a sliding window of 4
    over 8 positions, scores softcapped at 1: init 0.3 makes them O(1)), or Llama with sdpa (boolean masks)."""
    import transformers

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    if family == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **shape, num_key_value_heads=2, head_dim=8, max_position_embeddings=16, sliding_window=4,
            attn_logit_softcapping=1.0, initializer_range=0.3, attn_implementation="eager",
        )  # fmt: skip
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**shape, num_key_value_heads=2, attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(cfg)
    return model.double()


def _relatives(rank: int, world: int) -> list[str]:
    comm = Comm.world()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    weight = torch.randn(2, SEQ, VOCAB, generator=g, dtype=torch.float64)
    done = []
    for family, modes in (("gemma3", ("tp", "sp", "ulysses", "ring")), ("llama", ("ring",))):
        mask = torch.ones(2, SEQ, dtype=torch.long)
        # Gemma 3 in eager float64 makes NaNs on a query that attends to nothing (left padding), the plain model too
        if family == "gemma3":
            mask[1, -2:] = 0
        else:
            mask[0, :3] = 0
        # A padding query's output is arbitrary (the plain model's too): weighted 0.
        weighted = weight * mask.unsqueeze(-1)
        for mode in modes:
            ref, model = _relative(family), _relative(family)
            if mode == "ring":
                apply_ring(model, comm)
            elif mode == "ulysses":
                apply_ulysses(model, comm)
            else:
                apply_tensor_parallel(model, "auto", comm, sequence=mode == "sp")
            for m in (ref, model):
                logits = m(ids, attention_mask=mask).logits
                cut = weighted.chunk(world, -1)[rank] if logits.shape[-1] < VOCAB else weighted
                (logits * cut).sum().backward()  # a vocabulary-parallel head's f sums the ranks' parts
            ref_params = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                want = ref_params[name].grad
                torch.testing.assert_close(
                    _full(p.grad, p, comm),
                    want,
                    rtol=F32_ROUNDING,
                    atol=F32_ROUNDING * float(want.abs().max()),
                    msg=lambda m, n=f"{mode} {name}": f"{n}: {m}",
                )
            done.append(f"{family} {mode}")
    return done


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_llama_relatives_and_padding_masks_match_the_plain_model(cpu_device):  # no engine: CPU tensors, CPU ranks
    """Gemma 3 under 1D tensor parallelism (with and without Megatron-SP), Ulysses and ring attention, and Llama
    (sdpa) under ring attention, with a left-padded batch, in float64: every gradient equals the plain model's.
    Before: Gemma 3's vocabulary-parallel embedding skipped its sqrt(hidden) scale; its q/k norms (per head, so fed
    a rank's heads only) kept a part of their gradient under TP, and its pre/post-feedforward norms under SP, Ulysses
    and ring; ring attention ignored the attention mask (padding, sliding window) and the softcap."""
    pytest.importorskip("transformers")
    out = run_distributed(_relatives, 2, timeout=240)
    assert out[0] == ["gemma3 tp", "gemma3 sp", "gemma3 ulysses", "gemma3 ring", "llama ring"]


def test_plan_of_llama_relatives_and_unhandled_parameters_inside_attention():
    """The auto plan names Gemma's extra norms and per-head q/k norms; a plan that leaves a parameter inside a
    tensor-parallel attention or MLP without a style is refused before anything changes (it would get a part of its
    gradient on every rank, silently)."""
    pytest.importorskip("transformers")
    fake = types.SimpleNamespace(size=2, rank=0)  # checks run before any communication
    model = _relative("gemma3")
    plan = resolve_plan(model, "auto")
    assert plan["model.layers.1.pre_feedforward_layernorm"] == "norm"
    assert plan["model.layers.1.self_attn.k_norm"] == "head_norm"
    partial = {k: v for k, v in auto_plan(model).items() if v != "head_norm"}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"layers\.0\.self_attn\.q_norm .*holds parameters \['weight'\] inside"):
        apply_tensor_parallel(model, partial, fake)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert resolve_plan(_model("llama"), "auto")["model.layers.0.post_attention_layernorm"] == "norm"


def _built_per_rank(rank: int, world: int) -> str:
    torch.manual_seed(rank)  # another seed on each rank: two different models
    model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=16, block_size=8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"ranks hold different values of 8 parameters \(embed\.weight, pos_embed"):
        apply_tensor_parallel(model, "auto", Comm.world())
    for k, v in model.state_dict().items():  # checked before anything changed
        assert torch.equal(v, before[k])
    return "refused"


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(120)
def test_a_model_built_differently_on_each_tensor_rank_is_refused():
    """Each rank kept its slice of its own copy: a model of mismatched slices and replicated parameters (the
    position embedding) that differed between ranks trained without an error."""
    assert run_distributed(_built_per_rank, 2, timeout=100) == ["refused", "refused"]


def _built_unlike(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=1 + rank, n_head=2, n_embd=16, block_size=8))  # another depth
    with pytest.raises(ConfigError, match=r"models hold between \d+ and \d+ parameters off the meta device"):
        apply_tensor_parallel(model, "auto", Comm.world())
    return "refused"


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(120)
def test_models_of_another_layout_on_each_tensor_rank_are_refused():
    """The comparison's exchanges are shaped by the parameter count: ranks with another count passed gloo tensors of
    other sizes, which aborts the process (NCCL hangs); the counts are compared first."""
    assert run_distributed(_built_unlike, 2, timeout=100) == ["refused", "refused"]


def test_megatron_sp_needs_a_plan_that_cuts_and_gathers_the_sequence():
    """Without a sequence_scatter the region was never entered (every rank gathered the whole sequence t times:
    logits of twice its length), without a sequence_gather never left (logits of half of it); a loss failed on
    shapes inside the forward, and a forward without labels returned them."""
    from hetero.parallel.shape_comm import ShapeComm
    from hetero.parallel.tensor import check_tensor_plan

    for missing, role in (("drop", "'sequence_scatter'"), ("ln_f", "'sequence_gather'")):
        model = _model("gpt")
        plan = {k: v for k, v in auto_plan(model).items() if k != missing}
        if missing == "ln_f":
            plan["ln_f"] = "norm"  # still a norm, no longer where the region ends
        with pytest.raises(ConfigError, match=f"sequence parallelism \\(Megatron\\) needs a plan with a {role} module"):
            apply_tensor_parallel(model, plan, ShapeComm(0, 2), sequence=True)
        assert not any(hasattr(p, "_hetero_tp") for p in model.parameters())
        check_tensor_plan(model, plan, 2)  # the same plan without sequence parallelism
        check_tensor_plan(model, plan, 2, sequence=True, strict=False)  # a pipeline stage's part: checked before
