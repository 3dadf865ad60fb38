"""A fused q/k/v projection (one layer whose output holds an attention's queries, keys and values) and the column cut
its layout needs, checked before anything is cut.

[Note: fused q/k/v projections]
A fused projection lays its output features out in one of two ways, and each needs its own cut:
- blocks: all of q, then all of k, then all of v (GPT-2's c_attn, MPT's Wqkv, Phi-3's qkv_proj, nanoGPT's c_attn,
  timm's qkv: an attention that splits or chunks the output in three). A plain `colwise` cut gives rank 0 the first
  1/t of that run, at t = 2 all of q and half of k, which the attention reads as its own heads' q, k and v: no shape
  error, a different model (measured at tensor 2 on tests/test_plan_checks.py's model: loss 4.36798 against plain
  PyTorch's 4.35335 at the first step; `colwise_qkv` 4.35335). `colwise_qkv` cuts each third on its own.
- per head: each head's q, k and v side by side (GPT-NeoX's, Bloom's and Persimmon's query_key_value, Falcon's
  grouped by key/value head, GPT-BigCode's multi-head c_attn). A contiguous 1/t of the output is whole heads, so
  plain `colwise` is the right cut and `colwise_qkv`'s thirds mix heads (measured on a GPT-NeoX: plain 4.24420,
  the same as plain PyTorch's; `colwise_qkv` 4.24986).
The layout lives in the attention's forward, not in the shapes, so it is read from what the attention module is:
its `qkv_layout` attribute where it declares one ("blocks" or "per_head"; how a model hetero does not know says
which it has), else its class (the families above, subclasses included), else blocks, the common layout. A layer
is fused when its output width is the queries' width w (the row-parallel output layer's input, or heads x
head_dim) plus twice the keys' (3w with as many key/value heads as query heads; w (1 + 2 kv / heads) with kv of
them). The decision reads only the modules' classes, attributes and shapes, the same on every rank.

With fewer key/value heads than query heads the blocks differ in width (Phi-3-medium and Phi-4: 40 query heads and
10 key/value heads of 128, q 5120 wide, k and v 1280 each), and `colwise_qkv` cuts each by its own heads: rank r
holds its slice of q (w / t, its query heads), then of k and of v (kv width / t, its key/value heads), a `TPShard`
whose `sizes` are the three widths, read from the shapes before `heads` changes the counts (`qkv_blocks`).
Checkpoints record them (a record without them, an earlier checkpoint's, is equal blocks); the shard reads of
`weights=` and lazy init, consolidation, `full_state_dict` and `full_grads` cut and join by them. Under Hugging
Face's grouping query head j reads key/value head j // (heads / kv), so rank r's query heads read exactly its key/
value heads, and the attention, its counts divided by `heads` (Phi-3's from a copy of its config,
kv_replicas.head_counts), splits the local output at its own q, k and v widths. The key/value heads must divide by
the degree: holding one whole on several ranks ([Note: key/value heads replicated over tensor ranks]) needs k and
v projections of their own, so a larger degree is refused naming those that work; the grid modes cut a fused
layer's blocks alike (BlockShard's `fused`) and refuse unequal ones, naming tensor_mode '1d'. Measured on
tests/test_tp_fused_gqa.py's Phi-3 (hidden 64, 4 query heads over 2 key/value heads, qkv_proj biased) at tensor 2,
its first batch: `colwise_qkv` 4.19857, plain PyTorch's 4.19857 (float64's too), gradients within 4e-7 of
float64's; a plain `colwise` cut (refused: rank 0 holds all of q, rank 1 k and v) 4.17864, gradients off by up to
130%. Before, this layer was refused under every style, the attention left whole or split into q, k and v.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from torch import nn

from hetero.errors import ConfigError

LAYOUTS = ("blocks", "per_head")
# The head counts kv_replicas.py divides by the degree: query heads, key/value heads.
_QUERY_HEADS = ("num_heads", "n_head", "num_attention_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_PER_HEAD = ("GPTNeoXAttention", "BloomAttention", "PersimmonAttention")


def features(module: nn.Module) -> tuple[int, int] | None:
    """(input, output) features of an nn.Linear or a Hugging Face Conv1D (`nx`, `nf`); None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    return (nx, nf) if type(nx) is int and type(nf) is int else None


