"""A fused gate/up projection (one layer whose output holds a gated MLP's gate and its up projection) and the column
cut its layout needs, checked before anything is cut.

[Note: fused gate/up projections]
A gated MLP (SwiGLU, GeGLU) multiplies an activation of one projection of its input, the gate, by another, up, then
projects the product back with its down projection. A model may fuse gate and up into one layer twice as wide and
split its output: Phi-3's `gate_up_proj` holds all of gate, then all of up, which its MLP takes apart with
`chunk(2, dim=-1)`. A plain `colwise` cut gives rank 0 the first 1/t of that run, at t = 2 all of gate and none of up,
which the MLP's chunk(2) splits again into halves of gate it multiplies together: no shape error (the local product
is as wide as down_proj's cut input), a different model. Measured on tests/test_tp_fused_mlp.py's Phi-3 (hidden 32,
intermediate 64, 2 layers) at tensor 2, its first batch: loss 4.18838 against plain PyTorch's 4.18991 (float64's
too), `colwise_gate_up` 4.18991. `colwise_gate_up` cuts each half on its own (a `TPShard` of 2 parts, as
`colwise_qkv`'s 3), so rank r's output holds its slice of gate, then the same slice of up, and chunk(2) pairs them.

Which layer is one is read from shapes: a `colwise` layer whose output is twice the input of the `rowwise` layer after
it (down_proj: its sibling in the same module, else a row-parallel layer inside the MLP region, the `parallel_input`
module around it) is a fused gate/up projection. An unfused MLP's up projection makes exactly what down reads, so
twice that width means its output is split in two before down. Layers inside an attention (style `heads`) are
fused_qkv.py's, where q, k and v can make twice the queries' width (half as many key/value heads as query heads).
A `colwise_gate_up` layer whose output is not twice down's input is refused too (its halves would be no gate and
up), as is one inside an attention; with no row-parallel layer to compare with, the style is taken as given.
An MLP holding gate and up interleaved (`x[..., ::2]` and `x[..., 1::2]`) needs the plain cut, a contiguous 1/t
being whole (gate, up) pairs: it says so with `gate_up_layout = "interleaved"` on the MLP module (default "halves").
The decision reads only the modules' classes, attributes and shapes, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from hetero.errors import ConfigError
from hetero.parallel.fused_qkv import features

LAYOUTS = ("halves", "interleaved")


def _styles(resolved: Mapping[str, str], name: str) -> set[str]:
    return set(resolved.get(name, "").split("+")) - {""}


def _ancestors(name: str) -> list[str]:
    """The names of the modules above `name`, nearest first ("" is the model)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def _down_width(name: str, resolved: Mapping[str, str], modules: Mapping[str, nn.Module]) -> int | None:
    """The input features of the row-parallel layer after `name`: its siblings', else those inside the MLP region
    (`parallel_input`) around it; None when there is none or they differ."""
    parent = name.rpartition(".")[0]
    regions = [a for a in _ancestors(name) if "parallel_input" in _styles(resolved, a)]
    for scope, direct in ((parent, True), *((r, False) for r in regions[:1])):
        widths = set()
        for other, style in resolved.items():
            inside = other.rpartition(".")[0] == scope if direct else other.startswith(f"{scope}.")
            if inside and "rowwise" in style.split("+") and (dims := features(modules[other])) is not None:
                widths.add(dims[0])
        if widths:
            return widths.pop() if len(widths) == 1 else None
    return None


def _layout(mlp: nn.Module, name: str) -> str:
    declared = getattr(mlp, "gate_up_layout", None)
    if declared is None:
        return "halves"
    if declared not in LAYOUTS:
        raise ConfigError(f"{name}.gate_up_layout = {declared!r}: expected one of {', '.join(map(repr, LAYOUTS))}")
    return declared


def check_gate_up(resolved: Mapping[str, str], modules: Mapping[str, nn.Module]) -> list[tuple[str, str, str]]:
    """The column-parallel layers outside attentions whose cut does not fit a fused gate/up output ([Note: fused
    gate/up projections]): (layer, the style it must have, or "" for none, why) for each."""
    wrong = []
    for name in resolved:
        given = _styles(resolved, name) & {"colwise", "colwise_gate_up"}
        if not given or (dims := features(modules[name])) is None:
            continue
        given_style, (inp, out) = given.pop(), dims
        what = f"{name} ({type(modules[name]).__name__} {inp} -> {out})"
        attention = next((a for a in _ancestors(name) if "heads" in _styles(resolved, a)), None)
        if attention is not None:  # q/k/v: [Note: fused q/k/v projections]
            if given_style == "colwise_gate_up":
                why = (f"{what} is styled 'colwise_gate_up' inside the attention {attention}: a fused layer there "
                       "holds q, k and v, not gate and up. Style it 'colwise_qkv' (all of q, then k, then v) or "
                       "'colwise' (each head's q, k and v side by side, or a plain projection)")  # fmt: skip
                wrong.append((name, "", why))
            continue
        parent = name.rpartition(".")[0]
        width = _down_width(name, resolved, modules)
        layout = _layout(modules[parent], parent)
        if given_style == "colwise" and width and out == 2 * width and layout == "halves":
            why = (f"{what} is a fused gate/up projection (its {out} outputs are twice the {width} the row-parallel "
                   f"layer after it reads: all of gate, then all of up) styled 'colwise': a plain cut gives rank 0 the "
                   "first 1/t of its outputs, all of gate and none of up at t = 2, which the MLP splits in two and "
                   "multiplies, and the model trains wrong without an error. 'colwise_gate_up' cuts gate and up each "
                   "on its own (if the layer holds them interleaved instead, set gate_up_layout = 'interleaved' on "
                   f"{type(modules[parent]).__name__})")  # fmt: skip
            wrong.append((name, "colwise_gate_up", why))
        elif given_style == "colwise_gate_up" and layout == "interleaved":
            why = (f"{what} is styled 'colwise_gate_up', but {parent} declares gate_up_layout = 'interleaved': "
                   "cut in halves, each rank would hold parts of gate and up that are not pairs. A plain 'colwise' "
                   "cut gives each rank whole (gate, up) pairs")  # fmt: skip
            wrong.append((name, "colwise", why))
        elif given_style == "colwise_gate_up" and width and out != 2 * width:
            new = "colwise" if out == width else ""  # an up projection making what down reads
            fix = f"style it {new!r}" if new else "style it by what its output holds"
            why = (f"{what} is styled 'colwise_gate_up', which cuts its outputs as gate and up halves, but they are "
                   f"not twice the {width} features the row-parallel layer after it reads: it is no fused gate/up "
                   f"projection; {fix}")  # fmt: skip
            wrong.append((name, new, why))
    return wrong
