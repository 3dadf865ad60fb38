"""Which parameter goes into which chunk, at which offset.

Parameters are packed in the order the model registers them (for most models the order forward uses them, which
keeps a chunk's tensors needed together and makes prefetch effective), one param group of the user's optimizer at a
time: every chunk belongs to exactly one group, so a chunk's optimizer update uses one set of hyperparameters.
Parameters that will not be trained (requires_grad False, or in no optimizer group) go to frozen chunks, which are
placed and sharded like the others but get no gradients and no optimizer state.

Every chunk's capacity is a multiple of the data-parallel world size, so it splits into equal shards, one per rank.
A parameter larger than a chunk is split over chunks of its own, one tile (a run of whole rows) each, where its
modules can compute on it tile by tile (`hetero/memory/chunk_size.py`, [Note: tiles]; `hetero/zero/tiling.py`);
with the automatic chunk size, only one larger than the budgets' chunk ([Note: tiling only what the budgets need]).

[Note: tiling only what the budgets need]
A tiled layer computes one tile at a time: smaller matrix products, the tiles' outputs joined, the input gradient
summed over them. That is the price of a working set no larger than a chunk, worth paying for a weight the budgets
could not hold whole. The automatic chunk size, though, is chosen for low padding within the budgets' cap
(`_auto_chunk_numel`), and tiled anything above it: the 8192 x 512 embedding of the step_time race's Llama
(tied to the head; 22.6M parameters, budgets of gigabytes) went into two tiles at a 3.8M-element chunk, and its
tiled code took an eighth of a ZeRO-3 rank's samples on two CPU ranks (py-spy, 2026-11-27), its matrix products
included. Nothing was bought with it. Against FSDP2 side by side (`benchmarks/step_time.py --only
fsdp2,hetero_stage3`), three alternating runs each: 1.148x, 1.170x, 1.017x FSDP2's step with the tiles, 1.054x,
0.989x, 0.961x without. So with the automatic size a weight is split only when its own chunk would exceed the
largest the budgets hold (`chunk_size.budget_cap`), or 64M elements (the automatic capacities' ceiling) where no
budget limits it; below that it gets a chunk of its own, which the budgets hold like any other. An explicit
`chunk_size` keeps the plain rule: whatever is larger than a chunk is tiled.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hetero.memory.chunk_budgets import budget_costs, small_chunks
from hetero.memory.chunk_size import budget_cap, pack_tiled, search_tiled
from hetero.zero.tileable import tile_rows

if TYPE_CHECKING:
    from hetero.comm import Comm
    from hetero.config import Config
    from hetero.memory import ChunkManager
    from hetero.zero.optim import Algorithm

log = logging.getLogger("hetero.zero")


@dataclass(eq=False)
class ParamInfo:
    name: str  # fully qualified name (the first, when a parameter is shared)
    param: nn.Parameter
    offset: int = 0  # first element within its chunk
    trainable: bool = True  # gets a gradient and an update
    registered: int = 0  # position in model.named_parameters(): roughly forward order (see reduce_order)
    start: int = 0  # first element of the parameter held here (a tile's; 0 for a whole parameter)
    count: int | None = None  # elements held: a tile's; None for the whole parameter

    @functools.cached_property  # read per parameter per use; a released parameter answers through Python
    def numel(self) -> int:
        """Elements held in the chunk: the whole parameter's, or a tile's."""
        return self.param.numel() if self.count is None else self.count

    def element(self, a: int) -> int:
        """The parameter's flat element index at chunk element `a` (checkpoints store element ranges)."""
        return self.start + a - self.offset

    @property
    def tiled(self) -> bool:
        """This is one tile of a parameter split over several chunks ([Note: tiles])."""
        return self.count is not None

    @property
    def shape(self) -> torch.Size:
        """The shape of what is held here: the parameter's, or the tile's rows (tiles are runs of dim-0 rows)."""
        shape = self.param.shape
        if self.count is None:
            return shape
        row = self.param.numel() // shape[0]
        return torch.Size((self.count // row, *shape[1:]))

    @property
    def rows(self) -> tuple[int, int]:
        """The dim-0 rows [a, b) of the parameter held here."""
        row = max(1, self.param.numel() // max(1, self.param.shape[0])) if self.param.dim() else 1
        return self.start // row, (self.start + self.numel) // row


@dataclass(eq=False)
class ChunkSpec:
    index: int  # position in the layout: the order of reduction and of the optimizer pass, the same on every rank
    group: int | None  # the optimizer param group; None for frozen chunks
    capacity: int  # elements, a multiple of the world size
    params: list[ParamInfo] = field(default_factory=list)
    tile: bool = False  # holds one tile of a parameter split over several chunks, and nothing else
    chunk_numel: int = 0  # the layout's chunk size (a regular chunk's capacity; trimmed chunks and tiles are smaller)

    @property
    def trainable(self) -> bool:
        return self.group is not None

    def label(self) -> str:
        """What the chunk holds, for errors: its first parameter (a tile's rows)."""
        first = self.params[0]
        if first.tiled:
            a, b = first.rows
            return f"{first.name}[{a}:{b}]"
        return first.name + (", ..." if len(self.params) > 1 else "")

    def overlaps(self, lo: int, hi: int) -> Iterator[tuple[ParamInfo, int, int]]:
        """Each parameter that meets the chunk's element range [lo, hi), with the range [a, b) they share (in chunk
        elements): how a rank's shard, a saved segment or a gradient region maps onto parameters."""
        for info in self.params:
            a, b = max(info.offset, lo), min(info.offset + info.numel, hi)
            if a < b:
                yield info, a, b


def build_layout(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    chunk_numel: int | None,
    world: int,
    max_chunk_numel: int | None = None,
    tiling: bool = True,
) -> list[ChunkSpec]:
    """Chunks for every parameter of the model. chunk_numel None: search the size that wastes least, at most
    `max_chunk_numel` (what the budgets allow, `chunk_size.budget_cap`). tiling: split parameters larger than a chunk
    into tiles where their modules allow it ([Note: tiles]); else they get a chunk of their own. optimizer None
    (inference): every chunk is frozen."""
    names = {id(p): n for n, p in model.named_parameters()}  # shared parameters appear once, by first name
    group_of: dict[int, int] = {}
    for g, group in enumerate(optimizer.param_groups if optimizer is not None else []):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"the optimizer's param group {g} holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                    "of the model: build the optimizer from model.parameters()"
                )
            if id(p) in group_of:
                raise ValueError(f"parameter {names[id(p)]!r} appears in two optimizer param groups")
            group_of[id(p)] = g
    buckets: dict[int | None, list[ParamInfo]] = {}
    for position, (name, p) in enumerate(model.named_parameters()):
        g = group_of.get(id(p)) if p.requires_grad else None
        if p.requires_grad and g is None and optimizer is not None:
            log.warning("parameter %r requires grad but is in no optimizer group: it is treated as frozen", name)
        if p.numel() == 0:
            continue
        info = ParamInfo(name=name, param=p, trainable=g is not None, registered=position)
        buckets.setdefault(g, []).append(info)
    if not buckets:
        raise ValueError("the model has no parameters to place")
    rows = tile_rows(model) if tiling else {}
    if chunk_numel is None:  # [Note: tiling only what the budgets need]
        most = min(max_chunk_numel, AUTO_MAX) if max_chunk_numel is not None else AUTO_MAX
        numel = {id(i.param): i.param.numel() for infos in buckets.values() for i in infos}
        rows = {k: r for k, r in rows.items() if k in numel and _round_up(numel[k], world) > most}
    order = sorted(buckets, key=lambda g: (g is None, g if g is not None else 0))
    runs = [([i.numel for i in buckets[g]], [rows.get(id(i.param)) for i in buckets[g]]) for g in order]
    align = 1
    if chunk_numel is None:
        chunk_numel = _auto_chunk_numel(runs, max_chunk_numel)
        align = AUTO_ALIGN
    specs: list[ChunkSpec] = []
    for g, (numels, run_rows) in zip(order, runs):
        infos = buckets[g]
        for packed in pack_tiled(numels, run_rows, chunk_numel, align=align):
            capacity = _round_up(packed.capacity, world)
            spec = ChunkSpec(index=len(specs), group=g, capacity=capacity, tile=packed.tile, chunk_numel=chunk_numel)
            offset = 0
            for i, start, count in packed.members:
                info = infos[i]
                if packed.tile:
                    info = dataclasses.replace(info, start=start, count=count)
                info.offset = offset
                offset += count
                spec.params.append(info)
            specs.append(spec)
    return specs


AUTO_ALIGN = 1024  # elements: automatic capacities (and trimmed ones) are multiples of it
AUTO_MAX = 64 << 20  # elements: the automatic capacity's ceiling, and the largest weight it leaves whole


def _auto_chunk_numel(runs: list[tuple[list[int], list[int | None]]], cap: int | None) -> int:
    """A capacity with little padding, within a range scaled to the model so that small models still get several
    chunks (at least ~8 for fine-grained movement) and large ones stay under 64M elements per chunk, and at most
    `cap` (the budgets' limit)."""
    numels = [n for run, _ in runs for n in run]
    total, largest = sum(numels), max(numels)
    lo = max(AUTO_ALIGN, min(1 << 20, total // 8))
    hi = max(lo, min(AUTO_MAX, max(largest, total // 4)))
    if cap is not None:
        hi = max(AUTO_ALIGN, min(hi, cap))
        lo = min(lo, hi)
    return search_tiled(runs, min_numel=lo, max_numel=hi, align_numel=AUTO_ALIGN)


def config_cap(
    config: Config, *, device_budget: int | None, host_budget: int | None, n_states: int, world: int
) -> int | None:
    """The largest automatic chunk capacity these budgets hold with room to spare (`chunk_size.budget_cap`)."""
    return budget_cap(
        **_sizing(config, device_budget=device_budget, host_budget=host_budget, n_states=n_states, world=world)
    )


def _sizing(config: Config, **given: int | None) -> dict[str, Any]:
    """The keywords of `chunk_size.budget_costs` the config gives, with the `given` budgets and sizes."""
    from hetero.zero.precision import COMPUTE_DTYPES

    return dict(
        stage=config.zero_stage,
        param_bytes=COMPUTE_DTYPES[config.precision].itemsize,
        params_tier=config.offload.params,
        optim_tier=config.offload.optimizer,
        prefetch_depth=config.prefetch_depth,
        **given,
    )


def warn_small_chunks(
    config: Config, specs: list[ChunkSpec], manager: ChunkManager, *, n_states: int, world: int
) -> None:
    """Log once, at initialize, where the budgets forced the automatic chunk size below the size at which per-chunk
    costs stop mattering ([Note: chunks too small for their fixed costs]): the size, the budget that forced it and
    the one that lifts it."""
    from hetero.memory import Tier

    if config.chunk_size != "auto" or not specs:
        return
    budgets = {k: manager.ledgers[t].budget for k, t in (("device_budget", Tier.DEVICE), ("host_budget", Tier.HOST))}
    sizing = _sizing(config, **budgets, n_states=n_states, world=world)
    total = sum(p.numel for spec in specs for p in spec.params)
    natural = max(AUTO_ALIGN, min(1 << 20, total // 8))  # the least `_auto_chunk_numel` picks with no budget
    costs = budget_costs(**sizing)
    message = small_chunks(specs[0].chunk_numel, natural_numel=natural, itemsize=sizing["param_bytes"], costs=costs)
    if message:
        log.warning("%s", message)


def chunk_cap(
    config: Config, manager: ChunkManager, algorithm: Algorithm, comm: Comm, *, agree_over: Comm | None = None
) -> int | None:
    """`config_cap` for the manager's budgets (sharded over `comm`), agreed by `agree_over` (default: `comm`): the
    smallest, so every rank builds the same layout (budgets may differ between ranks). Under pipeline parallelism
    that is every rank of the job: whether a tied weight is split into tiles must be the same on the two stages that
    hold its copies, whose sums meet in one all-reduce."""
    from hetero.memory import Tier

    cap = config_cap(
        config,
        device_budget=manager.ledgers[Tier.DEVICE].budget,
        host_budget=manager.ledgers[Tier.HOST].budget,
        n_states=len(algorithm.state_names),
        world=comm.size,
    )
    agreed = torch.tensor([cap if cap is not None else _NO_CAP], dtype=torch.int64)
    (agree_over or comm).control.all_reduce(agreed, op="min")
    value = int(agreed)
    return None if value == _NO_CAP else value


_NO_CAP = 1 << 62


def _round_up(n: int, k: int) -> int:
    return int(math.ceil(n / k)) * k
