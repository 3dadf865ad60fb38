"""A Hugging Face decoder left with `use_cache=True` (its config's default) under activation checkpointing: a training
forward builds no KV cache (each recomputation filled it again: twice the keys and values), the model's config is not
changed, and evaluation and `generate` keep their cache ([Note: no KV cache under recomputation] in
hetero/kv_cache.py)."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from torch import nn

import hetero

try:
    import transformers
except ImportError:  # the toy model's test runs without it
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is not installed")

LAYERS, SEQ = 2, 10


def _llama(*, use_cache: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=use_cache,
    )
    return transformers.LlamaForCausalLM(cfg)


def _engine(model: torch.nn.Module, checkpointing: bool = True, stage: int = 3) -> hetero.Engine:
    # SGD at lr 1 without momentum: a step moves each parameter by minus its gradient, so the states compare gradients
    config = {"zero_stage": stage, "chunk_size": 8192, "activation_checkpointing": checkpointing}
    return hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), config)


@pytest.fixture
def cache_writes(monkeypatch):
    """The (grad enabled, keys' shape) of every write into a KV cache."""
    writes = []
    update = transformers.DynamicCache.update

    def counted(self, keys, *args, **kwargs):
        writes.append((torch.is_grad_enabled(), tuple(keys.shape)))
        return update(self, keys, *args, **kwargs)

    monkeypatch.setattr(transformers.DynamicCache, "update", counted)
    return writes


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))


@needs_transformers
def test_training_builds_no_cache_and_config_kept(cache_writes):
    model = _llama(use_cache=True)
    engine = _engine(model)
    ids = _ids()
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    engine.step()
    # Without the guard every layer wrote its keys in forward and again in its recomputation (2 x LAYERS writes, the
    # cache holding keys 2 x SEQ long); with the config switched off for good none wrote, but config.use_cache stayed
    # False after training and in the checkpoints saved from it.
    assert cache_writes == []
    assert out.past_key_values is None
    assert model.config.use_cache is True
    # Evaluation keeps its cache, built once: one write of SEQ positions per layer.
    with torch.no_grad():
        out = engine(input_ids=ids)
    assert cache_writes == [(False, (2, 2, SEQ, 16))] * LAYERS
    assert out.past_key_values.get_seq_length() == SEQ
    # generate (without autograd) feeds one new token a step: the cache holds the rest.
    cache_writes.clear()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert [shape[2] for _, shape in cache_writes] == [SEQ] * LAYERS + [1] * LAYERS * 2
    engine.close()


@needs_transformers
def test_closed_engine_gives_the_cache_back(cache_writes):
    """Closed, the model is the user's again: a forward with autograd builds its cache as transformers does. (Stage 0:
    at stage 3 a closed engine's parameters stay released, and the model cannot run by itself.)"""
    model = _llama(use_cache=True)
    engine = _engine(model, stage=0)
    ids = _ids()
    engine(input_ids=ids)
    assert cache_writes == []
    engine.close()
    model(input_ids=ids)
    assert len(cache_writes) == LAYERS


@needs_transformers
def test_explicit_use_cache_overridden_with_a_warning(cache_writes, caplog):
    model = _llama(use_cache=False)
    engine = _engine(model)
    ids = _ids()
    with caplog.at_level(logging.WARNING, logger="hetero.activation"):
        out = engine(input_ids=ids, labels=ids, use_cache=True)
    engine.backward(out.loss)
    engine.step()
    assert cache_writes == []
    assert "use_cache=True in a forward with autograd" in caplog.text
    engine.close()


@needs_transformers
def test_same_losses_and_gradients():
    """use_cache on or off in the config trains alike under checkpointing, and as without checkpointing: equal
    exactly, since the same kernels run on the same inputs (a recomputation recomputes the forward's values bit for
    bit, and the cache of a forward without checkpointing only stores the keys it returns)."""
    ids = [torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    runs = {}
    for name, use_cache, checkpointing in [("on", True, True), ("off", False, True), ("plain", True, False)]:
        model = _llama(use_cache=use_cache)
        engine = _engine(model, checkpointing)
        before = engine.full_state_dict()
        losses = []
        for x in ids:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
            if not losses[1:]:
                grads = {k: before[k] - v for k, v in engine.full_state_dict().items()}  # lr 1: the first gradient
        runs[name] = (torch.stack(losses), grads)
        engine.close()
    for name in ("off", "plain"):
        torch.testing.assert_close(runs["on"][0], runs[name][0], rtol=0, atol=0)
        torch.testing.assert_close(runs["on"][1], runs[name][1], rtol=0, atol=0)


class _Toy(nn.Module):
    """A model with a Hugging Face-like `config.use_cache`, taking `use_cache` by position or (keyword_only) by
    keyword only; it records the `use_cache` each forward saw."""

    def __init__(self, keyword_only: bool) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(use_cache=True)
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.seen = []
        if keyword_only:
            self.forward = self._forward_keyword_only

    def forward(self, x, use_cache=None):
        return self._run(x, use_cache)

    def _forward_keyword_only(self, x, *, use_cache=None):
        return self._run(x, use_cache)

    def _run(self, x, use_cache):
        self.seen.append(use_cache)
        for layer in self.layers:
            x = layer(x)
        return x.sum()


@pytest.mark.parametrize("keyword_only", [False, True])
def test_use_cache_by_position_or_keyword(keyword_only, caplog):
    model = _Toy(keyword_only)
    engine = hetero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": 0, "activation_checkpointing": True}
    )
    x = torch.ones(2, 4)
    with caplog.at_level(logging.WARNING, logger="hetero.activation"):
        engine.backward(engine(x, use_cache=True) if keyword_only else engine(x, True))
    engine.step()
    engine.backward(engine(x))
    engine.step()
    with torch.no_grad():
        engine(x)
        engine(x, use_cache=True)
    # with autograd always False (the given True overridden, with a warning); without it, as given
    assert model.seen == [False, False, None, True]
    assert caplog.text.count("use_cache=True in a forward with autograd") == 1
    engine.close()


