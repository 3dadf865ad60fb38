"""ZeRO stages 1-3 on models whose parameter use depends on the data or is unusual, over 2 and 4 ranks on gloo,
against a plain single-process PyTorch loop (the mean of the ranks' losses, one backward, one step: what data
parallelism computes; float64 reference and fp32's own distance to it, tests/tolerance.py).

Scenarios (`Net(kind)`):
- moe: a top-1 router steered by the token ids, so each rank's tokens go to other experts, one expert no rank uses
  (its AdamW moments and weights must stay untouched, as torch skips a parameter whose grad is None);
- skip: a block each rank runs or skips by its own input (`x.sum() > 0`);
- reused: a linear layer called twice in one block's forward; tied: one weight owned by the linears of blocks 0 and
  2; shared: both. A module whose weight is tied to another block's took that block as its unit, and at stage 3
  its backward's use was held by a unit whose backward had ended: "chunk 1 ... cannot be released while
  ['blocks.0.lin.bias'] are being computed on" (`module_units` in hetero/zero/units.py);
- frozen: a frozen bias beside trainable weights in the same module, and a block frozen for the middle step only;
- bn: BatchNorm1d, whose running statistics forward updates (buffers, each rank's own, as DDP without
  broadcast_buffers keeps them; under activation checkpointing updated again by the recomputation, as
  torch.utils.checkpoint does, which the reference then uses);
- twice: the model's forward (moe's) called twice before one backward (two losses summed), other experts each time.
A block skipped by some ranks cannot be gathered at stage 3 ([Note: units]): every rank stops with the check's
error, which names the way out; stages 1-2 train like plain PyTorch.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

try:
    from tests import tolerance
    from tests.dist import RANKS_DIFFER, ranks_apart, run_distributed
except ImportError:  # tests/ itself on sys.path
    import tolerance  # type: ignore[no-redef]
    from dist import RANKS_DIFFER, ranks_apart, run_distributed  # type: ignore[no-redef]

DTYPE = torch.float32
HF = ("mixtral", "qwen2_moe")
VOCAB, DIM, EXPERTS, SEQ, ROWS, STEPS = 32, 16, 4, 6, 2, 3
CHUNK = 512  # a 16x16 linear and its bias fill about half a chunk: blocks span a few chunks each


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm(DIM)
        self.lin = nn.Linear(DIM, DIM)
        if kind in ("moe", "twice"):
            self.router = nn.Linear(DIM, EXPERTS, bias=False)
            self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        if kind == "bn":
            self.bn = nn.BatchNorm1d(DIM)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.kind in ("reused", "shared"):
            return x + self.lin(F.gelu(self.lin(h)))  # one module, so one weight, called twice
        if self.kind == "bn":
            return x + self.bn(self.lin(h).transpose(1, 2)).transpose(1, 2)
        if self.kind not in ("moe", "twice"):
            return x + self.lin(h)
        gate = self.router(h).softmax(-1)
        route = ids % EXPERTS  # steered by the ids (see `batches`), so the ranks' experts differ
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            mask = route == e
            if bool(mask.any()):  # an expert no token of this rank goes to is not called at all
                out[mask] = expert(h[mask]) * gate[mask][:, e : e + 1]
        return x + self.lin(h) + out


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.recompute = False  # the reference's blocks recomputed in backward: what activation_checkpointing does
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(kind) for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)
        if kind in ("tied", "shared"):  # a weight owned by two modules of two blocks
            self.blocks[2].lin.weight = self.blocks[0].lin.weight
        if kind == "samemod":  # one module in two blocks, and a top-level one tied to a block's weight
            self.blocks[2].lin = self.blocks[0].lin
            self.proj = nn.Linear(DIM, DIM)
            self.proj.weight = self.blocks[1].lin.weight
        if kind == "frozen":  # a frozen bias beside its trainable weight
            self.blocks[1].lin.bias.requires_grad_(False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for i, blk in enumerate(self.blocks):
            if self.kind == "skip" and i == 1 and bool(x.sum() > 0):
                continue  # a block skipped by this rank's own data
            if self.recompute and self.training:  # as torch.utils.checkpoint recomputes: BatchNorm updates twice
                x = torch.utils.checkpoint.checkpoint(blk, x, ids, use_reentrant=False)
            else:
                x = blk(x, ids)
        if self.kind == "samemod":
            x = x + self.proj(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class HFLoss(nn.Module):
    """A transformers MoE causal LM called as `Net` is: (ids, labels) -> loss."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.recompute = False  # never: the configs checkpoint these models through hetero only

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=labels).loss


