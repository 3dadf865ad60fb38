"""One plain state_dict from a sharded checkpoint, streamed tensor by tensor.

Each output tensor is assembled from the segments every rank saved, converted, written, and let go, part by part
(runs of whole segments up to `PART_NUMEL` elements; a weight split into tiles is saved in tile-sized segments), so
peak memory is about one part (twice it when converting dtype), not the largest tensor, let alone the model. The
keys are the model's own state_dict keys: tied parameters appear under each of their names, buffers included, so
the output loads into the unwrapped model with `load_state_dict`. Trainable parameters come from the fp32 master
weights. A tensor-parallel parameter is joined from every tensor rank's shard with `unshard` (about twice its size in
memory at that moment); a `.pt` output is built in memory whole (torch.save needs the dict).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

from hetero.checkpoint import blocks
from hetero.checkpoint import manifest as mf
from hetero.checkpoint import model_parallel as par
from hetero.checkpoint.part_writer import PartWriter
from hetero.config import parse_size
from hetero.errors import CheckpointError, disk_trouble
from hetero.progress import bar

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PART_NUMEL = 16 << 20  # elements of a tensor assembled at once (more only for a single segment larger than this)
HF_SHARD_SIZE = "5GB"  # Hugging Face's default max_shard_size


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def consolidate(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | None = None,
    hf: bool = False,
    max_shard_size: int | str = HF_SHARD_SIZE,
) -> list[str]:
    """Write the checkpoint's full model state to `out`: a .safetensors file (streamed), a .pt file (built in memory:
    torch.save needs the whole dict), or a directory (model.safetensors, plus config.json for a Hugging Face model,
    so that `from_pretrained(out)` works). hf: `out` is a directory laid out as Hugging Face's save_pretrained does:
    `model-00001-of-0000N.safetensors` files of at most max_shard_size bytes each with `model.safetensors.index.json`
    (one `model.safetensors` when everything fits in one), and config.json. dtype: "fp32" / "bf16" / "fp16" for
    floating tensors; None keeps the fp32 master weights and the saved dtype of frozen parameters and buffers.
    Returns the files written."""
    directory = mf.resolve(ckpt)
    manifest = mf.read_manifest(directory)
    mf.check_files(directory, manifest, names=[n for n in manifest["files"] if n != mf.STATE_FILE])
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    target = DTYPES[dtype] if dtype is not None else None
    plan = _plan(manifest, target)
    out = os.fspath(out)
    if hf and out.endswith((".pt", ".safetensors")):
        raise CheckpointError(f"--hf writes a directory of shards: {out!r} looks like a file name; name a directory")
    is_dir = hf or not out.endswith((".pt", ".safetensors"))
    _check_out(out, is_dir)
    limit = parse_size(max_shard_size, key="max_shard_size") if hf else sys.maxsize
    index = mf.Index(directory, manifest)
    shown = bar(sum(_numel(spec) for spec in plan.values()), "hetero: consolidating", unit="el")
    try:
        if is_dir:  # Hugging Face's layout; without --hf everything in one model.safetensors
            return _write_hf(index, manifest, plan, out, limit, shown)
        if out.endswith(".pt"):
            state = {k: _assemble(index, spec).view(spec["shape"]) for k, spec in plan.items()}
            with _unfinished(out + ".tmp") as tmp:
                torch.save(state, tmp)
            os.replace(out + ".tmp", out)
            return [out]
        # One scratch buffer, the size of the largest part, reused for every part: the allocator cannot let freed
        # buffers pile up, so peak memory stays at about one part.
        _write_file(out, list(plan), plan, index, _scratch(plan, index), shown)
        return [out]
    except OSError as e:  # a full disk, no permission: the output's fault, not the checkpoint's
        where = e.filename if e.filename is not None else out
        trouble = disk_trouble(e, os.path.dirname(os.path.abspath(where)))  # a full disk, a quota, an I/O error
        raise CheckpointError(
            f"consolidating {directory} into {out}: cannot write {where}: {trouble}. The file being written was "
            "removed; name an OUT elsewhere"
        ) from None
    finally:
        shown.close()
        index.close()


def _check_out(out: str, is_dir: bool) -> None:
    """Refuse an output path that cannot be written before any tensor is read."""
    if is_dir:
        if os.path.exists(out) and not os.path.isdir(out):
            raise CheckpointError(
                f"{out} exists and is not a directory: a directory output (no .safetensors / .pt suffix, or --hf) is "
                "a folder for model.safetensors and config.json; name a folder, or end OUT in .safetensors for one file"
            )
        return
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise CheckpointError(f"{out}: its directory {parent} does not exist; create it first or name another OUT")
    if os.path.isdir(out):
        raise CheckpointError(f"{out} is a directory: name a file to write (or drop the suffix for a folder)")


@contextlib.contextmanager
def _unfinished(path: str) -> Iterator[str]:
    """A temporary output file, removed if writing it fails (a full disk must not be left fuller)."""
    try:
        yield path
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise


def _write_hf(
    index: mf.Index, manifest: dict[str, Any], plan: dict[str, dict[str, Any]], out: str, limit: int, shown: Any
) -> list[str]:
    """Hugging Face's sharded layout (see `consolidate`): tensors in state_dict order, a new shard whenever the next
    tensor would take the current one past `limit` (a tensor larger than the limit gets a shard of its own)."""
    if limit <= 0:
        raise CheckpointError(f"max_shard_size must be positive, got {limit}")
    shards: list[list[str]] = [[]]
    size = 0
    for k, spec in plan.items():
        n = _numel(spec) * spec["out_dtype"].itemsize
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    os.makedirs(out, exist_ok=True)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    scratch = _scratch(plan, index)
    written = []
    for name, keys in zip(names, shards):
        path = os.path.join(out, name)
        _write_file(path, keys, plan, index, scratch, shown)
        written.append(path)
    if len(shards) > 1:
        total = sum(_numel(spec) * spec["out_dtype"].itemsize for spec in plan.values())
        weight_map = {k: name for name, keys in zip(names, shards) for k in keys}
        path = os.path.join(out, "model.safetensors.index.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        os.replace(path + ".tmp", path)
        written.append(path)
    hf_config = manifest["model"].get("hf_config")
    if hf_config is not None:
        path = os.path.join(out, "config.json")
        with open(path, "w") as f:
            json.dump(hf_config, f, indent=2)
        written.append(path)
    return written


def _scratch(plan: dict[str, dict[str, Any]], index: mf.Index) -> torch.Tensor:
    """Room for the largest part (`_parts`) of any tensor, at 8 bytes an element."""
    return torch.empty(
        max((b - a for s in plan.values() for a, b in _parts(index, s)), default=0) * 8, dtype=torch.uint8
    )


def _write_file(
    path: str, keys: list[str], plan: dict[str, dict[str, Any]], index: mf.Index, scratch: torch.Tensor, shown: Any
) -> None:
    """One .safetensors file of `keys`, streamed part by part through `scratch`; renamed into place when whole."""
    entries = [(k, plan[k]["out_dtype"], tuple(plan[k]["shape"])) for k in keys]
    with _unfinished(path + ".tmp") as tmp, PartWriter(tmp, entries, metadata={"format": "pt"}) as w:
        for k in keys:
            _write_one(w, index, k, plan[k], _parts(index, plan[k]), scratch)
            shown.update(_numel(plan[k]))
    os.replace(path + ".tmp", path)


def _plan(manifest: dict[str, Any], target: torch.dtype | None) -> dict[str, dict[str, Any]]:
    params, buffers = manifest["model"]["params"], manifest["model"]["buffers"]
    plan: dict[str, dict[str, Any]] = {}
    for entry in manifest["model"]["state_dict"]:
        key, role = entry[0], entry[1]
        if role == "param":
            p = params[entry[2]]
            kind = "master" if p["trainable"] else "frozen"
            src_dtype = torch.float32 if p["trainable"] else _dtype(p["dtype"])
            spec = {"kind": kind, "name": entry[2], "shape": p["shape"], "dtype": src_dtype}
        elif role == "tp_param":  # joined from the tensor ranks' shards
            cut = manifest["model"]["tp"][entry[2]]
            shards = par.shard_names(entry[2], cut)
            p = params[shards[0]]
            kind = "master" if p["trainable"] else "frozen"
            src_dtype = torch.float32 if p["trainable"] else _dtype(p["dtype"])
            spec = {"kind": kind, "name": entry[2], "shape": cut["full_shape"], "dtype": src_dtype}
            spec["tp"] = {**cut, "shards": [(n, params[n]["shape"]) for n in shards]}
        elif role == "buffer":
            b = buffers[entry[2]]
            spec = {"kind": "buffer", "name": entry[2], "shape": b["shape"], "dtype": _dtype(b["dtype"])}
        else:  # a parameter with no elements
            spec = {"kind": "empty", "name": key, "shape": entry[2], "dtype": _dtype(entry[3])}
        floating = spec["dtype"].is_floating_point
        spec["out_dtype"] = target if (target is not None and floating) else spec["dtype"]
        plan[key] = spec
    return plan


def _numel(spec: dict[str, Any]) -> int:
    numel = 1
    for s in spec["shape"]:
        numel *= s
    return numel


def _nbytes(spec: dict[str, Any]) -> int:
    return _numel(spec) * spec["dtype"].itemsize


def _assemble(index: mf.Index, spec: dict[str, Any], scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor's flat values, read into `scratch` (valid until the next call) or a new tensor."""
    numel = _numel(spec)
    if scratch is None:
        flat = torch.empty(numel, dtype=spec["dtype"])
    else:
        flat = scratch[: _nbytes(spec)].view(spec["dtype"])
    if "tp" in spec:
        flat.copy_(_unshard(index, spec).reshape(-1))
    elif spec["kind"] != "empty":
        index.fill(spec["kind"], spec["name"], 0, flat)
    return flat.to(spec["out_dtype"]) if spec["out_dtype"] != spec["dtype"] else flat


