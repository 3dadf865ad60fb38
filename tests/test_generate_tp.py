"""Hugging Face `generate` under tensor parallelism gives the plain model's tokens, greedy and sampled, on every rank:
[Note: dropout under tensor parallelism] (a region inside which nothing drew gives the shared stream back as found)
and [Note: one prompt and one stream per tensor group].

Sampling used to draw other tokens than the plain model's with the same `torch.manual_seed`: every forward entered
the tensor-parallel region once per layer, each entry moving the shared CPU stream that the sampler then drew from.
The ranks still agreed with each other, so nothing failed.

Why exact equality: the sampler maps one uniform draw per row through the cumulative probabilities (after
temperature, top-k, top-p). The draws are now the plain model's bit for bit (the CPU stream after generate is checked
equal too), and the probabilities differ only by the rounding of the tensor-parallel sums (another order over a
32-wide hidden state: ~1e-7 relative in fp32). A token differs only where a draw lands within that much of a
boundary of the cumulative sum, a chance of ~1e-7 per token here, ~1e-4 over the test's few hundred tokens; a
wrongly ordered vocabulary gather or a moved stream changes most tokens. The tiny models' logits lie close together,
so temperatures below 1 and top-k / top-p keep several tokens in play, each case drawing on the logits' values."""

from __future__ import annotations

import copy
import types

import pytest
import torch

import hetero
from hetero.parallel.tp_rng import RegionRng, inputs_device, shared_draw
from tests import grid_parity
from tests.dist import NEEDS_DEGREES, ranks_apart, run_distributed

pytest.importorskip("transformers")

SAMPLERS = {  # generate's arguments: greedy, then sampling with each of its filters
    "greedy": {"do_sample": False},
    "temperature": {"do_sample": True, "temperature": 0.05, "top_k": 0},
    "top_k": {"do_sample": True, "temperature": 0.1, "top_k": 5},
    "top_p": {"do_sample": True, "temperature": 0.1, "top_k": 0, "top_p": 0.6},
}
NEW = 6  # tokens generated per case


def _generate(model: torch.nn.Module, prompts: torch.Tensor, sampler: dict, seed: int, to: object = None) -> tuple:
    """Tokens generated from `seed` and the CPU stream's state afterwards; `to`: the engine whose device runs it."""
    torch.manual_seed(seed)
    mask = torch.ones_like(prompts)
    kwargs = {"max_new_tokens": NEW, "pad_token_id": 0, **sampler}
    with torch.no_grad():
        if to is None:
            out = model.generate(prompts, attention_mask=mask, **kwargs)
        else:
            with to.device.compute_context():
                out = model.generate(to.to_device(prompts), attention_mask=to.to_device(mask), **kwargs).cpu()
    return out, torch.get_rng_state()


def _job(rank: int, world: int, config: dict) -> dict:
    """Every sampler on Llama and GPT-2 through an engine, against the plain model generating from the same prompts
    and seed: this data-parallel replica's (each replica its own prompts and seed, the same on its tensor ranks)."""
    torch.set_num_threads(1)
    out: dict = {}
    for family in ("llama", "gpt2"):
        plain = grid_parity.build(family).eval()
        model = copy.deepcopy(plain)
        engine = hetero.initialize(model, None, {"chunk_size": 4096, "comm_timeout": 60, **config})
        model.eval()
        replica = engine.mesh.dp_rank
        prompts = torch.randint(1, grid_parity.VOCAB, (4, 5), generator=torch.Generator().manual_seed(10 + replica))
        for name, sampler in SAMPLERS.items():
            want, want_state = _generate(plain, prompts, sampler, seed=7 + replica)
            got, got_state = _generate(model, prompts, sampler, seed=7 + replica, to=engine)
            out[(family, name)] = {
                "same": torch.equal(got, want),
                "stream": torch.equal(got_state, want_state),  # moved as the plain model's, no further
                "got": got[:, prompts.shape[1] :].tolist(),
                "want": want[:, prompts.shape[1] :].tolist(),
            }
        engine.close()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world, config",
    [
        (2, {"zero_stage": 1, "parallel": {"tensor": 2}}),
        (4, {"zero_stage": 3, "parallel": {"tensor": 2}}),  # tensor 2 x data 2: each replica its own prompts
        (4, {"zero_stage": 1, "parallel": {"tensor": 4, "tensor_mode": "2d"}}),  # the whole forward is the region
    ],
    ids=["tp2", "tp2xdp2", "grid2d"],
)
def test_generate_under_tensor_parallelism_gives_the_plain_models_tokens(world, config):
    results = run_distributed(_job, world, config, timeout=270)
    for rank, r in enumerate(results):
        for key, res in r.items():
            assert res["same"], (rank, key, res["got"], res["want"])
            assert res["stream"], (rank, key)


def test_a_region_that_draws_nothing_gives_the_shared_stream_back():
    """One rank of two, single-process: a region entered and left without a draw leaves the shared CPU stream as it
    was; one that drew inside leaves it moved by the entry's draw alone (the masks' draws stay on the rank's own)."""
    rng = RegionRng(types.SimpleNamespace(rank=0, size=2))
    torch.manual_seed(3)
    start = torch.get_rng_state()
    rng.enter(None)
    rng.leave()
    assert torch.equal(torch.get_rng_state(), start)
    rng.enter(None)
    torch.rand(4)  # a dropout's mask, drawn inside
    rng.leave()
    after = torch.get_rng_state()
    torch.set_rng_state(start)
    shared_draw()
    assert torch.equal(after, torch.get_rng_state())


@pytest.mark.parametrize(
    "args, kwargs, want",
    [
        ((), {"batch": {"ids": torch.zeros(2, device="meta")}}, "meta"),  # inside a dict: was None (no swap)
        ((torch.zeros(2),), {}, "cpu"),
        ((), {}, None),
    ],
)
def test_a_bracketed_model_enters_with_the_device_of_its_inputs(args, kwargs, want):
    """`bracket` read the first top-level tensor only: a batch given in a dict found none, and the region swapped
    the CPU's generator alone, so on a GPU every tensor rank drew the same masks from the shared CUDA stream."""
    got = inputs_device(args, kwargs)
    assert (None if got is None else got.type) == want