def _hf(kind: str) -> HFLoss:
    """Tiny Mixtral or Qwen2-MoE (fused 3D expert weights, Qwen2-MoE's shared expert beside them), its routers
    steered by hand as tests/test_moe_routing.py does: a token's group (id mod 4) is written large into its
    embedding and router row e reads group e, so each rank's tokens (see `batches`) go to their own experts."""
    import transformers

    common = {"vocab_size": VOCAB, "hidden_size": DIM, "num_hidden_layers": 2, "num_attention_heads": 2}
    common |= {"num_key_value_heads": 1, "num_experts_per_tok": 1, "tie_word_embeddings": False}
    common |= {"experts_implementation": "eager"}  # grouped_mm refuses float64, which the reference needs
    if kind == "mixtral":
        lm = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**common, intermediate_size=2 * DIM, num_local_experts=EXPERTS)
        )
    else:
        cfg = transformers.Qwen2MoeConfig(
            **common, intermediate_size=2 * DIM, moe_intermediate_size=DIM, shared_expert_intermediate_size=DIM
        )
        cfg.num_experts = EXPERTS
        lm = transformers.Qwen2MoeForCausalLM(cfg)
    with torch.no_grad():
        embed = lm.get_input_embeddings().weight
        embed[:, :EXPERTS] = 0
        embed[torch.arange(VOCAB), torch.arange(VOCAB) % EXPERTS] = 4.0
        for layer in lm.model.layers:
            layer.mlp.gate.weight.zero_()
            layer.mlp.gate.weight[torch.arange(EXPERTS), torch.arange(EXPERTS)] = 3.0
    return HFLoss(lm)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return _hf(kind) if kind in HF else Net(kind)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with eps 1e-3. Adam's step g / (|g| + eps) moves by at most lr * dg / eps for a change dg of the
    gradient: at the default 1e-8 a gradient element that cancels to ~4e-8 (experts 2's w2 over 4 ranks, forward
    twice), which fp32 rounds differently by a few ulps of its terms (~1e-9: a parameter viewing a chunk's memory
    takes another kernel path than a tensor of its own), moved its weight by 5e-6, 25 times plain fp32's own
    distance there, which had landed near float64 by chance. At 1e-3 that is at most 1e-8, the weights' own
    rounding, while an expert wrongly stepped with a zero gradient still moves by about lr / 2 (and decays)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-3)


