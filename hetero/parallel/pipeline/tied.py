"""Parameters tied across pipeline stages: an embedding shared with the head (GPT-2's `lm_head.weight`, which is
`transformer.wte.weight`), held by the first and the last stage.

[Note: parameters tied across stages]
The cut keeps a parameter in every stage that uses it, so a tied embedding lives on the ranks of the first stage
(as `transformer.wte.weight`) and of the last (as `lm_head.weight`, the embedding module removed there). Each rank
holds one copy, trained by ZeRO over its own data-parallel group like any parameter; the copies start equal (the
model is built alike on every rank, as for every other parameter) and stay equal because every copy steps on the
same gradient: the sum of both stages' contributions. After a batch's backwards, and before any reduction over the
data-parallel group, the ranks holding the copies (same tensor and data coordinates, the holding pipeline ranks:
the tie group) all-reduce the parameter's full gradient (Megatron's embedding group does the same). Both sums are
linear, so the order does not matter; before ZeRO's reduction the whole gradient is still there on every stage.
Stages 2-3 sum the batch's full gradient (`grad_full`) before `reduce_batch`; stages 0-1 sum the accumulated
gradient once, before the update that reads it (the train_batch that ends an accumulation). The copies then take
the same clipping coefficient, the same optimizer arithmetic and stay bit-identical. The global gradient norm
counts the parameter once: the copies on other than the lowest holding rank count 0 (`counts_in_norm`).

When every rank that uses the parameter holds all its uses (Chimera: ranks r and p - 1 - r hold the same two
stages, so the first and last stages sit together), nothing is needed: one object, autograd sums the uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hetero.errors import ConfigError

if TYPE_CHECKING:
    from hetero.comm import Comm
    from hetero.parallel.mesh import Mesh
    from hetero.zero.units import Entry


@dataclass
class Ties:
    """The parameters tied across pipeline ranks: every holder set in the model (each rank builds the same groups),
    and this rank's tied parameters with their holders."""

    sets: list[tuple[int, ...]] = field(default_factory=list)  # distinct holder sets, in model order
    mine: list[tuple[str, nn.Parameter, tuple[int, ...]]] = field(default_factory=list)  # (where, param, holders)


def find_ties(
    groups: list[list[tuple[str, nn.Module]]],
    holders: Callable[[int], list[int]],
    rank: int,
    names: Mapping[int, str] | None = None,
) -> Ties:
    """Parameters used by stages on different pipeline ranks; `holders(s)`: the pipeline ranks holding stage s;
    `names`: each parameter's names in the model, quoted, by id, for the errors (a Hugging Face unit's own names
    are not the model's: its "embeddings" unit holds `model.embed_tokens`)."""
    uses: dict[int, tuple[nn.Parameter, str, list[int]]] = {}  # param id -> (param, its names, stages using it)
    for s, group in enumerate(groups):
        for unit_name, unit in group:
            for pname, p in unit.named_parameters(remove_duplicate=False):
                where = (names or {}).get(id(p), repr(f"{unit_name}.{pname}"))
                entry = uses.setdefault(id(p), (p, where, []))
                if s not in entry[2]:
                    entry[2].append(s)
    ties = Ties()
    for p, where, stages in uses.values():
        sets = {tuple(holders(s)) for s in stages}
        if len(sets) == 1:
            continue  # the ranks holding it hold all its uses: one object each
        if any(len(h) > 1 for h in sets):
            raise ConfigError(
                f"parallel: {where} is used by stages {stages}, which Chimera places on different pairs of ranks; "
                "a parameter shared between stages is supported there only between stages r and p - 1 - r (an "
                "embedding tied to the head): choose pipeline_split so its uses fall in such stages"
            )
        ranks = tuple(sorted({r for h in sets for r in h}))
        if ranks not in ties.sets:
            ties.sets.append(ranks)
        if rank in ranks:
            ties.mine.append((where, p, ranks))
    return ties


def tie_groups(ties: Ties, mesh: Mesh, world: Comm) -> dict[tuple[int, ...], Comm]:
    """One group per holder set: the holding pipeline ranks at each tensor and data coordinate. Every rank calls it
    (it splits the world, once per set, in the same order everywhere)."""
    from hetero.parallel.mesh import Mesh

    t, d = mesh.tp_size, mesh.dp_size
    out = {}
    for ranks in ties.sets:
        parts = [[Mesh.rank_of(a, b, c, tensor=t, data=d) for c in ranks] for a in range(t) for b in range(d)]
        inside = {r for part in parts for r in part}
        parts += [[r] for r in range(world.size) if r not in inside]
        out[ranks] = world.split(parts)
    return out


class TiedGrads:
    """Sums the gradients of this rank's tied parameters over their tie groups ([Note: parameters tied across
    stages])."""

    def __init__(self, ties: Ties, groups: dict[tuple[int, ...], Comm], entries: dict[int, Entry], pp_rank: int):
        self.items: list[tuple[Entry, Comm]] = []
        for where, p, ranks in ties.mine:
            if id(p) not in entries:
                raise ConfigError(
                    f"parallel: {where} is tied across pipeline stages and split over chunks (tiling); a tied "
                    "parameter must sit whole in one chunk: raise chunk_size or turn tiling off"
                )
            p._hetero_tied_copy = pp_rank != ranks[0]  # the lowest holder counts it in the gradient norm
            if entries[id(p)].info.trainable and entries[id(p)].chunk.spec.trainable:  # a frozen one: no gradient
                self.items.append((entries[id(p)], groups[ranks]))

    def __bool__(self) -> bool:
        return bool(self.items)

    @torch.no_grad()
    def sum_grads(self, *, update_follows: bool) -> None:
        """After a batch's backwards, before the data-parallel reduction. `update_follows`: the update comes after
        this batch (stages 0-1 sum their accumulated gradient only then)."""
        from hetero.memory import TensorState, Tier

        for e, comm in self.items:
            zc, info = e.chunk, e.info
            if zc.grad_full is not None:  # stages 2-3: this batch's full gradient, reduced once after it
                buf = zc.manager.access(zc.grad_full, Tier.DEVICE)
                if zc.grad_full.slots[0].state is TensorState.FREE:
                    zc.grad_full.set_state(zc.grad_full.slots[0], TensorState.HOLD)
                region = buf.narrow(0, info.offset, info.numel)
                if id(info.param) not in zc.batch_seen:  # no use on this rank this batch: its part is zero
                    region.zero_()
                    zc.batch_seen.add(id(info.param))
                comm.all_reduce(region, op="sum")
            elif update_follows:
                region = zc.grad_buffer().narrow(0, info.offset, info.numel)
                staged = comm.needs_device_tensors and region.device != zc.device.torch_device
                work = zc.device.to_device(region) if staged else region
                comm.all_reduce(work, op="sum")
                if staged:
                    region.copy_(zc.device.to_host(work))


def counts_in_norm(param: Any) -> bool:
    """False for a tied parameter's copy that another pipeline rank counts in the global gradient norm."""
    return not getattr(param, "_hetero_tied_copy", False)
