"""The reference for fp16 with dynamic loss scaling: a plain single-process PyTorch loop with torch.amp.GradScaler
and fp32 master weights, run on the same rows as hetero's ranks (tests/test_precision_audit.py).

Each rank's rows are a forward of their own here too, so that a rank's micro-batch made to overflow (its loss
multiplied by `BOOST`) is that rank's alone, as under hetero. The model computes in fp16; its gradients (scaled by
the loss scale, divided by the accumulation steps) add up in fp16 in `.grad`, as one rank's do in hetero's chunk;
the master's gradient is their float mean over the ranks; GradScaler unscales it, finds inf/nan, skips the step and
halves the scale, or steps and grows the scale after `growth_interval` good steps. The same loop in float64 with the
fp16 run's skipped steps left out is the exact run, whose distance from the fp16 one sets the tolerance
([Note: tolerances from the arithmetic] in tests/tolerance.py).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch

import hetero

try:
    from tests import parity, pipe_parity
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]

BOOST = 2.0**40  # a loss times this overflows fp16 (its largest finite value is 65504)


def reference(
    *,
    steps: int,
    world: int,
    rows: int,
    accum: int = 1,
    clip: float | None = None,
    boosts: frozenset[tuple[int, int, int]] = frozenset(),
    scale: float = 2.0**10,
    growth_interval: int = 2000,
    precision: str = "fp16",
    skipped: tuple[int, ...] = (),
    build: Callable[[], torch.nn.Module] = parity.build,
    hf: bool = False,
    deepspeed_scaler: Any = None,
) -> dict[str, Any]:
    """boosts: the (step, micro-batch, rank) whose loss is multiplied by BOOST (fp16 only). precision "bf16": fp32
    master weights, no scale; "fp64": the exact run, skipping the steps in `skipped` (the fp16 run's) instead of
    scaling. Returns the per-step log (applied, scale after), the losses (mean over micro-batches and ranks,
    unboosted), the norms clip_grad_norm_ returned (with `clip`) and the final weights. build: the model (the parity
    GPT by default); hf: a transformers model, which shifts the labels itself (given the inputs). deepspeed_scaler:
    DeepSpeed's DynamicLossScaler sets the scale instead of GradScaler (its hysteresis), the overflow found as
    GradScaler finds it (any unscaled gradient not finite) and skipped alike."""
    model = build()
    dtype = parity.DTYPES[precision]
    low = dtype in (torch.float16, torch.bfloat16)  # fp32 master weights, the model cast down
    master = copy.deepcopy(model) if low else model
    model = model.to(dtype)
    opt = parity.make_optimizer(master)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=growth_interval)
    scaler.scale(torch.ones(()))  # GradScaler makes its scale tensor lazily, at its first scale()
    fp16 = dtype == torch.float16
    data = parity.batches(steps * accum, rows)
    local = rows // world
    log, losses, norms = [], [], []
    for step in range(steps):
        total = 0.0
        ds = deepspeed_scaler
        s = (scaler.get_scale() if ds is None else ds.cur_scale) if fp16 else 1.0
        for micro in range(accum):
            x, y = data[step * accum + micro]
            for r in range(world):
                part = slice(r * local, (r + 1) * local)
                loss = model(x[part], labels=(x if hf else y)[part]).loss
                total += loss.item() / accum / world
                boost = BOOST if (step, micro, r) in boosts and fp16 else 1.0
                (loss * boost * (s / accum)).backward()
        for pm, p in zip(master.parameters(), model.parameters()):
            if p.grad is not None:
                pm.grad = p.grad.float() / world if low else p.grad / world
            if low:
                p.grad = None
        if fp16 and ds is not None:
            grads = [pm.grad for pm in master.parameters() if pm.grad is not None]
            overflow = not all(bool(torch.isfinite(g).all()) for g in grads)
            skipped = (*skipped, step) if overflow else skipped
            for g in grads:
                g.div_(s)
            ds.update_scale(overflow)
        elif fp16:
            scaler.unscale_(opt)
        if clip is not None and step not in skipped:
            norms.append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), clip)))
        before = scaler.get_scale()
        if fp16 and ds is None:
            scaler.step(opt)  # skipped where unscale_ found inf or nan
            scaler.update()
        elif step not in skipped:
            opt.step()
        applied = scaler.get_scale() >= before and step not in skipped  # GradScaler halves exactly when it skipped
        if ds is not None:
            scale_after = ds.cur_scale
        else:
            scale_after = scaler.get_scale() if fp16 else 1.0
        opt.zero_grad()
        if low:
            with torch.no_grad():
                for pm, p in zip(master.parameters(), model.parameters()):
                    p.copy_(pm)
        log.append((applied, scale_after))
        losses.append(total)
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {"log": log, "losses": losses, "norms": norms, "state": state}


def run_hetero(
    rank: int,
    world: int,
    *,
    steps: int,
    rows: int,
    config: dict,
    boosts: frozenset[tuple[int, int, int]] = frozenset(),
    nvme_dir: str | None = None,
    build: Callable[[], torch.nn.Module] = parity.build,
    hf: bool = False,
    loop_clip: float | None = None,
) -> dict[str, Any]:
    """hetero on this rank's rows, the same schedule of boosted micro-batches; the log, losses and norms as
    `reference`'s (build, hf: the model, as `reference` takes them). loop_clip: the loop clips with torch's
    clip_grad_norm_ before each update, as a plain loop does (else the norms are the engine's last_grad_norm)."""
    model = build()
    opt = parity.make_optimizer(model)
    config = copy.deepcopy(config)
    config.setdefault("chunk_size", parity.CHUNK)
    if nvme_dir is not None:
        config.setdefault("memory", {})["nvme_dir"] = os.path.join(nvme_dir, f"rank{rank}")
        os.makedirs(config["memory"]["nvme_dir"], exist_ok=True)
    engine = hetero.initialize(model, opt, config)
    accum = config.get("grad_accumulation_steps", 1)
    local = rows // world
    data = parity.batches(steps * accum, rows)
    log, losses, norms = [], [], []
    for step in range(steps):
        total = torch.zeros(())
        for micro in range(accum):
            x, y = data[step * accum + micro]
            x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
            loss = engine(x, labels=x if hf else y).loss
            engine.backward(loss * (BOOST if (step, micro, rank) in boosts else 1.0))
            if loop_clip is not None and micro == accum - 1:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), loop_clip)))
            engine.step()
            total += loss.detach().float().cpu() / accum
        engine.comm.control.all_reduce(total, op="avg")
        losses.append(total.item())
        log.append((engine.was_step_applied(), engine.scaler.scale if engine.scaler is not None else 1.0))
    state = {k: v.float() for k, v in engine.local_state_dict().items()}
    out = {"log": log, "losses": losses, "norms": norms, "state": state, "skipped": engine.skipped_steps}
    engine.close()
    return out


