"""Cut a model into pipeline stages, and keep only this rank's.

[Note: pipeline units]
A model is pipelined as the sequence of its top-level children, in registration order, with every ModuleList child
expanded into its items ("layers.0", "layers.1", ...). That covers an `nn.Sequential`, a ModuleList of blocks, and a
model whose forward runs its children one after the other (hetero.models.gpt_pipe.GPTPipe); each unit takes the
previous unit's output, the first takes the batch's inputs, and the last, when the model computes its own loss, is
also called with `labels=`. A Hugging Face causal LM is cut into the units of a decoder instead (hf.py, [Note:
pipelining a Hugging Face decoder]). Stages are runs of consecutive units, cut where `pipeline_split` names a unit, or
balanced by each unit's cost: its measured time ("auto", see balance.py) or its parameter count ("params"). Units
of other ranks' stages are removed from the user's model in place (their parent's slot set to None; a unit that
wraps several of the model's modules names them in `parts`), so their memory is freed and the parameters that
remain keep their names. A parameter several stages use (an embedding tied to the head) stays in each of them:
tied.py.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from hetero.errors import ConfigError
from hetero.parallel.pipeline.hf import bind_microbatch, hf_units, is_hf_decoder, microbatch_digest
from hetero.parallel.pipeline.tied import Ties, find_ties


# [Note: the cut a checkpoint records]
# "auto" times the units, and timings vary from run to run: about 1 run in 12 of a 6-block GPTPipe over 4 stages cut
# apart from the run before. Weights and optimizer states load into another cut by name, but a checkpoint saved
# mid-accumulation holds each rank's pending gradients of its own stage's parameters, and the cut decides which ranks
# add which squares in the gradient norm (and so its rounding): a bit-exact resume needs the saved cut. So every
# checkpoint records its cut (the layout's "pipeline_cut": the units, where stages begin, how the cut was found and
# the costs it balanced), `hetero.initialize(..., pipeline_cut_from=CKPT)` cuts "auto" there instead of timing (a
# cut can only change before the model is split), and a load into another cut names the saved one and the
# `pipeline_split` that reproduces it: an error mid-accumulation, a warning at a step boundary.
@dataclass(frozen=True)
class Cut:
    """Where the pipeline's virtual stages begin, and why ([Note: the cut a checkpoint records])."""

    units: tuple[str, ...]  # every unit of the whole model, in order
    split: tuple[str, ...]  # the units where stages 1.. begin: a `pipeline_split` that gives this cut
    basis: str  # "timed" | "flops" | "given" (pipeline_costs) | "params" | "split" (pipeline_split's FQNs)
    costs: tuple[float, ...] | None = None  # what "auto" balanced, one per unit
    source: str | None = None  # the checkpoint this cut was read from (not recorded)

    def record(self) -> dict[str, Any]:
        """The cut as a checkpoint's layout holds it (JSON)."""
        costs = list(self.costs) if self.costs is not None else None
        return {"units": list(self.units), "split": list(self.split), "basis": self.basis, "costs": costs}

    @classmethod
    def of(cls, record: dict[str, Any], source: str | None = None) -> Cut:
        costs = record.get("costs")
        return cls(
            tuple(record["units"]),
            tuple(record["split"]),
            str(record.get("basis", "split")),
            tuple(float(c) for c in costs) if costs is not None else None,
            source,
        )

    def describe(self) -> str:
        """Where the stages begin and why, for log lines and errors."""
        why = {
            "timed": "balanced by the units' times in a warm-up",
            "flops": "balanced by the units' FLOPs",
            "given": "balanced by parallel.pipeline_costs",
            "params": "balanced by parameter counts",
            "split": "given by parallel.pipeline_split",
        }.get(self.basis, self.basis)
        if self.source is not None:
            why = f"saved in {self.source}, {why} there"
        costs = f"; costs {[float(f'{c:.3g}') for c in self.costs]}" if self.costs is not None else ""
        return f"stages begin at {', '.join([self.units[0], *self.split])} ({why}{costs})"


