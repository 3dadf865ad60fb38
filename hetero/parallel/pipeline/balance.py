"""What each pipeline unit costs, for `"pipeline_split": "auto"`: given by the user, timed, or counted.

[Note: balancing stages by time]
A pipeline runs at the pace of its slowest stage, so stages should take equal time, not hold equal parameters: an
embedding holds many parameters and costs almost nothing, a language-model head the reverse. "auto" therefore
balances the units' costs, taken, in this order, from
 - `parallel.pipeline_costs`: one number per unit, or unit-name patterns -> cost (unmatched units cost 1);
 - a short warm-up on the real device: each unit's forward and backward on a sample micro-batch, one unit at a
   time (moved to the device for it and back), the least of a few repeats (interference from other processes only
   adds time); the output of one unit is the next one's input, so every unit sees the shapes it will train on;
 - the FLOPs of the same forward and backward counted on the meta device, for a model built on meta (nothing to
   time).
The sample is one sequence of token ids when the first unit begins with an embedding (its length the model's
context, capped), or one row of features when it begins with a linear layer; a model that starts otherwise needs
`pipeline_costs`, else its units are balanced by parameters (logged). Every rank must cut alike while timings differ
from rank to rank, so the timings are averaged over the world and rank 0's result is broadcast: the split comes
from state every rank shares. The random state is restored after the warm-up, so dropout draws what it would have
without it. A run that resumes a checkpoint (`hetero.initialize(..., pipeline_cut_from=CKPT)`) cuts where that
checkpoint's run cut instead of timing again: [Note: the cut a checkpoint records] in split.py.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hetero.comm import Comm
from hetero.device import Device
from hetero.errors import ConfigError
from hetero.parallel.pipeline.runtime import PipelineError
from hetero.parallel.pipeline.split import Cut, boundaries

log = logging.getLogger("hetero.parallel")

_REPEATS = 3  # timed forward+backward passes per unit, after one to warm up
_SEQ_CAP = 256  # tokens in the timing sample at most


def choose_cut(
    model: nn.Module,
    units: Sequence[tuple[str, nn.Module]],
    *,
    split: Sequence[str] | str,
    given: Mapping[str, float] | Sequence[float] | None,
    stages: int,
    world: Comm,
    device: Device,
    saved: dict[str, Any] | None = None,
) -> tuple[Sequence[str] | str, list[float] | None, str | None, str | None]:
    """(split, costs, basis, source) for `split.cut_stages`: with "auto", the cut `saved` records (what
    `checkpoint.describe.read_cut` read from the checkpoint `pipeline_cut_from` names) where there is one, else the
    units' costs (`unit_costs`); a given split as it is, checked against a saved cut ([Note: the cut a checkpoint
    records] in split.py). Every rank calls it and gets the same answer."""
    names = [n for n, _ in units]
    if saved is not None:
        # Every rank read the checkpoint itself: one that could not, or read another cut, stops them all alike.
        views = world.all_gather_object((saved.get("error"), saved.get("cut")))
        failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(views) if e is not None]
        if failed:
            raise ConfigError(f"pipeline_cut_from {saved['source']!r} cannot be read: {'; '.join(failed)}")
        if any(c != views[0][1] for _, c in views):
            raise ConfigError(
                f"pipeline_cut_from {saved['source']!r}: the ranks read different cuts from it; every rank must see "
                "the same checkpoint at the same path"
            )
        record = saved.get("cut")
        if record is None:
            log.warning(
                "%s records no pipeline cut (saved without a pipeline, or by an older hetero): the stages are cut "
                "as pipeline_split %r cuts them",
                saved["source"],
                split,
            )
        else:
            cut = Cut.of(record, saved["source"])
            _check_saved(cut, names, stages, split, units)
            if split == "auto":
                return cut.split, list(cut.costs) if cut.costs is not None else None, cut.basis, cut.source
    if split != "auto":
        return split, None, None, None
    costs, basis = unit_costs(model, units, given=given, world=world, device=device)
    if costs is None:
        log.info("pipeline stages balanced by parameters: %s", basis)
        return split, None, "params", None
    return split, costs, basis, None


def _check_saved(
    cut: Cut, names: list[str], stages: int, split: Sequence[str] | str, units: Sequence[tuple[str, nn.Module]]
) -> None:
    """Refuse a saved cut this run cannot train on, naming it and what to set."""
    where = f"pipeline_cut_from {cut.source!r}: its {len(cut.split) + 1} {cut.describe()}"
    if list(cut.units) != names:
        raise ConfigError(
            f"{where}, over the units {', '.join(cut.units)}; this model's units are {', '.join(names)}: it is another "
            "model. Build the model the checkpoint was saved from, or drop pipeline_cut_from"
        )
    if len(cut.split) + 1 != stages:
        raise ConfigError(
            f"{where}; this run has {stages} stages (parallel.pipeline x virtual_stages): set them as the run that "
            "saved it did (a checkpoint loads only into the same pipeline degree), or drop pipeline_cut_from"
        )
    if split == "auto":
        return
    mine = list(split) if not isinstance(split, str) else [names[i] for i in boundaries(units, stages, split)[1:]]
    if mine != list(cut.split):
        raise ConfigError(
            f"{where}; parallel.pipeline_split {split!r} begins them at {', '.join(mine)}. Set pipeline_split "
            f'to {list(cut.split)!r} or "auto" to train on the saved cut, or drop pipeline_cut_from to train on yours'
        )


def given_costs(names: Sequence[str], costs: Mapping[str, float] | Sequence[float]) -> list[float]:
    """The user's costs, one per unit (see the note)."""
    if isinstance(costs, Mapping):
        return [float(next((c for pat, c in costs.items() if fnmatch.fnmatchcase(n, pat)), 1.0)) for n in names]
    return [float(c) for c in costs]


