"""Tensor plans that cut a layer in a way that does not fit it are refused before anything changes, naming the layer,
its style, the style it needs and why, with the fixed plan lines ([Note: cuts that must chain] in
hetero/parallel/plan_shapes.py, [Note: fused q/k/v projections] in hetero/parallel/fused_qkv.py). Before: an LM head
styled colwise and an MLP with its styles swapped failed on raw torch shapes inside the forward; a fused q/k/v
projection styled colwise trained a different model without an error (measured below, two ranks)."""

from __future__ import annotations

import copy
import re
import types

import pytest
import torch
from torch import nn

from hetero.errors import ConfigError
from hetero.parallel import apply_tensor_parallel
from hetero.parallel.plans import auto_plan
from hetero.parallel.tensor import check_tensor_plan
from tests.dist import NEEDS_DEGREES, ranks_apart
from tests.test_plan_checks import GOOD, Tiny

transformers = pytest.importorskip("transformers")

FAKE = types.SimpleNamespace(size=2, rank=0)  # every check runs before any communication


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4, bos_token_id=0,
                                  eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _neox() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16,
    )  # fmt: skip
    return transformers.GPTNeoXForCausalLM(cfg)


NEOX = {
    "gpt_neox.embed_in": "vocab",
    "gpt_neox.layers.*.attention": "heads",
    "gpt_neox.layers.*.attention.query_key_value": "colwise",  # each head's q, k, v side by side
    "gpt_neox.layers.*.attention.dense": "rowwise",
    "gpt_neox.layers.*.mlp": "parallel_input",
    "gpt_neox.layers.*.mlp.dense_h_to_4h": "colwise",
    "gpt_neox.layers.*.mlp.dense_4h_to_h": "rowwise",
    "lm_head": "vocab_head",
}


def _refused(model: nn.Module, plan: dict, *lines: str) -> str:
    """The refusal's message, checked to end with exactly `lines` as the fixed plan, the model left as it was."""
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError) as caught:
        apply_tensor_parallel(model, plan, FAKE)
    message = str(caught.value)
    if lines:
        assert message.endswith("Fixed plan lines: {" + ", ".join(lines) + "}"), message
    assert all(v.equal(before[k]) and v.shape == before[k].shape for k, v in model.state_dict().items())
    return message


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_an_lm_head_cut_as_a_plain_layer_is_refused(style):
    shapes = (
        r"\[\.\.\., 32\] logits with labels up to 63" if style == "colwise" else r"cut to \[64, 16\] .*\[\.\.\., 32\]"
    )
    message = _refused(Tiny(), GOOD | {"head": style}, "'head': 'vocab_head'")
    assert re.search(rf"head \(Linear 32 -> 64\) is the LM head .*styled '{style}': .*{shapes}", message)
    llama = _llama()
    message = _refused(llama, auto_plan(llama) | {"lm_head": style}, "'lm_head': 'vocab_head'")
    assert "lm_head (Linear 32 -> 64) is the LM head" in message
    gpt2 = _gpt2()  # its head is found by its weight, the token embedding's
    message = _refused(gpt2, auto_plan(gpt2) | {"lm_head": style}, "'lm_head': 'vocab_head'")
    assert "(its weight is the token embedding's)" in message


