"""Giving chunks their first values: from a built model, from a meta-device model's own initialiser, or from
safetensors files.

[Note: initialising on meta, chunk by chunk]
A model built under `torch.device("meta")` (or `hetero.lazy_init()`) has parameters with shapes and no memory. We run
the model's own initialiser, the one normal construction would have run, in the same order, so it consumes the random
number generator exactly as normal construction does: a Hugging Face `PreTrainedModel`'s `init_weights()` (the
`_init_weights(module)` walk of `post_init`, then weight tying; also inside the user's module); otherwise
`reset_parameters()` of every module in module order, skipping a subtree an ancestor's `reset_parameters()` already
initialised (hetero's GPT initialises its whole tree from the root); a tensor keeps the values of the first call that
wrote it (a parent's write, which normal construction runs last), later calls only drawing their numbers, and within one
call the last write; a weight tied at construction those of the module that made it (`hetero.lazy.tie_makers`; for
Hugging Face models the walk of the model holding the tie's source). The walks are in hetero/zero/init_replay.py. While
it runs, a `TorchFunctionMode` stands a real tensor in for each meta parameter the moment a function touches it: a view
into a staging buffer of the parameter's chunk, a host chunk of the manager (so the host ledger counts it). Once every
parameter of a chunk has had its last write (counted on meta first: [Note: counting the writes first]) and the
initialiser writes a parameter of another chunk, the chunk is complete: `ZeroChunk.load` takes this rank's share (the
shard at stage 3) and the staging buffer is freed. Host memory therefore holds the rank's share plus the chunks being
written (one per optimizer param group: groups fill separate chunks). Every rank computes the same values from the same
seed, so nothing is broadcast; a checksum all-reduce at the end catches ranks that were seeded differently. A write to a
parameter whose chunk was already loaded, or a parameter the initialiser never wrote, is an error that names it. Buffers
are small and kept whole: the initialiser's writes to meta buffers go to real CPU tensors that replace them.

[Note: streaming pretrained weights]
With `weights=` (a .safetensors or .bin file, a directory of them, or Hugging Face's sharded index), tensors are read
one at a time (hetero/zero/weights.py) into the same staging buffers, chunk by chunk; names are the model's own
state_dict keys (a tied parameter may come under any of its names), through its base-model prefix where the files were
saved from the base or the head model. Names and shapes are matched from the files' headers before anything is read;
what cannot load is reported together, with its cause.

[Note: initialising tiles]
A weight split into tiles ([Note: tiles] in `hetero/memory/chunk_size.py`) is initialised through one staging buffer of
its whole size: an initialiser draws a tensor's random numbers in one call, and only the whole tensor's call gives the
values of normal construction. Once written, it is copied into its tiles one at a time (each tile's chunk loads and
frees its own staging buffer) and freed, so host memory holds the whole weight once, in fp32, during its own
initialisation only. `weights=` needs no such buffer: each tile's rows are read from the file on their own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetero.comm import Comm
from hetero.device import Device
from hetero.errors import WeightsError
from hetero.lazy import refuse_meta_adapters
from hetero.memory import ChunkManager
from hetero.progress import bar as make_bar
from hetero.zero import weights
from hetero.zero.init_replay import (
    StandIn,
    count_writes,
    run_initialiser,
    scratch,
    take_shard,
    tensors,
    whole_modules,
    whole_shape,
)
from hetero.zero.layout import ChunkSpec
from hetero.zero.staging import Staging
from hetero.zero.twins import buffers_from_twins
from hetero.zero.zero_chunk import ZeroChunk

log = logging.getLogger("hetero.zero")


def is_lazy(model: nn.Module) -> bool:
    """True when some parameter or buffer of the model is on the meta device (no memory yet)."""
    return any(t.is_meta for t in tensors(model))


def load_values(
    model: nn.Module,
    chunks: list[ZeroChunk],
    *,
    manager: ChunkManager,
    comm: Comm,
    weights: str | os.PathLike | None = None,
    strict: bool = False,
    progress: bool = True,
) -> None:
    """Fill every chunk with the model's first values (see the notes above), and give meta buffers real memory.
    strict: keys in the weight files that the model does not have are an error (else a warning). progress: show a
    bar (rank 0, on a terminal; hetero/progress.py)."""

    def bar(total: float, desc: str, unit: str = "it") -> Any:
        return make_bar(total, desc, unit=unit, rank=comm.rank, config=progress)

    mode = _agreed_mode(0 if weights is not None else 1 if any(p.is_meta for p in model.parameters()) else 2, comm)
    refuse_meta_adapters(model)
    if mode == 0:
        _stream_weights(model, chunks, manager, Path(weights), strict=strict, bar=bar)
    elif mode == 1:
        _initialise(model, chunks, manager, comm, bar)
    else:
        shown = bar(len(chunks), "hetero: placing weights", unit="chunk")
        for zc in chunks:
            # Every rank starts from rank 0's weights, as DDP does (on the device: NCCL broadcasts device memory).
            flat = flat_values(zc.spec, manager.device)  # where NCCL broadcasts it, and no host copy beside the model
            comm.broadcast(flat, src=0)
            zc.load(flat)
            del flat
            shown.update()
        shown.close()
    buffers_from_twins(model)
    still = [n for n, b in model.named_buffers() if b.is_meta]
    if still:
        raise WeightsError(
            f"buffers {still[:10]} are still on the meta device after initialisation: give their modules a reset_"
            "parameters() that sets them (a Hugging Face model: an _init_weights branch), or build the model normally"
        )


# ---- initialising a meta model ------------------------------------------------------------------------------
def _initialise(
    model: nn.Module, chunks: list[ZeroChunk], manager: ChunkManager, comm: Comm, bar: Callable[..., Any]
) -> None:
    staging = Staging(manager, checksum=comm.size > 1)
    shown = bar(len(chunks), "hetero: initialising", unit="chunk")
    where = {id(info.param): (zc, info) for zc in chunks for info in zc.spec.params if not info.tiled}
    tiles: dict[int, list[tuple[ZeroChunk, Any]]] = {}  # tiled parameter id -> its tiles, in row order
    for zc in chunks:
        for info in zc.spec.params:
            if info.tiled:
                tiles.setdefault(id(info.param), []).append((zc, info))
                where.setdefault(id(info.param), (zc, info))  # the first tile stands for it in what follows
    unwritten = {zc.spec.index: {id(i.param) for i in zc.spec.params} for zc in chunks}
    by_index = {zc.spec.index: zc for zc in chunks}
    loaded: set[int] = set()
    sums = torch.zeros(len(chunks), dtype=torch.float64)
    buffers = {id(b): (m, n, b) for m in model.modules() for n, b in m.named_buffers(recurse=False) if b.is_meta}
    real_buffers: dict[int, torch.Tensor] = {}
    written_any: set[int] = set()  # ids of params and buffers written (to skip subtrees an ancestor initialised)

    passes = [0]  # which initialiser pass runs (a Hugging Face model has one per PreTrainedModel)
    written_in: dict[int, int] = {}  # param id -> the pass that wrote it
    # A tensor-parallel shard's whole tensor while the initialiser writes it ([Note: initialising a tensor-parallel
    # shard] in init_replay.py); a shard taken from it (`flushed`) is complete, its stand-in only tells its shape.
    wholes: dict[int, torch.Tensor] = {}
    flushed: set[int] = set()
    # param id -> writes still to come in its pass: complete at its last ([Note: counting the writes first])
    with whole_modules(model) as dropped:
        left, defaults = count_writes(model, set(where) | set(buffers))

    def real(t: torch.Tensor) -> torch.Tensor | None:
        if id(t) in dropped:
            return scratch(t)  # [Note: replaying the stages a rank dropped] in init_replay.py
        if written_in.get(id(t), passes[0]) < passes[0]:
            # Tied at construction on meta, but a separate tensor when Hugging Face's later pass wrote it in normal
            # construction (tying came after, and kept the first): the numbers are drawn, then dropped.
            return scratch(t)
        hit = where.get(id(t))
        if hit is not None:
            zc, info = hit
            if zc.spec.index in loaded or id(t) in flushed:
                return scratch(t)  # its shape can be read; a write is an error (on_write)
            if getattr(t, "_hetero_tp", None) is not None:
                if id(t) not in wholes:  # zeros, as a staging buffer starts: an initialiser may write a part
                    wholes[id(t)] = torch.zeros(whole_shape(t), dtype=t.dtype)
                return wholes[id(t)]
            return stand_in(zc, info)
        if id(t) in buffers:
            if id(t) not in real_buffers:
                real_buffers[id(t)] = torch.zeros(t.shape, dtype=t.dtype)
            return real_buffers[id(t)]
        return None

    def stand_in(zc: ZeroChunk, info: Any) -> torch.Tensor:
        return staging.whole_view(info) if info.tiled else staging.view(zc, info)

    def take_shards(but: int | None = None) -> None:
        """This rank's shard of each whole tensor whose last write is in (not `but`, being written now)."""
        for key in [k for k in wholes if k != but and left.get(k, 1) <= 0]:
            zc, info = where[key]
            take_shard(wholes.pop(key), info.param._hetero_tp, stand_in(zc, info))
            flushed.add(key)

    def on_write(key: int) -> None:
        if key in dropped:
            written_any.add(key)  # an ancestor that wrote it covered its subtree, as for the rank's own tensors
            return
        if key not in where and key not in buffers:
            return  # a temporary, or a view (`weight[padding_idx].zero_()` after the weight's last counted write)
        take_shards(but=key)  # another tensor is written: the whole tensors done are, before any chunk is loaded
        written_any.add(key)
        if written_in.setdefault(key, passes[0]) < passes[0]:
            return  # goes to scratch (see real)
        hit = where.get(key)
        if hit is None:
            return
        zc, info = hit
        if zc.spec.index in loaded:
            raise WeightsError(
                f"the model's initialiser wrote parameter {info.name!r} after hetero had loaded its chunk (more "
                "often than its run on the meta device did): initialise each parameter in one place (its module's "
                "reset_parameters) without reading values, or build the model normally"
            )
        left[key] = left.get(key, 1) - 1
        if left[key] <= 0:
            for zc_, _ in tiles.get(key, [(zc, info)]):
                unwritten[zc_.spec.index].discard(key)
        # Another chunk's parameter is being written: chunks whose parameters are all written are complete.
        for index in [i for i in staging.open if i != zc.spec.index and not unwritten[i]]:
            sums[index] = staging.load(by_index[index])
            loaded.add(index)
            shown.update()
        for other in [k for k in staging.whole if k != key and left.get(k, 1) <= 0]:
            complete_tiles(other)

    def complete_tiles(key: int) -> None:
        for index, total in staging.load_tiles(tiles[key]):
            sums[index] = total
            loaded.add(index)
            shown.update()

    try:
        with whole_modules(model):
            run_initialiser(model, real, on_write, written_any, passes, defaults=defaults)
        model.__dict__.pop("_hetero_dropped", None)  # the dropped stages' meta modules are not needed again
        for key in wholes:  # the initialiser has ended: every whole tensor is complete, written as often as counted
            left[key] = 0  # or fewer (see below)
        take_shards()
        for index in unwritten:  # the initialiser has ended: a tensor written fewer times than counted is complete
            unwritten[index] -= set(written_in)
        for key in list(staging.whole):
            complete_tiles(key)
        for index in list(staging.open):
            if not unwritten[index]:
                sums[index] = staging.load(by_index[index])
                loaded.add(index)
                shown.update()
    finally:
        shown.close()
        staging.close()
    missing = [where[k][1].name for index in sorted(unwritten) for k in unwritten[index] if index not in loaded]
    if missing:
        raise WeightsError(
            f"the model's initialiser never wrote parameters {missing[:10]}"
            f"{f' (and {len(missing) - 10} more)' if len(missing) > 10 else ''}: on the meta device they have no "
            "values. Give their modules a reset_parameters() (or, for a Hugging Face model, an _init_weights branch), "
            "pass weights=..., or build the model normally"
        )
    for key, value in real_buffers.items():
        module, name, _ = buffers[key]
        setattr(module, name, value)  # a registered buffer's slot: persistence kept
    _check_same_everywhere(sums, comm)


