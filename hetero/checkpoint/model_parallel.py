"""Checkpoints of tensor- and pipeline-parallel layouts: stored names, who saves what, and the merged model table.

[Note: parallel layouts in a checkpoint]
Every global rank writes its own file, as without parallelism; what changes is how a tensor is named and who saves
it. A tensor-parallel shard (a parameter carrying `_hetero_tp`) is stored under "NAME@tpR": tensor rank R's shard,
with the shard's own (local) shape, split by element range over the data-parallel ranks exactly as a whole
parameter is. In a grid layout (2D, 2.5D, 3D) a shard is a block (`BlockShard`); a block that several tensor
ranks hold alike (2.5D's depth layers; in 1D, a key/value head held whole by several ranks,
[Note: key/value heads replicated over tensor ranks]) is stored once, under and by the lowest of them, and joined
once. A parameter replicated over the tensor ranks (a norm's weight, a row-parallel bias) is the same on each of
them, so only tensor rank 0 saves it, under its plain name; pipeline stages hold disjoint parameters, so their names
never collide. A parameter tied across stages (an embedding tied to the head, [Note: parameters tied across stages])
is held by each of its stages, each storing it under the name its cut model gives it (GPT-2's `lm_head.weight` on
the last stage), with the same values (its gradient is summed over the tie). Module buffers are saved by
data-parallel rank 0 at tensor rank 0 of every stage.

Each rank describes its own part of the model (stored names, shapes, stage, tensor-parallel cut, state_dict keys);
rank 0 merges these into the manifest's model table, so nothing needs a whole model on one rank. Consequences:
 - loading into the same tensor and pipeline degrees needs nothing new: a rank reads its stored names, by element
   range, from whatever files hold them, so the data-parallel degree, ZeRO stage and offload may change;
 - consolidation reads every tensor rank's shard of a parameter and joins them with `join_shards`, giving the
   full state_dict of the unwrapped model (`engine.full_state_dict()` joins the shards it gathers through the same
   function, hetero/parallel/full_state.py);
 - other tensor or pipeline degrees are refused with a clear error (re-cutting shards is not done at load):
   consolidate, then load the full state_dict into the new layout before wrapping it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from hetero.comm import Comm
    from hetero.engine import Engine

TP_MARK = "@tp"


def tp_cut(param: Any) -> Any:
    """The parameter's tensor-parallel cut (a `TPShard`), or None when it is whole on this rank."""
    cut = getattr(param, "_hetero_tp", None)
    return cut if cut is not None and cut.degree > 1 else None


def stored_name(info: Any) -> str:
    """The name a parameter's tensors are stored under (see [Note: parallel layouts in a checkpoint]); a block that
    several tensor ranks hold alike (2.5D) is stored under its lowest holder's rank."""
    cut = tp_cut(info.param)
    return f"{info.name}{TP_MARK}{cut.stored_rank}" if cut is not None else info.name


def saves(info: Any, replicas: bool) -> bool:
    """Whether this rank writes the parameter: a shard by its stored rank only, a replicated parameter by the ranks
    that save replicas (`saves_replicated`)."""
    cut = tp_cut(info.param)
    return replicas if cut is None else cut.stored_rank == cut.rank


def stored_ranks(cut: dict[str, Any]) -> list[int]:
    """The tensor ranks whose shards a manifest's cut is stored from, in rank order."""
    if "indices" in cut:  # a grid layout's BlockShard: one rank per distinct block
        return sorted({cut["indices"].index(ix) for ix in cut["indices"]})
    return list(range(cut["degree"]))


def shard_names(name: str, cut: dict[str, Any]) -> list[str]:
    """The stored names of the shards of parameter `name`, in tensor rank order."""
    return [f"{name}{TP_MARK}{r}" for r in stored_ranks(cut)]


def describe_cut(cut: Any) -> dict[str, Any]:
    """A parameter's tensor-parallel cut as a manifest's model table records it (JSON-able, the same for every
    tensor rank): what `join_shards` reads."""
    if hasattr(cut, "to_dict"):  # a grid block: every rank's block indices
        return cut.to_dict()
    if all(hasattr(cut, a) for a in ("dim", "parts", "degree", "full_shape")):  # a 1D cut (TPShard)
        out = {"dim": cut.dim, "parts": cut.parts, "degree": cut.degree, "full_shape": list(cut.full_shape)}
        if getattr(cut, "sizes", None) is not None:  # unequal blocks (a fused q/k/v of fewer key/value heads)
            out["sizes"] = list(cut.sizes)  # absent (earlier checkpoints, equal blocks): `parts` equal blocks
        return out
    raise TypeError(f"a tensor-parallel cut of an unknown kind ({type(cut).__name__}): its shards cannot be joined")


