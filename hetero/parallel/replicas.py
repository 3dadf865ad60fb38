"""The check that a model about to be cut by tensor parallelism (1D or a grid) is the same on every rank of the group.

Each tensor rank keeps its slice of its own copy, so copies built differently (a seed per rank) would make one model
of mismatched slices, with replicated parameters that differ between ranks, and train without an error. The
engine's broadcast of rank 0's values covers the data-parallel group only, never the tensor group.

[Note: one verdict for every rank]
Through `hetero.initialize` the check runs on the whole model before a pipeline cuts it (`setup.py`), each tensor
group comparing its ranks' copies, and the verdict is then agreed over every rank of the job (`every`): a tensor
group whose copies agree would otherwise go on to initialize and wait until comm_timeout for a group that raised,
be it another pipeline stage's or another data-parallel replica's. All collectives below are issued by every rank,
whatever its model holds; what follows them is decided from what they returned, the same on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from hetero.comm import Comm
from hetero.errors import ConfigError


def check_replicas(model: nn.Module, comm: Comm, *, every: Comm | None = None) -> None:
    """Raise a ConfigError unless ``model`` is the same on every rank of the tensor group ``comm``: two float64
    numbers per parameter (its sum and norm) compared over the control group. ``every``: a group holding ``comm``
    (the world) over which the verdict is agreed, so that every rank of it raises the same error ([Note: one verdict
    for every rank]); every rank of it must call this with the same model layout. A model on the meta device has
    nothing to compare yet (the engine initialises it alike on every rank)."""
    control = getattr(comm, "control", None)  # the estimator's ShapeComm has none: it only cuts meta models
    if comm.size == 1 or control is None:
        return
    group = every if every is not None and every.size > 1 else comm
    named = [(n, p) for n, p in model.named_parameters() if not p.is_meta]
    counts = torch.tensor([len(named), -len(named)], dtype=torch.float64)
    group.control.all_reduce(counts, op="max")  # shapes of the exchanges below: a mismatch would abort gloo
    if counts[0] != -counts[1]:
        raise ConfigError(
            f"the ranks' models hold between {int(-counts[1])} and {int(counts[0])} parameters off the meta device: "
            "tensor parallelism cuts one model, the same on every rank, so build it alike on each (the same "
            "configuration, wholly on the meta device or wholly off it)"
        )
    if not named:
        return
    with torch.no_grad():
        sums = [
            torch.stack([p.sum(dtype=torch.float64), torch.linalg.vector_norm(p, dtype=torch.float64)])
            for _, p in named
        ]
    lo = torch.stack(sums).cpu()
    hi = lo.clone()
    control.all_reduce(lo, op="min")
    control.all_reduce(hi, op="max")
    # The same values summed alike agree exactly; the tolerance only allows for another thread count.
    differ = (~torch.isclose(lo, hi, rtol=1e-9, atol=0, equal_nan=True).all(1)).double()
    ranks = comm.global_ranks
    if group is not comm:  # every rank learns which parameters differ in any tensor group, and whose ranks hold them
        mine = torch.zeros(group.size, dtype=torch.float64)
        mine[group.rank] = float(differ.any())
        flags = torch.cat([differ, mine])
        group.control.all_reduce(flags, op="max")
        differ, mine = flags[: len(named)], flags[len(named) :]
        ranks = [group.global_rank(r) for r in range(group.size) if mine[r]]
    names = [n for (n, _), d in zip(named, differ.tolist()) if d]
    if names:
        raise ConfigError(
            f"the tensor-parallel ranks hold different values of {len(names)} parameters ({', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}; global ranks {ranks}): tensor parallelism cuts one model, "
            "identical on every rank of the tensor group, so build it alike on each (the same torch.manual_seed "
            "before building it, or the same weights), or on the meta device"
        )
