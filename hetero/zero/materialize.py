"""Giving chunks their first values: from a built model, from a meta-device model's own initialiser, or from
safetensors files.

[Note: initialising on meta, chunk by chunk]
A model built under `torch.device("meta")` (or `hetero.lazy_init()`) has parameters with shapes and no memory. We
run the model's own initialiser, the one normal construction would have run, in the same order, so it consumes the
random number generator exactly as normal construction does: a Hugging Face `PreTrainedModel`'s `init_weights()`
(the `_init_weights(module)` walk of `post_init`, then weight tying); otherwise `reset_parameters()` of every module
in module order, skipping a subtree an ancestor's `reset_parameters()` already initialised (hetero's GPT
initialises its whole tree from the root). While it runs, a `TorchFunctionMode` stands a real tensor in for each
meta parameter the moment a function touches it: a view into a staging buffer of the parameter's chunk, a host
chunk of the manager (so the host ledger counts it). Once every parameter of a chunk has been written and the
initialiser writes a parameter of another chunk, the chunk is complete: `ZeroChunk.load` takes this rank's share
(the shard at stage 3) and the staging buffer is freed. Host memory therefore holds the rank's share plus the chunks
being written (one per optimizer param group, as groups are packed into separate chunks). Every rank computes the
same values from the same seed, so nothing is broadcast; a checksum all-reduce at the end catches ranks that were
seeded differently. A write to a parameter whose chunk was already loaded, or a parameter the initialiser never
wrote, is an error that names it. Buffers are small and kept whole: the initialiser's writes to meta buffers go to
real CPU tensors that replace them.

[Note: streaming pretrained weights]
With `weights=` (a .safetensors file, a directory of them, or Hugging Face's sharded index), tensors are read one
at a time with `safetensors.safe_open` into the same staging buffers, chunk by chunk; names are the model's own
state_dict keys (a tied parameter may come under any of its names). Missing, unexpected and mis-shaped names are
checked from the files' headers before anything is read, and reported together.

[Note: initialising tiles]
A weight split into tiles ([Note: tiles] in `hetero/memory/chunk_size.py`) is initialised through one staging buffer
of its whole size: an initialiser draws a tensor's random numbers in one call, and only the whole tensor's call gives
the values of normal construction. Once written, it is copied into its tiles one at a time (each tile's chunk loads
and frees its own staging buffer) and freed, so host memory holds the whole weight once, in fp32, during its own
initialisation only. `weights=` needs no such buffer: each tile's rows are read from the file on their own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from hetero.comm import Comm
from hetero.errors import WeightsError
from hetero.memory import Chunk, ChunkManager, TensorState, Tier
from hetero.zero.zero_chunk import ZeroChunk, flat_values

log = logging.getLogger("hetero.zero")


def is_lazy(model: nn.Module) -> bool:
    """True when some parameter or buffer of the model is on the meta device (no memory yet)."""
    return any(t.is_meta for t in _tensors(model))


def load_values(
    model: nn.Module,
    chunks: list[ZeroChunk],
    *,
    manager: ChunkManager,
    comm: Comm,
    weights: str | os.PathLike | None = None,
) -> None:
    """Fill every chunk with the model's first values (see the notes above), and give meta buffers real memory."""
    if weights is not None:
        _stream_weights(model, chunks, manager, Path(weights))
    elif any(p.is_meta for p in model.parameters()):
        _initialise(model, chunks, manager, comm)
    else:
        for zc in chunks:
            # Every rank starts from rank 0's weights, as DDP does (on the device: NCCL broadcasts device memory).
            flat = manager.device.to_device(flat_values(zc.spec)) if comm.size > 1 else flat_values(zc.spec)
            comm.broadcast(flat, src=0)
            zc.load(flat)
            del flat
    still = [n for n, b in model.named_buffers() if b.is_meta]
    if still:
        raise WeightsError(
            f"buffers {still[:10]} are still on the meta device after initialisation: give their modules a "
            "reset_parameters() that sets them (or an _init_weights branch for a Hugging Face model), or build the "
            "model normally"
        )