def _first_step(model: torch.nn.Module, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and the first gradient (SGD at lr 1: before minus after) of one hetero step under checkpointing."""
    engine = _engine(model)
    before = engine.full_state_dict()
    ids = _ids()
    loss = engine(input_ids=ids, labels=ids, **kwargs).loss
    engine.backward(loss)
    engine.step()
    grads = {k: before[k] - v for k, v in engine.full_state_dict().items()}
    engine.close()
    return loss.detach(), grads


@needs_transformers
def test_explicit_cache_object_filled_as_under_transformers_checkpointing(cache_writes, caplog):
    """A cache object given with use_cache=True reached the checkpointed layers whatever use_cache said: each wrote its
    keys in forward and again in its recomputation (the cache held 2 x SEQ positions, where plain PyTorch under
    transformers' own gradient checkpointing leaves it empty: its layers run without the cache, with a warning)."""
    reference = _llama(use_cache=True)
    reference.gradient_checkpointing_enable()
    reference.train()
    theirs = transformers.DynamicCache()
    ids = _ids()
    reference(input_ids=ids, labels=ids, past_key_values=theirs, use_cache=True).loss.backward()
    cache_writes.clear()

    ours = transformers.DynamicCache()
    with caplog.at_level(logging.WARNING, logger="hetero.activation"):
        loss, grads = _first_step(_llama(use_cache=True), past_key_values=ours, use_cache=True)
    assert ours.get_seq_length() == theirs.get_seq_length() == 0
    assert cache_writes == []
    assert "LlamaDecoderLayer was given a KV cache (cache) in a forward with autograd" in caplog.text
    # Training as without the cache object, exactly: the same kernels on the same inputs (an empty cache offsets no
    # position and adds no keys).
    plain_loss, plain_grads = _first_step(_llama(use_cache=True))
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    torch.testing.assert_close(grads, plain_grads, rtol=0, atol=0)
    # Without autograd nothing recomputes: the given cache is filled, once.
    model = _llama(use_cache=True)
    engine = _engine(model)
    given = transformers.DynamicCache()
    with torch.no_grad():
        engine(input_ids=ids, past_key_values=given, use_cache=True)
    assert given.get_seq_length() == SEQ
    engine.close()


class _Cache:
    """A cache object (hetero maps over lists and tuples of inputs, so a list would reach the model as a copy)."""

    def __init__(self) -> None:
        self.writes = 0


class _CachedBlock(nn.Module):
    """A layer that counts a write into the cache it is given (by position or by keyword), as a decoder layer
    appends its keys; `_can_checkpoint_with_cache` marks one that only reads it."""

    def __init__(self, reads_only: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self._can_checkpoint_with_cache = reads_only

    def forward(self, x, layer_past=None):
        if layer_past is not None:
            layer_past.writes += 1
        return self.linear(x)


class _CachedToy(nn.Module):
    def __init__(self, reads_only: bool) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(use_cache=True)
        self.layers = nn.ModuleList([_CachedBlock(reads_only) for _ in range(2)])

    def forward(self, x, cache=None, use_cache=None):
        x = self.layers[0](x, cache)  # by position
        return self.layers[1](x, layer_past=cache).sum()  # by keyword


@pytest.mark.parametrize("reads_only", [False, True])
def test_cache_object_by_position_or_keyword(reads_only):
    model = _CachedToy(reads_only)
    engine = hetero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": 0, "activation_checkpointing": True}
    )
    cache = _Cache()
    engine.backward(engine(torch.ones(2, 4), cache))
    engine.step()
    # a writer runs without it under autograd; a reader keeps it (and here counts once per run: forward, recompute)
    assert cache.writes == (4 if reads_only else 0)
    with torch.no_grad():
        engine(torch.ones(2, 4), cache)
    assert cache.writes == (6 if reads_only else 2)
    engine.close()
