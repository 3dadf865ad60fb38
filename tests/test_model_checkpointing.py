"""A model's own activation checkpointing (Hugging Face's `activation_checkpointing_enable`, torch.utils.checkpoint
underneath) trains through hetero as without it: every stage, offload to the host and NVMe, hetero's own
checkpointing on top, and stage 3 over two ranks with tiled weights (a small Mixtral).

Checkpointing changes when the forward runs, not what it computes: the recomputation repeats the same fp32
operations on the same inputs, so a run with it must give the bits of the run without it (two ranks), and plain
PyTorch's losses and weights within fp32 rounding of a float64 run (tests/tolerance.py) like any other run.
"""

from __future__ import annotations

import pytest
import torch

from tests import test_unmodified_models as unmodified
from tests.dist import run_distributed

transformers = pytest.importorskip("transformers")


def _enable(model: torch.nn.Module) -> None:
    """The model's own checkpointing, by the name transformers gives it (`activation_checkpointing_enable` since 5.x;
    `gradient_checkpointing_enable` before, deprecated since)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()


def _llama() -> torch.nn.Module:
    return unmodified.tiny_hf()


def _counting(model: torch.nn.Module) -> list[int]:
    """Counts the calls of the first decoder layer's MLP: two a step where the model recomputes the layer in backward
    (transformers 5 checkpoints the layer's `forward`, inside the layer's own hooks, so count a module within)."""
    calls = [0]
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.timeout(300)
def test_hf_checkpointing_every_stage_and_placement(tmp_path):
    batches = unmodified._lm_batches(96)
    refs = unmodified._references(_llama(), batches, unmodified._lm_loss)
    nvme = {"optimizer": "nvme", "params": "nvme"}
    configs = {
        **{f"z{k}": {"zero_stage": k} for k in range(4)},
        "z3-host": {"zero_stage": 3, "offload": {"optimizer": "host", "params": "host"}},
        "z3-nvme": {"zero_stage": 3, "offload": nvme, "memory": {"nvme_dir": str(tmp_path)}},
        # hetero's own checkpointing of the same blocks, with their inputs offloaded, around the model's
        "z3-both": {"zero_stage": 3, "activation_checkpointing": True, "activation_offload": True},
        "z2-in-backward": {"zero_stage": 2, "update_in_backward": True, "offload": {"optimizer": "host"}},
    }
    for name, cfg in configs.items():
        model = _llama()
        _enable(model)
        calls = _counting(model)
        got = unmodified._train(model, batches, engine_cfg=cfg, loss_of=unmodified._lm_loss)
        assert calls[0] >= 2 * len(batches), f"{name}: the model did not recompute its layers ({calls[0]} calls)"
        unmodified._compare(got, refs)


def _mixtral() -> torch.nn.Module:
    return unmodified.tiny_hf("Mixtral", num_local_experts=8, num_experts_per_tok=1)


def _train_rank(rank: int, world: int, checkpointing: bool) -> tuple[list[float], dict, bool]:
    torch.set_num_threads(1)
    model = _mixtral()
    if checkpointing:
        _enable(model)
    import hetero

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # 512-element chunks: the embedding, the attention's q and o projections and the head are larger, so they are
    # tiled ([Note: computing on tiles]); transformers 5 keeps the experts in fused 3D weights, which are not.
    engine = hetero.initialize(model, opt, {"zero_stage": 3, "chunk_size": 512, "comm_timeout": 60})
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, 96, (2 * world, 6), generator=g)[2 * rank : 2 * rank + 2]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = {k: v.clone() for k, v in engine.full_state_dict().items()}
    tiled = bool(engine.memory_stats().get("tiled"))
    engine.close()
    return losses, state, tiled


@pytest.mark.timeout(400)
def test_hf_checkpointing_two_ranks_tiled_weights_same_bits():
    plain = run_distributed(_train_rank, 2, False, timeout=300)
    assert all(tiled for _, _, tiled in plain), "weights were meant to be tiled"
    if int(transformers.__version__.split(".")[0]) < 5:
        # Each of transformers 4's Mixtral experts is three Linear layers, tiled at this chunk size, and only those a
        # rank's router picks run; the model's own checkpointing recomputes them in backward on that rank alone, where
        # tile turns cannot meet the other ranks ([Note: tile gathers in turns]: a clear collective mismatch). The
        # run without it trained above (it stopped in its first step before [Note: siblings out of the order]).
        pytest.skip("transformers 4: the model's own checkpointing recomputes tiled experts some ranks skip")
    ckpt = run_distributed(_train_rank, 2, True, timeout=300)
    assert all(tiled for _, _, tiled in ckpt), "weights were meant to be tiled"
    for (losses, state, _), (losses_c, state_c, _) in zip(plain, ckpt):
        assert losses == losses_c
        assert state.keys() == state_c.keys()
        for k in state:
            assert torch.equal(state[k], state_c[k]), k
