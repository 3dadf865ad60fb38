"""Plan mistakes that would train a different model without an error of their own, refused before anything changes.

[Note: styles a plan cannot leave out]
A hand-written tensor plan (README's styles over one's own model) trained wrong, silently, when it left out:
- `heads` on an attention module whose projections it cuts (measured: the loss off plain PyTorch's from the first
  step, 4.31184 against 4.31358): the module kept its whole head count, so each rank reshaped its half-width q/k/v
  into that many heads of half the size. A module holding a head count of its own (`num_heads`,
  `num_attention_heads`, ...) whose direct children are cut `colwise`/`colwise_qkv` must be styled `heads`.
- `norm` on a norm inside a decoder block under Megatron sequence parallelism: each rank sees a part of the
  sequence there, so a norm's weight gets a part of its gradient on each rank; unsummed, the tensor ranks' copies
  drifted apart (0.0089 after four steps) and the losses left plain's at the second step. Under `sequence`, a norm
  (a module whose class name ends in "Norm", holding parameters) inside a block, the parent of an attention styled
  `heads`, must be styled `norm` (or `head_norm`, for a norm applied to each head).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from hetero.errors import ConfigError
from hetero.parallel.fused_mlp import check_gate_up
from hetero.parallel.fused_qkv import check_fused
from hetero.parallel.kv_replicas import HEAD_ATTRS
from hetero.parallel.plan_shapes import check_chain, fixed_line, pattern
from hetero.parallel.plans import COLUMN


def _parts(resolved: Mapping[str, str], name: str) -> set[str]:
    return set(resolved.get(name, "").split("+")) - {""}


def _head_count(module: nn.Module) -> str | None:
    # Its own attribute only: a shared config's count (Llama's attention and MLP both hold the config) says nothing
    # of which module splits heads, and a module reading it there needs no division (`head_counts`).
    for a in HEAD_ATTRS:
        if type(getattr(module, a, None)) is int:
            return f"{a} = {getattr(module, a)}"
    return None


def check_cuts_fit(resolved: Mapping[str, str], modules: Mapping[str, nn.Module], degree: int) -> None:
    """Raise, naming every layer and the plan lines that fix them, where a cut does not fit the layer: shapes that
    do not chain ([Note: cuts that must chain]), a fused q/k/v projection ([Note: fused q/k/v projections]) or a fused
    gate/up projection ([Note: fused gate/up projections]) cut wrong."""
    wrong = check_chain(resolved, modules, degree) + check_fused(resolved, modules) + check_gate_up(resolved, modules)
    if not wrong:
        return
    seen: dict[str, tuple[str, str]] = {}  # one entry per pattern: the layers' copies in other blocks say the same
    for name, new, why in wrong:
        seen.setdefault(pattern(name), (why, fixed_line(name, resolved[name], new) if new else ""))
    lines = [line for _, line in seen.values() if line]
    raise ConfigError(
        "the tensor plan cuts layers in ways that do not fit them (each would fail on shapes inside the forward, or "
        "train a different model without an error):\n"
        + "\n".join(f"- {why}" for why, _ in seen.values())
        + (f"\nFixed plan lines: {{{', '.join(lines)}}}" if lines else "")
    )


def check_styles_given(
    resolved: Mapping[str, str], modules: Mapping[str, nn.Module], *, sequence: bool, degree: int
) -> None:
    """Raise where the plan leaves out a style it cannot do without ([Note: styles a plan cannot leave out]) or
    gives a layer a cut that does not fit it (`check_cuts_fit`)."""
    check_cuts_fit(resolved, modules, degree)
    for name, module in modules.items():
        prefix = f"{name}." if name else ""
        cut = [c for c, _ in module.named_children() if _parts(resolved, prefix + c) & set(COLUMN)]
        count = _head_count(module) if cut else None
        if count and "heads" not in _parts(resolved, name):
            raise ConfigError(
                f"{name} ({type(module).__name__}) holds a head count ({count}) and the plan cuts its projections "
                f"{cut} column-wise, but gives it no style 'heads': each tensor rank would split its share of the "
                f"features into all {count.split(' = ')[1]} heads, a different model. Add {name!r}: 'heads' to the plan"
            )
    if not sequence:
        return
    blocks = {n.rpartition(".")[0] for n, s in resolved.items() if "heads" in s.split("+") and "." in n}
    for block in sorted(blocks):
        for sub, module in modules[block].named_modules():
            name = f"{block}.{sub}" if sub else block
            own = [n for n, _ in module.named_parameters(recurse=False)]
            if own and type(module).__name__.endswith("Norm") and not _parts(resolved, name) & {"norm", "head_norm"}:
                raise ConfigError(
                    f"{name} ({type(module).__name__}) is a norm inside {block} with no style 'norm': under sequence "
                    "parallelism each tensor rank sees a part of the sequence there, so its weight would get a part "
                    f"of its gradient on each rank and the ranks' copies drift apart. Add {name!r}: 'norm' to the plan"
                )