def _write_one(
    w: PartWriter,
    index: mf.Index,
    key: str,
    spec: dict[str, Any],
    parts: list[tuple[int, int]],
    scratch: torch.Tensor,
) -> None:
    """Write one output tensor part by part (a tensor-parallel or empty one whole)."""
    if "tp" in spec or spec["kind"] == "empty":
        w.write(key, _assemble(index, spec, torch.empty(_nbytes(spec), dtype=torch.uint8)))
    else:
        w.write_parts(key, _numel(spec), (_assemble_part(index, spec, a, b, scratch) for a, b in parts))


def _parts(index: mf.Index, spec: dict[str, Any]) -> list[tuple[int, int]]:
    """Element ranges [a, b) to assemble one at a time: runs of whole saved segments, up to PART_NUMEL elements."""
    numel = _numel(spec)
    if "tp" in spec or spec["kind"] == "empty":
        return [(0, numel)]
    ranges, a = [], 0
    for seg in index.segments.get((spec["kind"], spec["name"]), ()):
        if seg.start > a and seg.end - a > PART_NUMEL:
            ranges.append((a, seg.start))
            a = seg.start
    ranges.append((a, numel))
    return ranges


def _assemble_part(index: mf.Index, spec: dict[str, Any], a: int, b: int, scratch: torch.Tensor) -> torch.Tensor:
    """Elements [a, b) of the tensor's flat values, read into `scratch` (valid until the next call)."""
    flat = scratch[: (b - a) * spec["dtype"].itemsize].view(spec["dtype"])
    index.fill(spec["kind"], spec["name"], a, flat)
    return flat.to(spec["out_dtype"]) if spec["out_dtype"] != spec["dtype"] else flat


def _unshard(index: mf.Index, spec: dict[str, Any]) -> torch.Tensor:
    cut = spec["tp"]
    shards = {}
    for r, (name, shape) in zip(par.stored_ranks(cut), cut["shards"]):
        t = torch.empty(shape, dtype=spec["dtype"])
        index.fill(spec["kind"], name, 0, t.view(-1))
        shards[r] = t
    return par.join_shards(cut, shards)


def verify(ckpt: str | os.PathLike) -> int:
    """Read every tensor of a checkpoint and check its checksum (and its blocks'); returns the bytes checked."""
    directory = mf.resolve(ckpt)
    manifest = mf.read_manifest(directory)
    mf.check_files(directory, manifest)
    index = mf.Index(directory, manifest)
    total = 0
    shown = bar(sum(len(segs) for segs in index.segments.values()), "hetero: verifying", unit="tensor")
    try:
        for segs in index.segments.values():
            for seg in segs:
                t = index.reader(seg.file).read(seg.key, crc=seg.crc)
                blocks.check_whole(index.reader(seg.file), seg, t)  # [Note: block checksums] in blocks.py
                total += t.numel() * t.element_size()
                shown.update()
    finally:
        shown.close()
        index.close()
    return total