def sample_input(model: nn.Module, units: Sequence[tuple[str, nn.Module]], rows: int = 1) -> torch.Tensor | None:
    """A micro-batch for timing the first unit, or None when its input cannot be guessed (see the note)."""
    first = next((m for m in units[0][1].modules() if not list(m.children())), None)
    g = torch.Generator().manual_seed(0)
    if isinstance(first, nn.Embedding):
        cfg = getattr(model, "config", None)
        ctx = next(
            (
                v
                for k in ("block_size", "max_position_embeddings", "n_positions", "n_ctx")
                if isinstance(v := getattr(cfg, k, None), int) and v > 0
            ),
            _SEQ_CAP,
        )
        return torch.randint(0, first.num_embeddings, (rows, min(ctx, _SEQ_CAP)), generator=g)
    if isinstance(first, nn.Linear):
        return torch.randn(rows, first.in_features, generator=g)
    return None


def unit_costs(
    model: nn.Module,
    units: Sequence[tuple[str, nn.Module]],
    *,
    given: Mapping[str, float] | Sequence[float] | None,
    world: Comm,
    device: Device,
    sample: torch.Tensor | None = None,
) -> tuple[list[float] | None, str]:
    """(cost per unit, how it was found: "given" | "timed" | "flops"), or (None, why) to balance by parameters.
    Identical on every rank of `world` (every rank calls it). sample: the first unit's input (default: guessed,
    see the note)."""
    names = [n for n, _ in units]
    if given is not None:
        return given_costs(names, given), "given"
    sample = sample if sample is not None else sample_input(model, units)
    if sample is None:
        return None, "no sample input to time the units with (give parallel.pipeline_costs)"
    meta = any(p.is_meta for p in model.parameters())
    error: Exception | None = None
    try:  # running the units can fail on one rank alone (out of memory): it says so in the all-reduce below
        measured = flop_costs(units, sample) if meta else timed_costs(units, sample, device)
    except Exception as e:
        error, measured = e, [0.0] * len(units)
    t = torch.tensor([*measured, float(error is not None)], dtype=torch.float64)  # host numbers: the control group's
    world.control.all_reduce(t, op="avg")
    world.control.broadcast(t, src=0)  # bit-identical on every rank, whatever the reduction's rounding
    if error is not None:
        raise error
    if float(t[-1]) > 0:
        raise PipelineError(
            "timing the pipeline's units failed on another rank (its own error says why): no rank can balance the "
            "stages without it; give parallel.pipeline_costs to skip the timing"
        )
    return [max(float(c), 1e-12) for c in t[:-1]], "flops" if meta else "timed"


def timed_costs(units: Sequence[tuple[str, nn.Module]], sample: torch.Tensor, device: Device) -> list[float]:
    """Seconds of each unit's forward and backward on the device (the least of a few repeats), in order."""
    dev = device.torch_device
    cpu_state = torch.get_rng_state()
    dev_state = device.rng_state()
    x: Any = sample.to(dev)
    out: list[float] = []
    try:
        for _, unit in units:
            homes = {id(p): p.device for p in unit.parameters()}
            unit.to(dev)
            times = []
            for i in range(_REPEATS + 1):
                inp = x.detach().requires_grad_(x.is_floating_point())
                device.synchronize()
                start = time.perf_counter()
                y = unit(inp)
                _backward(y)
                device.synchronize()
                if i:
                    times.append(time.perf_counter() - start)
            unit.zero_grad(set_to_none=True)
            for p in unit.parameters():
                if p.device != homes[id(p)]:
                    p.data = p.data.to(homes[id(p)])
            out.append(min(times))
            x = _tensor_of(y).detach()
    finally:
        torch.set_rng_state(cpu_state)
        if dev_state is not None:
            device.set_rng_state(dev_state)
    return out


def flop_costs(units: Sequence[tuple[str, nn.Module]], sample: torch.Tensor) -> list[float]:
    """FLOPs of each unit's forward and backward, counted on the meta device (nothing is allocated)."""
    from torch.utils.flop_counter import FlopCounterMode

    x: Any = sample.to("meta")
    out = []
    for _, unit in units:
        inp = x.detach().requires_grad_(x.is_floating_point())
        with FlopCounterMode(display=False) as counter:
            y = unit(inp)
            _backward(y)
        out.append(float(max(counter.get_total_flops(), 1)))
        x = _tensor_of(y).detach()
    return out


def _tensor_of(y: Any) -> torch.Tensor:
    if isinstance(y, torch.Tensor):
        return y
    for key in ("logits", "last_hidden_state"):
        v = getattr(y, key, None)
        if isinstance(v, torch.Tensor):
            return v
    if isinstance(y, (tuple, list)) and y and isinstance(y[0], torch.Tensor):
        return y[0]
    raise TypeError(f"a pipeline unit returned {type(y).__name__}; a stage must pass one tensor to the next")


def _backward(y: Any) -> None:
    t = _tensor_of(y)
    if t.requires_grad:
        t.float().mean().backward()
