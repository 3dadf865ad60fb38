"""A meta-device model's first values equal normal construction's bit for bit, for initialisers that write a tensor
more than once (GPT-2's `_init_weights`, a `reset_parameters` scaling a weight after drawing another), draw in a
module's constructor (transformers' Conv1D), put a Hugging Face base model under an untied head, or tie an inner
model's weights to an outer one's (T5), or leave some tensors to torch's default inits (a model's own
`_init_weights`). Values are
compared exactly: the same initialiser drawing the same numbers in the same order gives the same bits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hetero
from tests.dist import run_distributed

transformers = pytest.importorskip("transformers")

# Small chunks (elements), so that a tensor's rewrite comes after other chunks' tensors were written.
CHUNK = 2048


def _llama(tie: bool) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(cfg)


def _gpt2(tie: bool) -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=tie
    )
    return transformers.GPT2LMHeadModel(cfg)


class _Rescaled(nn.Module):
    """Draws `a`, then `b` (another chunk), then scales `a`: normal construction keeps the scaled `a`."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(64, 32))
        self.b = nn.Parameter(torch.empty(64, 32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.a)
        nn.init.normal_(self.b)
        self.a.data.mul_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.a.t() + x @ self.b.t()


def _first_values(build, stage: int, chunk: int = CHUNK) -> tuple[dict, dict]:
    torch.manual_seed(0)
    normal = build()
    torch.manual_seed(0)
    with hetero.lazy_init():
        model = build()
    offload = {"params": "host", "optimizer": "host"} if stage == 3 else {}
    config = {"zero_stage": stage, "chunk_size": chunk, "offload": offload, "progress": False}
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    got = engine.full_state_dict()
    buffers = {n: b.detach().cpu().clone() for n, b in model.named_buffers()}
    engine.close()
    return got, {"state": normal.state_dict(), "buffers": dict(normal.named_buffers()), "buffers_got": buffers}


def _assert_same(got: dict, ref: dict) -> None:
    assert got.keys() == ref["state"].keys()
    for k, v in ref["state"].items():
        assert torch.equal(got[k].float(), v.float()), f"{k} differs from normal construction"
    for k, v in ref["buffers"].items():  # non-persistent ones too (rotary tables)
        assert torch.equal(ref["buffers_got"][k].float(), v.float()), f"buffer {k} differs from normal construction"


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("tie", [True, False])
def test_llama_untied_head_matches_normal_construction(stage, tie):
    # The head's numbers come after the base model's walk, which skips the modules the base model initialised.
    _assert_same(*_first_values(lambda: _llama(tie), stage))


@pytest.mark.parametrize("stage,chunk", [(1, CHUNK), (3, CHUNK), (3, 1024)])  # 1024: the Conv1D weights are tiled
@pytest.mark.parametrize("tie", [True, False])
def test_gpt2_rewrites_and_constructor_draws_match_normal_construction(stage, chunk, tie):
    # GPT-2's walk draws each c_proj.weight twice (Conv1D, then its attention or MLP module at a scaled std), and
    # each Conv1D draws its weight in its constructor.
    _assert_same(*_first_values(lambda: _gpt2(tie), stage, chunk))


def _t5() -> nn.Module:
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8)
    return transformers.T5ForConditionalGeneration(cfg)


@pytest.mark.parametrize("stage", [1, 3])
def test_t5_shared_embedding_takes_the_outer_walks_values(stage):
    # The encoder's and decoder's embeddings (their own walks) are tied to `shared` (the outer walk, which runs last).
    _assert_same(*_first_values(_t5, stage))


class _TinyConfig(transformers.PretrainedConfig):
    model_type = "hetero_tiny"

    def __init__(self, vocab: int = 64, dim: int = 32, **kw) -> None:
        self.vocab, self.dim = vocab, dim
        super().__init__(**kw)


class _Tiny(transformers.PreTrainedModel):
    """A model of the user's own whose _init_weights has no LayerNorm branch (nor a bias one): those keep torch's
    default init, as in normal construction."""

    config_class = _TinyConfig

    def __init__(self, config: _TinyConfig) -> None:
        super().__init__(config)
        self.emb = nn.Embedding(config.vocab, config.dim)
        self.norm = nn.LayerNorm(config.dim)
        self.fc = nn.Linear(config.dim, config.dim)
        self.out = nn.Linear(config.dim, config.vocab, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)


class _Proj(nn.Module):
    """Draws its weight in its constructor, through `.data`, and has no reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(32, 32))
        self.weight.data.normal_(0, 0.02)


class _WithProj(transformers.PreTrainedModel):
    config_class = _TinyConfig

    def __init__(self, config: _TinyConfig) -> None:
        super().__init__(config)
        self.proj = _Proj()  # its draw moves the generator before the others' defaults and the walk
        self.out = nn.Linear(config.dim, config.vocab)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding, _Proj)):
            nn.init.normal_(module.weight, std=0.02)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_constructors_draw_through_data_is_drawn_again(stage):
    _assert_same(*_first_values(lambda: _WithProj(_TinyConfig()), stage))


@pytest.mark.parametrize("stage", [1, 3])
def test_a_users_init_weights_leaves_default_inits_in_place(stage):
    _assert_same(*_first_values(lambda: _Tiny(_TinyConfig()), stage))


@pytest.mark.parametrize("stage", [0, 3])
def test_a_weight_written_again_after_another_chunk_keeps_the_last_write(stage):
    torch.manual_seed(0)
    normal = _Rescaled()
    torch.manual_seed(0)
    with hetero.lazy_init():
        model = _Rescaled()
    offload = {"params": "host", "optimizer": "host"} if stage == 3 else {}
    config = {"zero_stage": stage, "chunk_size": 64 * 32, "offload": offload, "progress": False}
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    got = engine.full_state_dict()
    engine.close()
    for k, v in normal.state_dict().items():
        assert torch.equal(got[k], v), k


def _rank_gpt2(rank: int, world: int) -> list[str]:
    got, ref = _first_values(lambda: _gpt2(False), 3)
    return [k for k, v in ref["state"].items() if not torch.equal(got[k], v)]


@pytest.mark.timeout(240)
def test_gpt2_over_two_ranks_matches_normal_construction():
    # Each rank runs the initialiser and keeps its shards; the checksum all-reduce compares ranks.
    for differing in run_distributed(_rank_gpt2, 2, timeout=200):
        assert differing == []
