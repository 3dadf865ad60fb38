"""ZeRO-3's units: the modules whose parameters are gathered together, before they run, on every rank.

[Note: units]
At stage 3 a parameter's values exist on a rank only while gathered, and gathering is a collective: every rank of
the data-parallel group must gather the same chunk at the same point of its program. Gathering when a module runs
makes that point the module's call, so a module that only some ranks call in a step (a data-dependent branch, the
experts a router picks) would gather on some ranks only and the collective would never match. So the unit of
gathering is the block: a child of one of the model's ModuleLists (a transformer layer), whose parameters, those
of every module inside it included, are gathered when the block starts. Branches and routing inside a block then
cost nothing special: every rank runs every block. A module that owns parameters and sits in no block (embeddings,
the final norm, the head, a model without ModuleLists) is a unit of its own. What a unit must not be is skipped by
some ranks: the collective schedule's check names it (see `hetero/zero/protocol.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from hetero.memory import TensorSlot
from hetero.zero.layout import ParamInfo

if TYPE_CHECKING:
    from hetero.zero.zero_chunk import ZeroChunk


@dataclass(eq=False, frozen=True)
class Entry:
    """One parameter as the engine tracks it: its chunk, where it sits in the layout, its slot in the chunk."""

    chunk: ZeroChunk
    info: ParamInfo
    slot: TensorSlot


@dataclass(eq=False)
class Unit:
    """Modules whose parameters are gathered together; see [Note: units]."""

    index: int  # position in module order: the same on every rank
    name: str  # qualified name of the unit's module ("" for the root)
    module: nn.Module
    entries: list[Entry] = field(default_factory=list)  # the parameters it uses, each once
    chunks: list[ZeroChunk] = field(default_factory=list)  # the chunks holding them, in layout order


def unit_parameters(
    model: nn.Module, managed: set[int] | None = None
) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """The units of a model in module order: (qualified name, module, the parameters it uses, each once).
    managed: ids of the parameters to count (default: all)."""
    blocks = {id(child) for m in model.modules() if isinstance(m, nn.ModuleList) for child in m.children()}
    units: dict[int, tuple[str, nn.Module, list[nn.Parameter]]] = {}  # id(unit module) -> unit
    visited: set[int] = set()  # a module reachable twice belongs where it is met first, as in named_modules()

    def visit(module: nn.Module, name: str, unit: tuple | None) -> None:
        if id(module) in visited:
            return
        visited.add(id(module))
        if unit is None and id(module) in blocks:
            unit = units.setdefault(id(module), (name, module, []))
        own = [p for p in module.parameters(recurse=False) if managed is None or id(p) in managed]
        if own:
            target = unit if unit is not None else units.setdefault(id(module), (name, module, []))
            seen = {id(p) for p in target[2]}
            target[2].extend(p for p in own if id(p) not in seen)
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, unit)

    visit(model, "", None)
    return [u for u in units.values() if u[2]]


def module_units(model: nn.Module, units: list[Unit]) -> dict[int, Unit]:
    """id(module) -> the unit around it, walked as `unit_parameters` walks: the block it is in, or the module's own
    unit. A module whose parameter is tied to another unit's (a weight shared by two blocks) is still its block's:
    the first owner of that parameter would make it look called outside its unit, and its backward's use held by a
    unit whose backward had already ended."""
    blocks = {id(child) for m in model.modules() if isinstance(m, nn.ModuleList) for child in m.children()}
    by_module = {id(u.module): u for u in units}  # a block without parameters is no unit: None below it
    out: dict[int, Unit] = {}
    visited: set[int] = set()

    def visit(module: nn.Module, block: Unit | None) -> None:
        if id(module) in visited:
            return
        visited.add(id(module))
        if block is None and id(module) in blocks:
            block = by_module.get(id(module))
        unit = block if block is not None else by_module.get(id(module))
        if unit is not None:
            out[id(module)] = unit
        for child in module.children():
            visit(child, block)

    visit(model, None)
    return out


def find_units(model: nn.Module, entries: dict[int, Entry]) -> list[Unit]:
    """The units of a model, in module order; every parameter of `entries` is used by at least one. A weight split
    into tiles (marked by `tiling.detach_tiled`) is no entry, its layer gathers its tiles, but it makes a unit as the
    others do: a block whose weights are all tiled is a unit with no chunks, whose events its layers' turns need
    ([Note: tile gathers in turns] in `hetero/zero/turns.py`)."""
    tiled = {id(p) for p in model.parameters() if p.__dict__.get("_hetero_tiled")}
    out = []
    for i, (name, module, params) in enumerate(unit_parameters(model, set(entries) | tiled)):
        unit = Unit(index=i, name=name, module=module, entries=[entries[id(p)] for p in params if id(p) in entries])
        by_chunk = {id(e.chunk): e.chunk for e in unit.entries}
        unit.chunks = sorted(by_chunk.values(), key=lambda zc: zc.spec.index)
        out.append(unit)
    return out