def qkv_layout(attention: nn.Module, name: str) -> str:
    """How `attention`'s fused projection lays out q, k and v: "blocks" or "per_head" (see the Note)."""
    declared = getattr(attention, "qkv_layout", None)
    if declared is not None:
        if declared not in LAYOUTS:
            raise ConfigError(f"{name}.qkv_layout = {declared!r}: expected one of {', '.join(map(repr, LAYOUTS))}")
        return declared
    classes = {c.__name__ for c in type(attention).__mro__}
    if classes & set(_PER_HEAD):
        return "per_head"
    if "FalconAttention" in classes:  # multi-query without the new architecture: [q heads; k; v]
        multi = getattr(attention, "multi_query", False) and not getattr(attention, "new_decoder_architecture", False)
        return "blocks" if multi else "per_head"
    if "GPTBigCodeAttention" in classes:  # multi-query: [q; k; v], else viewed as heads of 3 x head_dim
        return "blocks" if getattr(attention, "multi_query", False) else "per_head"
    return "blocks"


def _count(attention: nn.Module, attrs: tuple[str, ...]) -> int | None:
    """The first of `attrs` the attention holds as a positive int, else its config's."""
    for holder in (attention, getattr(attention, "config", None)):
        for a in attrs:
            if type(v := getattr(holder, a, None)) is int and v > 0:
                return v
    return None


def _kv_count(attention: nn.Module, heads: int | None) -> int | None:
    """Its key/value heads: a declared count, one under multi-query attention, else as many as the query heads."""
    if getattr(attention, "multi_query", False) and not getattr(attention, "new_decoder_architecture", False):
        return 1
    return _count(attention, _KV_HEADS) or heads


def _query_width(attention: nn.Module, name: str, resolved: Mapping[str, str], heads: int | None) -> int | None:
    """The queries' width: the row-parallel output layer's input features, else heads x head_dim."""
    widths = set()
    for sub, inner in attention.named_modules():
        if sub and "rowwise" in resolved.get(f"{name}.{sub}", "").split("+") and (dims := features(inner)):
            widths.add(dims[0])
    if len(widths) == 1:
        return widths.pop()
    head_dim = getattr(attention, "head_dim", None)
    if type(head_dim) is not int:
        head_dim = getattr(getattr(attention, "config", None), "head_dim", None)
    return heads * head_dim if heads and type(head_dim) is int and not widths else None


def _fused(out: int, width: int, heads: int | None, kv: int | None) -> bool:
    """Whether `out` features are queries `width` wide and keys and values of `kv` of the `heads` heads each."""
    if not heads or not kv:
        return out == 3 * width  # the counts unknown: q, k and v alike
    return out * heads == width * (heads + 2 * kv)


def _fused_layers(
    resolved: Mapping[str, str], modules: Mapping[str, nn.Module]
) -> Iterator[tuple[str, str, str, int, int, int | None, int | None]]:
    """(attention, layer, its column style, output features, queries' width, query heads, key/value heads) of each
    column-parallel layer inside an attention styled 'heads' whose queries' width is known."""
    for outer, style in resolved.items():
        if "heads" not in style.split("+"):
            continue
        attention = modules[outer]
        heads = _count(attention, _QUERY_HEADS)
        kv = _kv_count(attention, heads)
        width = _query_width(attention, outer, resolved, heads)
        if not width:
            continue
        for sub, inner in attention.named_modules():
            given = set(resolved.get(f"{outer}.{sub}", "").split("+")) & {"colwise", "colwise_qkv"}
            if sub and given and (dims := features(inner)) is not None:
                yield outer, f"{outer}.{sub}", given.pop(), dims[1], width, heads, kv


