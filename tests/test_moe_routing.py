"""Mixture-of-experts models whose routers pick other experts on each rank, at stage 3 over two ranks.

Transformers 5's MoE models (Mixtral here) keep their experts fused in 3D weights, so every rank's backward reaches
every expert weight: the ranks differ in which rows get a gradient and in how many times the experts' loop runs. The
routers are steered by hand (`_steer`): a token's group (id mod 4) is written large into its embedding, and router
row e reads group e, so rank 0 (groups 0-1) routes to experts 0-1, rank 1 (groups 1-2) to experts 1-2, and expert 3
to no rank. hetero must train like plain PyTorch on both ranks' batches (float64 reference, tests/tolerance.py).

A hand-written MoE whose experts are tiled (larger than a chunk) and whose loop visits them busiest first, an order
of each rank's own data, breaks the rule that layers some ranks skip run in the same relative order on every rank
that runs them ([Note: tile gathers in turns] in hetero/zero/turns.py). That must stop both ranks with the
CollectiveMismatchError naming the turns: the off-turn gather was issued before its check was compared, and over
gloo the two ranks' gathers of other sizes met, so a rank died in gloo's native code (SIGABRT, no message).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.dist import RANKS_DIFFER, ranks_apart

try:
    from tests import branchy, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import branchy  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

pytest.importorskip("transformers")

VOCAB, EXPERTS, STEPS = 48, 4, 2
CONFIGS = {  # at 256 elements the attention's and the head's weights are tiled; the fused experts get chunks apart
    "tiled, checkpointing": {"zero_stage": 3, "chunk_size": 256, "activation_checkpointing": True},
    "params on host, accumulation": {
        "zero_stage": 3,
        "chunk_size": 1024,
        "offload": {"params": "host"},
        "grad_accumulation_steps": 2,
    },
}


def _mixtral(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=EXPERTS,
        num_experts_per_tok=1,
        tie_word_embeddings=False,
        experts_implementation="eager",  # grouped_mm refuses float64, which the reference needs
    )
    model = transformers.MixtralForCausalLM(cfg)
    _steer(model)
    return model.to(dtype)


def _steer(model: torch.nn.Module) -> None:
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed[:, :EXPERTS] = 0
        embed[torch.arange(VOCAB), torch.arange(VOCAB) % EXPERTS] = 4.0
        for layer in model.model.layers:
            router = layer.mlp.gate.weight
            router.zero_()
            router[torch.arange(3), torch.arange(3)] = 3.0
            router[3, :3] = -3.0  # expert 3: no token of any rank


def _batches(micro: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per micro-batch, per rank: (ids, labels); rank r's tokens are in groups r and r + 1."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(micro):
        per_rank = []
        for r in range(2):
            x = torch.randint(0, VOCAB // 4, (2, 7), generator=g) * 4 + r + torch.randint(0, 2, (2, 7), generator=g)
            per_rank.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
        out.append(per_rank)
    return out


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _reference(dtype: torch.dtype, accumulation: int) -> tuple[list[float], dict]:
    model = _mixtral(dtype)
    data = _batches(STEPS * accumulation)
    steps = [sum((data[s * accumulation + a] for a in range(accumulation)), []) for s in range(STEPS)]
    return branchy.plain(model, _optimizer(model), steps, lambda m, b: m(input_ids=b[0], labels=b[1]).loss)


def _train(rank: int, world: int) -> dict:
    import hetero

    torch.set_num_threads(1)
    out = {}
    for name, config in CONFIGS.items():
        model = _mixtral()
        engine = hetero.initialize(model, _optimizer(model), {"comm_timeout": 60, **copy.deepcopy(config)})
        accumulation, losses, routed = config.get("grad_accumulation_steps", 1), [0.0] * STEPS, []
        hooks = [
            layer.mlp.gate.register_forward_hook(lambda m, i, o, routed=routed: routed.append(o[2]))
            for layer in model.model.layers
        ]
        for micro, per_rank in enumerate(_batches(STEPS * accumulation)):
            x, y = per_rank[rank]
            loss = engine(input_ids=x, labels=y).loss
            engine.backward(loss)
            engine.step()
            mean = loss.detach().reshape(1) / accumulation
            engine.comm.control.all_reduce(mean, op="avg")
            losses[micro // accumulation] += float(mean)
        for h in hooks:
            h.remove()
        state = {k: v.float() for k, v in engine.full_state_dict().items()}
        engine.close()
        out[name] = {"losses": losses, "state": state, "experts": sorted(set(torch.cat(routed).flatten().tolist()))}
    return out


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(200)
def test_mixtral_routed_apart_on_two_ranks_trains_like_plain_pytorch():
    results = run_distributed(_train, 2, timeout=170)
    init = _mixtral().state_dict()
    for name, config in CONFIGS.items():
        accumulation = config.get("grad_accumulation_steps", 1)
        exact_losses, exact = _reference(torch.float64, accumulation)
        plain_losses, plain = _reference(torch.float32, accumulation)
        assert [results[r][name]["experts"] for r in range(2)] == [[0, 1], [1, 2]], name
        got = results[0][name]
        assert results[1][name]["losses"] == got["losses"], name
        tolerance.assert_losses(got["losses"], exact_losses, plain_losses, dtype=torch.float32)
        tolerance.assert_weights(got["state"], exact, plain, dtype=torch.float32)
        experts = "model.layers.0.mlp.experts.gate_up_proj"
        assert not torch.equal(got["state"][experts][0], init[experts][0]), name  # rank 0's expert alone trained


# ---- experts run in an order of each rank's data: a clear error on both ranks, no crash -------------------------
class _BusiestFirst(branchy.Block):
    """branchy's block without its branch, whose expert loop visits the busiest expert first."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        weight = self.gate(h).softmax(-1)
        route = ids % branchy.EXPERTS
        counts = torch.bincount(route.flatten(), minlength=branchy.EXPERTS)
        out = torch.zeros_like(h)
        for e in sorted(range(branchy.EXPERTS), key=lambda e: -int(counts[e])):
            mask = route == e
            if bool(mask.any()):
                out[mask] = self.experts[e](h[mask]) * weight[mask][:, e : e + 1]
        return x + out


def _busiest_first(rank: int, world: int) -> str:
    import hetero

    torch.set_num_threads(1)
    model = branchy.build(gated=True)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = _BusiestFirst(gated=True)
        model.blocks[i].load_state_dict(block.state_dict())
    engine = hetero.initialize(model, branchy.make_optimizer(model), {"zero_stage": 3, "chunk_size": 300})
    try:
        for per_rank in branchy.batches(2, world, every_expert=True):
            x, y = per_rank[rank]
            engine.backward(engine(x, y).loss)
            engine.step()
    except hetero.errors.CollectiveMismatchError as err:
        return str(err)
    finally:
        engine.close()
    return "no error"


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(120)
def test_tiled_experts_run_in_an_order_of_each_ranks_data_stop_both_ranks_naming_the_turns():
    for message in run_distributed(_busiest_first, 2, timeout=90):
        assert "different collectives" in message and "tile gathers in turns" in message, message
        assert "blocks.0.experts." in message, message