# ---- staging buffers ------------------------------------------------------------------------------------------
class _Staging:
    """One fp32 host chunk per ZeroChunk being filled, counted in the host ledger and pinned there."""

    def __init__(self, manager: ChunkManager, *, checksum: bool = False) -> None:
        self.m = manager
        self.checksum = checksum  # sum each chunk's values as it is loaded (to compare ranks)
        self.open: dict[int, Chunk] = {}  # ZeroChunk index -> staging chunk
        self.whole: dict[int, Chunk] = {}  # tiled parameter id -> its whole value ([Note: initialising tiles])

    def flat(self, zc: ZeroChunk) -> torch.Tensor:
        c = self.open.get(zc.spec.index)
        if c is None:
            c = self.m.new_chunk(dtype=torch.float32, capacity=zc.spec.capacity, kind="staging")
            slot = c.add_tensor(f"{zc.spec.params[0].name}..staging", (zc.spec.capacity,))
            self.m.access(c, Tier.HOST)
            c.set_state(slot, TensorState.HOLD)
            self.m.pin(c)  # loading other chunks must not evict it to NVMe
            c.payload.zero_()  # the padding past the last parameter
            self.open[zc.spec.index] = c
        return c.payload

    def view(self, zc: ZeroChunk, info: Any) -> torch.Tensor:
        return self.flat(zc).narrow(0, info.offset, info.numel).view(info.shape)

    def whole_view(self, info: Any) -> torch.Tensor:
        """A tiled parameter's whole value (fp32, zeros at first), for an initialiser to write."""
        key = id(info.param)
        c = self.whole.get(key)
        if c is None:
            numel = info.param.numel()
            c = self.m.new_chunk(dtype=torch.float32, capacity=numel, kind="staging")
            slot = c.add_tensor(f"{info.name}..staging", (numel,))
            self.m.access(c, Tier.HOST)
            c.set_state(slot, TensorState.HOLD)
            self.m.pin(c)
            c.payload.zero_()
            self.whole[key] = c
        return c.payload.view(info.param.shape)

    def load_tiles(self, tiles: list[tuple[ZeroChunk, Any]]) -> list[tuple[int, float]]:
        """Copy a tiled parameter's whole value into its tiles' chunks, one at a time, and free it; (chunk index,
        checksum) per tile."""
        c = self.whole.pop(id(tiles[0][1].param))
        flat = c.payload
        sums = []
        for zc, info in tiles:
            self.flat(zc).narrow(0, info.offset, info.numel).copy_(flat.narrow(0, info.start, info.numel))
            sums.append((zc.spec.index, self.load(zc)))
        self._free(c)
        return sums

    def load(self, zc: ZeroChunk) -> float:
        """Load the chunk from its staging buffer and free the buffer; returns the values' sum (a checksum)."""
        c = self.open.pop(zc.spec.index)
        flat = c.payload
        total = float(flat.sum(dtype=torch.float64)) if self.checksum else 0.0
        zc.load(flat)
        self._free(c)
        return total

    def _free(self, c: Chunk) -> None:
        self.m.unpin(c)
        c.set_state(c.slots[0], TensorState.FREE)
        self.m.free_chunk(c)

    def close(self) -> None:
        for c in [*self.open.values(), *self.whole.values()]:
            self._free(c)
        self.open.clear()
        self.whole.clear()


# ---- initialising a meta model ------------------------------------------------------------------------------
class _StandIn(TorchFunctionMode):
    """Replaces tracked meta tensors by real ones in every torch function call (see the note above)."""

    def __init__(self, real: Callable[[torch.Tensor], torch.Tensor | None], on_write: Callable[[int], None]) -> None:
        super().__init__()
        self._real = real  # tracked tensor -> its stand-in (None: not tracked)
        self._on_write = on_write  # called with id() of a tracked tensor a function writes in place

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _writes(name):
            # The written tensor comes first: positional, or by keyword (`nn.init` passes `tensor=`).
            target = args[0] if args else next(iter(kwargs.values()), None)
            if isinstance(target, torch.Tensor):
                self._on_write(id(target))
        args, kwargs = tree_map(self._swap, (args, kwargs))
        return func(*args, **kwargs)

    def _swap(self, x: Any) -> Any:
        # Tracked tensors are meta until their chunk loads; after that they view chunk memory that the initialiser
        # must not touch (at stage 3 it has no bytes): `real` decides for both.
        if isinstance(x, torch.Tensor):
            real = self._real(x)
            if real is not None:
                return real
        return x


_NOT_WRITES = frozenset({"requires_grad_", "share_memory_"})  # in-place by name, but they change no values


def _writes(name: str) -> bool:
    """Whether a torch function of this name writes its first argument in place (`normal_`, `copy_`, ...)."""
    if name in _NOT_WRITES:
        return False
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))


