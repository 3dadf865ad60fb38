"""The reference GPT (hetero.models) and the examples' corpus / batch helpers (examples/corpus.py)."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from hetero.models import GPT, GPTConfig, generate_greedy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))  # the corpus reader is example code, not part of the library
from corpus import DEFAULT_CORPUS, VOCAB_SIZE, batches, decode, encode, load_corpus  # noqa: E402


def small_config(**overrides) -> GPTConfig:
    kwargs = dict(vocab_size=VOCAB_SIZE, n_layer=2, n_head=4, n_embd=32, block_size=16)
    kwargs.update(overrides)
    return GPTConfig(**kwargs)


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- GPT -------------------------------------------------------------------------------------------------------
def test_config_is_keyword_only_and_checks_heads():
    with pytest.raises(TypeError):
        GPTConfig(256, 2, 4, 32, 16)  # type: ignore[misc]
    with pytest.raises(ValueError, match="divisible"):
        small_config(n_embd=30)


def test_shapes_and_finite_loss():
    model = GPT(small_config())
    ids = torch.randint(0, VOCAB_SIZE, (3, 16))
    out = model(ids)
    assert out.logits.shape == (3, 16, VOCAB_SIZE) and out.loss is None
    out = model(input_ids=ids, labels=ids)
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    # A fresh model predicts almost uniformly: loss near ln(vocab).
    assert abs(model(ids, labels=torch.randint(0, VOCAB_SIZE, (3, 16))).loss.item() - math.log(VOCAB_SIZE)) < 0.5
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_loss_uses_aligned_labels_and_ignores_minus_100():
    model = GPT(small_config())
    ids = torch.randint(0, VOCAB_SIZE, (2, 16))
    labels = torch.randint(0, VOCAB_SIZE, (2, 16))
    out = model(ids, labels=labels)
    # No shift inside: position t is scored against labels[:, t].
    expected = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB_SIZE), labels.reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    masked = labels.clone()
    masked[:, 8:] = -100
    expected = torch.nn.functional.cross_entropy(out.logits[:, :8].reshape(-1, VOCAB_SIZE), labels[:, :8].reshape(-1))
    torch.testing.assert_close(model(ids, labels=masked).loss, expected)


def test_causal():
    model = GPT(small_config())
    ids = torch.randint(0, VOCAB_SIZE, (1, 16))
    changed = ids.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % VOCAB_SIZE
    torch.testing.assert_close(model(ids).logits[:, :10], model(changed).logits[:, :10])


def test_too_long_sequence_is_an_error():
    with pytest.raises(ValueError, match="block_size"):
        GPT(small_config())(torch.zeros(1, 17, dtype=torch.long))


def test_tied_weights_are_one_parameter():
    model = GPT(small_config())
    assert model.lm_head.weight is model.embed.weight
    names = [n for n, _ in model.named_parameters()]
    assert "embed.weight" in names and "lm_head.weight" not in names  # counted (and sharded) once
    ids = torch.randint(0, VOCAB_SIZE, (2, 16))
    model(ids, labels=ids).loss.backward()
    assert model.lm_head.weight.grad is model.embed.weight.grad
    with torch.no_grad():
        model.embed.weight[0, 0] = 7.0
    assert model.lm_head.weight[0, 0] == 7.0


def test_untied_weights_are_separate():
    model = GPT(small_config(tie_weights=False, bias=False))
    assert model.lm_head.weight is not model.embed.weight
    assert not torch.equal(model.lm_head.weight, model.embed.weight)
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_gpt2_init():
    cfg = small_config(n_layer=4, n_embd=64)
    model = GPT(cfg)
    block = model.layers[0]
    assert block.attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert block.attn.o_proj.weight.std().item() == pytest.approx(resid, rel=0.1)
    assert block.mlp.proj.weight.std().item() == pytest.approx(resid, rel=0.1)
    assert torch.count_nonzero(block.mlp.fc.bias) == 0
    assert torch.equal(block.ln_1.weight, torch.ones(64))


def test_init_is_deterministic_per_seed():
    torch.manual_seed(1)
    a = GPT(small_config())
    torch.manual_seed(1)
    b = GPT(small_config())
    torch.manual_seed(2)
    c = GPT(small_config())
    assert same_params(a, b)
    assert not same_params(a, c)


def test_reset_parameters_reproduces_init():
    torch.manual_seed(3)
    a = GPT(small_config())
    b = GPT(small_config())
    assert not same_params(a, b)
    torch.manual_seed(3)
    b.reset_parameters()
    assert same_params(a, b)


def test_materialise_from_meta():
    torch.manual_seed(4)
    reference = GPT(small_config())
    with torch.device("meta"):
        model = GPT(small_config())
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.embed.weight
    model.to_empty(device="cpu")
    torch.manual_seed(4)
    model.reset_parameters()
    assert model.lm_head.weight is model.embed.weight  # to_empty unties; reset_parameters ties again
    assert same_params(reference, model)


def test_generate_greedy_matches_unpadded_forward():
    model = GPT(small_config()).eval()
    prompt = torch.randint(0, VOCAB_SIZE, (1, 5))
    out = generate_greedy(model, prompt, max_new_tokens=20, block_size=16)
    assert out.shape == (1, 25) and torch.equal(out[:, :5], prompt)
    ids = prompt
    for _ in range(20):  # the same decoding without padding: right-padding must not change a causal model's choice
        nxt = model(ids[:, -16:]).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    assert torch.equal(out, ids)


# ---- data ------------------------------------------------------------------------------------------------------
def test_corpus_ships_and_is_large_enough():
    assert DEFAULT_CORPUS == ROOT / "examples" / "data" / "tiny_corpus.txt"
    assert DEFAULT_CORPUS.stat().st_size > 100_000
    text = load_corpus()
    assert text.isascii() and "Once upon a time" in text


def test_corpus_is_what_the_generator_makes():
    spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "examples" / "data" / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.make_corpus() == load_corpus()


def test_load_corpus_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_corpus(str(tmp_path / "nope.txt"))


def test_tokenizer_round_trip():
    text = "héllo, wörld\n"
    ids = encode(text)
    assert ids.dtype == torch.uint8 and ids.numel() == len(text.encode())
    assert decode(ids) == text
    assert decode(ids.tolist()) == text
    assert decode(ids[:2]) == "h\ufffd"  # half a character: replaced, not an error


def test_batches_shapes_and_next_byte_labels():
    text = load_corpus()
    raw = text.encode()
    batch = next(batches(text, block_size=32, batch_size=4, seed=0))
    assert set(batch) == {"input_ids", "labels"}
    for v in batch.values():
        assert v.shape == (4, 32) and v.dtype == torch.long
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    for row, labels in zip(batch["input_ids"], batch["labels"]):
        # The inputs plus the last label are one window of the text: each label is the byte after its input.
        assert bytes(row.tolist()) + bytes([labels[-1].item()]) in raw


def test_batches_hf_labels_copy_inputs():
    batch = next(batches(load_corpus(), block_size=16, batch_size=2, seed=0, hf_labels=True))
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert batch["labels"].data_ptr() != batch["input_ids"].data_ptr()


def take(it, n):
    return [next(it) for _ in range(n)]


def test_batches_deterministic_per_seed():
    text = load_corpus()
    a = take(batches(text, block_size=16, batch_size=4, seed=5), 3)
    b = take(batches(text, block_size=16, batch_size=4, seed=5), 3)
    c = take(batches(text, block_size=16, batch_size=4, seed=6), 3)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    assert not all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, c))
    assert not torch.equal(a[0]["input_ids"], a[1]["input_ids"])  # successive batches differ


def test_batches_leave_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    take(batches(load_corpus(), block_size=16, batch_size=4, seed=5), 2)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_slices_partition_the_global_batch(world_size):
    text = load_corpus()
    whole = take(batches(text, block_size=16, batch_size=4 * world_size, seed=7), 3)
    ranks = [
        take(batches(text, block_size=16, batch_size=4, seed=7, rank=r, world_size=world_size), 3)
        for r in range(world_size)
    ]
    for step in range(3):
        for key in ("input_ids", "labels"):
            joined = torch.cat([ranks[r][step][key] for r in range(world_size)])
            assert torch.equal(joined, whole[step][key])


def test_batches_reject_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        next(batches("abc" * 100, block_size=4, batch_size=2, seed=0, rank=2, world_size=2))
    with pytest.raises(ValueError, match="too short"):
        next(batches("abc", block_size=4, batch_size=2, seed=0))
    with pytest.raises(ValueError, match="batch_size"):
        next(batches("abc" * 100, block_size=4, batch_size=0, seed=0))
