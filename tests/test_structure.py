"""The house rules of `hetero/`, checked on its source: no import circles, no module reaching into another object's
private attributes, files a reader can hold in their head, and torch.cuda / torch.distributed each in one place."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "hetero"
MAX_LINES = 450
# Files allowed past MAX_LINES, each with its reason (say why, or split the file).
LONG_FILES: dict[str, str] = {
    "hetero/engine.py": "the composition plus the user-facing loop API (initialize's options, the accumulation "
    "boundary and LR scheduler, metrics, the inference mode); each mechanism behind it lives in a file of its own",
}
# Roots of expressions whose private names are other projects' (PyTorch's C bindings, the standard library).
EXTERNAL = {"torch", "dist", "np", "numpy", "os", "sys", "mmap", "ctypes", "threading", "weakref", "functools"}
# Private names of other projects' objects that hetero must read: a storage's identity (PyTorch), the attention
# implementation a transformers config selects, the mark transformers 4 leaves on modules post_init initialised, and
# the storage method that lends a pooled buffer's memory to a gathered chunk ([Note: transient storage on pooled
# memory] in hetero/device.py), and an operator's schema, which says what arguments it writes (the CPU stand-in's
# write stamps, [Note: the CPU stand-in]), and an uncoalesced sparse tensor's values and indices, whose memory the
# stand-in tracks (an `nn.Embedding(sparse=True)` gradient; the public accessors want a coalesced copy), a tensor's
# version counter, which tells a loop's in-place write into a parameter ([Note: the loop's writes into parameters]),
# and a module's `_apply`, through which torch converts its children (a held model's guard walks them the same way:
# [Note: casting or moving a held model]), and a process group's own timeout, which a transport other than its
# backend keeps where the Comm sets none ([Note: collectives by cross-memory attach]), and TrainingArguments' GPU
# count, which transformers' Trainer itself sets to 1 where the model must not go into nn.DataParallel (HeteroTrainer:
# one device per process), and a parameter's gradient hooks, which keep it from being split into tiles (a hook sees
# the whole gradient: [Note: hooks on tiled gradients] in hetero/zero/tiling.py).
EXTERNAL_ATTRS = {
    "_cdata",
    "_backward_hooks",
    "_post_accumulate_grad_hooks",
    "_attn_implementation",
    "_is_hf_initialized",
    "_swap_data_ptr_",
    "_schema",
    "_values",
    "_indices",
    "_version",
    "_apply",
    "_get_backend",
    "_timeout",
    "_n_gpu",
}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.Module, module: str, known: set[str]) -> set[str]:
    """hetero modules this module imports at run time (at any depth, function bodies included; imports under
    `if TYPE_CHECKING:` are for annotations only and left out)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative
                parts = module.split(".")[: -node.level]
                base = ".".join([*parts, node.module])
            for a in node.names:  # `from pkg import module` imports the module; `from module import name`, the module
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in known and m != module}


def test_no_import_circles():
    mods = _modules()
    graph = {m: _imports(t, m, set(mods)) for m, t in mods.items()}
    # A package's __init__ re-exports its modules: importing the package is importing them.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                dfs(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    # A package importing its own modules (and they the package's siblings) is how packages work; a circle through
    # two separate concepts is not.
    real = [c for c in cycles if len({x.rsplit(".", 1)[0] if x.count(".") > 1 else x for x in c}) > 1]
    assert not real, "import circles:\n" + "\n".join(" -> ".join(c) for c in real)


def test_no_module_touches_another_objects_private_attributes():
    """`x._name` only where x is the object itself (self, cls, super()) or another project's module (torch._C);
    `from module import _name` never across hetero's modules."""
    offences = []
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hetero"):
                offences += [
                    f"{module}:{node.lineno}: from {node.module} import {a.name}"
                    for a in node.names
                    if _private(a.name)
                ]
                continue
            if not isinstance(node, ast.Attribute) or not _private(node.attr) or node.attr in EXTERNAL_ATTRS:
                continue
            if node.attr.startswith("_hetero"):
                continue  # hetero's own marks on torch objects (a parameter's shard, a module's region)
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue  # its own attribute
            if isinstance(value, ast.Call) and ast.unparse(value.func) == "super":
                continue
            root = value
            while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
                root = root.func if isinstance(root, ast.Call) else root.value
            if isinstance(root, ast.Name) and root.id in EXTERNAL:
                continue
            offences.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert not offences, "private attributes of other objects:\n" + "\n".join(offences)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_files_a_reader_can_hold_in_their_head():
    long = {
        str(p.relative_to(ROOT.parent)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    unexplained = {f: n for f, n in long.items() if f not in LONG_FILES}
    assert not unexplained, f"files over {MAX_LINES} lines without a stated reason: {unexplained}"


@pytest.mark.parametrize(("name", "home"), [("torch.cuda", "hetero/device.py"), ("torch.distributed", "hetero/comm/")])
def test_cuda_and_distributed_touched_in_one_place_each(name, home):
    users = []
    for path in ROOT.rglob("*.py"):
        rel = str(path.relative_to(ROOT.parent))
        if rel.startswith(home):
            continue
        text = path.read_text()
        if f"import {name}" in text or f"{name}." in text.replace(f"'{name}.", "").replace(f'"{name}.', ""):
            users.append(rel)
    assert not users, f"{name} used outside {home}: {users}"


def _note_name(text: str) -> str:
    # A citation may wrap over lines, inside a comment or a docstring.
    return " ".join(re.sub(r"\n\s*#", " ", text).split())


def test_every_cited_note_is_defined_once():
    """A `[Note: name]` alone on its line (in a comment or a docstring) defines the note; anywhere else it cites one."""
    defined: dict[str, list[str]] = {}
    cited: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel, text = str(path.relative_to(ROOT.parent)), path.read_text()
        for m in re.finditer(r'^[ \t]*(?:#[ \t]*|""")?\[Note: ([^\]\n]+)\][ \t]*$', text, re.M):
            defined.setdefault(_note_name(m.group(1)), []).append(rel)
        for m in re.finditer(r"\[Note: ([^\]]+)\]", text):
            cited.setdefault(_note_name(m.group(1)), []).append(rel)
    undefined = {name: where for name, where in cited.items() if name not in defined}
    twice = {name: where for name, where in defined.items() if len(where) > 1}
    assert not undefined, f"notes cited but written nowhere: {undefined}"
    assert not twice, f"notes defined more than once: {twice}"
