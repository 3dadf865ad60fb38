"""Activation checkpointing and offload of blocks however they are called: inputs given by keyword, and what happens
to the offloaded inputs when the host has no room for them.

A checkpointed block keeps its inputs from forward to backward; with `activation_offload` they wait in host memory,
whether the model passes them by position (`block(h)`) or by keyword (`block(x=h)`). Checkpointing changes when the
forward runs, not what it computes, so every run here ends within fp32 rounding of plain PyTorch's float64 run
(tests/tolerance.py), as a run without checkpointing does.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
from torch import nn

import hetero
from hetero import standin
from tests import test_unmodified_models as unmodified

DIM, VOCAB, LAYERS = 16, 32, 3


class KeywordBlock(nn.Module):
    """A residual MLP block whose inputs are keyword-only, as many user models call their blocks."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(p)

    def forward(self, *, x: torch.Tensor, gate: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * gate * self.fc2(self.drop(torch.relu(self.fc1(self.ln(x)))))


class KeywordModel(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(KeywordBlock(p) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            # each block's gate is its own tensor, made here by operations that save nothing for backward: the block
            # alone keeps it
            h = layer(x=h, gate=1 + 0.5 * h.mean(-1, keepdim=True), scale=0.5)
        return self.head(h)


def _loss(runner, ids, i):
    return nn.functional.cross_entropy(runner(ids).flatten(0, 1), ids.roll(-1, 1).flatten())


def _batches(n: int = 3, rows: int = 4, seq: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (rows, seq), generator=g) for _ in range(n)]


def _model(p: float = 0.0) -> KeywordModel:
    torch.manual_seed(0)
    return KeywordModel(p)


@pytest.mark.parametrize("stage", [0, 3])
def test_offload_takes_inputs_given_by_keyword(stage):
    """Blocks called with keywords only train to plain PyTorch's losses and weights with their inputs offloaded, and
    those inputs leave the device: before, only positional inputs were offloaded, so `block(x=h)` kept every block's
    input on the device until backward (offload saved nothing, silently)."""
    batches = _batches()
    refs = unmodified._references(_model(), batches, _loss)
    cfg = {"zero_stage": stage, "activation_checkpointing": True, "activation_offload": True, "chunk_size": 2048}
    if stage == 3:
        cfg["offload"] = {"params": "host", "optimizer": "host"}
    unmodified._compare(unmodified._train(_model(), batches, engine_cfg=cfg, loss_of=_loss), refs)

    model = _model()
    engine = hetero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    given: list[weakref.ref] = []
    for layer in model.layers:
        layer.register_forward_pre_hook(
            lambda m, args, kwargs: given.extend(weakref.ref(kwargs[k]) for k in ("x", "gate")), with_kwargs=True
        )
    ids = batches[0]
    loss = _loss(engine, ids, 0)
    gc.collect()
    # The hidden states and the gates of every block: none is alive on the device between forward and backward.
    alive = [r() for r in given if r() is not None]
    assert not alive, f"{len(alive)} of {len(given)} keyword inputs still held on the device after forward"
    rows, seq = ids.shape
    assert engine.activations.offloaded_bytes == LAYERS * (rows * seq * DIM + rows * seq) * 4
    engine.backward(loss)
    engine.step()
    engine.close()


class PairBlock(nn.Module):
    """A block given a tuple by position, as Llama-style code passes the rotary `(cos, sin)` pair."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = pair
        return x + torch.tanh(self.fc(x)) * cos + sin


class PairModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(PairBlock() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        angle = torch.arange(DIM, dtype=self.head.weight.dtype) / DIM
        pair = (torch.cos(angle), 0.1 * torch.sin(angle))
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h, pair)
        return self.head(h)


def test_offload_keeps_tuple_inputs_as_given():
    """A tuple given by position is passed to the recomputation as it was: before, every two-element tuple among the
    positional inputs was taken for an offloaded tensor's (tensor, requires_grad) record, so `(cos, sin)` became
    `cos.requires_grad_(sin)` and backward raised a TypeError."""
    batches = _batches()
    torch.manual_seed(0)
    model = PairModel()
    refs = unmodified._references(model, batches, _loss)
    cfg = {"zero_stage": 0, "activation_checkpointing": True, "activation_offload": True}
    unmodified._compare(unmodified._train(model, batches, engine_cfg=cfg, loss_of=_loss), refs)


def test_host_out_of_memory_while_offloading_frees_what_it_took():
    """A host too small for a batch's offloaded inputs raises TierOutOfMemoryError naming activation_offload and the
    block, and gives back what that block's inputs had taken: before, an input already copied to a pinned host chunk
    when the next one found no room stayed pinned for good (the host budget shrank by it for the rest of the run),
    and every chunk made for the block stayed listed in the manager. A loop that catches the error and goes on with
    smaller batches then trains as a fresh engine does."""
    rows, seq = 16, 32
    x_bytes, gate_bytes = rows * seq * DIM * 4, rows * seq * 4
    # Room for the first block's inputs and the second's hidden states, not for its gate.
    budget = 2 * x_bytes + gate_bytes + gate_bytes // 2
    cfg = {
        "zero_stage": 0,
        "activation_checkpointing": True,
        "activation_offload": True,
        "memory": {"host_budget": budget},
    }
    small = _batches(n=2)
    losses = {}
    for fails_first in (True, False):
        model = _model()
        engine = hetero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
        chunks = len(engine.manager.chunks)
        if fails_first:
            with pytest.raises(hetero.TierOutOfMemoryError) as failed:
                _loss(engine, torch.randint(0, VOCAB, (rows, seq)), 0)
            notes = "\n".join(getattr(failed.value, "__notes__", [])) + str(failed.value)
            assert "activation_offload" in notes and "layers.1" in notes, notes
            assert len(engine.manager.chunks) == chunks
            assert engine.memory_stats()["host"]["current"] == 0
        got = []
        for ids in small:
            loss = _loss(engine, ids, 0)
            engine.backward(loss)
            engine.step()
            got.append(loss.item())
        losses[fails_first] = got
        engine.close()
    assert losses[True] == losses[False]


def test_dropout_masks_of_blocks_given_device_tensors_by_keyword(monkeypatch):
    """A block given its tensors by keyword only redraws the same dropout masks in its recomputation on the GPU too.
    torch's checkpoint saves and restores the random state of the devices of its positional tensors only (the CPU's
    always), so hetero puts a zero-size device tensor first. On a CPU-only machine the tensors the checkpoint takes
    its devices from are checked: before, `block(x=h)` gave it none, and on CUDA its masks were redrawn afresh."""
    import torch.utils.checkpoint as ckpt

    seen: list[tuple] = []
    real = ckpt._infer_device_type  # reads the same positional arguments as get_device_states, also without CUDA

    def recording(*args):
        seen.append(args)
        return real(*args)

    monkeypatch.setattr(ckpt, "_infer_device_type", recording)
    model = _model(p=0.3)
    engine = hetero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": 0, "activation_checkpointing": True}
    )
    token = engine.activations._token
    engine.backward(_loss(engine, _batches(n=1)[0], 0))
    engine.step()
    engine.close()
    assert len(seen) >= LAYERS
    assert all(any(a is token for a in args) for args in seen), "the device's random state was not saved"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the CPU's random state is always saved")
@pytest.mark.parametrize("offload", [False, True])
def test_dropout_under_checkpointing_on_cuda_same_bits(offload):
    """On the GPU, blocks called by keyword with dropout train to the bits of the run without checkpointing."""
    batches = [b.cuda() for b in _batches()]
    results = []
    for extra in ({}, {"activation_checkpointing": True, "activation_offload": offload}):
        model = _model(p=0.3)
        engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": 0, **extra})
        torch.manual_seed(5)
        for ids in batches:
            engine.backward(_loss(engine, ids, 0))
            engine.step()
        results.append({k: v.cpu().clone() for k, v in engine.full_state_dict().items()})
        engine.close()
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k


class SharedBiasModel(nn.Module):
    """Every block is given the same additive bias (as an attention mask or an encoder's output is given to every
    layer), by position or by keyword; `mutate` scales it in place after each block, a write its blocks must see."""

    def __init__(self, by_keyword: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(BiasBlock() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)
        self.by_keyword = by_keyword
        self.mutate = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        bias = torch.linspace(-1, 1, ids.shape[1] * DIM).reshape(ids.shape[1], DIM).expand(*ids.shape, DIM).clone()
        for layer in self.layers:
            h = layer(x=h, bias=bias) if self.by_keyword else layer(h, bias)
            if self.mutate:
                bias.mul_(0.5)
        return self.head(h)


class BiasBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x) + bias)


@pytest.mark.parametrize("by_keyword", [False, True])
def test_offload_copies_a_tensor_given_to_every_block_once(by_keyword):
    """A tensor given to every block goes to the host once, its chunk shared and freed after the last recomputation
    that needs it: before, each block copied it again (a float attention mask or an encoder's output took the host
    memory of one copy per layer), and the training is plain PyTorch's."""
    batches = _batches()
    torch.manual_seed(0)
    model = SharedBiasModel(by_keyword)
    refs = unmodified._references(model, batches, _loss)
    cfg = {"zero_stage": 0, "activation_checkpointing": True, "activation_offload": True}
    got = unmodified._train(model, batches, engine_cfg=cfg, loss_of=_loss)
    unmodified._compare(got, refs)

    engine = hetero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    chunks = len(engine.manager.chunks)
    ids = batches[0]
    loss = _loss(engine, ids, 0)
    x_bytes = ids.numel() * DIM * 4
    # Each block's hidden states, and the bias once.
    assert engine.activations.offloaded_bytes == LAYERS * x_bytes + x_bytes
    engine.backward(loss)
    engine.step()
    assert len(engine.manager.chunks) == chunks  # every host copy freed, the shared one too
    engine.close()


@pytest.mark.parametrize("offload", [False, True])
def test_an_input_written_in_place_after_its_block_is_an_error(offload, monkeypatch):
    """A block's input written in place after the block ran is refused in backward, as torch's checkpoint refuses it
    (the recomputation would read other values than the forward did). With offload the checkpoint holds no input to
    check, and the host copy, made as forward moves on, raced the write: before, backward took whichever values the
    copy found, with no error (the stale bias here, or the new one: gradients of the wrong inputs, silently)."""
    if offload and standin.active():
        pytest.skip("the stand-in stops the copy itself, as racing the write ([Note: the CPU stand-in])")
    torch.manual_seed(0)
    model = SharedBiasModel(by_keyword=True)
    model.mutate = True
    cfg = {"zero_stage": 0, "activation_checkpointing": True, "activation_offload": offload}
    engine = hetero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    copy = engine.device.copy

    def slow_copy(dst, src, *, after=None):
        if threading.current_thread().name.startswith("hetero-act"):
            time.sleep(0.05)  # a copy to the host that lands after the forward's next operations (a GPU's, at times)
        copy(dst, src, after=after)

    monkeypatch.setattr(engine.device, "copy", slow_copy)
    loss = _loss(engine, _batches(n=1)[0], 0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        engine.backward(loss)
    engine.close()


@pytest.mark.parametrize("selection", [["layers"], ["ModuleList"]])
def test_a_selected_module_list_checkpoints_its_blocks(selection):
    """A selection naming the ModuleList itself (`["model.layers"]`, or its class) checkpoints the blocks in it: a
    ModuleList is never called, so before, checkpointing it (and the blocks inside, skipped as within a chosen
    module) recomputed nothing, silently."""
    model = _model()
    calls = [0]
    model.layers[0].fc1.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    engine = hetero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": 0, "activation_checkpointing": selection}
    )
    assert [name for name, _ in engine.activations.blocks] == [f"layers.{i}" for i in range(LAYERS)]
    engine.backward(_loss(engine, _batches(n=1)[0], 0))
    engine.step()
    engine.close()
    assert calls[0] == 2  # the forward and the recomputation


def _two_forwards_then_two_backwards(cfg: dict) -> tuple[dict[str, torch.Tensor], int]:
    model = _model()
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    chunks = len(engine.manager.chunks)
    a, b = _batches(n=2)
    loss_a = _loss(engine, a, 0)
    loss_b = _loss(engine, b, 0)
    engine.backward(loss_a)
    engine.backward(loss_b)
    engine.step()
    state = {k: v.clone() for k, v in engine.full_state_dict().items()}
    left = len(engine.manager.chunks) - chunks
    engine.close()
    return state, left


@pytest.mark.parametrize("stage", [0, 3])
def test_two_forwards_then_a_backward_of_each(stage):
    """Two forwards, then a backward of each, train as without checkpointing (the same fp32 operations, so the same
    bits), every host copy freed at the end: before, the first backward's end freed the second forward's offloaded
    inputs too, and its recomputation ran on None (a TypeError inside the model)."""
    base = {"zero_stage": stage}
    plain, _ = _two_forwards_then_two_backwards(base)
    got, left = _two_forwards_then_two_backwards({**base, "activation_checkpointing": True, "activation_offload": True})
    assert left == 0
    for k in plain:
        assert torch.equal(got[k], plain[k]), k