@dataclass(eq=False)
class StageChunk:
    """One model chunk: a run of units, virtual stage `index` of `count`."""

    index: int
    count: int
    units: list[tuple[str, nn.Module]]
    # Every parameter name of the whole model before the cut: a checkpoint of another cut holds them on other stages.
    model_params: frozenset[str] = frozenset()
    cut: Cut | None = None  # the whole pipeline's cut, the same on every rank
    # The whole model's state_dict keys in its own order, before the cut: an interleaved or Chimera rank holds stages
    # that are not neighbours, so the stages' keys in rank order are not the model's ([Note: the whole model's order]).
    model_keys: tuple[str, ...] = ()

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def __call__(self, x: Any, labels: Any = None, batch: Any = None) -> Any:
        """The chunk's units on `x`; `batch`: this rank's copy of the micro-batch, which a later stage's Hugging Face
        layers read their mask and positions from (hf.py, [Note: a padded batch through the stages])."""
        if not self.first:  # the first chunk's embeddings bind their own input
            bind_microbatch(self.units[0][1], batch)
        for i, (_, unit) in enumerate(self.units):
            if labels is not None and self.last and i == len(self.units) - 1:
                x = unit(x, labels=labels)
            else:
                x = unit(x)
        return x

    def side_digest(self, batch: Any) -> Any:
        """What the stages compare of a micro-batch besides the activations (a Hugging Face model's mask and
        positions: an int64 tensor), None when nothing."""
        return microbatch_digest(self.units[0][1], batch)


def units_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's pipeline units (see [Note: pipeline units])."""
    if is_hf_decoder(model):
        return hf_units(model)
    out: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if child is None:
            continue
        if isinstance(child, nn.ModuleList):
            out += [(f"{name}.{i}", m) for i, m in child.named_children() if m is not None]
        else:
            out.append((name, child))
    return out


def boundaries(
    units: Sequence[tuple[str, nn.Module]],
    stages: int,
    split: Sequence[str] | str,
    costs: Sequence[float] | None = None,
) -> list[int]:
    """Index of the first unit of each stage (stage 0 starts at 0). split "auto" balances `costs` (one per unit),
    "params" (or "auto" without costs) the units' parameter counts."""
    names = [n for n, _ in units]
    if len(units) < stages:
        raise ConfigError(
            f"parallel: {stages} pipeline stages need at least {stages} units, the model has {len(units)} "
            f"({', '.join(names)}); lower pipeline / virtual_stages, or pipeline a model with more top-level blocks"
        )
    empty = [
        _numel(m) == 0 for _, m in units
    ]  # a stage of these alone holds nothing to place: [Note: stages hold parameters]
    if split in ("auto", "params"):
        if split == "auto" and costs is not None:
            if len(costs) != len(units):
                raise ConfigError(
                    f"parallel.pipeline_costs: {len(costs)} costs for {len(units)} units ({', '.join(names)})"
                )
            starts = balanced(list(costs), stages, empty=empty)
        else:
            starts = balanced([_numel(m) for _, m in units], stages, empty=empty)
        _check_parameters(names, empty, starts, split)
        return starts
    starts = [0]
    for fqn in split:
        if fqn not in names:
            close = difflib.get_close_matches(fqn, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"parallel.pipeline_split: {fqn!r} is not a unit a stage can begin at{hint} Units: {', '.join(names)}"
            )
        i = names.index(fqn)
        if i <= starts[-1]:
            raise ConfigError(
                f"parallel.pipeline_split: {fqn!r} must come after {names[starts[-1]]!r}: list the FQNs where stages "
                "begin in model order, the first unit excluded"
            )
        starts.append(i)
    _check_parameters(names, empty, starts, split)
    return starts


# [Note: stages hold parameters]
# ZeRO places each rank's parameters in chunks and has nothing to do for a rank with none: a stage of parameterless
# units alone (an nn.Sequential's activations) failed on that rank only, in initialize, while the other ranks went on
# into the first batch and stopped there on a closed connection. Every rank computes every stage's units, so the cut
# is refused alike on every rank before anything else runs; "auto" and "params" avoid such stages where they can.
def _check_parameters(names: list[str], empty: list[bool], starts: list[int], split: Sequence[str] | str) -> None:
    bounds = [*starts, len(names)]
    for s in range(len(starts)):
        if all(empty[bounds[s] : bounds[s + 1]]):
            units = ", ".join(repr(n) for n in names[bounds[s] : bounds[s + 1]])
            how = (
                "begin the stages at other units (pipeline_split: a list of the units where stages begin)"
                if not isinstance(split, str)
                else "no cut of these units gives every stage parameters: lower pipeline / virtual_stages"
            )
            raise ConfigError(
                f"parallel.pipeline_split: stage {s} would hold only the units {units}, without parameters; every "
                f"pipeline stage must hold some ([Note: stages hold parameters] in split.py): {how}"
            )


