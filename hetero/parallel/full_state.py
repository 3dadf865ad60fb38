"""The whole model's state_dict on every rank under tensor and pipeline parallelism (`engine.full_state_dict()`).

Each rank starts from its own full values (`ParameterViews.full_state_dict`: whole chunks gathered over the ZeRO
group): its stage's keys only, a tensor-parallel parameter as this rank's shard. Two collectives make the whole
model of that, each over a group whose order every rank knows without asking the others:

 1. over the tensor group, in tensor rank order: every stored rank's shards (`model_parallel.saves`' rule: a block
    that several ranks hold alike, 2.5D's depth layers or a key/value head held whole by several ranks, comes from
    the lowest of them), joined by the checkpoint's own merge (`model_parallel.join_shards`), so the values equal
    `consolidate`'s bit for bit;
 2. over the pipeline group, in stage order: every stage's joined dict; a key met on two stages (a parameter tied
    across stages, each stage holding it under the name its cut model gives it) is taken from the first; the result
    is then put in the model's own order ([Note: the whole model's order]).

Data-parallel ranks hold the same values, so each repeats this with its own groups and needs nothing more.

[Note: the whole model's order]
Stage order is the model's order only when each rank holds one run of neighbouring units. An interleaved rank holds
virtual stages r, r + p, ... and a Chimera rank stages r and p - 1 - r, so joining in rank order put rank 0's later
blocks before rank 1's earlier ones (layers.1 before layers.0 at pipeline 2, 2 virtual stages): a dict whose keys
differ in order from `model.state_dict()`'s, which `load_state_dict` accepts but `save_pretrained`'s shards, a
diff of two dicts' key lists and anything zipping keys with another model's do not. So the cut records the whole
model's keys in order before it drops other stages' units (`StageChunk.model_keys`), the same list on every rank,
and the joined dict is put in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hetero.checkpoint import model_parallel as par
from hetero.errors import CheckpointError

if TYPE_CHECKING:
    from hetero.parallel.mesh import Mesh


def gather_full_state(
    local: dict[str, torch.Tensor],
    module: nn.Module,
    mesh: Mesh,
    *,
    rank0_only: bool = False,
    order: Sequence[str] = (),
) -> dict[str, torch.Tensor]:
    """The whole model's state_dict from this rank's `local` one (keys of `module`'s state_dict, or some of them:
    `full_grads`' trainable parameters; full chunk values);
    every rank of the job must call it. Memory: every rank ends up holding the whole model on the CPU (in the compute
    dtype), and for a moment its tensor group's shards besides. rank0_only: global rank 0 alone gets the tensors, the
    others an empty dict (as torch's `StateDictOptions(full_state_dict=True, cpu_offload=True)`): ranks off rank 0's
    data-parallel coordinate then skip both gathers, and those off its tensor coordinate the pipeline one, so only the
    ranks of rank 0's pipeline group hold the whole model for a moment. order: the whole model's keys in its order
    ([Note: the whole model's order]); keys not in it follow in stage order."""
    state = local
    if mesh.tp_size > 1 and not (rank0_only and mesh.dp_rank != 0):
        state = _join_tensor_shards(state, module, mesh)
    if mesh.pp_size > 1 and not (rank0_only and (mesh.dp_rank != 0 or mesh.tp_rank != 0)):
        state = _join_stages(state, mesh)
        if order:
            state = {**{k: state[k] for k in order if k in state}, **state}
    if rank0_only and mesh.world.rank != 0:
        return {}
    return state


def _join_tensor_shards(state: dict[str, torch.Tensor], module: nn.Module, mesh: Mesh) -> dict[str, torch.Tensor]:
    cuts: dict[str, Any] = {}  # first key of each tensor-parallel parameter -> its cut
    same: dict[str, str] = {}  # every key of one -> its first (a tied parameter: joined once, one tensor)
    first: dict[int, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        cut = par.tp_cut(t)
        if cut is not None and name in state:  # full_grads' dict lacks frozen parameters
            same[name] = first.setdefault(id(t), name)
            cuts.setdefault(same[name], cut)
    try:
        described = {name: par.describe_cut(cut) for name, cut in cuts.items()}
    except TypeError as e:
        raise CheckpointError(
            f"engine.full_state_dict(): {e}. Save with engine.save_checkpoint(dir) and write the whole model with "
            "python -m hetero.checkpoint consolidate dir out.safetensors instead"
        ) from None
    # Only the stored rank of a block sends it: a 2.5D block held by several tensor ranks travels once.
    mine = {name: state[name] for name, cut in cuts.items() if cut.stored_rank == cut.rank}
    every = mesh.tp.all_gather_object(mine)  # in tensor rank order: the order `stored_ranks` counts in
    joined = {
        name: par.join_shards(cut, {r: every[r][name] for r in par.stored_ranks(cut)})
        for name, cut in described.items()
    }
    return {name: joined[same[name]] if name in same else value for name, value in state.items()}


def _join_stages(state: dict[str, torch.Tensor], mesh: Mesh) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for part in mesh.pp.all_gather_object(state):  # in stage order, as the pipeline group ranks its members
        for name, value in part.items():
            out.setdefault(name, value)
    return out