def qkv_blocks(resolved: Mapping[str, str], modules: Mapping[str, nn.Module]) -> dict[str, tuple[int, int, int]]:
    """The layers styled 'colwise_qkv' that hold q, k and v in blocks of unequal width (fewer key/value heads than
    query heads) -> the blocks' widths (q, k, v), which their cut takes each by heads (see the Note)."""
    out = {}
    for outer, name, given, out_features, width, heads, kv in _fused_layers(resolved, modules):
        unequal = out_features != 3 * width and _fused(out_features, width, heads, kv)
        if given == "colwise_qkv" and unequal and qkv_layout(modules[outer], outer) == "blocks":
            kv_width = (out_features - width) // 2
            out[name] = (width, kv_width, kv_width)
    return out


def check_fused(
    resolved: Mapping[str, str], modules: Mapping[str, nn.Module], *, grid: str = ""
) -> list[tuple[str, str, str]]:
    """The column-parallel layers inside attentions styled 'heads' whose cut does not fit their output: (layer, the
    style it must have, or "" for none, why) for each. `grid`: the grid mode cutting them ("" for 1D), which cuts a
    fused layer's blocks alike and so refuses unequal ones."""
    wrong = []
    for outer, name, given_style, out, width, heads, kv in _fused_layers(resolved, modules):
        attention, inner = modules[outer], modules[name]
        what = f"{name} ({type(inner).__name__} {features(inner)[0]} -> {out}) inside {outer}"  # type: ignore[index]
        if not _fused(out, width, heads, kv):
            if given_style == "colwise_qkv":
                why = (f"{what} is styled 'colwise_qkv', but its {out} outputs are not q, k and v (the queries "
                       f"are {width} wide): cut in thirds, each rank would hold parts of three runs of its "
                       "features. It is a plain projection")  # fmt: skip
                wrong.append((name, "colwise", why))
            continue
        layout = qkv_layout(attention, outer)
        if out != 3 * width and layout == "blocks" and grid:
            why = (f"{what} is a fused q/k/v projection whose blocks differ in width (q {width}, k and v "
                   f"{(out - width) // 2} each: {heads} query heads, {kv} key/value heads); tensor_mode {grid!r} cuts "
                   "a fused layer's blocks alike, not each by its own heads. Use tensor_mode '1d' (which does), or "
                   "split the layer into q, k and v projections (plan them 'colwise')")  # fmt: skip
            wrong.append((name, "", why))
            continue
        wanted = "colwise_qkv" if layout == "blocks" else "colwise"
        if given_style != wanted:
            wrong.append((name, wanted, _why(what, layout, out, width, type(attention).__name__)))
    return wrong


def _why(what: str, layout: str, out: int, width: int, cls: str) -> str:
    if layout == "blocks":
        blocks = f"q, k, v of {width} each" if out == 3 * width else f"q {width}, k and v {(out - width) // 2} each"
        half = out // 2  # rank 0's features at t = 2
        held = "part of q" if half < width else "all of q" + (" and part of k" if half > width else "")
        return (
            f"{what} is a fused q/k/v projection ({out} = {blocks}, one after another: {cls}'s layout) styled "
            f"'colwise': a plain cut gives rank 0 the first {out} / t features, {held} at t = 2, not its own heads' "
            "q, k and v, and the model trains wrong without an error. "
            "'colwise_qkv' cuts each of q, k and v by heads (if this layer holds each head's q, k, v side by side "
            f"instead, set qkv_layout = 'per_head' on {cls})"
        )
    return (
        f"{what} is a fused q/k/v projection holding each head's q, k and v side by side ({cls}'s layout), styled "
        f"'colwise_qkv': cut in thirds of {out // 3}, each rank's share would mix parts of several heads. A plain "
        f"'colwise' cut gives each rank whole heads (if the layer holds all of q, then k, then v instead, set "
        f"qkv_layout = 'blocks' on {cls})"
    )