_MODES = ("loaded its weights from files (weights=)", "built it on the meta device", "built it with real values")


def _agreed_mode(mine: int, comm: Comm) -> int:
    """How every rank fills the chunks (an index of `_MODES`): each way has its own collectives, so ranks that built
    the model differently (rank 0 alone with real values, as FSDP's sync_module_states allows) would hang."""
    seen = comm.all_gather_object(mine) if comm.size > 1 else [mine]  # on the control group
    if any(m != mine for m in seen):
        ways = "; ".join(f"rank {r} {_MODES[m]}" for r, m in enumerate(seen))
        raise WeightsError(
            f"the ranks prepared the model differently: {ways}. Build it the same way on every rank: with real values "
            "(rank 0's are broadcast), on the meta device (seeded alike), or with the same weights="
        )
    return mine


def _check_same_everywhere(sums: torch.Tensor, comm: Comm) -> None:
    if comm.size == 1:
        return
    lo, hi = sums.clone(), sums.clone()
    comm.control.all_reduce(lo, op="min")  # a few host numbers: the control group ([Note: data and control groups])
    comm.control.all_reduce(hi, op="max")
    # The same values summed in the same order agree exactly; a tolerance only guards against thread-count effects.
    if not torch.allclose(lo, hi, rtol=1e-9, atol=1e-6):
        bad = (lo != hi).nonzero().flatten().tolist()
        raise WeightsError(
            f"ranks initialised different values (chunks {bad[:8]}): a meta-device model is initialised on every "
            "rank from its own random generator, so seed every rank the same (torch.manual_seed) before building it"
        )