def test_an_mlp_with_its_styles_swapped_is_refused():
    llama = _llama()
    swapped = {
        "model.layers.*.mlp.gate_proj": "rowwise",
        "model.layers.*.mlp.up_proj": "rowwise",
        "model.layers.*.mlp.down_proj": "colwise",
    }
    fixed = ("'model.layers.*.mlp.gate_proj': 'colwise'", "'model.layers.*.mlp.up_proj': 'colwise'",
             "'model.layers.*.mlp.down_proj': 'rowwise'")  # fmt: skip
    message = _refused(llama, auto_plan(llama) | swapped, *fixed)
    assert re.search(r"up_proj \(Linear 32 -> 48\) is styled 'rowwise'.*\[48, 16\] on each rank.*32 is the model's "
                     r"hidden size", message)  # fmt: skip
    assert "down_proj (Linear 48 -> 32) is styled 'colwise'" in message
    assert message.count("model.layers.0.") == 3 and "model.layers.1." not in message  # once per pattern
    # A Sequential's layers differ by their last index: the fixed lines keep it.
    tiny = GOOD | {"blocks.*.mlp.0": "rowwise", "blocks.*.mlp.2": "colwise"}
    _refused(Tiny(), tiny, "'blocks.*.mlp.0': 'colwise'", "'blocks.*.mlp.2': 'rowwise'")


def test_a_fused_qkv_cut_plainly_is_refused_with_the_style_its_layout_needs():
    fixed = "'blocks.*.attn.qkv': 'colwise_qkv'"
    message = _refused(Tiny(), GOOD | {"blocks.*.attn.qkv": "colwise"}, fixed)
    assert "fused q/k/v projection (96 = q, k, v of 32 each, one after another: Attn's layout) styled" in message
    gpt2 = _gpt2()
    fixed = "'transformer.h.*.attn.c_attn': 'colwise_qkv'"
    _refused(gpt2, auto_plan(gpt2) | {"transformer.h.*.attn.c_attn": "colwise"}, fixed)
    # GPT-NeoX holds each head's q, k and v side by side: the plain cut is its right one, and thirds are refused.
    check_tensor_plan(_neox(), NEOX, 2)
    thirds = NEOX | {"gpt_neox.layers.*.attention.query_key_value": "colwise_qkv"}
    message = _refused(_neox(), thirds, "'gpt_neox.layers.*.attention.query_key_value': 'colwise'")
    assert "holding each head's q, k and v side by side (GPTNeoXAttention's layout)" in message
    # A projection that is not fused, cut in thirds, is refused too.
    llama = _llama()
    message = _refused(llama, auto_plan(llama) | {"model.layers.*.self_attn.q_proj": "colwise_qkv"})
    assert "q_proj (Linear 32 -> 32) inside model.layers.0.self_attn is styled 'colwise_qkv'" in message


def test_an_attention_declares_its_fused_layout():
    per_head = Tiny()
    for block in per_head.blocks:
        block.attn.qkv_layout = "per_head"
    check_tensor_plan(per_head, GOOD | {"blocks.*.attn.qkv": "colwise"}, 2)
    _refused(per_head, GOOD, "'blocks.*.attn.qkv': 'colwise'")
    per_head.blocks[0].attn.qkv_layout = "heads"
    with pytest.raises(
        ConfigError, match=r"blocks\.0\.attn\.qkv_layout = 'heads': expected one of 'blocks', 'per_head'"
    ):
        check_tensor_plan(per_head, GOOD, 2)


def test_a_fused_qkv_of_unequal_blocks_is_cut_by_heads():
    """Phi-3's qkv_proj with fewer key/value heads: q 64 wide, k and v 16. A plain cut is refused naming
    'colwise_qkv', which cuts each block by heads (tests/test_tp_fused_gqa.py trains it), where the key/value heads
    divide by the degree."""
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip
    plan = {
        "model.layers.*.self_attn": "heads",
        "model.layers.*.self_attn.qkv_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "lm_head": "vocab_head",
    }
    message = _refused(transformers.Phi3ForCausalLM(cfg), plan, "'model.layers.*.self_attn.qkv_proj': 'colwise_qkv'")
    assert "fused q/k/v projection (96 = q 64, k and v 16 each, one after another: Phi3Attention's layout)" in message
    plan["model.layers.*.self_attn.qkv_proj"] = "colwise_qkv"
    check_tensor_plan(transformers.Phi3ForCausalLM(cfg), plan, 2)
    with pytest.raises(ConfigError, match="2 key/value heads for 4 tensor ranks.*The degrees that work are 1, 2"):
        check_tensor_plan(transformers.Phi3ForCausalLM(cfg), plan, 4)


