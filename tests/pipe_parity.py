"""Parity runs for the parallel layouts: a tiny pipelineable GPT (GPTPipe, untied) trained by plain PyTorch on the
global batch, and by hetero's `train_batch` under a "parallel" config, for tests to compare."""

from __future__ import annotations

import copy
from typing import Any

import torch

import hetero
from hetero.models.gpt import GPTConfig
from hetero.models.gpt_pipe import GPTPipe
from hetero.parallel.tensor import unshard

try:
    from tests import parity, tolerance
    from tests.plain_loop import train_plain
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from plain_loop import train_plain  # type: ignore[no-redef]

CFG = dict(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16, bias=False, tie_weights=False)
STEPS, ROWS = 4, 4


def build(seed: int = 0) -> GPTPipe:
    torch.manual_seed(seed)
    return GPTPipe(GPTConfig(**CFG))


_REFERENCES: dict[tuple, tuple] = {}
_EVALS: dict[tuple, dict[str, Any]] = {}


def eval_data(rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch the models are evaluated on after training (not one they trained on)."""
    return parity.batches(1, rows, seed=7)[0]


def evaluation(
    steps: int = STEPS, rows: int = ROWS, clip: float | None = None, precision: str = "fp32"
) -> dict[str, Any]:
    """The trained reference model on `eval_data`: its loss and logits (cached with `reference`)."""
    reference(steps, rows, clip, precision)
    return _EVALS[(steps, rows, clip, precision)]


def reference(
    steps: int = STEPS, rows: int = ROWS, clip: float | None = None, precision: str = "fp32"
) -> tuple[list[float], dict, float]:
    """Plain PyTorch on the global batch (cached): losses, final weights, and the last step's gradient norm."""
    key = (steps, rows, clip, precision)
    if key not in _REFERENCES:
        *_REFERENCES[key], _EVALS[key] = _reference(steps, rows, clip, parity.DTYPES[precision])  # type: ignore[misc]
        _REFERENCES[key] = tuple(_REFERENCES[key])
    return _REFERENCES[key]


def _reference(steps: int, rows: int, clip: float | None, dtype: torch.dtype) -> tuple[list[float], dict, float, dict]:
    model = build().to(dtype)
    opt = parity.make_optimizer(model)
    losses, weights, norm = train_plain(model, opt, parity.batches(steps, rows), clip)
    x, y = eval_data(rows)
    with torch.no_grad():
        evals = {"loss": model(x, labels=y).loss.item(), "logits": model(x).logits}
    return losses, weights, norm, evals


def run(rank: int, world: int, config: dict, steps: int = STEPS, rows: int = ROWS) -> dict[str, Any]:
    """hetero on this rank's share of each global batch; returns losses, and this stage's full weights from the
    first data-parallel and tensor rank (None elsewhere)."""
    torch.manual_seed(1234 + rank)  # the model must not depend on a rank's RNG: it is built from the seed below
    model = build()
    opt = parity.make_optimizer(model)
    config = copy.deepcopy(config)
    config.setdefault("chunk_size", parity.CHUNK)
    engine = hetero.initialize(model, opt, config)
    reductions = _count_reductions(engine.comm)
    dp, dpr = engine.data_parallel_size, engine.data_parallel_rank
    local = rows // dp
    losses = []
    for x, y in parity.batches(steps, rows):
        loss = engine.train_batch(x[dpr * local : (dpr + 1) * local], y[dpr * local : (dpr + 1) * local])
        losses.append(float(loss))
    x, y = eval_data(rows)
    mine = slice(dpr * local, (dpr + 1) * local)
    eval_loss = float(engine.eval_batch(x[mine], y[mine]))
    eval_logits = engine.eval_batch(x[mine])  # this data-parallel rank's rows, whole, on every rank
    # loss_fn on the last stage's outputs (logits whole only without a vocabulary-parallel head)
    eval_fn_loss = (
        float(engine.eval_batch(x[mine], y[mine], loss_fn=cross_entropy)) if engine.mesh.tp_size == 1 else None
    )
    mesh = engine.mesh
    state = {k: v.float() for k, v in engine.local_state_dict().items()}  # collective at stage 3: every rank
    if mesh.dp_rank != 0:
        state = None
    shards = {n: p._hetero_tp for n, p in model.named_parameters() if hasattr(p, "_hetero_tp")}
    out = {
        "losses": losses,
        "state": state,
        "coords": (mesh.tp_rank, mesh.dp_rank, mesh.pp_rank),
        "grad_norm": engine.last_grad_norm,
        "reductions": reductions[0],
        "trainable_chunks": len(engine.trainable),
        "shards": shards,
        "eval_loss": eval_loss,
        "eval_fn_loss": eval_fn_loss,
        "eval_logits": eval_logits.logits if hasattr(eval_logits, "logits") else eval_logits,
        "rows": (mine.start, mine.stop),
    }
    engine.close()
    return out


def cross_entropy(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """A user's loss_fn: the model's own loss, computed from its outputs (the whole model's GPTOutput, or the logits
    its last pipeline unit returns)."""
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def _count_reductions(comm: Any) -> list[int]:
    """Count the gradient reduce-scatters issued on the data-parallel group (patched on this Comm instance)."""
    count, depth = [0], [0]  # depth: the async form may fall back to the blocking one; count the outer call
    for name in ("reduce_scatter", "reduce_scatter_async"):
        original = getattr(comm, name)

        def counted(*args: Any, _f: Any = original, **kwargs: Any) -> Any:
            count[0] += depth[0] == 0
            depth[0] += 1
            try:
                return _f(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(comm, name, counted)
    return count


def check(results: list[dict], *, steps: int = STEPS, rows: int = ROWS, clip: float | None = None) -> None:
    """Losses and gradient norm on every rank, and the final weights merged over stages and unsharded over tensor
    ranks, against plain PyTorch in float64 with fp32's own error as the scale (tests/tolerance.py); and eval_batch
    after training: the global mean loss (the model's own, and through a loss_fn) and this data-parallel rank's
    whole logits, on every rank. On top of that, the issues' figure: within rel 1e-5 of plain fp32 (each loss, the
    gradient norm, each weight tensor in norm beyond fp32's own noise on it)."""
    exact_losses, exact, exact_norm = reference(steps, rows, clip, "fp64")
    plain_losses, plain, plain_norm = reference(steps, rows, clip, "fp32")
    exact_eval, plain_eval = evaluation(steps, rows, clip, "fp64"), evaluation(steps, rows, clip, "fp32")
    merged: dict[str, torch.Tensor] = {}
    by_stage: dict[int, list[dict]] = {}  # pipeline rank -> the first data-parallel rank's results, by tensor rank
    for r in results:
        tolerance.assert_losses(r["losses"], exact_losses, plain_losses, dtype=torch.float32)
        tolerance.assert_losses([r["grad_norm"]], [exact_norm], [plain_norm], dtype=torch.float32)
        tolerance.assert_losses([r["eval_loss"]], [exact_eval["loss"]], [plain_eval["loss"]], dtype=torch.float32)
        if r["eval_fn_loss"] is not None:  # eval_batch's loss_fn: the same loss, the same arithmetic
            tolerance.assert_losses(
                [r["eval_fn_loss"]], [exact_eval["loss"]], [plain_eval["loss"]], dtype=torch.float32
            )
        # the issues' figure too (Chimera's: fp32, rel 1e-5): each loss and the gradient norm against plain fp32
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(plain_losses), rtol=1e-5, atol=0)
        assert abs(r["grad_norm"] - plain_norm) <= 1e-5 * plain_norm, (r["grad_norm"], plain_norm)
        a, b = r["rows"]
        tolerance.assert_weights(
            {"logits": r["eval_logits"]},
            {"logits": exact_eval["logits"][a:b]},
            {"logits": plain_eval["logits"][a:b]},
            dtype=torch.float32,
        )
        if r["state"] is not None:
            by_stage.setdefault(r["coords"][2], []).append(r)
    merged.update(merge_ranks(by_stage))
    assert merged.keys() == exact.keys(), sorted(set(exact) ^ set(merged))
    tolerance.assert_weights(merged, exact, plain, dtype=torch.float32)
    tolerance.assert_near_plain(merged, exact, plain, rel=1e-5)


def merge_ranks(by_stage: dict[int, list[dict[str, Any]]]) -> dict[str, torch.Tensor]:
    """The whole model's weights from each pipeline stage's tensor ranks' final states (tensor shards joined)."""
    merged: dict[str, torch.Tensor] = {}
    for ranks in by_stage.values():
        ranks.sort(key=lambda r: r["coords"][0])
        for name, value in ranks[0]["state"].items():
            info = ranks[0]["shards"].get(name)
            merged[name] = value if info is None else unshard([r["state"][name] for r in ranks], info)
    return merged