def batches(steps: int, world: int, calls: int = 1) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Per step (or micro-batch) i, per rank, per forward call: (ids, labels). Rank r's tokens are r+i or r+i+1 mod 4
    (the experts of those numbers): over 2 ranks three experts are used and one is nobody's, another each step, so an
    expert's AdamW states skip a step between two it steps in, as torch skips a parameter whose grad is None; over 4
    every expert is some ranks'. The sign of the embeddings' sum, which `skip` reads, differs between ranks by
    chance (stage 3 raising on `skip` shows it did)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(steps):
        per_rank = []
        for r in range(world):
            per_call = []
            for c in range(calls):  # a second call of the step: the next experts
                base = torch.randint(0, VOCAB // 4, (ROWS, SEQ + 1), generator=g) * 4
                x = (base + r + i + c + torch.randint(0, 2, (ROWS, SEQ + 1), generator=g)) % VOCAB
                per_call.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
            per_rank.append(per_call)
        out.append(per_rank)
    return out


def _toggle(model: nn.Module, kind: str, step: int) -> None:
    """`frozen`: block 2's linear is frozen in the middle step only."""
    if kind == "frozen":
        for p in model.blocks[2].lin.parameters():
            p.requires_grad_(step != 1)


def _calls(kind: str) -> int:
    return 2 if kind == "twice" else 1


def reference(
    kind: str, world: int, dtype: torch.dtype, accum: int = 1, *, recompute: bool = False
) -> tuple[list[float], dict, list[dict]]:
    """Plain PyTorch: per step the mean over ranks (and micro-batches) of each rank's losses; the final state; and
    per rank, the buffers that rank's own forwards left (each rank's BatchNorm statistics, as DDP without
    broadcast_buffers keeps them)."""
    model = build(kind).to(dtype)
    model.recompute = recompute
    opt = optimizer(model)
    names = [n for n, _ in model.named_buffers()]
    own = [{n: b.clone() for n, b in model.named_buffers()} for _ in range(world)]
    losses = []
    data = batches(STEPS * accum, world, _calls(kind))
    for step in range(STEPS):
        _toggle(model, kind, step)
        total = 0.0
        for micro in range(accum):
            for r in range(world):
                with torch.no_grad():
                    for n, b in model.named_buffers():
                        b.copy_(own[r][n])
                loss = sum(model(x, y) for x, y in data[step * accum + micro][r]) / (world * accum)
                loss.backward()
                total += float(loss.detach())
                own[r] = {n: b.clone() for n, b in model.named_buffers() if n in names}
        opt.step()
        opt.zero_grad()
        losses.append(total)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in names}
    return losses, state, own


def _run(rank: int, world: int, runs: list[tuple[str, str, dict]], accum: int = 1) -> dict[tuple[str, str], Any]:
    """Each run (kind, config's name, config): its losses, final weights and this rank's buffers, or its error."""
    import hetero

    out = {}
    for kind, name, config in runs:
        model = build(kind)
        cfg = {"comm_timeout": 60, **copy.deepcopy(config)}
        if accum > 1:
            cfg["grad_accumulation_steps"] = accum
        engine = hetero.initialize(model, optimizer(model), cfg)
        data = batches(STEPS * accum, world, _calls(kind))
        losses = []
        try:
            for step in range(STEPS):
                _toggle(model, kind, step)
                total = torch.zeros(1)
                for micro in range(accum):
                    loss = sum(engine(x, y) for x, y in data[step * accum + micro][rank])
                    engine.backward(loss)
                    engine.step()
                    total += loss.detach().float() / accum
                engine.comm.control.all_reduce(total, op="avg")
                losses.append(float(total))
            state = {k: v.float() for k, v in engine.full_state_dict().items()}
            buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        except hetero.errors.CollectiveMismatchError as err:
            out[kind, name] = {"error": str(err)}
            break  # the group's collectives are out of step now: nothing after it could run
        finally:
            engine.close()
        out[kind, name] = {"losses": losses, "state": state, "buffers": buffers}
    return out


def _check(results: list[dict], kind: str, world: int, configs: dict, accum: int = 1) -> None:
    refs = {}
    for name, config in configs.items():
        recompute = bool(config.get("activation_checkpointing"))
        if recompute not in refs:
            refs[recompute] = [
                reference(kind, world, d, accum, recompute=recompute) for d in (torch.float64, torch.float32)
            ]
        try:
            _check_one(results, kind, world, name, *refs[recompute])
        except AssertionError as err:
            raise AssertionError(f"{kind} at {name}: {err}") from None


