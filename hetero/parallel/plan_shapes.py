"""Plan cuts whose shapes do not chain (an LM head cut as a plain layer, an MLP with its styles swapped), refused
before anything is cut, with the plan lines that fix them.

[Note: cuts that must chain]
A column-parallel layer cuts its outputs, and the row-parallel layer after it reads exactly those cut features and
sums what the ranks make back into the hidden states, which every rank holds whole. Plans that break the chain
failed only inside the forward, on raw torch shapes, far from the plan line at fault:
- an LM head styled `colwise`: each rank gets 1/t of the logits and nothing gathers them, so the model's own loss
  compares [..., V/t] logits with labels up to V (`Target 40 is out of bounds`); `rowwise`: its weight cut to
  [V, H/t] meets the final norm's whole [..., H] output. It must be `vocab_head` (logits cut by vocabulary and the
  vocabulary-parallel loss), or stay out of the plan (whole on every rank).
- an MLP with up/gate `rowwise` and down `colwise`: up's weight cut to [I, H/t] meets the whole [..., H] hidden
  states (`mat1 and mat2 shapes cannot be multiplied`).
Which layer is which is read from shapes against the model's hidden size H (its config's `hidden_size`, `n_embd`
or `d_model`, its token embedding's width) and vocabulary V (the config's `vocab_size`, the token embedding's rows):
the LM head is the model's output embedding (`get_output_embeddings()`), a layer sharing the token embedding's
weight, or, where neither of those nor a plan's `vocab_head` names it, a layer outside every attention and MLP
region with V outputs; a `rowwise` layer that reads H features
and makes another width is one whose input is the hidden states, whole; a `colwise` layer that makes H features
from another width writes back into them. A layer square in H (o_proj, an MLP whose inner width is H) says nothing
of its place and is left alone, as is every layer when the model gives no H. The rule reads only the modules and
their shapes, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from hetero.parallel.fused_qkv import features
from hetero.parallel.plans import COLUMN

_HIDDEN = ("hidden_size", "n_embd", "d_model")
_CUT = ("colwise", "rowwise")


def _sizes(resolved: Mapping[str, str], modules: Mapping[str, nn.Module]) -> tuple[set[int], set[int], set[int]]:
    """The model's hidden sizes, vocabulary sizes, and the ids of its token embeddings' weights."""
    root = modules.get("")
    config = getattr(root, "config", None)
    hidden = {v for a in _HIDDEN if type(v := getattr(config, a, None)) is int}
    vocab = {v} if type(v := getattr(config, "vocab_size", None)) is int else set()
    tokens = [m for n, m in modules.items() if "vocab" in resolved.get(n, "").split("+")]
    get = getattr(root, "get_input_embeddings", None)
    if callable(get) and isinstance(found := _quiet(get), nn.Embedding):
        tokens.append(found)
    for m in tokens:
        if isinstance(m, nn.Embedding):
            hidden.add(m.embedding_dim)
            vocab.add(m.num_embeddings)
    return hidden, vocab, {id(m.weight) for m in tokens if isinstance(m, nn.Embedding)}


def _quiet(get: object) -> object:
    try:
        return get()  # type: ignore[operator]
    except (NotImplementedError, AttributeError):  # a PreTrainedModel subclass that does not say
        return None


def _regions(resolved: Mapping[str, str]) -> list[str]:
    """Prefixes of the modules inside an attention or MLP region: the regions, and the blocks holding attentions."""
    out = []
    for name, style in resolved.items():
        parts = set(style.split("+"))
        if parts & {"heads", "parallel_input"}:
            out.append(f"{name}.")
        if "heads" in parts and "." in name:
            out.append(name.rpartition(".")[0] + ".")
    return out


def pattern(name: str) -> str:
    """A plan pattern for `name` and its copies in the other layers: numbered components become `*`, but for the
    last (a Sequential's `mlp.0` and `mlp.2` are different layers)."""
    *path, last = name.split(".")
    return ".".join(["*" if part.isdigit() else part for part in path] + [last])


def check_chain(
    resolved: Mapping[str, str], modules: Mapping[str, nn.Module], degree: int
) -> list[tuple[str, str, str]]:
    """The layers whose cut does not chain ([Note: cuts that must chain]): (layer, the style it must have, why)."""
    hidden, vocab, token_weights = _sizes(resolved, modules)
    get = getattr(modules.get(""), "get_output_embeddings", None)
    head = _quiet(get) if callable(get) else None
    # A layer with V outputs is the head by its shape only where nothing else says which layer the head is: beside a
    # known head (the model's output embedding, a layer the plan styles `vocab_head`) it is an MLP's up projection
    # whose width happens to be V (a toy's 16 -> 64 beside a 64-token vocabulary).
    named_head = head is not None or any("vocab_head" in s.split("+") for s in resolved.values())
    regions = _regions(resolved)
    wrong = []
    for name, style in resolved.items():
        cut = [p for p in style.split("+") if p in _CUT]
        if not cut or (dims := features(module := modules[name])) is None:
            continue
        given, (inp, out) = cut[0], dims
        what = f"{name} ({type(module).__name__} {inp} -> {out})"
        tied = id(getattr(module, "weight", None)) in token_weights
        outside = not any(name.startswith(r) for r in regions)
        if module is head or tied or (not named_head and outside and out in vocab and out not in hidden):
            why = "its weight is the token embedding's" if tied else f"its {out} outputs are the logits"
            shapes = (
                f"each rank would make {out // degree} of the {out} logits and nothing gathers them, so the loss "
                f"compares [..., {out // degree}] logits with labels up to {out - 1}, and generation picks from a part"
                if given == "colwise"
                else f"its weight cut to [{out}, {inp // degree}] would meet the final norm's whole [..., {inp}] output"
            )
            wrong.append((name, "vocab_head", f"{what} is the LM head ({why}), styled {given!r}: {shapes}. Style it "
                          "'vocab_head' (logits cut by vocabulary, the vocabulary-parallel loss), or leave it out of "
                          "the plan (whole on every rank)"))  # fmt: skip
        elif given == "rowwise" and inp in hidden and out not in hidden:
            wrong.append((name, "colwise", f"{what} is styled 'rowwise', which cuts its input features (a weight "
                          f"of [{out}, {inp // degree}] on each rank), but {inp} is the model's hidden size: it reads "
                          f"the hidden states, whole [..., {inp}] on every rank, and makes {out} features of them, a "
                          "column-parallel layer's place"))  # fmt: skip
        elif given == "colwise" and out in hidden and inp not in hidden:
            wrong.append((name, "rowwise", f"{what} is styled 'colwise', which cuts its {out} outputs to "
                          f"{out // degree} on each rank, but {out} is the model's hidden size: its output goes back "
                          "into the hidden states, which every rank holds whole, and its input is the cut features "
                          "of the layer before, a row-parallel layer's place"))  # fmt: skip
    return wrong


def fixed_line(name: str, style: str, new: str) -> str:
    """The plan line that fixes `name` (styled `style`): its cut part replaced by `new`."""
    parts = [new if p in (*COLUMN, "rowwise") else p for p in style.split("+")]
    return f"{pattern(name)!r}: {'+'.join(parts)!r}"