def join_shards(cut: dict[str, Any], shards: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """The whole tensor from its shards, by stored tensor rank (`stored_ranks(cut)`: every tensor rank in 1D, one
    per distinct block in a grid layout); `cut` as `describe_cut` gives it. Consolidation and
    `engine.full_state_dict()` both join through here."""
    from hetero.parallel.grid.shard import BlockShard
    from hetero.parallel.tp_shard import TPShard, unshard

    wanted = stored_ranks(cut)
    if not set(wanted) <= shards.keys():
        raise ValueError(f"joining {cut['full_shape']} needs the shards of tensor ranks {wanted}, got {sorted(shards)}")
    if "indices" in cut:  # a grid layout: blocks by their stored ranks
        return BlockShard.from_dict(cut).join({r: shards[r] for r in wanted})
    sizes = tuple(cut["sizes"]) if cut.get("sizes") is not None else None
    info = TPShard(
        dim=cut["dim"],
        parts=cut["parts"],
        degree=cut["degree"],
        rank=0,
        full_shape=tuple(cut["full_shape"]),
        sizes=sizes,
    )
    return unshard([shards[r] for r in wanted], info)


def world(engine: Engine) -> Comm:
    """Every rank of the job: the group a save is coordinated over (the engine's own comm is data-parallel)."""
    mesh = getattr(engine, "mesh", None)
    return mesh.world if mesh is not None else engine.comm


def coordinates(engine: Engine) -> dict[str, int]:
    mesh = getattr(engine, "mesh", None)
    if mesh is None:
        return {"tp": 0, "dp": engine.comm.rank, "pp": 0}
    return {"tp": mesh.tp_rank, "dp": mesh.dp_rank, "pp": mesh.pp_rank}


def degrees(engine: Engine) -> tuple[int, int]:
    """(tensor, pipeline) degrees of the engine's layout."""
    mesh = getattr(engine, "mesh", None)
    return (mesh.tp_size, mesh.pp_size) if mesh is not None else (1, 1)


def tensor_mode(engine: Engine) -> str:
    """How the layout cuts its layers: "1d", or a grid's "2d" / "2.5d:<depth>" / "3d" (shards differ between them)."""
    grid = getattr(getattr(engine, "mesh", None), "grid", None)
    if grid is None:
        return "1d"
    return f"2.5d:{grid.depth}" if grid.mode == "2.5d" else grid.mode


def saves_replicated(engine: Engine) -> bool:
    """Whether this rank saves what every tensor rank holds alike (replicated parameters, buffers)."""
    return coordinates(engine)["tp"] == 0


def merge_tables(tables: list[dict[str, Any]]) -> dict[str, Any]:
    """The model table of the whole layout from each rank's (in global rank order): parameters and buffers by
    stored name, state_dict keys in the model's order (a table's "order", the whole model's keys before a pipeline
    cut: [Note: the whole model's order]; else, for checkpoints that record none, in order of first appearance), the
    tensor-parallel cuts by parameter name."""
    merged: dict[str, Any] = {"params": {}, "buffers": {}, "state_dict": [], "tp": {}, "hf_config": None}
    seen: set[str] = set()
    for t in tables:
        merged["params"].update(t["params"])
        merged["buffers"].update(t["buffers"])
        merged["tp"].update(t.get("tp", {}))
        for entry in t["state_dict"]:
            if entry[0] not in seen:
                seen.add(entry[0])
                merged["state_dict"].append(entry)
        if merged["hf_config"] is None:
            merged["hf_config"] = t.get("hf_config")
    order = {k: i for i, k in enumerate(next((t["order"] for t in tables if t.get("order")), ()))}
    merged["state_dict"].sort(key=lambda entry: order.get(entry[0], len(order)))  # stable: unknown keys keep theirs
    return merged


def find_mine(engine: Engine, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """This rank's entry of the manifest: the same mesh coordinates when the tensor and pipeline degrees match (the
    data-parallel rank alone for checkpoints without them)."""
    me = coordinates(engine)
    for r in manifest["ranks"]:
        c = r.get("coordinates")
        if isinstance(c, dict) and {"tp", "dp", "pp"} <= c.keys():
            if (c["tp"], c["dp"], c["pp"]) == (me["tp"], me["dp"], me["pp"]):
                return r
        elif r["data_parallel_rank"] == engine.comm.rank:
            return r
    return None


def sequence_note(config: dict[str, Any], who: str) -> str:
    """Why a layout whose tensor ranks split the sequence with the layers whole (Ulysses, ring: `config` a config's
    dict) has tensor degree 1 in a checkpoint; "" for any other."""
    parallel = config.get("parallel") or {}
    mode = parallel.get("sequence")
    if mode not in ("ulysses", "ring"):
        return ""
    return (
        f" ({who} parallel.sequence {mode!r}, which keeps the layers whole: its {parallel.get('tensor')} tensor ranks "
        "split the sequence and hold data-parallel shards, so its tensor degree is 1)"
    )