def _initialise(model: nn.Module, chunks: list[ZeroChunk], manager: ChunkManager, comm: Comm) -> None:
    staging = _Staging(manager, checksum=comm.size > 1)
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
    buffers = {id(b): (m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None and b.is_meta}
    real_buffers: dict[int, torch.Tensor] = {}
    written_any: set[int] = set()  # ids of params and buffers written (to skip subtrees an ancestor initialised)

    passes = [0]  # which initialiser pass runs (a Hugging Face model has one per PreTrainedModel)
    written_in: dict[int, int] = {}  # param id -> the pass that wrote it

    def real(t: torch.Tensor) -> torch.Tensor | None:
        if written_in.get(id(t), passes[0]) < passes[0]:
            # Tied at construction on meta, but a separate tensor when Hugging Face's later pass wrote it in normal
            # construction (tying came after, and kept the first): the numbers are drawn, then dropped.
            return _scratch(t)
        hit = where.get(id(t))
        if hit is not None:
            zc, info = hit
            if zc.spec.index in loaded:
                return _scratch(t)  # its shape can be read; a write is an error (on_write)
            return staging.whole_view(info) if info.tiled else staging.view(zc, info)
        if id(t) in buffers:
            if id(t) not in real_buffers:
                real_buffers[id(t)] = torch.zeros(t.shape, dtype=t.dtype)
            return real_buffers[id(t)]
        return None

    def on_write(key: int) -> None:
        if key not in where and key not in buffers:
            return  # a temporary, or a view: its id means nothing once it is gone
        written_any.add(key)
        if written_in.setdefault(key, passes[0]) < passes[0]:
            return  # goes to scratch (see real)
        hit = where.get(key)
        if hit is None:
            return
        zc, info = hit
        if zc.spec.index in loaded:
            raise WeightsError(
                f"the model's initialiser wrote parameter {info.name!r} after hetero had loaded its chunk: "
                "initialise each parameter in one place (its module's reset_parameters), or build the model normally"
            )
        for zc_, _ in tiles.get(key, [(zc, info)]):
            unwritten[zc_.spec.index].discard(key)
        # Another chunk's parameter is being written: chunks whose parameters are all written are complete.
        for index in [i for i in staging.open if i != zc.spec.index and not unwritten[i]]:
            sums[index] = staging.load(by_index[index])
            loaded.add(index)
        for other in [k for k in staging.whole if k != key]:
            complete_tiles(other)

    def complete_tiles(key: int) -> None:
        for index, total in staging.load_tiles(tiles[key]):
            sums[index] = total
            loaded.add(index)

    try:
        _run_initialiser(model, real, on_write, written_any, passes)
        for key in list(staging.whole):
            complete_tiles(key)
        for index in list(staging.open):
            if not unwritten[index]:
                sums[index] = staging.load(by_index[index])
                loaded.add(index)
    finally:
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
        module._buffers[name] = value
    _check_same_everywhere(sums, comm)


def _run_initialiser(
    model: nn.Module, real: Callable, on_write: Callable, written: set[int], passes: list[int]
) -> None:
    if _is_hf(model):
        _replay_hf(model, real, on_write, passes)
        return
    with _StandIn(real, on_write), torch.no_grad():
        _reset_walk(model, written)


def _replay_hf(module: nn.Module, real: Callable, on_write: Callable, passes: list[int]) -> None:
    """The initialisation order of a Hugging Face model's normal construction: each layer runs torch's default init
    as it is built, and each PreTrainedModel (a causal LM wraps a base model: two) runs post_init's _init_weights
    walk at the end of its own construction, over the modules not yet initialised. The default inits are
    overwritten, so they only need to advance the random generator: they run on scratch tensors."""
    if _is_hf(module):
        for child in module.children():
            _replay_hf(child, real, on_write, passes)
        passes[0] += 1
        with _StandIn(real, on_write), torch.no_grad():
            module.init_weights()  # what post_init runs: _init_weights per module, then tying
        return
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        with _StandIn(_scratch, lambda key: None), torch.no_grad():
            reset()
    for child in module.children():
        _replay_hf(child, real, on_write, passes)


def _is_hf(model: nn.Module) -> bool:
    return callable(getattr(model, "_init_weights", None)) and callable(getattr(model, "init_weights", None))


def _scratch(t: torch.Tensor) -> torch.Tensor | None:
    return torch.empty(t.shape, dtype=t.dtype) if t.is_meta or isinstance(t, nn.Parameter) else None


def _reset_walk(model: nn.Module, written: set[int]) -> None:
    """reset_parameters() of every module in module order, skipping subtrees an ancestor's call initialised."""

    def visit(module: nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        for child in module.children():
            own = list(_tensors(child))
            if own and all(id(t) in written for t in own):
                continue  # an ancestor's reset_parameters covered this subtree (hetero's GPT does)
            visit(child)

    visit(model)


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


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


# ---- streaming safetensors ------------------------------------------------------------------------------------
def weight_files(path: Path) -> list[Path]:
    """The .safetensors files of a file, a directory, or a Hugging Face `*.safetensors.index.json`."""
    if path.is_dir():
        index = sorted(path.glob("*.safetensors.index.json"))
        if index:
            path = index[0]
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise WeightsError(f"weights: no .safetensors files in directory {str(path)!r}")
            return files
    if not path.is_file():
        raise WeightsError(f"weights: {str(path)!r} does not exist")
    if path.name.endswith(".index.json"):
        shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        return [path.parent / s for s in shards]
    if path.suffix != ".safetensors":
        raise WeightsError(f"weights: expected a .safetensors file, a directory or an index.json, got {str(path)!r}")
    return [path]


def _safe_open() -> Callable[..., Any]:
    try:
        from safetensors import safe_open
    except ImportError:
        raise WeightsError(
            "weights=: reading .safetensors files needs the safetensors package: pip install 'hetero[hf]'"
        ) from None
    return safe_open


def _stream_weights(model: nn.Module, chunks: list[ZeroChunk], manager: ChunkManager, path: Path) -> None:
    safe_open = _safe_open()
    files = weight_files(path)
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in files]
        source = {k: h for h in handles for k in h.keys()}  # noqa: SIM118 (safe_open has keys(), not iteration)
        state = model.state_dict(keep_vars=True)
        names_of: dict[int, list[str]] = {}
        for name, t in state.items():
            names_of.setdefault(id(t), []).append(name)
        unexpected = sorted(k for k in source if k not in state)
        missing, shapes = [], []
        chosen: dict[int, str] = {}  # tensor id -> the name to read it from
        for key, names in names_of.items():
            found = [n for n in names if n in source]
            if not found:
                missing.append(names[0])
                continue
            chosen[key] = found[0]
            expect = tuple(state[found[0]].shape)
            got = tuple(source[found[0]].get_slice(found[0]).get_shape())
            if got != expect:
                shapes.append(f"{found[0]}: file {got}, model {expect}")
        if missing or unexpected or shapes:
            parts = []
            if missing:
                parts.append(f"missing from the files: {missing[:10]}")
            if unexpected:
                parts.append(f"not in the model: {unexpected[:10]}")
            if shapes:
                parts.append(f"shape mismatches: {shapes[:10]}")
            raise WeightsError(
                f"weights {str(path)!r} do not match the model's state_dict keys; "
                + "; ".join(parts)
                + ". Build the model from the same config the weights were saved with"
            )

        def read(t: torch.Tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
            name = chosen[id(t)]
            if rows is not None:  # a tile's rows only ([Note: initialising tiles])
                return source[name].get_slice(name)[rows[0] : rows[1]]
            return source[name].get_tensor(name)

        # Buffers first, while parameters still have no memory: an initialiser run for non-persistent buffers
        # (rotary tables) then writes nothing that matters.
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None and id(b) in chosen:
                    module._buffers[name] = read(b).to(b.dtype)
        _initialise_buffers(model)
        staging = _Staging(manager)
        try:
            for zc in chunks:
                for info in zc.spec.params:
                    staging.view(zc, info).copy_(read(info.param, info.rows if info.tiled else None))
                staging.load(zc)
        finally:
            staging.close()


def _initialise_buffers(model: nn.Module) -> None:
    """Run the own initialiser of each module that still has meta buffers (non-persistent ones: not in files)."""
    hf_init = getattr(model, "_init_weights", None)
    for module in model.modules():
        metas = {id(b): (n, b) for n, b in module._buffers.items() if b is not None and b.is_meta}
        if not metas:
            continue
        real: dict[int, torch.Tensor] = {}

        def stand_in(t: torch.Tensor, metas: dict = metas, real: dict = real) -> torch.Tensor | None:
            if id(t) not in metas:
                return None
            return real.setdefault(id(t), torch.zeros(t.shape, dtype=t.dtype))

        with _StandIn(stand_in, lambda key: None), torch.no_grad():
            if callable(hf_init):
                hf_init(module)
            elif callable(getattr(module, "reset_parameters", None)) and not list(module.parameters()):
                module.reset_parameters()
        for key, value in real.items():
            module._buffers[metas[key][0]] = value
