"""Grid tensor parallelism on Llama's relatives with per-head q/k norms (Qwen3, Gemma 3), and padded batches under 3D.

Qwen3 and Gemma 3 normalise each head's queries and keys (`head_norm` in the plan): the grid refused them, as every
module holding parameters had to be cut. Now they train through `hetero.initialize` in 2D, 2.5D and 3D to the
losses, gradient norm and weights of plain PyTorch on the whole batch, within fp32's own distance from a float64
run (tests/tolerance.py). 3D attends over other batch rows than it embeds, and refused a mask or positions whose
rows differ; now a left-padded batch gives the plain model's loss and gradients there too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hetero
from hetero.errors import ConfigError
from hetero.parallel.grid import Grid, apply_grid_parallel
from hetero.parallel.plans import auto_plan
from tests.dist import NEEDS_DEGREES, ranks_apart
from tests.plain_loop import train_plain

try:
    from tests import grid_parity, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import grid_parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

transformers = pytest.importorskip("transformers")

CLIP = 0.5  # below the tiny models' gradient norms: clipping acts


def build(family: str) -> nn.Module:
    """A tiny Qwen3 or Gemma 3 (sliding window 4 over 8 positions), its weights moved off their init (Gemma's norm
    weights start at 0, read as 1 + w); GPT-2 and Llama as the other grid tests build them."""
    if family not in ("qwen3", "gemma3"):
        return grid_parity.build(family)
    torch.manual_seed(0)
    shape = dict(
        vocab_size=grid_parity.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=16,
    )  # fmt: skip
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**shape, sliding_window=4))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def reference(family: str, clip: float | None, dtype: torch.dtype) -> tuple[list[float], dict, float]:
    """Plain PyTorch on the whole batches: losses, final weights, the last step's gradient norm."""
    model = build(family).to(dtype)
    opt = grid_parity.optimizer(model)
    return train_plain(model, opt, grid_parity.batches(family), clip)


def _train(family: str, config: dict, rank: int) -> dict:
    torch.manual_seed(1234 + rank)  # the model must not depend on a rank's RNG
    model = build(family)
    engine = hetero.initialize(model, grid_parity.optimizer(model), {"chunk_size": grid_parity.CHUNK, **config})
    dp, dpr = engine.data_parallel_size, engine.data_parallel_rank
    mine = slice(dpr * grid_parity.ROWS // dp, (dpr + 1) * grid_parity.ROWS // dp)
    losses = [float(engine.train_batch(x[mine], y[mine])) for x, y in grid_parity.batches(family)]
    state = {k: v.float() for k, v in engine.local_state_dict().items()}  # collective: every rank
    out = {"losses": losses, "grad_norm": engine.last_grad_norm, "state": state if dpr == 0 else None}
    out["tp_rank"] = engine.mesh.tp_rank
    out["cuts"] = {
        n: p._hetero_tp for n, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "_hetero_tp")
    }
    engine.close()
    return out