def _check_one(results: list[dict], kind: str, world: int, name: str, ref: tuple, fp32: tuple) -> None:
    (exact_losses, exact, exact_own), (plain_losses, plain, plain_own) = ref, fp32
    if True:
        got = results[0][kind, name]
        assert "error" not in got, f"{kind} at {name}: {got['error']}"
        for r in range(1, world):
            assert results[r][kind, name]["losses"] == got["losses"], (kind, name)
        tolerance.assert_losses(got["losses"], exact_losses, plain_losses, dtype=torch.float32)
        state = {k: v for k, v in got["state"].items() if k in exact}
        assert state.keys() == exact.keys(), (kind, name)
        tolerance.assert_weights(state, exact, plain, dtype=torch.float32)
        for r in range(world):
            buffers = results[r][kind, name]["buffers"]
            tolerance.assert_weights(
                {n: b for n, b in buffers.items() if b.is_floating_point()},
                {n: b for n, b in exact_own[r].items() if b.is_floating_point()},
                {n: b for n, b in plain_own[r].items() if b.is_floating_point()},
                dtype=torch.float32,
            )
            assert all(torch.equal(buffers[n], b) for n, b in exact_own[r].items() if not b.is_floating_point())


KINDS = ("moe", "skip", "reused", "tied", "shared", "samemod", "frozen", "bn", "twice")
CONFIGS = {f"stage {s}": {"zero_stage": s, "chunk_size": CHUNK} for s in (1, 2, 3)}
STAGE3 = {  # stage 3's other paths: gathers issued at each use only, blocks recomputed in backward
    "stage 3, no gather ahead": {"zero_stage": 3, "chunk_size": CHUNK, "gather_ahead": False},
    "stage 3, checkpointing": {"zero_stage": 3, "chunk_size": CHUNK, "activation_checkpointing": True},
}


def _runs(kinds: tuple[str, ...], configs: dict) -> list[tuple[str, str, dict]]:
    """Each kind under each config; `skip` at stage 3 stops every rank with the check's error, which leaves the
    group out of step, so it runs last, under one config."""
    runs = [(k, n, c) for k in kinds for n, c in configs.items() if k != "skip" or c["zero_stage"] < 3]
    last = [(k, n, c) for k in kinds for n, c in configs.items() if k == "skip" and c["zero_stage"] == 3]
    return runs + last[:1]


def _all(rank: int, world: int, kinds: tuple[str, ...], configs: dict, accum: int = 1) -> dict:
    torch.set_num_threads(1)
    return _run(rank, world, _runs(kinds, configs), accum)


def _check_all(results: list[dict], kinds: tuple[str, ...], world: int, configs: dict, accum: int = 1) -> None:
    for kind in kinds:
        names = configs
        if kind == "skip":  # a block some ranks skip cannot be gathered at stage 3: every rank stops with the error
            names = {n: c for n, c in configs.items() if c["zero_stage"] < 3}
            for k, n, _ in _runs(kinds, configs):
                for r in results if k == kind and n not in names else ():
                    assert "about to run different collectives" in r[kind, n]["error"], r[kind, n]
                    assert "make every rank call it, or use zero_stage <= 2" in r[kind, n]["error"]
        _check(results, kind, world, names, accum)


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks(kind):
    results = run_distributed(_all, 2, (kind,), {**CONFIGS, **STAGE3}, timeout=500)
    _check_all(results, (kind,), 2, {**CONFIGS, **STAGE3})


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(600)
def test_four_ranks():
    kinds = ("moe", "skip", "shared", "frozen", "bn", "twice")
    results = run_distributed(_all, 4, kinds, CONFIGS, timeout=500)
    _check_all(results, kinds, 4, CONFIGS)


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", HF)
def test_transformers_moe_with_accumulation(kind):
    pytest.importorskip("transformers")
    results = run_distributed(_all, 2, (kind,), CONFIGS, 2, timeout=500)
    _check_all(results, (kind,), 2, CONFIGS, 2)


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(600)
def test_accumulation():
    kinds = ("moe", "shared", "frozen", "bn", "twice")
    configs = {**CONFIGS, "stage 3, checkpointing": STAGE3["stage 3, checkpointing"]}
    results = run_distributed(_all, 2, kinds, configs, 2, timeout=500)
    _check_all(results, kinds, 2, configs, 2)
