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

import json
import os
from typing import Any

import torch

from hetero.checkpoint import manifest as mf
from hetero.checkpoint import model_parallel as par
from hetero.checkpoint.format import TensorWriter
from hetero.errors import CheckpointError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PART_NUMEL = 16 << 20  # elements of a tensor assembled at once (more only for a single segment larger than this)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def consolidate(ckpt: str | os.PathLike, out: str | os.PathLike, *, dtype: str | None = None) -> list[str]:
    """Write the checkpoint's full model state to `out`: a .safetensors file (streamed), a .pt file (built in memory:
    torch.save needs the whole dict), or a directory (model.safetensors, plus config.json for a Hugging Face model,
    so that `from_pretrained(out)` works). dtype: "fp32" / "bf16" / "fp16" for floating tensors; None keeps the
    fp32 master weights and the saved dtype of frozen parameters and buffers. Returns the files written."""
    directory = mf.resolve(ckpt)
    manifest = mf.read_manifest(directory)
    mf.check_files(directory, manifest, names=[n for n in manifest["files"] if n != mf.STATE_FILE])
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    target = DTYPES[dtype] if dtype is not None else None
    plan = _plan(manifest, target)
    out = os.fspath(out)
    index = mf.Index(directory, manifest)
    try:
        if out.endswith(".pt"):
            state = {k: _assemble(index, spec).view(spec["shape"]) for k, spec in plan.items()}
            tmp = out + ".tmp"
            torch.save(state, tmp)
            os.replace(tmp, out)
            return [out]
        written = []
        if out.endswith(".safetensors"):
            path = out
        else:
            os.makedirs(out, exist_ok=True)
            path = os.path.join(out, "model.safetensors")
            hf = manifest["model"].get("hf_config")
            if hf is not None:
                cfg = os.path.join(out, "config.json")
                with open(cfg, "w") as f:
                    json.dump(hf, f, indent=2)
                written.append(cfg)
        tmp = path + ".tmp"
        entries = [(k, spec["out_dtype"], tuple(spec["shape"])) for k, spec in plan.items()]
        # One scratch buffer, the size of the largest part, reused for every part: the allocator cannot let freed
        # buffers pile up, so peak memory stays at about one part.
        parts = {k: _parts(index, spec) for k, spec in plan.items()}
        largest = max((b - a for ranges in parts.values() for a, b in ranges), default=0)
        scratch = torch.empty(largest * 8, dtype=torch.uint8)
        with TensorWriter(tmp, entries, metadata={"format": "pt"}) as w:
            for k, spec in plan.items():
                if "tp" in spec or spec["kind"] == "empty":
                    w.write(k, _assemble(index, spec, torch.empty(_nbytes(spec), dtype=torch.uint8)))
                    continue
                pieces = (_assemble_part(index, spec, a, b, scratch) for a, b in parts[k])
                w.write_parts(k, _numel(spec), pieces)
        os.replace(tmp, path)
        written.insert(0, path)
        return written
    finally:
        index.close()


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
    from hetero.parallel.grid.shard import BlockShard
    from hetero.parallel.tensor import TPShard, unshard

    cut = spec["tp"]
    shards = []
    for name, shape in cut["shards"]:
        t = torch.empty(shape, dtype=spec["dtype"])
        index.fill(spec["kind"], name, 0, t.view(-1))
        shards.append(t)
    if "indices" in cut:  # a grid layout: blocks by their stored ranks
        return BlockShard.from_dict(cut).join(dict(zip(par.stored_ranks(cut), shards)))
    info = TPShard(
        dim=cut["dim"], parts=cut["parts"], degree=cut["degree"], rank=0, full_shape=tuple(cut["full_shape"])
    )
    return unshard(shards, info)


def verify(ckpt: str | os.PathLike) -> int:
    """Read every tensor of a checkpoint and check its CRC32; returns the bytes checked."""
    directory = mf.resolve(ckpt)
    manifest = mf.read_manifest(directory)
    mf.check_files(directory, manifest)
    index = mf.Index(directory, manifest)
    total = 0
    try:
        for segs in index.segments.values():
            for seg in segs:
                t = index.reader(seg.file).read(seg.key, crc=seg.crc)
                total += t.numel() * t.element_size()
    finally:
        index.close()
    return total