def run_parallel(
    rank: int, world: int, *, steps: int, rows: int, config: dict, overflows: dict[int, tuple[int, int, int]]
) -> dict[str, Any]:
    """The pipelineable GPT (tests/pipe_parity.py) under a tensor or pipeline layout, through `train_batch`.
    overflows: step -> the (tensor, data, pipeline) rank whose embedding gradient is multiplied by BOOST at that
    step, that rank's alone (its peers' gradients stay finite). The log and losses as `reference`'s; the state and
    coordinates as `pipe_parity.merge_ranks` takes them."""
    from hetero.models.gpt_pipe import TP_PLAN

    model = pipe_parity.build()
    if config.get("parallel", {}).get("tensor", 1) > 1:
        config = {**config, "parallel": {"tensor_plan": TP_PLAN, **config["parallel"]}}
    engine = hetero.initialize(model, parity.make_optimizer(model), {"chunk_size": parity.CHUNK, **config})
    mesh = engine.mesh
    step = [0]

    def boost(_module: torch.nn.Module, _inputs: Any, out: torch.Tensor) -> None:
        if overflows.get(step[0]) == (mesh.tp_rank, mesh.dp_rank, mesh.pp_rank) and out.requires_grad:
            out.register_hook(lambda g: g * BOOST)

    if model.embed is not None:  # the first pipeline stage's
        model.embed.register_forward_hook(boost)
    dp, dpr = engine.data_parallel_size, engine.data_parallel_rank
    local = rows // dp
    log, losses = [], []
    for step[0], (x, y) in enumerate(parity.batches(steps, rows)):
        losses.append(float(engine.train_batch(x[dpr * local : (dpr + 1) * local], y[dpr * local : (dpr + 1) * local])))
        log.append((engine.was_step_applied(), engine.scaler.scale))
    state = {k: v.float() for k, v in engine.local_state_dict().items()}
    shards = {n: p._hetero_tp for n, p in model.named_parameters() if hasattr(p, "_hetero_tp")}
    coords = (mesh.tp_rank, mesh.dp_rank, mesh.pp_rank)
    out = {"log": log, "losses": losses, "state": state if mesh.dp_rank == 0 else None, "coords": coords}
    engine.close()
    return {**out, "shards": shards}
