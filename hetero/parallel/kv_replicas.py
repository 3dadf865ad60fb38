"""How an attention module's heads are divided over the tensor ranks: evenly (`head_counts`), or, where the
key/value heads are fewer than the ranks, with each key/value head held whole by several ranks (`KVReplicas`).

[Note: key/value heads replicated over tensor ranks]
Grouped-query models have few key/value heads (Qwen2.5-7B: 28 query heads, 4 key/value heads; Gemma-2B: 1), and
cutting k_proj and v_proj as column-parallel layers needs the degree t to divide their count kv. When it does not,
but kv divides t (and t divides the query heads), rank r holds the whole key/value head r // (t / kv) (k_proj's and
v_proj's rows for it, their biases) next to its own t-th of the query heads: under Hugging Face's grouping, query
head j reads key/value head j // (heads / kv), and rank r's query heads all read head r // (t / kv). The module then
runs with one local key/value head (`num_key_value_groups` = heads / t: the attention repeats it for each query head),
o_proj and q_proj cut as before. The t / kv ranks holding a head (its replicas, ranks h t/kv .. (h+1) t/kv - 1) each
compute its gradient from their own query heads only, a part of the whole: a hook sums k_proj's and v_proj's
gradients over that subgroup as autograd makes them (before ZeRO sees them), so every replica accumulates the same
whole gradient and, given the same optimizer state, makes the same update at every ZeRO stage. Which ranks sum with
which follows from the layout alone, never from a rank's data. Their input gradient needs nothing new: each rank's
part flows into the tensor region's entry, whose all-reduce over the whole group completes it; a norm applied per
head to k (Qwen3's k_norm, `head_norm`) is whole on every rank and summed over the whole group, which counts each
replica's part once as well.

The cut is a `BlockShard` (grid/shard.py) along the output dimension in kv blocks, the same block index on the
ranks of a replica group: the record 2.5D's replicated blocks already have, so checkpoints store a head once (by
the lowest replica), consolidation and `engine.full_state_dict()` join one copy of each head, the gradient norm
counts each replica 1 / (t / kv), and weights read from files are read as that block. A column-parallel layer
inside such an attention is a key/value projection when its output features are kv x head_dim, a query projection
when they are heads x head_dim (they differ: kv < t <= heads); anything else, or a fused q/k/v, is refused.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from hetero.errors import ConfigError
from hetero.parallel.sequence import all_reduce_grads
from hetero.parallel.shape_comm import ShapeComm

if TYPE_CHECKING:
    from hetero.comm import Comm
    from hetero.parallel.grid.shard import BlockShard

_Q_ATTRS = ("num_heads", "n_head", "num_attention_heads")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_HEAD_ATTRS = _Q_ATTRS + _KV_ATTRS
HEAD_ATTRS = _HEAD_ATTRS  # what plan_checks.py looks for
_WIDTH_ATTRS = ("split_size", "embed_dim")  # GPT-2 splits c_attn's output and sizes views with these
# Attentions whose forward reads the query head count from their config: Phi-3 slices q off its fused qkv_proj at
# config.num_attention_heads x head_dim, which at the whole count takes k and v as q (a shape error further on).
_READS_CONFIG = ("Phi3Attention", "Phi4MultimodalAttention")


def head_counts(module: nn.Module, name: str, degree: int) -> dict[str, Any]:
    """The per-instance attributes to divide by the degree; raises if a head count does not divide. An attention
    that reads its counts from its config (`_READS_CONFIG`) gets its own copy with this rank's counts as `config`
    (the model's keeps the whole ones: its masks, save_pretrained and the other modules read them)."""
    own = {a: getattr(module, a) for a in _HEAD_ATTRS + _WIDTH_ATTRS if type(getattr(module, a, None)) is int}
    config = getattr(module, "config", None)
    # Llama's attention reads its head counts from the shared config (and shapes from the weights): check only.
    read = {a: getattr(config, a) for a in _HEAD_ATTRS if type(getattr(config, a, None)) is int}
    if not any(a in own or a in read for a in _HEAD_ATTRS):
        raise ConfigError(
            f"{name} ({type(module).__name__}) has no head count ({', '.join(_HEAD_ATTRS)}) on itself or its config: "
            "style 'heads' belongs on an attention module"
        )
    for a, v in {**read, **own}.items():
        if v % degree:
            raise ConfigError(
                f"{name}: {a} = {v} does not divide by the tensor-parallel degree {degree}; every rank must hold "
                f"whole heads, so choose a degree that divides the number of attention heads and key/value heads"
            )
    local: dict[str, Any] = {a: v // degree for a, v in own.items()}
    if read and {c.__name__ for c in type(module).__mro__} & set(_READS_CONFIG):
        local["config"] = copy.copy(config)
        for a, v in read.items():
            setattr(local["config"], a, v // degree)
    return local


def _count(module: nn.Module, attrs: tuple[str, ...]) -> tuple[str, int] | None:
    """The first of `attrs` the module has as an int, else its config's (the module's own count is what it runs)."""
    for holder in (module, getattr(module, "config", None)):
        for a in attrs:
            if type(v := getattr(holder, a, None)) is int:
                return a, v
    return None


def _head_dim(module: nn.Module, heads: int) -> int | None:
    config = getattr(module, "config", None)
    for v in (getattr(module, "head_dim", None), getattr(config, "head_dim", None)):
        if type(v) is int:
            return v
    hidden = getattr(config, "hidden_size", None)
    return hidden // heads if type(hidden) is int else None


def working_degrees(heads: int, kv: int) -> list[int]:
    """The 1D tensor-parallel degrees an attention of `heads` query and `kv` key/value heads runs at."""
    return [d for d in range(1, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]


@dataclass(frozen=True)
class KVReplicas:
    """An attention whose `kv_heads` key/value heads are each held whole by `replicas` of the `degree` tensor
    ranks ([Note: key/value heads replicated over tensor ranks])."""

    heads: int  # query heads of the whole attention
    kv_heads: int
    head_dim: int
    degree: int

    @property
    def replicas(self) -> int:
        return self.degree // self.kv_heads

    def cut(self, full_shape: tuple[int, ...], dim: int, rank: int) -> BlockShard:
        """Tensor rank `rank`'s cut of a key/value projection's weight or bias (output features along `dim`)."""
        from hetero.parallel.grid.shard import BlockShard  # the grid package imports tensor.py, which imports this

        owners = tuple((r // self.replicas,) for r in range(self.degree))
        return BlockShard(full_shape=full_shape, dims=(dim,), parts=(self.kv_heads,), indices=owners, rank=rank)

    def local_counts(self, module: nn.Module) -> dict[str, int]:
        """The module's own head attributes as one rank runs it: its share of the query heads, one key/value head
        (so `num_key_value_groups`, query heads per key/value head, is its share of the query heads)."""
        share = self.heads // self.degree
        wanted = {a: share for a in (*_Q_ATTRS, "num_key_value_groups")} | {a: 1 for a in _KV_ATTRS}
        out = {a: v for a, v in wanted.items() if type(getattr(module, a, None)) is int}
        out |= {a: v // self.degree for a in _WIDTH_ATTRS if type(v := getattr(module, a, None)) is int}
        return out


def kv_layout(module: nn.Module, name: str, degree: int) -> KVReplicas | None:
    """How attention `module` is cut at `degree`: None where its key/value heads divide by the degree (the even cut,
    `head_counts` checks it), its `KVReplicas` where the degree divides by them; a ConfigError naming the degrees that
    work otherwise."""
    q, kv = _count(module, _Q_ATTRS), _count(module, _KV_ATTRS)
    if q is None or kv is None or kv[1] % degree == 0:
        return None
    (q_attr, heads), (kv_attr, kvs) = q, kv
    if heads % degree or degree % kvs:
        why = (
            f"{q_attr} = {heads} does not divide by the tensor-parallel degree {degree}"
            if heads % degree
            else f"{kv_attr} = {kvs} does not divide by the tensor-parallel degree {degree}, nor the degree by it (a "
            f"rank holds whole heads: a share of them, or one held by degree / {kvs} ranks)"
        )
        raise ConfigError(
            f"{name}: {why}; with {heads} query and {kvs} key/value heads the degrees that work are "
            f"{', '.join(map(str, working_degrees(heads, kvs)))}"
        )
    head_dim = _head_dim(module, heads)
    if head_dim is None:
        raise ConfigError(
            f"{name}: {kv_attr} = {kvs} is fewer than the tensor-parallel degree {degree}, and replicating its "
            "key/value heads needs their width: give the module (or its config) a head_dim, or choose a degree "
            f"that divides {kvs}"
        )
    for a in _WIDTH_ATTRS:
        if type(v := getattr(module, a, None)) is int and v % degree:
            raise ConfigError(f"{name}: {a} = {v} does not divide by the tensor-parallel degree {degree}")
    return KVReplicas(heads=heads, kv_heads=kvs, head_dim=head_dim, degree=degree)


def _out_features(module: nn.Module) -> int | None:
    """A Linear's output features, or a Hugging Face Conv1D's (`nf`)."""
    out = getattr(module, "out_features", None)
    return out if type(out) is int else getattr(module, "nf", None)


def kv_projections(resolved: Mapping[str, str], modules: Mapping[str, nn.Module], degree: int) -> dict[str, KVReplicas]:
    """The column-parallel layers of the plan that project key/value heads replicated over the tensor ranks, each
    with its attention's layout; raises before anything changes where such an attention cannot be cut."""
    out: dict[str, KVReplicas] = {}
    for outer, style in resolved.items():
        if "heads" not in style.split("+") or (layout := kv_layout(modules[outer], outer, degree)) is None:
            continue
        kv_width, q_width = layout.kv_heads * layout.head_dim, layout.heads * layout.head_dim
        found = []
        for name, inner in resolved.items():
            parts = set(inner.split("+"))
            if not name.startswith(f"{outer}.") or not parts & {"colwise", "colwise_qkv"}:
                continue
            width = _out_features(modules[name])
            if "colwise_qkv" in parts:  # q, k and v each cut by heads: the key/value heads divide by the degree
                works = [d for d in working_degrees(layout.heads, layout.kv_heads) if layout.kv_heads % d == 0]
                raise ConfigError(
                    f"{name}: {outer} has {layout.kv_heads} key/value heads for {degree} tensor ranks, and its fused "
                    "q/k/v projection (style 'colwise_qkv') is cut by heads, each rank holding a share of them; "
                    "holding a key/value head whole on several ranks needs k and v projections of their own. The "
                    f"degrees that work are {', '.join(map(str, works))} (or split the layer into q_proj, k_proj "
                    "and v_proj, planned 'colwise')"
                )
            if width not in (kv_width, q_width):
                raise ConfigError(
                    f"{name}: {outer} has {layout.kv_heads} key/value heads for {degree} tensor ranks, so each "
                    f"rank holds a whole key/value head, and a column-parallel layer inside it must project either "
                    f"the query heads ({q_width} outputs) or the key/value heads ({kv_width}), unfused; this one has "
                    f"{width} (style {inner!r}). Choose a degree that divides {layout.kv_heads}"
                )
            if width == kv_width:
                out[name] = layout
                found.append(name)
        if not found:
            raise ConfigError(
                f"{outer} has {layout.kv_heads} key/value heads for {degree} tensor ranks, and the plan gives no "
                "column-parallel ('colwise') key/value projection inside it to hold a whole head on each rank: plan "
                f"its k and v projections 'colwise', or choose a degree that divides {layout.kv_heads}"
            )
    return out


class ReplicaGroups:
    """The subgroups of a tensor group whose ranks hold the same key/value head, made once per replica count, in
    plan order on every rank (making a group is collective)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.made: dict[int, Any] = {}  # replicas -> this rank's subgroup

    def of(self, replicas: int) -> Any:
        if replicas not in self.made:
            self.made[replicas] = _subgroup(self.comm, replicas)
        return self.made[replicas]


def _subgroup(comm: Any, replicas: int) -> Comm:
    if replicas == comm.size:
        return comm
    if isinstance(comm, ShapeComm):  # the estimator's shapes: no process group to split
        return ShapeComm(comm.rank % replicas, replicas)
    return comm.split([[h * replicas + i for i in range(replicas)] for h in range(comm.size // replicas)])


def shard_kv_projection(module: nn.Module, name: str, out_dim: int, layout: KVReplicas, groups: ReplicaGroups) -> None:
    """Keep this rank's whole key/value head of `module`'s weight (and bias), and sum their gradients over the
    ranks holding the same head ([Note: key/value heads replicated over tensor ranks])."""
    rank = groups.comm.rank
    params = [(module.weight, out_dim)] + ([(module.bias, 0)] if getattr(module, "bias", None) is not None else [])
    for param, dim in params:
        if getattr(param, "_hetero_tp", None) is not None:
            raise ConfigError(f"{name} shares a parameter with a layer sharded already: replicated key/value heads "
                              "need their own k and v projections")  # fmt: skip
        cut = layout.cut(tuple(param.shape), dim, rank)
        param.data = cut.shard_of(param.data)
        param.grad = None  # a gradient of the full shape would no longer fit
        param._hetero_tp = cut
    if layout.replicas > 1:
        all_reduce_grads([p for p, _ in params], groups.of(layout.replicas))