# ---- streaming pretrained weights -------------------------------------------------------------------------------
def _stream_weights(
    model: nn.Module,
    chunks: list[ZeroChunk],
    manager: ChunkManager,
    path: Path,
    *,
    strict: bool,
    bar: Callable[..., Any],
) -> None:
    """See [Note: streaming pretrained weights] here and [Note: matching weight names] in weights.py."""
    meta = any(p.is_meta for p in model.parameters())
    with weights.open_source(path, model) as source:
        m = weights.match(model, source)
        fatal = bool(m.shapes or m.dtypes) or (strict and bool(m.unexpected)) or (meta and bool(m.missing))
        if fatal or not m.chosen:
            raise WeightsError(weights.explain(m, model, path))
        if m.mapping:
            log.info("weights %s: %s", path, m.mapping)
        if m.unexpected:
            log.warning(
                "weights %s: %d keys the model does not have were left out: %s (strict_weights=True makes this an "
                "error)",
                path,
                len(m.unexpected),
                ", ".join(m.unexpected[:10]) + (" ..." if len(m.unexpected) > 10 else ""),
            )
        if m.missing:
            log.warning(
                "weights %s: %d tensors of the model are not in the files and keep the model's own values: %s",
                path,
                len(m.missing),
                ", ".join(m.missing[:10]) + (" ..." if len(m.missing) > 10 else ""),
            )

        # Buffers first, while parameters still have no memory: an initialiser run for non-persistent buffers
        # (rotary tables) then writes nothing that matters.
        for module in model.modules():
            for name, b in list(module.named_buffers(recurse=False)):
                if id(b) in m.chosen:
                    setattr(module, name, source.read(m.chosen[id(b)]).to(b.dtype))
        _initialise_buffers(model)
        staging = Staging(manager)
        progress = bar(sum(zc.spec.capacity * 4 for zc in chunks), "hetero: loading weights", unit="B")
        try:
            for zc in chunks:
                # At stage 3 a rank keeps only its range of the chunk: it reads only that ([Note: each rank reads its
                # share] in weights.py); a tile's elements are its rows ([Note: initialising tiles]).
                lo, hi = zc.kept_range() if zc.layout.params_sharded else (0, zc.spec.capacity)
                flat = staging.flat(zc)
                for info in zc.spec.params:
                    a, b = max(lo, info.offset), min(hi, info.offset + info.numel)
                    if a < b:
                        first, key = info.start + a - info.offset, m.chosen.get(id(info.param))
                        flat.narrow(0, a, b - a).copy_(weights.read_part(source, key, info.param, first, first + b - a))
                staging.load(zc)
                progress.update(zc.spec.capacity * 4)
        finally:
            progress.close()
            staging.close()


