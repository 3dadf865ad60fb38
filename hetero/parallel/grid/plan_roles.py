"""The 1D plan checks under a grid (2D, 2.5D, 3D): the mistakes they refuse, refused here too, before anything is cut,
where a rule differs under a grid in the grid's own words.

[Note: plan mistakes under a grid]
A grid applies the 1D plans, each style naming a layer's role (apply.py's table), and the mistakes the 1D checks
refuse trained wrong here too, or failed far from the plan line at fault. Measured before these checks, on tiny
hetero GPT, GPT-2 and Llama (tests/test_grid_plan_mistakes.py's model as well), loss at the first step against plain
PyTorch's, 2D at tensor 4, 2.5D at tensor 8 depth 2, 3D at tensor 8:
- a fused q/k/v projection styled `colwise` (GPT-2's c_attn): a grid cuts its output features in q blocks of the
  whole run [q; k; v], as 1D does at t = q, not each of q, k and v by heads: 4.18930 against 4.19033 in every mode
  (the test's model in 2D: 4.29700 against 4.28275). fused_qkv.py's rule, its message as it is ([Note: fused q/k/v
  projections]); it also names Llama's q_proj styled `colwise_qkv`, refused before only where its width did not
  divide into 3 q blocks.
- `heads` left out on an attention reshaping by a head count of its own: the grid cuts the hidden dimension q ways,
  so each rank split its share of the features into all the heads (GPT-2: `not enough values to unpack` inside the
  forward; the test's model: 4.27686 against 4.28275 in 2D, without an error). plan_checks.py's rule, as it is:
  hetero's GPT, which reshapes by -1 and trained the plain loss without `heads`, holds `n_head` and is refused as
  under 1D; Llama's attention holds no count of its own and is not.
- an LM head styled `colwise` or `rowwise`. Tied to the token embedding (GPT-2, hetero's GPT) it was refused only as
  "tied to a parameter already cut differently", naming neither the head nor the fix; untied (Llama) it trained
  another model in 3D, where a column-parallel product leaves its logits in the layout between two layers (`alt`:
  other batch rows) and the grid loss reads them in `main` (4.16617 colwise, 4.15362 rowwise, against 4.14969). In
  2D and 2.5D the loss was right, but generate, which gathers whole logits from a `vocab_head` only, failed on shapes
  inside (`size of tensor a (2) must match ... (4)`). The grid's rule differs from 1D's in its fix: `vocab_head`
  only, as a grid cuts every module holding parameters (1D may leave the head whole).
- an MLP with its styles swapped (up `rowwise`, down `colwise`). In 3D each style is its own product (column: `main`
  to `alt`; row: `alt` to `main`), and the swap read each layer's input in the other layout: another model without
  an error (GPT-2 4.17447 against 4.19033, Llama 4.14902 against 4.14969, hetero's GPT 4.17094 against 4.16821). In
  2D and 2.5D both styles are the same SUMMA product and the swap trained the plain loss; it is refused there too,
  as a plan's styles say each layer's role and the same plan trains another model under '3d' and fails under '1d'.
  plan_shapes.py's rule ([Note: cuts that must chain]), in the grid's words.
- a norm left out: refused already when it holds parameters (a grid cuts every one), now naming the plan line; a
  norm without parameters (LayerNorm(elementwise_affine=False)) was left as it is and failed inside the forward on
  its rank's part of the hidden dimension (`normalized_shape=[32] ... got input of size [2, 8, 16]`), and one that
  does not check its width would normalise that part on its own. The grid's own rule: every norm outside an
  attention styled `heads` is styled `norm`, parameters or not, since every activation is cut along the hidden
  dimension (1D asks it of a block's norms under sequence parallelism only).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from hetero.errors import ConfigError
from hetero.parallel.fused_qkv import check_fused, features
from hetero.parallel.grid.layers import norm_kind
from hetero.parallel.grid.mesh import Grid
from hetero.parallel.plan_checks import check_styles_given
from hetero.parallel.plan_shapes import check_chain, fixed_line, pattern


def is_norm(module: nn.Module) -> bool:
    """A norm over the last (hidden) dimension: one the grid computes, or a class named like one."""
    return norm_kind(module) is not None or type(module).__name__.endswith("Norm")


def _chain_why(name: str, module: nn.Module, given: str, new: str, modules: Mapping[str, nn.Module], mode: str) -> str:
    """Why `name`, styled `given`, needs `new` under a grid (plan_shapes.py found which)."""
    inp, out = features(module) or (0, 0)
    what = f"{name} ({type(module).__name__} {inp} -> {out}) is styled {given!r}"
    if new == "vocab_head":
        weight = getattr(module, "weight", None)
        tied = any(m is not module and getattr(m, "weight", None) is weight for m in modules.values())
        tie = ", and its weight, the token embedding's, would be cut unlike the embedding's" if tied else ""
        return (
            f"{what}, but it is the LM head ({out} logits): cut as a plain layer, nothing gathers its logits for "
            f"generate, and under tensor_mode '3d' its logits are left on other batch rows than the grid loss reads"
            f"{tie}. Style it 'vocab_head' (tensor_mode {mode!r} cannot leave it whole)"
        )
    place = (
        f"it reads the hidden states ({inp} is the model's hidden size) and makes {out} features"
        if new == "colwise"
        else f"it makes the hidden states ({out} is the model's hidden size) from the layer before's {inp}"
    )
    return (
        f"{what}, but {place}: a {new!r} layer's place. Under tensor_mode '3d' the two styles are different products "
        "(column-parallel: from the residual stream's layout to the one between two layers; row-parallel: back), and "
        "each would read its input in the other's layout, a different model without an error; under '2d' and "
        "'2.5d' they compute alike, but the plan would train that other model under '3d' and fail under '1d'"
    )


def check_plan_roles(resolved: Mapping[str, str], modules: Mapping[str, nn.Module], grid: Grid) -> None:
    """Raise, naming each layer and the plan line that fixes it, where the plan gives a layer a role that does not
    fit it or leaves out a style it cannot do without ([Note: plan mistakes under a grid]); changes nothing."""
    chain = check_chain(resolved, modules, grid.q)
    wrong = [(n, new, _chain_why(n, modules[n], _cut(resolved[n]), new, modules, grid.mode)) for n, new, _ in chain]
    # The 1D words hold (the output features are cut q ways, as at t = q), but for unequal q/k/v blocks
    # ([Note: fused q/k/v projections]): a grid's BlockShard cuts a fused layer's blocks alike.
    wrong += check_fused(resolved, modules, grid=grid.mode)
    if wrong:
        seen: dict[str, tuple[str, str]] = {}  # one entry per pattern: the copies in other blocks say the same
        for name, new, why in wrong:
            seen.setdefault(pattern(name), (why, fixed_line(name, resolved[name], new) if new else ""))
        lines = [line for _, line in seen.values() if line]
        raise ConfigError(
            f"the tensor plan gives layers roles that do not fit them under tensor_mode {grid.mode!r} (each would "
            "fail inside the forward, or train a different model without an error):\n"
            + "\n".join(f"- {why}" for why, _ in seen.values())
            + (f"\nFixed plan lines: {{{', '.join(lines)}}}" if lines else "")
        )
    # `heads` on an attention that reshapes by a head count of its own: the grid cuts its features q ways, as 1D
    # does t ways. (Its cut checks ran above; sequence parallelism is no grid's, so its norm rule is not asked.)
    check_styles_given(resolved, modules, sequence=False, degree=grid.q)
    attentions = [f"{n}." for n, s in resolved.items() if "heads" in s.split("+")]
    for name, module in modules.items():
        styles = set(resolved.get(name, "").split("+"))
        if not is_norm(module) or styles & {"norm", "head_norm"} or any(name.startswith(a) for a in attentions):
            continue
        if any(True for _ in module.parameters(recurse=False)):
            continue  # apply.py refuses it with the rest of the modules holding parameters, naming the fix too
        raise ConfigError(
            f"{name} ({type(module).__name__}) is a norm with no style 'norm': tensor_mode {grid.mode!r} cuts every "
            "activation along the hidden dimension, so left as it is it would see each rank's part of the features "
            "(nn.LayerNorm fails on the width inside the forward; a norm that does not check it computes another "
            "model): it has no parameters to cut, but its statistics must be summed over the grid. Add "
            f"{pattern(name)!r}: 'norm' to the plan"
        )


def _cut(style: str) -> str:
    return next(p for p in style.split("+") if p in ("colwise", "rowwise"))