def _parity(rank: int, world: int) -> dict[str, float]:
    """The first step's loss, and the largest gradient error, against plain PyTorch's on the same model."""
    from hetero.comm import Comm
    from hetero.parallel import plan_checks
    from hetero.parallel.tensor import unshard

    comm, out = Comm.world(), {}
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for label, build, plan in (
        ("neox colwise", _neox, NEOX),
        ("tiny qkv colwise", Tiny, GOOD | {"blocks.*.attn.qkv": "colwise"}),
        ("tiny qkv colwise_qkv", Tiny, GOOD),
    ):
        torch.manual_seed(0)
        ref = build()
        tp = copy.deepcopy(ref)
        keep = plan_checks.check_cuts_fit
        plan_checks.check_cuts_fit = lambda *a: None  # the check taken away: what the plan trains without it
        try:
            apply_tensor_parallel(tp, plan, comm)
        finally:
            plan_checks.check_cuts_fit = keep
        if isinstance(ref, Tiny):
            ref_loss, loss = _tiny_loss(ref, x, None), _tiny_loss(tp, x, comm)
        else:
            ref_loss, loss = ref(x, labels=x).loss, tp(x, labels=x).loss
        ref_loss.backward()
        loss.backward()
        grads = dict(ref.named_parameters())
        err = 0.0
        for name, p in tp.named_parameters():
            info = getattr(p, "_hetero_tp", None)
            full = p.grad if info is None else unshard(comm.all_gather_object(p.grad.clone()), info)
            err = max(err, (full - grads[name].grad).abs().max().item())
        out[label] = (ref_loss.item(), loss.item(), err)
    return out


def _tiny_loss(model: Tiny, x: torch.Tensor, comm) -> torch.Tensor:
    from hetero.parallel import vocab_parallel_cross_entropy

    h = model.tok(x)
    for block in model.blocks:
        h = block(h)
    logits, labels = model.head(model.norm(h))[:, :-1], x[:, 1:]
    if comm is None:
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return vocab_parallel_cross_entropy(logits, labels, comm).mean()


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(240)
def test_the_layouts_cuts_train_the_plain_model_and_the_refused_one_does_not():
    """Two ranks, fp32: GPT-NeoX's plain cut (allowed) and the blocks layout's colwise_qkv match plain PyTorch to
    fp32 rounding; the blocks layout cut plainly (refused) is off by far more."""
    from tests.dist import run_distributed

    out = run_distributed(_parity, 2, timeout=200)[0]
    eps = torch.finfo(torch.float32).eps
    for label in ("neox colwise", "tiny qkv colwise_qkv"):
        ref, got, err = out[label]
        assert abs(got - ref) <= 64 * eps * abs(ref) and err <= 1e3 * eps, (label, out[label])
    ref, got, err = out["tiny qkv colwise"]
    assert abs(got - ref) > 1e4 * eps * abs(ref) and err > 1e4 * eps, out["tiny qkv colwise"]


class _TiedUpDown(nn.Module):
    """An MLP whose down projection is its up projection's weight (tied): no cut fits both."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8, bias=False)
        self.down = nn.Linear(8, 8, bias=False)
        self.down.weight = self.up.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def test_a_tied_parameter_cut_two_ways_names_both_modules_and_the_cuts():
    """It said "tied to a parameter already sharded differently", naming neither the other module nor the cuts."""
    with pytest.raises(ConfigError) as err:
        apply_tensor_parallel(_TiedUpDown(), {"up": "colwise", "down": "rowwise"}, FAKE)
    msg = str(err.value)
    assert "down.weight is the same parameter as up.weight (tied)" in msg, msg
    assert "up.weight along dimension 0, down.weight along dimension 1" in msg, msg
    assert "untie them" in msg, msg
