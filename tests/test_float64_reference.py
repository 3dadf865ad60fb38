"""A Hugging Face model in float64, the exact run of the parity tests, computes its loss in float64; fp32 and bf16
models compute theirs as transformers does, bit for bit ([Note: float64 references keep their loss in float64] in
tests/hf_float64.py).

The bound on the float64 loss: the model's loss and the hand-computed one are the same float64 cross entropy of the
same logits, so they differ by float64 rounding at most (a few ulps of a sum of 30 terms, ~1e-15 relative). A loss
computed in fp32 is one fp32 rounding away at least (~6e-8 relative for these seeds: 5e-8 measured on 5.24), four
orders of magnitude above the bound."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist import run_distributed

transformers = pytest.importorskip("transformers")
loss_utils = pytest.importorskip("transformers.loss.loss_utils")

VOCAB = 64
REL = 1e-12  # float64 rounding of a 30-term sum is ~1e-15; fp32's is ~1e-8 (module docstring)


def _llama(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def _by_hand(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _float64_errors(_rank: int = 0, _world: int = 1) -> tuple[float, float]:
    """The float64 model's loss, and its logits' gradient, relative to float64's cross entropy of its logits."""
    ids = _ids()
    out = _llama(torch.float64)(ids, labels=ids)
    out.logits.retain_grad()
    out.loss.backward()
    logits = out.logits.detach().requires_grad_()
    exact = _by_hand(logits, ids)
    exact.backward()
    loss_err = abs(out.loss.item() - exact.item()) / abs(exact.item())
    grad_err = float((out.logits.grad - logits.grad).norm() / logits.grad.norm())
    return loss_err, grad_err


def test_float64_reference_loss_is_float64():
    loss_err, grad_err = _float64_errors()
    assert loss_err <= REL and grad_err <= REL, f"loss {loss_err:.3g}, logits' gradient {grad_err:.3g} from float64"


def test_float64_reference_loss_in_the_ranks():
    """The ranks run_distributed starts (forked from its server, which preloads the models) see it too."""
    for loss_err, grad_err in run_distributed(_float64_errors, 2, timeout=60):
        assert loss_err <= REL and grad_err <= REL, f"loss {loss_err:.3g}, gradient {grad_err:.3g} from float64"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precisions_unchanged_bit_for_bit(dtype):
    """fp32 and bf16 models: the loss and the logits' gradient are transformers' own ForCausalLMLoss's, bit for bit
    (bf16 logits upcast to fp32 as before)."""
    ids = _ids()
    out = _llama(dtype)(ids, labels=ids)
    out.logits.retain_grad()
    out.loss.backward()
    logits = out.logits.detach().requires_grad_()
    theirs = loss_utils.ForCausalLMLoss(logits, ids, VOCAB)
    theirs.backward()
    assert out.loss.dtype == theirs.dtype == torch.float32
    assert torch.equal(out.loss, theirs) and torch.equal(out.logits.grad, logits.grad)


def test_what_else_reads_the_losses_is_unchanged():
    """Transformers' Trainer asks LOSS_MAPPING whether a model's loss `is ForCausalLMLoss`; hetero's tensor layouts
    set `model.loss_function` and test that the class's is a property; a masked-LM loss type keeps float64 too, with
    its arguments by keyword, and a causal one with them by position (hetero's pipeline calls it so)."""
    assert loss_utils.LOSS_MAPPING["ForCausalLM"] is loss_utils.ForCausalLMLoss
    model = _llama(torch.float64)
    assert isinstance(type(model).loss_function, property)
    logits = torch.randn(2, 16, VOCAB, dtype=torch.float64)
    ids = _ids()
    positional = model.loss_function(logits, ids, VOCAB)
    assert positional.dtype == torch.float64 and abs(float(positional - _by_hand(logits, ids))) <= REL * 10
    model.loss_type = "ForMaskedLM"
    masked = model.loss_function(logits=logits, labels=ids, vocab_size=VOCAB)
    assert masked.dtype == torch.float64
    mine = object()
    model.loss_function = mine
    assert model.loss_function is mine
