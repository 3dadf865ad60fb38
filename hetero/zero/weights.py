"""Pretrained weights as users have them: which files, which tensor goes to which parameter.

[Note: matching weight names]
`weights=` names a .safetensors or .bin (.pt, .pth) file, a directory of either (Hugging Face's own file names
first, as from_pretrained reads them; a Trainer's state files never), or a Hugging Face sharded index
(`*.safetensors.index.json`, `pytorch_model.bin.index.json`). safetensors files are read one tensor at a time
with positioned reads ([Note: reading .safetensors without a memory map]; no safetensors package needed), and so are
torch.save's zip files (.bin since torch 1.6: [Note: reading torch's zip format without torch.load]). Other torch
files (the legacy format, compressed members) are loaded by torch.load with `weights_only=True` (never unpickling
code), memory-mapped where their format allows, so the pages a rank touches stay resident until the load ends; the
legacy format cannot be mapped and is loaded whole by every rank.

Names are the model's own `state_dict` keys. Like `from_pretrained`, a model with a `base_model_prefix` (GPT-2's
"transformer", Llama's "model") takes weights saved from its base model (keys without the prefix) and a base model
takes weights saved from a head model (keys with it; the head's own tensors are then unexpected). Keys in the files
that the model does not have are a warning by default (`strict_weights=True`: an error), except those
from_pretrained drops silently (old buffers: GPT-2's `attn.bias`, each layer's rotary `inv_freq`); tensors the model
has and the files lack keep the model's own values when it was built normally, and are an error for a meta-device
model, which has no values. Shape mismatches are always errors: the model was built from another config. Floating
tensors are cast to the model's dtype (bf16 files into fp32 master weights), as from_pretrained casts them; an integer,
boolean or 8-bit float tensor where the model has a floating one (quantized weights) is an error naming it. When
most names fail to match, the error says why in terms of the names themselves: a prefix one side has and the other lacks
(a `module.` wrapper, another head) or two different naming schemes (another architecture). Files hold whole
tensors; a weight that tensor parallelism cut (1D or a grid) is matched by its whole shape, and each tensor rank reads
only its own shard of it (hetero/zero/shard_reads.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetero.errors import WeightsError
from hetero.zero import hf_names, shard_reads
from hetero.zero.safetensors_file import SafetensorsFile, unreadable
from hetero.zero.torch_zip_file import NotServed, TorchZipFile

log = logging.getLogger("hetero.zero")
_SAFE = (".safetensors",)
_TORCH = (".bin", ".pt", ".pth")
_SHOW = 10
_HF_NAMES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")
_TORCH_GLOBS = ("*.bin", "*.pt", "*.pth")


def weight_files(path: Path) -> list[Path]:
    """The weight files of a file, a directory, or a Hugging Face `*.index.json`."""
    path = Path(path)
    if path.is_dir():
        # Hugging Face's own names first, as from_pretrained reads them: a Trainer's output holds its training state
        # in .bin/.pt/.pth files too (training_args.bin is a pickled object, not tensors).
        for pattern in (*_HF_NAMES, "*.safetensors.index.json", "*.safetensors", "*.bin.index.json", *_TORCH_GLOBS):
            found = sorted(f for f in path.glob(pattern) if not _trainer_state(f.name))
            if found and pattern.endswith(".index.json"):
                path = found[0]
                break
            if found:
                return found
        else:
            raise WeightsError(
                f"weights: no .safetensors, .bin, .pt or .pth files (or index.json) in directory {str(path)!r}"
            )
    if not path.is_file():
        raise WeightsError(f"weights: {str(path)!r} does not exist")
    if path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise WeightsError(f"weights: {str(path)!r} is not a Hugging Face index (no weight_map): {e}") from None
        files = [path.parent / s for s in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise WeightsError(f"weights: the index {str(path)!r} names files that do not exist: {absent[:_SHOW]}")
        return files
    if not path.name.endswith(_SAFE + _TORCH):
        raise WeightsError(
            f"weights: expected a .safetensors, .bin, .pt or .pth file, a directory or an index.json, got {str(path)!r}"
        )
    return [path]


@contextlib.contextmanager
def open_source(path: Path, model: nn.Module) -> Iterator[Any]:
    """The tensors of the weight files at `path`, under the names the model's from_pretrained would give them
    ([Note: transformers' checkpoint conversions] in hf_names.py)."""
    with WeightSource(weight_files(path)) as source:
        yield hf_names.converted(source, model)


def _trainer_state(name: str) -> bool:
    """A file transformers' Trainer writes beside the weights: its arguments, optimizer, scheduler, scaler, RNG."""
    return name in ("training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt") or name.startswith("rng_state")


class WeightSource:
    """Tensors by name across a set of weight files, read on demand."""

    def __init__(self, files: list[Path]) -> None:
        self._stack = contextlib.ExitStack()
        self._where: dict[str, Any] = {}  # key -> its file (PositionedFile), or the dict torch.load gave
        try:
            for f in files:
                self._open(f)
        except BaseException:
            self._stack.close()
            raise

    def _open(self, f: Path) -> None:
        if f.name.endswith(_SAFE):
            handle = SafetensorsFile(f)
            self._stack.callback(handle.close)
            for k in handle.names():
                self._where[k] = handle
            return
        try:
            handle = TorchZipFile(f)  # [Note: reading torch's zip format without torch.load]
        except NotServed as why:
            state = _torch_load(f, why)
        else:
            self._stack.callback(handle.close)
            for k in handle.names():
                self._where[k] = handle
            return
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                self._where[k] = state

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        src = self._where[key]
        return tuple(src[key].shape) if isinstance(src, dict) else src.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        src = self._where[key]
        return src[key].dtype if isinstance(src, dict) else src.dtype(key)

    def read(self, key: str) -> torch.Tensor:
        src = self._where[key]
        return src[key] if isinstance(src, dict) else src.read(key)

    def read_elements(self, key: str, a: int, b: int, into: memoryview | None = None) -> torch.Tensor:
        """Elements [a, b) of a tensor flattened, without reading the rest from a PositionedFile (a tile's rows,
        [Note: initialising tiles] in materialize.py, or a rank's share: [Note: each rank reads its share]); written
        into `into` (exactly their bytes) when given, which the result then views."""
        src = self._where[key]
        if not isinstance(src, dict):
            return src.read_elements(key, a, b, into)
        if not src[key].is_contiguous():
            src[key] = src[key].contiguous()  # once: a run of a strided tensor would copy all of it each time
        part = src[key].reshape(-1)[a:b]
        return part if into is None else torch.frombuffer(into, dtype=torch.uint8).view(part.dtype).copy_(part)

    def close(self) -> None:
        self._stack.close()
        self._where.clear()

    def __enter__(self) -> WeightSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _torch_load(f: Path, why: NotServed) -> dict[str, Any]:
    """A torch file TorchZipFile does not read (`why`), loaded by torch.load: memory-mapped where it can be."""
    try:
        mapped = why.mappable
        if mapped:
            try:
                state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                mapped = False  # torch's legacy format
        if not mapped:
            state = torch.load(str(f), map_location="cpu", weights_only=True)
        log.warning(
            "weights: %s is loaded by torch.load, %s: %s",
            f,
            "memory-mapped (the pages each rank touches stay resident until the load ends)"
            if mapped
            else "whole into host memory on every rank (convert it to .safetensors to read only each rank's share)",
            why,
        )
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        if isinstance(e, pickle.UnpicklingError) and "weights only" in first.lower():
            raise WeightsError(
                f"weights: {str(f)!r} cannot be loaded safely (torch.load weights_only=True: {type(e).__name__}: "
                f"{first}). It must hold a plain state_dict of tensors; convert it to .safetensors where it holds more"
            ) from None
        raise unreadable(f, "torch", e) from None  # no pickle refused: the bytes themselves are wrong
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]  # a training checkpoint's common layout
    if not isinstance(state, dict):
        raise WeightsError(f"weights: {str(f)!r} holds a {type(state).__name__}, not a state_dict")
    return state


@dataclass
class Match:
    """How the files' keys map onto the model's tensors."""

    chosen: dict[int, str] = field(default_factory=dict)  # id(model tensor) -> source key to read it from
    missing: list[str] = field(default_factory=list)  # model keys the files lack (one name per tensor)
    unexpected: list[str] = field(default_factory=list)  # file keys the model does not have
    shapes: list[str] = field(default_factory=list)  # "name: file (..), model (..)"
    dtypes: list[str] = field(default_factory=list)  # "name: file int8, model torch.float32" (see _dtype_refused)
    mapping: str = ""  # how names were mapped, for messages ("" when they matched as they are)


def match(model: nn.Module, source: Any) -> Match:
    """Map the files' keys onto the model's state_dict by name, through the model's base prefix if it has one."""
    state = model.state_dict(keep_vars=True)
    file_keys = source.keys()
    rename, how = _prefix_map(model, list(state), file_keys)
    by_model_name: dict[str, str] = {}
    out = Match(mapping=how)
    ignored = _ignored_unexpected(model)
    for k in file_keys:
        name = rename(k)
        if name in state:
            by_model_name[name] = k
        elif ignored is None or ignored.search(k) is None:
            out.unexpected.append(k)
    names_of: dict[int, list[str]] = {}
    for name, t in state.items():
        names_of.setdefault(id(t), []).append(name)
    for key, names in names_of.items():
        found = [n for n in names if n in by_model_name]
        if not found:
            out.missing.append(names[0])
            continue
        src = by_model_name[found[0]]
        out.chosen[key] = src
        expect, got = whole_shape(state[found[0]]), source.shape(src)
        if got != expect:
            out.shapes.append(f"{found[0]}: file {got}, model {expect}")
        held, wanted = _file_dtype(source, src), state[found[0]].dtype
        if _dtype_refused(held, wanted):
            out.dtypes.append(f"{found[0]}: file {held}, model {wanted}")
    # A tied parameter's other names are neither missing nor unexpected when the files hold it under one of them.
    return out


def _file_dtype(source: Any, key: str) -> torch.dtype:
    """The dtype the files hold `key` in (a name transformers' conversions fuse: its first file tensor's)."""
    parts = getattr(source, "parts", {})  # hf_names.Converted's model name -> (file keys, shape)
    if key in parts:
        key = parts[key][0][0]
    return getattr(source, "source", source).dtype(key)


def _dtype_refused(held: torch.dtype, wanted: torch.dtype) -> bool:
    """Whether a file tensor of dtype `held` cannot be cast into a model tensor of dtype `wanted`. Floating weights are
    cast as from_pretrained casts them (bf16 files into an fp32 model); integer, boolean and 8-bit float tensors in
    place of floating ones are quantized weights or other data, whose cast would give wrong values silently (an int8
    weight read as its integer codes, an fp8 weight without its scales)."""
    if wanted.is_floating_point:
        return not held.is_floating_point or held.itemsize < 2
    if wanted == torch.bool:
        return held != torch.bool
    return held.is_floating_point or held == torch.bool  # an integer buffer (position ids) takes integers only


def _ignored_unexpected(model: nn.Module) -> re.Pattern | None:
    """Keys that from_pretrained drops without a word, as transformers does: its model's
    `_keys_to_ignore_on_load_unexpected` (GPT-2's `attn.bias` causal masks, saved by older versions) and buffers older
    checkpoints saved that are no longer persistent (each layer's `rotary_emb.inv_freq`, `position_ids`)."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [n for n, _ in model.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None


def whole_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape the files hold a tensor in: a tensor-parallel parameter's before it was cut."""
    cut = getattr(t, "_hetero_tp", None)
    return tuple(cut.full_shape) if cut is not None else tuple(t.shape)


def read_part(source: Any, key: str | None, t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Elements [a, b) of `t` flattened, from the files' tensor `key` (None: not in the files, `t`'s own values).

    [Note: each rank reads its share]
    At stage 3 a rank keeps only its range of each chunk, so it reads only the elements there: over N ranks the files
    are read about once in all, not once per rank (a model larger than the host does not fit the page cache either,
    so each rank's whole read went to the disk). A tensor-parallel shard is not contiguous in the file: it is read
    as the runs it is made of ([Note: reading a tensor-parallel shard] in shard_reads.py), only those in [a, b)."""
    if key is None:
        return t.detach().reshape(-1)[a:b]
    cut = getattr(t, "_hetero_tp", None)
    if cut is not None:
        return shard_reads.read_shard(source, key, cut, a, b)
    return source.read_elements(key, a, b)


def _prefix_map(model: nn.Module, model_keys: list[str], file_keys: list[str]) -> tuple[Any, str]:
    prefix = getattr(model, "base_model_prefix", "") or ""
    if prefix:
        dot = prefix + "."
        has = any(k.startswith(dot) for k in file_keys)
        expects = any(k.startswith(dot) for k in model_keys)
        if expects and not has:
            # Base-model weights into a model with a head: the base's keys gain the prefix, except those the model
            # has as they are (a head tied outside the base).
            plain = set(model_keys)
            return (lambda k: k if k in plain else dot + k), f"base-model keys given the prefix {dot!r}"
        if has and not expects:
            return (lambda k: k[len(dot) :] if k.startswith(dot) else k), f"the prefix {dot!r} removed"
    return (lambda k: k), ""


def explain(m: Match, model: nn.Module, path: Path) -> str:
    """Why the names do not match, in terms of the names (see [Note: matching weight names])."""
    parts = []
    if m.missing:
        parts.append(f"{len(m.missing)} missing from the files: {_list(m.missing)}")
    if m.unexpected:
        parts.append(f"{len(m.unexpected)} not in the model: {_list(m.unexpected)}")
    if m.shapes:
        parts.append(f"{len(m.shapes)} with other shapes: {_list(m.shapes)}")
    if m.dtypes:
        parts.append(f"{len(m.dtypes)} in dtypes the model cannot take: {_list(m.dtypes)}")
    cause = _cause(m, model)
    return f"weights {str(path)!r} do not fit {type(model).__name__}: " + "; ".join(parts) + f". {cause}"


def _cause(m: Match, model: nn.Module) -> str:
    if m.dtypes and not m.shapes and not m.missing:
        return (
            "Floating-point weights are cast to the model's dtypes, as from_pretrained casts them; integer, boolean "
            "or 8-bit float tensors in their place are quantized weights (GPTQ, AWQ, bitsandbytes, fp8 with its "
            "scales) or other data: dequantize them to fp16, bf16 or fp32 first, or check that the names are right"
        )
    if m.shapes and not m.missing:
        return (
            "The names match but shapes do not: the model was built from another config than the weights (compare "
            "hidden sizes, vocabulary, layer counts)"
        )
    if m.missing and m.unexpected:
        diff = _common_prefix_difference(m.missing, m.unexpected)
        if diff is not None:
            extra, side = diff
            where = "the files' keys" if side == "files" else "the model's keys"
            return (
                f"{where} carry the prefix {extra!r} that the other side's lack (a wrapper such as DDP's 'module.', "
                "or weights of another head or base model): strip or add it, or build the model class the weights "
                "were saved from"
            )
        if not m.chosen:
            return (
                f"No name matches: the files follow another naming scheme (first file key {m.unexpected[0]!r}, "
                f"first model key {m.missing[0]!r}): they were saved from another architecture than "
                f"{type(model).__name__}"
            )
        return "Some names differ: the weights were saved from another version or variant of this model"
    if m.missing:
        return (
            "The model has tensors the files do not: build the model normally (its own values are kept, as "
            "from_pretrained initialises new heads), or pass weights that hold them"
        )
    return "Pass strict_weights=False to load them anyway, leaving out the keys the model does not have"


def _common_prefix_difference(missing: list[str], unexpected: list[str]) -> tuple[str, str] | None:
    """A first name component that one side has on (nearly) every key and whose removal makes the names match."""
    for keys, others, side in ((unexpected, missing, "files"), (missing, unexpected, "model")):
        heads = {k.split(".", 1)[0] for k in keys if "." in k}
        for head in heads:
            dot = head + "."
            stripped = {k[len(dot) :] for k in keys if k.startswith(dot)}
            hits = stripped & set(others)
            if hits and len(hits) >= max(1, len(others) // 2):
                return dot, side
    return None


def _list(names: list[str]) -> str:
    return ", ".join(names[:_SHOW]) + (" ..." if len(names) > _SHOW else "")