def _initialise_buffers(model: nn.Module) -> None:
    """Run the own initialiser of each module that still has meta buffers (non-persistent ones: not in files)."""
    hf_init = getattr(model, "_init_weights", None)
    for module in model.modules():
        metas = {id(b): (n, b) for n, b in module.named_buffers(recurse=False) if b.is_meta}
        if not metas:
            continue
        real: dict[int, torch.Tensor] = {}

        def stand_in(t: torch.Tensor, metas: dict = metas, real: dict = real) -> torch.Tensor | None:
            if id(t) not in metas:
                return None
            return real.setdefault(id(t), torch.zeros(t.shape, dtype=t.dtype))

        with StandIn(stand_in, lambda key: None), torch.no_grad():
            if callable(hf_init):
                hf_init(module)
            elif callable(getattr(module, "reset_parameters", None)) and not list(module.parameters()):
                module.reset_parameters()
        for key, value in real.items():
            setattr(module, metas[key][0], value)


def flat_values(spec: ChunkSpec, device: Device | None = None) -> torch.Tensor:
    """The chunk's parameters as one flat fp32 tensor of `capacity` elements, zero-padded: in the device's own memory
    where it has one (a GPU), else on the CPU. A chunk built on the host would sit there beside the built model's
    weights, which are freed only as their chunk loads: one fp32 chunk (115 MB for the 551M Llama of
    benchmarks/gpu_race.py) on top of the peak host memory of placing a model, which FSDP2 does not pay."""
    if device is not None and device.separate_memory:
        flat = device.empty((spec.capacity,), torch.float32).zero_()
    else:
        flat = torch.zeros(spec.capacity, dtype=torch.float32)
    for info in spec.params:
        flat.narrow(0, info.offset, info.numel).copy_(info.param.detach().reshape(-1).narrow(0, info.start, info.numel))
    return flat