def balanced(sizes: list[float], k: int, empty: list[bool] | None = None) -> list[int]:
    """Starts of k non-empty runs of `sizes` minimising the largest run's sum, then (among cuts with the same
    largest run) the sum of the runs' squares, so that the runs besides the largest are balanced too (dynamic
    programming). `empty`: units a run must not consist of alone, where a cut can avoid it."""
    n = len(sizes)
    prefix = [0.0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    full = [0]  # units up to i that are not `empty`
    for e in empty or [False] * n:
        full.append(full[-1] + (not e))
    if full[-1] < k:  # no cut avoids them (or none given): every run counts as holding something
        full = list(range(n + 1))
    inf = (float("inf"), float("inf"))
    # best[j][i]: (largest run, sum of squares) of the best cut of the first i units into j runs
    best: list[list[tuple[float, float]]] = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = (0.0, 0.0)
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for a in range(j - 1, i):
                if full[i] == full[a]:
                    continue  # a run of `empty` units alone
                run = prefix[i] - prefix[a]
                cost = (max(best[j - 1][a][0], run), best[j - 1][a][1] + run * run)
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, a
    starts, i = [], n
    for j in range(k, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return starts[::-1]


def keep_stages(
    model: nn.Module,
    *,
    rank: int,
    ranks: int,
    virtual: int,
    split: Sequence[str] | str,
    costs: Sequence[float] | None = None,
    bidirectional: bool = False,
) -> list[StageChunk]:
    """Split the model into ranks x virtual stages, drop every unit that is not this rank's from the model (in
    place) and return this rank's chunks in order: chunk c is virtual stage c * ranks + rank. `bidirectional`
    (Chimera): `ranks` stages, this rank keeps stage `rank` (chunk 0) and stage `ranks - 1 - rank` (chunk 1)."""
    return cut_stages(
        model, rank=rank, ranks=ranks, virtual=virtual, split=split, costs=costs, bidirectional=bidirectional
    )[0]


def cut_stages(
    model: nn.Module,
    *,
    rank: int,
    ranks: int,
    virtual: int,
    split: Sequence[str] | str,
    costs: Sequence[float] | None = None,
    bidirectional: bool = False,
    basis: str | None = None,
    source: str | None = None,
) -> tuple[list[StageChunk], Ties]:
    """`keep_stages`, and the parameters this rank shares with other pipeline ranks (tied.py). basis: how `costs`
    were found (balance.py), and source: the checkpoint a split was read from, for the chunks' `cut`."""
    units = units_of(model)
    count = ranks * virtual
    starts = boundaries(units, count, split, costs) + [len(units)]
    names = tuple(n for n, _ in units)
    if basis is None:
        basis = "split" if not isinstance(split, str) else "given" if split == "auto" and costs else "params"
    cut = Cut(names, tuple(names[i] for i in starts[1:-1]), basis, _floats(costs), source)
    groups = [units[starts[i] : starts[i + 1]] for i in range(count)]

    def holders(s: int) -> list[int]:  # the pipeline ranks that hold stage s
        return sorted({s, ranks - 1 - s}) if bidirectional else [s % ranks]

    mine = [rank, ranks - 1 - rank] if bidirectional else [i for i in range(count) if i % ranks == rank]
    fqns: dict[int, list[str]] = {}  # each parameter's names in the model, for the errors on tied ones
    for n, p in model.named_parameters(remove_duplicate=False):
        fqns.setdefault(id(p), []).append(n)
    named = {k: repr(v[0]) + (f" (also {', '.join(map(repr, v[1:]))})" if v[1:] else "") for k, v in fqns.items()}
    ties = find_ties(groups, holders, rank, named)
    every = frozenset(n for n, _ in model.named_parameters(remove_duplicate=False))  # tied names too
    order = tuple(model.state_dict(keep_vars=True))  # keep_vars: names only, no copies (and meta tensors pass)
    kept = {id(m) for i in mine for _, m in groups[i]}
    dropped: list[tuple[nn.Module, str, nn.Module]] = []  # meta modules lazy_init's replay puts back
    for name, unit in units:
        if id(unit) not in kept:
            for part in getattr(unit, "parts", [name]):
                parent_name, _, leaf = part.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                gone = getattr(parent, leaf)
                if gone is not None and any(t.is_meta for t in (*gone.parameters(), *gone.buffers())):
                    dropped.append((parent, leaf, gone))  # [Note: replaying the stages a rank dropped]
                setattr(parent, leaf, None)  # nn.Module skips None children: parameters and state_dict drop it
    if dropped:
        model._hetero_dropped = dropped  # a plain attribute (a list): not a submodule, so not in the model
    return [StageChunk(i, count, groups[i], every, cut, order) for i in mine], ties


def _floats(costs: Sequence[float] | None) -> tuple[float, ...] | None:
    return tuple(float(c) for c in costs) if costs is not None else None


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())