def _padded_batch(rows: int) -> tuple[torch.Tensor, ...]:
    """Rows 1, 2, 5 and 6 left-padded: a mask, positions counted from each row's first token, padding ignored."""
    x = torch.randint(1, grid_parity.VOCAB, (rows, grid_parity.SEQ), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(x)
    mask[1, :3] = mask[2, :5] = 0
    if rows > 4:
        mask[5, :2] = mask[6, :6] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return x.masked_fill(mask == 0, 0), mask, positions, x.masked_fill(mask == 0, -100)


def _padded_loss(model: nn.Module, rows: int, positions: bool) -> tuple[float, dict[str, torch.Tensor]]:
    x, mask, pos, y = _padded_batch(rows)
    model.zero_grad()
    loss = model(x, attention_mask=mask, position_ids=pos if positions else None, labels=y).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _padded(family: str, rows: int) -> dict:
    """On a 3D grid of the world's ranks, without an engine (CPU tensors, CPU ranks)."""
    from hetero.comm import Comm

    model = build(family)
    apply_grid_parallel(model, "auto", Grid.build(Comm.world(), "3d"))
    out: dict = {p: _padded_loss(model, rows, p) for p in (False, True)}
    out["cuts"] = {n: p._hetero_tp for n, p in model.named_parameters() if hasattr(p, "_hetero_tp")}
    return out


def _job(rank: int, world: int, trained: list[tuple[str, dict]], padded: list[tuple[str, int]]) -> dict:
    torch.set_num_threads(1)
    return {
        "trained": [_train(family, config, rank) for family, config in trained],
        "padded": [_padded(family, rows) for family, rows in padded],
    }


def _check_trained(results: list[dict], family: str, config: dict) -> None:
    clip = config.get("grad_clip_norm")
    exact_losses, exact, exact_norm = reference(family, clip, torch.float64)
    plain_losses, plain, plain_norm = reference(family, clip, torch.float32)
    assert clip is None or exact_norm > clip, (exact_norm, clip)  # clipping acts
    for r in results:
        tolerance.assert_losses(r["losses"], exact_losses, plain_losses, dtype=torch.float32)
        tolerance.assert_losses([r["grad_norm"]], [exact_norm], [plain_norm], dtype=torch.float32)
    tensor = sorted((r for r in results if r["state"] is not None), key=lambda r: r["tp_rank"])  # one data rank's
    assert tensor[0]["state"].keys() == exact.keys()
    tolerance.assert_weights(
        _joined([r["state"] for r in tensor], tensor[0]["cuts"]), exact, plain, dtype=torch.float32
    )


def _joined(parts: list[dict[str, torch.Tensor]], cuts: dict) -> dict[str, torch.Tensor]:
    """Whole tensors from the tensor ranks' blocks (in tensor rank order); a whole one (a head norm) is the same on
    every rank."""
    out = {}
    for n, value in parts[0].items():
        if n in cuts:
            out[n] = cuts[n].join([p[n] for p in parts])
        else:
            assert all(torch.equal(p[n], value) for p in parts), f"{n}: the ranks' copies differ"
            out[n] = value
    return out


def _check_padded(results: list[dict], family: str, rows: int) -> None:
    for positions in (False, True):
        exact_loss, exact = _padded_loss(build(family).to(torch.float64), rows, positions)
        plain_loss, plain = _padded_loss(build(family), rows, positions)
        for r in results:
            tolerance.assert_losses([r[positions][0]], [exact_loss], [plain_loss], dtype=torch.float32)
        joined = _joined([r[positions][1] for r in results], results[0]["cuts"])
        assert joined.keys() == exact.keys()
        tolerance.assert_weights(joined, exact, plain, dtype=torch.float32)


def _run(world: int, trained: dict[str, tuple[str, dict]], padded: dict[str, tuple[str, int]]) -> None:
    results = run_distributed(_job, world, list(trained.values()), list(padded.values()), timeout=400)
    for i, (name, (family, config)) in enumerate(trained.items()):
        try:
            _check_trained([r["trained"][i] for r in results], family, config)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err
    for i, (name, (family, rows)) in enumerate(padded.items()):
        try:
            _check_padded([r["padded"][i] for r in results], family, rows)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err


def _case(stage: int, parallel: dict, clip: bool = False) -> dict:
    return {"zero_stage": stage, "parallel": parallel, **({"grad_clip_norm": CLIP} if clip else {})}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(450)
def test_qwen3_and_gemma3_train_on_a_2d_grid():
    """2D (q = 2) at ZeRO-1 with clipping and at ZeRO-3: the q/k norms are whole on every rank, fed its rows and
    heads, and their gradient summed over the grid (before: a ConfigError, no module style cut them)."""
    d2 = {"tensor": 4, "tensor_mode": "2d"}
    _run(
        4, {"2d-qwen3-zero1-clip": ("qwen3", _case(1, d2, clip=True)), "2d-gemma3-zero3": ("gemma3", _case(3, d2))}, {}
    )


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(600)
def test_qwen3_and_gemma3_train_and_padded_batches_match_on_8_ranks(cpu_device):  # the padded cases: no engine
    """3D (q = 2) and 2.5D (q = 2, depth 2) on Qwen3 and Gemma 3; left-padded batches on a 3D grid (one and two rows
    per rank, positions given or counted from 0) give the plain model's loss and gradients for Llama and GPT-2 (whose
    position embedding reads the positions on the rows it embeds). Before, 3D refused a mask whose rows differ: it
    attends over other rows than it embeds."""
    d3, d25 = {"tensor": 8, "tensor_mode": "3d"}, {"tensor": 8, "tensor_mode": "2.5d", "tensor_depth": 2}
    trained = {
        "3d-qwen3-zero2-clip": ("qwen3", _case(2, d3, clip=True)),
        "3d-gemma3-zero3": ("gemma3", _case(3, d3)),
        "2.5d-gemma3-zero1-clip": ("gemma3", _case(1, d25, clip=True)),
    }
    padded = {"3d-llama-8": ("llama", 8), "3d-gpt2-4": ("gpt2", 4)}
    _run(8, trained, padded)


def test_a_head_norm_outside_attention_is_refused():
    """'head_norm' leaves a norm whole: outside an attention module ('heads') it would see this rank's part of the
    hidden dimension, another norm; refused before anything changes."""
    model = build("qwen3")
    plan = {**auto_plan(model), "model.norm": "head_norm"}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"model\.norm: style 'head_norm' is a norm of each head inside an attenti"):
        apply_grid_parallel(model, plan, Grid.shape_only("2d", 4, rank=1))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(hasattr(p, "_hetero_tp") for p in model.parameters())
