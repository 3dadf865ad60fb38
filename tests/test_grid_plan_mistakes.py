"""Under a grid (2D, 2.5D, 3D) the plan mistakes the 1D checks refuse are refused too, before anything is cut, naming
the layer and the plan line that fixes it ([Note: plan mistakes under a grid] in hetero/parallel/grid/plan_roles.py).
Before, under 2D at tensor 4 on this file's model: a fused q/k/v projection styled colwise (loss 4.29700) and an
attention left without `heads` (4.27686) trained a different model than plain PyTorch's (4.28275) without an error
(measured below, the checks taken away); a norm without parameters left out failed on shapes inside the forward; an
LM head tied to the embedding and styled colwise was refused as "tied to a parameter already cut differently"; GPT-2
without `heads` failed inside its forward; an MLP's swapped styles and an untied colwise head trained another model
under 3D (figures in the Note)."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetero.errors import ConfigError
from hetero.parallel.grid import Grid, apply_grid_parallel
from hetero.parallel.plans import auto_plan
from tests.dist import NEEDS_DEGREES, ranks_apart

transformers = pytest.importorskip("transformers")

D, H, V = 32, 4, 64


class Attn(nn.Module):
    """Fused q/k/v, all of q then k then v, reshaped by a head count of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = H
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.reshape(b, t, self.num_heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.attn, self.n2 = nn.LayerNorm(D), Attn(), nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


@dataclass
class Out:
    logits: torch.Tensor
    loss: torch.Tensor | None


class Tiny(nn.Module):
    """Untied head; a final norm without parameters (nothing to cut, its statistics still over the whole width)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(D, elementwise_affine=False)
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Out:
        h = self.tok(input_ids)
        for block in self.blocks:
            h = block(h)
        logits = self.lm_head(self.norm(h))
        return Out(logits, None if labels is None else self.loss_function(logits, labels))

    def loss_function(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())  # labels aligned (grid: AlignedLMLoss)


GOOD = {
    "tok": "vocab",
    "blocks.*.n?": "norm",
    "blocks.*.attn": "heads",
    "blocks.*.attn.qkv": "colwise_qkv",
    "blocks.*.attn.out": "rowwise",
    "blocks.*.mlp.0": "colwise",
    "blocks.*.mlp.2": "rowwise",
    "norm": "norm",
    "lm_head": "vocab_head",
}
SILENT = {  # the mistakes that trained a different model under 2D without an error, before the checks
    "qkv colwise": GOOD | {"blocks.*.attn.qkv": "colwise"},
    "no heads": {k: v for k, v in GOOD.items() if k != "blocks.*.attn"},
}
NO_NORM = {k: v for k, v in GOOD.items() if k != "norm"}  # before: a torch shape error inside the forward


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return Tiny()


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=D, n_layer=1, n_head=H, bos_token_id=0,
                                  eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=H, num_key_value_heads=2)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _gpt() -> nn.Module:
    from hetero.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, n_layer=1, n_head=H, n_embd=D, block_size=8))


def _refused(model: nn.Module, plan: dict, *lines: str, grid: Grid | None = None) -> str:
    """The refusal's message under 2D at tensor 4, checked to end with `lines` as the fixed plan (if given), the
    model left as it was."""
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError) as caught:
        apply_grid_parallel(model, plan, grid or Grid.shape_only("2d", 4, rank=1))
    message = str(caught.value)
    if lines:
        assert message.endswith("Fixed plan lines: {" + ", ".join(lines) + "}"), message
    assert all(v.equal(before[k]) and v.shape == before[k].shape for k, v in model.state_dict().items())
    assert not any(hasattr(p, "_hetero_tp") for p in model.parameters())
    return message


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_an_lm_head_cut_as_a_plain_layer_is_refused(style):
    message = _refused(_tiny(), GOOD | {"lm_head": style}, "'lm_head': 'vocab_head'")
    assert re.search(rf"lm_head \(Linear 32 -> 64\) is styled '{style}', but it is the LM head", message)
    assert "cannot leave it whole" in message and "token embedding's" not in message
    for build in (_gpt2, _llama, _gpt):  # GPT-2's and hetero GPT's are tied to the embedding: said so
        model = build()
        message = _refused(model, auto_plan(model) | {"lm_head": style}, "'lm_head': 'vocab_head'")
        assert ("its weight, the token embedding's, would be cut unlike" in message) == (build is not _llama)


def test_an_mlp_with_its_styles_swapped_is_refused():
    message = _refused(_tiny(), GOOD | {"blocks.*.mlp.0": "rowwise", "blocks.*.mlp.2": "colwise"},
                       "'blocks.*.mlp.0': 'colwise'", "'blocks.*.mlp.2': 'rowwise'")  # fmt: skip
    assert "blocks.0.mlp.0 (Linear 32 -> 128) is styled 'rowwise', but it reads the hidden states" in message
    assert "under '2d' and '2.5d' they compute alike" in message and "blocks.1." not in message  # once per pattern
    swaps = {
        _llama: ({"model.layers.*.mlp.gate_proj": "rowwise", "model.layers.*.mlp.up_proj": "rowwise",
                  "model.layers.*.mlp.down_proj": "colwise"}, "'model.layers.*.mlp.gate_proj': 'colwise'"),
        _gpt2: ({"transformer.h.*.mlp.c_fc": "rowwise", "transformer.h.*.mlp.c_proj": "colwise"},
                "'transformer.h.*.mlp.c_fc': 'colwise'"),
        _gpt: ({"layers.*.mlp.fc": "rowwise", "layers.*.mlp.proj": "colwise"}, "'layers.*.mlp.fc': 'colwise'"),
    }  # fmt: skip
    for build, (swap, line) in swaps.items():
        model = build()
        assert line in _refused(model, auto_plan(model) | swap, grid=Grid.shape_only("3d", 8, rank=5))


def test_a_fused_qkv_cut_wrong_is_refused():
    message = _refused(_tiny(), SILENT["qkv colwise"], "'blocks.*.attn.qkv': 'colwise_qkv'")
    assert "blocks.0.attn.qkv (Linear 32 -> 96) inside blocks.0.attn is a fused q/k/v projection" in message
    gpt2 = _gpt2()
    _refused(gpt2, auto_plan(gpt2) | {"transformer.h.*.attn.c_attn": "colwise"},
             "'transformer.h.*.attn.c_attn': 'colwise_qkv'")  # fmt: skip
    llama = _llama()  # a projection that is not fused, cut in thirds
    message = _refused(llama, auto_plan(llama) | {"model.layers.*.self_attn.q_proj": "colwise_qkv"},
                       "'model.layers.*.self_attn.q_proj': 'colwise'")  # fmt: skip
    assert "q_proj (Linear 32 -> 32) inside model.layers.0.self_attn is styled 'colwise_qkv'" in message


def test_an_attention_without_heads_and_a_norm_left_out_are_refused():
    message = _refused(_tiny(), SILENT["no heads"])
    assert re.search(r"blocks\.0\.attn \(Attn\) holds a head count \(num_heads = 4\).*Add 'blocks\.0\.attn': "
                     r"'heads' to the plan", message)  # fmt: skip
    for build, attn, said in ((_gpt2, "transformer.h.*.attn", "transformer.h.0.attn (GPT2Attention) holds a head"),
                              (_gpt, "layers.*.attn", "layers.0.attn (CausalSelfAttention) holds a head")):  # fmt: skip
        model = build()
        assert said in _refused(model, {k: v for k, v in auto_plan(model).items() if k != attn})
    message = _refused(_tiny(), NO_NORM)
    assert message.startswith("norm (LayerNorm) is a norm with no style 'norm'") and "Add 'norm': 'norm'" in message
    message = _refused(_tiny(), {k: v for k, v in GOOD.items() if k != "blocks.*.n?"})  # holding parameters
    assert "blocks.0.n1 (LayerNorm) holds parameters" in message and "add 'blocks.*.n1': 'norm'" in message
    llama = _llama()
    message = _refused(llama, {k: v for k, v in auto_plan(llama).items() if k != "model.layers.*.*_layernorm"})
    assert "add 'model.layers.*.input_layernorm': 'norm' to the plan" in message


def _losses(rank: int, world: int) -> dict:
    """On a real 2D grid of 4 ranks: the correct plan's first loss, and each silent mistake's with the checks taken
    away (what it trained before them) and with them (refused on every rank)."""
    from hetero.comm import Comm
    from hetero.parallel.grid import apply as grid_apply

    torch.set_num_threads(1)
    grid = Grid.build(Comm.world(), "2d")
    x = torch.randint(0, V, (4, 8), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, V, (4, 8), generator=torch.Generator().manual_seed(2))
    out = {}
    keep = grid_apply.check_plan_roles
    for label, plan in {"good": GOOD, **SILENT, "no norm": NO_NORM}.items():
        try:
            apply_grid_parallel(_tiny(), plan, grid)
            out[label, "refused"] = False
        except ConfigError:
            out[label, "refused"] = True
        grid_apply.check_plan_roles = lambda *a: None  # the checks taken away: what the plan trains without them
        try:
            model = _tiny()
            apply_grid_parallel(model, plan, grid)
        finally:
            grid_apply.check_plan_roles = keep
        try:
            out[label] = model(x, labels=y).loss.item()
        except RuntimeError as err:  # a shape error inside the forward
            out[label] = str(err)
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(120)
def test_the_refused_plans_trained_another_model_and_the_right_one_the_plain_model():
    """Four ranks, 2D, fp32: the correct plan's loss is plain PyTorch's to fp32 rounding; each refused silent
    mistake, its check taken away, is off by far more; the norm left out failed on shapes inside the forward."""
    from tests.dist import run_distributed

    results = run_distributed(_losses, 4, timeout=100)
    x = torch.randint(0, V, (4, 8), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, V, (4, 8), generator=torch.Generator().manual_seed(2))
    plain = _tiny()(x, labels=y).loss.item()
    eps = torch.finfo(torch.float32).eps
    for r in results:
        assert not r["good", "refused"] and abs(r["good"] - plain) <= 64 * eps * plain, (r["good"], plain)
        for label in SILENT:
            assert r[label, "refused"], label
            assert abs(r[label] - plain) > 1e4 * eps * plain, (label, r[label], plain)
        assert r["no norm", "refused"] and "expected input with shape [*, 32]" in r["no norm"], r["no norm"]
