"""`engine.save_checkpoint`: every rank streams its own shard to disk in parallel; rank 0 commits the checkpoint.

[Note: an atomic save]
1. Before a byte is written, rank 0 checks that the root is a writable directory, that the tag is new, and that
   the file system has room for every rank's planned bytes; the outcome is broadcast, so every rank raises the same
   error and nothing already saved is touched.
2. Rank 0 makes ROOT/.tmp-<tag>-<nonce>/; each rank writes rank-<global rank>.safetensors into it chunk by chunk
   (written on I/O threads while the next chunk is brought to the host; a chunk on NVMe is read back and returned
   there) and fsyncs it.
3. The ranks' sizes and checksums are gathered on rank 0, which writes state.pt and manifest.json, fsyncs them and
   the directory, renames the directory to ROOT/<tag>, fsyncs the root, and only then replaces ROOT/latest
   atomically (temporary file, fsync, rename, fsync).
A process killed at any point leaves ROOT/latest naming the previous complete checkpoint: before the rename the new
one exists only as a .tmp-* directory, which no reader opens; after it, `latest` is either old or new, both complete.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import random
import secrets
import shutil
import time
from typing import TYPE_CHECKING, Any

import torch

from hetero.checkpoint import manifest as mf
from hetero.checkpoint import model_parallel as par
from hetero.checkpoint.format import DIRECT_ALIGN, TensorWriter
from hetero.errors import CheckpointError
from hetero.memory import Tier

if TYPE_CHECKING:
    from hetero.engine import Engine

log = logging.getLogger("hetero.checkpoint")
_PAUSE_ENV = "HETERO_CHECKPOINT_TEST_PAUSE"  # "<point>:<marker path>": tests pause a save there to kill it
_SPACE_MARGIN = 1.02  # planned bytes times this (plus the manifest's estimate) must be free


def save_checkpoint(
    engine: Engine,
    path: str | os.PathLike,
    client_state: Any = None,
    *,
    lr_scheduler: Any = None,
    tag: str | None = None,
) -> str:
    """Save everything a bit-exact resume needs under the root directory `path`; returns the checkpoint's directory."""
    comm = par.world(engine)  # every rank of the job; engine.comm is the data-parallel group
    root = os.path.abspath(os.fspath(path))
    tag = tag if tag is not None else default_tag(engine)
    _check_tag(tag)
    plan = _plan(engine)
    writer_size = _file_size(plan)
    sizes = comm.all_gather_object(writer_size)
    # 1. checks, then the temporary directory, decided on rank 0 for everyone
    outcome: tuple[str, str] = ("", "")
    if comm.rank == 0:
        try:
            state_bytes = _small_state(engine, client_state, lr_scheduler)
            need = sum(sizes) + len(state_bytes) + _extra_estimate(engine, plan, comm.size)
            outcome = ("ok", _prepare(root, tag, need))
        except Exception as e:  # any failure here is every rank's error: none may wait on rank 0
            outcome = ("error", str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")
    status, value = comm.broadcast_object(outcome, src=0)
    if status != "ok":
        raise CheckpointError(value)
    tmp = value
    # 2. every rank writes its shard
    fname = mf.rank_file(comm.global_rank(comm.rank))
    try:
        os.makedirs(tmp, exist_ok=True)  # present already on a shared file system
        info = _write_rank(engine, os.path.join(tmp, fname), plan)
        info.update(_rank_info(engine, fname))
        _test_pause("shard-written")
    except Exception as e:  # reported to every rank below, so none waits for a rank that failed
        info = {"error": f"rank {comm.rank} could not write {os.path.join(tmp, fname)}: {type(e).__name__}: {e}"}
    infos = comm.all_gather_object(info)
    errors = [i["error"] for i in infos if "error" in i]
    # 3. rank 0 commits
    outcome = ("ok", "")
    if comm.rank == 0:
        try:
            if errors:
                raise CheckpointError("; ".join(errors) + ". Nothing was committed: the previous checkpoint stands")
            _commit(engine, root, tag, tmp, infos, state_bytes)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = ("error", str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")
    status, value = comm.broadcast_object(outcome, src=0)
    if status != "ok":
        raise CheckpointError(f"saving checkpoint {tag!r} under {root} failed: {value}")
    return os.path.join(root, tag)


def default_tag(engine: Engine) -> str:
    tag = f"step-{engine.global_steps:08d}"
    if engine.micro_steps % engine.config.grad_accumulation_steps:
        tag += f"-micro-{engine.micro_steps:08d}"  # saved in the middle of gradient accumulation
    return tag


def _check_tag(tag: str) -> None:
    bad = not tag or tag.startswith(".") or tag == mf.LATEST or os.sep in tag or (os.altsep and os.altsep in tag)
    if bad:
        raise CheckpointError(f"tag {tag!r}: must be a plain directory name, not starting with '.', not {mf.LATEST!r}")


# ---- what a rank writes ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Item:
    key: str
    dtype: torch.dtype
    numel: int
    chunk: Any  # the manager chunk to read it from, or None (the tensor is given)
    slot: int | None = 0  # which slot of the chunk; None: the whole payload (a full parameter chunk)
    offset: int = 0  # first element within that slot's view (or the payload)
    tensor: torch.Tensor | None = None


def _owned(zc: Any, rank: int) -> tuple[int, int]:
    """The element range [lo, hi) of a chunk this rank saves: its shard, even at stage 0 (where every rank holds the
    whole chunk, the ranks split the writing between them)."""
    s = zc.shard_numel
    return rank * s, (rank + 1) * s


def _plan(engine: Engine) -> list[_Item]:
    rank, stage = engine.comm.rank, engine.stage
    replicas = par.saves_replicated(engine)  # see [Note: parallel layouts in a checkpoint]
    pending = engine.micro_steps % engine.config.grad_accumulation_steps != 0
    items: list[_Item] = []
    for zc in engine.chunks:
        lo, hi = _owned(zc, rank)
        if zc.optim is not None:
            base = 0 if stage == 0 else lo  # the optim buffer holds the whole chunk at stage 0, the shard otherwise
            kinds = ["master"] + [f"state.{n}" for n in engine.algorithm.state_names]
            # In the optim buffer's own order (master, then each state), which a load of the same layout reads
            # back in the same order: sequential on both sides.
            for j, kind in enumerate(kinds):
                for info, a, b in zc.spec.overlaps(lo, hi):
                    if par.saves(info, replicas):
                        k = mf.key(kind, par.stored_name(info), info.element(a))
                        items.append(_Item(k, torch.float32, b - a, zc.optim, j, a - base))
        else:
            src, slot, base = (zc.shard, 0, lo) if stage == 3 else (zc.full, None, 0)
            for info, a, b in zc.spec.overlaps(lo, hi):
                if par.saves(info, replicas):
                    k = mf.key("frozen", par.stored_name(info), info.element(a))
                    items.append(_Item(k, zc.dtype, b - a, src, slot, a - base))
        if pending and zc.grad is not None:
            # The gradient accumulated so far: rank-local and unreduced at stages 0-1 (the whole chunk), this rank's
            # reduced shard at stages 2-3. Read back only by the same rank of the same layout. A chunk that holds no
            # data yet (stages 2-3 before their first reduce-scatter) is given its zeros first.
            zc.grad_buffer()
            glo, ghi = (lo, hi) if stage >= 2 else (0, zc.spec.capacity)
            for info, a, b in zc.spec.overlaps(glo, ghi):
                k = mf.key("grad", par.stored_name(info), info.element(a))
                items.append(_Item(k, torch.float32, b - a, zc.grad, 0, a - glo))
    if rank == 0 and replicas:
        for name, t in _buffers(engine).items():
            items.append(_Item(mf.key("buffer", name), t.dtype, t.numel(), None, tensor=t.detach()))
    items.append(_Item(mf.key("rng", "torch_cpu"), torch.uint8, 0, None, tensor=torch.get_rng_state()))
    cuda = engine.device.rng_state()
    if cuda is not None:
        items.append(_Item(mf.key("rng", "cuda"), torch.uint8, 0, None, tensor=cuda.cpu()))
    for it in items:
        if it.tensor is not None:
            it.numel = it.tensor.numel()
    return items


def _buffers(engine: Engine) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by state_dict key (one entry per buffer object)."""
    params = {id(p) for p in engine.module.parameters()}
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in params or id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t
    return out


def _file_size(plan: list[_Item]) -> int:
    # The header is a few dozen bytes per tensor: estimate it generously; padding is under DIRECT_ALIGN per tensor.
    return sum(it.numel * it.dtype.itemsize + 160 + len(it.key) + DIRECT_ALIGN for it in plan) + DIRECT_ALIGN


def _residue(it: _Item) -> int | None:
    """Where the tensor's first byte sits in its chunk's buffer, modulo DIRECT_ALIGN: the file places it at the same
    residue, so that a load into the same layout (page-aligned chunk buffers) can read it with O_DIRECT in place
    ([Note: direct reads] in format.py)."""
    if it.chunk is None:
        return None
    first = (it.chunk.slots[it.slot].offset if it.slot is not None else 0) + it.offset
    return first * it.chunk.dtype.itemsize % DIRECT_ALIGN


def _write_rank(engine: Engine, path: str, plan: list[_Item]) -> dict[str, Any]:
    """Stream this rank's tensors, a chunk at a time; returns the file's entry for the manifest.

    A chunk's run is written on the writer's I/O threads while the next chunk is made resident (read back from NVMe,
    copied off the device), so the disk and the chunk moves overlap ([Note: overlapped writes] in format.py). A chunk
    stays pinned, and so unchanged, until its run is written; at most two are held on the host at once, and only
    one when the host has no room for a second."""
    m = engine.manager
    in_flight: list[tuple[Any, bool, Any]] = []  # (chunk or None, read back from NVMe, future), in submission order

    def retire() -> None:
        chunk, was_nvme, future = in_flight.pop(0)
        try:
            future.result()
        finally:
            if chunk is not None:
                m.unpin(chunk)
        if was_nvme:
            m.move(chunk, Tier.NVME)  # back home; clean, so no write

    with TensorWriter(path, [(it.key, it.dtype, (it.numel,), _residue(it)) for it in plan], align=DIRECT_ALIGN) as w:
        try:
            i = 0
            while i < len(plan):
                chunk = plan[i].chunk
                if chunk is None:
                    in_flight.append((None, False, w.submit([(plan[i].key, plan[i].tensor.reshape(-1))])))
                    i += 1
                    continue
                j = i
                while j < len(plan) and plan[j].chunk is chunk:
                    j += 1
                was_nvme = chunk.tier is Tier.NVME or (chunk.move is not None and chunk.move.dst is Tier.NVME)
                tier = chunk.tier if chunk.tier in (Tier.DEVICE, Tier.HOST) and not was_nvme else Tier.HOST
                if was_nvme and m.ledgers[Tier.HOST].free < chunk.nbytes:
                    while in_flight:  # no room for a second chunk on the host: let the ones written go first
                        retire()
                m.access(chunk, tier, write=False)  # only read: a clean swap copy stays valid
                m.pin(chunk)
                try:
                    run = []
                    for it in plan[i:j]:
                        view = chunk.payload if it.slot is None else chunk.view(chunk.slots[it.slot])
                        run.append((it.key, view.narrow(0, it.offset, it.numel)))
                    future = w.submit(run)
                except BaseException:
                    m.unpin(chunk)
                    raise
                in_flight.append((chunk, was_nvme, future))
                while len(in_flight) > 2:
                    retire()
                i = j
            while in_flight:
                retire()
        finally:
            for chunk, _, future in in_flight:  # after an error: wait for the threads before letting go of memory
                future.exception()
                if chunk is not None:
                    m.unpin(chunk)
    return {
        "file": os.path.basename(path),
        "size": w.size,
        "header_crc32": w.header_crc,
        "tensors": {it.key: [it.numel, w.crcs[it.key]] for it in plan},
    }


def _rank_info(engine: Engine, fname: str) -> dict[str, Any]:
    """This rank's small state: its place in the layout, RNG states, and mid-accumulation bookkeeping."""
    import numpy as np

    py = random.getstate()
    npst = np.random.get_state(legacy=True)
    states = [zc.state_dict() for zc in engine.chunks]
    used = [info.name for zc, st in zip(engine.chunks, states) for info, u in zip(zc.spec.params, st["used"]) if u]
    return {
        "global_rank": par.world(engine).global_rank(par.world(engine).rank),
        "data_parallel_rank": engine.comm.rank,
        "coordinates": par.coordinates(engine),
        "rng": {
            "python": [py[0], list(py[1]), py[2]],
            "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
        },
        "used": used,
        "grad_fresh": [st["grad_is_zero"] for st in states],
        # This rank's part of the model and its step counts, merged on rank 0 (each stage knows only its own).
        "model": _model_table(engine),
        "param_steps": {
            par.stored_name(info): n
            for zc, st in zip(engine.chunks, states)
            for info, n in zip(zc.spec.params, st["param_steps"])
        },
    }


# ---- rank 0: checks and commit -----------------------------------------------------------------------------------
def _extra_estimate(engine: Engine, plan: list[_Item], world: int) -> int:
    return (1 << 20) + 200 * len(plan) * world  # manifest and state.pt


def _prepare(root: str, tag: str, nbytes: int) -> str:
    """Check the root and the free space, then make the temporary directory; returns its path."""
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the checkpoint directory {root}: {e.strerror or e}") from None
    if not os.path.isdir(root) or not os.access(root, os.W_OK | os.X_OK):
        raise CheckpointError(f"{root} is not a writable directory: choose another path or fix its permissions")
    final = os.path.join(root, tag)
    if os.path.exists(final):
        if _latest(root) == tag:
            raise CheckpointError(f"{final} exists already and is the latest: pass another tag, or remove it first")
        # A checkpoint `latest` never moved to (a save killed between its rename and the pointer's move, or a run
        # that went back to an earlier checkpoint): set aside now, deleted once the new one is committed.
        stale = os.path.join(root, f".stale-{tag}-{secrets.token_hex(4)}")
        os.rename(final, stale)
        log.warning("%s was not the latest checkpoint: replaced by this save", final)
    free = shutil.disk_usage(root).free
    need = int(nbytes * _SPACE_MARGIN)
    if free < need:
        raise CheckpointError(
            f"not enough disk space under {root} for the checkpoint: it needs about {need / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB are free. Free space, delete old checkpoints, or save elsewhere. Nothing was "
            "written"
        )
    tmp = os.path.join(root, f".tmp-{tag}-{secrets.token_hex(4)}")
    try:
        os.makedirs(tmp)
    except OSError as e:
        raise CheckpointError(f"cannot write under {root}: {e.strerror or e}") from None
    return tmp


def _small_state(engine: Engine, client_state: Any, lr_scheduler: Any) -> bytes:
    """state.pt's bytes: param groups, client_state, LR scheduler. Checked to load back with weights_only=True now,
    before anything is written, since a checkpoint that cannot be loaded safely is worth nothing."""
    extra = {
        "param_groups": engine.optimizer.hyperparameters(),
        "client_state": client_state,
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
    }
    buf = io.BytesIO()
    try:
        torch.save(extra, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"client_state or the LR scheduler's state holds objects that a safe load (weights_only=True) cannot "
            f"read back ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Keep to tensors, numbers, "
            "strings, lists, tuples and dicts. Nothing was written"
        ) from None
    return buf.getvalue()


def _commit(engine: Engine, root: str, tag: str, tmp: str, infos: list[dict[str, Any]], data: bytes) -> None:
    files: dict[str, Any] = {}
    for info in infos:
        files[info["file"]] = {k: info[k] for k in ("size", "header_crc32", "tensors")}
    files[mf.STATE_FILE] = {"size": len(data), "crc32": mf.write_durable(os.path.join(tmp, mf.STATE_FILE), data)}
    manifest = {
        "format": mf.FORMAT,
        "version": mf.VERSION,
        "tag": tag,
        "created": time.time(),
        "engine": _engine_state(engine, infos),
        "layout": _layout(engine),
        "model": par.merge_tables([i["model"] for i in infos]),
        "ranks": [{k: v for k, v in i.items() if k not in _NOT_PER_RANK} for i in infos],
        "files": files,
    }
    mf.write_durable(os.path.join(tmp, mf.MANIFEST), mf.dumps(manifest))
    mf.fsync_dir(tmp)
    final = os.path.join(root, tag)
    os.rename(tmp, final)
    mf.fsync_dir(root)
    _test_pause("before-latest")
    mf.replace_atomic(os.path.join(root, mf.LATEST), (tag + "\n").encode())
    for name in os.listdir(root):
        if name.startswith(f".stale-{tag}-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _latest(root: str) -> str | None:
    try:
        with open(os.path.join(root, mf.LATEST)) as f:
            return f.read().strip()
    except OSError:
        return None


_NOT_PER_RANK = ("size", "header_crc32", "tensors", "model", "param_steps")  # in the manifest's files and model


def _engine_state(engine: Engine, infos: list[dict[str, Any]]) -> dict[str, Any]:
    steps = {k: v for i in infos for k, v in i["param_steps"].items()}
    return {
        **engine.state_dict(),  # micro_steps, global_steps, skipped_steps, last_grad_norm, scaler
        "grad_accumulation_steps": engine.config.grad_accumulation_steps,
        "pending_grads": engine.micro_steps % engine.config.grad_accumulation_steps != 0,
        "param_steps": steps,
        "config": engine.config.to_dict(),
    }


def _layout(engine: Engine) -> dict[str, Any]:
    mesh = getattr(engine, "mesh", None)
    return {
        "world_size": engine.comm.size,  # the data-parallel degree (what ZeRO shards over)
        "global_ranks": engine.comm.global_ranks,
        "zero_stage": engine.stage,
        "precision": engine.config.precision,
        "compute_dtype": str(engine.dtype).removeprefix("torch."),
        "offload": {"params": engine.config.offload.params, "optimizer": engine.config.offload.optimizer},
        "algorithm": engine.algorithm.name,
        "state_names": list(engine.algorithm.state_names),
        "tensor_parallel": mesh.tp_size if mesh is not None else 1,
        "pipeline_parallel": mesh.pp_size if mesh is not None else 1,
        "tensor_mode": par.tensor_mode(engine),
        "chunks": [zc.spec.capacity for zc in engine.chunks],
        "ranks": par.world(engine).size,  # every rank of the job: one file each
    }


def _model_table(engine: Engine) -> dict[str, Any]:
    """This rank's part of the model: names (as stored), shapes and roles of every tensor, and the model's
    state_dict keys (tied parameters under each name); a tensor-parallel shard's cut under "tp"."""
    params = {}
    canonical: dict[int, str] = {}
    cuts: dict[str, Any] = {}
    stage = par.coordinates(engine)["pp"]
    for zc in engine.chunks:
        for info in zc.spec.params:
            canonical[id(info.param)] = info.name
            cut = par.tp_cut(info.param)
            params[par.stored_name(info)] = {
                "shape": list(info.param.shape),  # a shard's own shape under tensor parallelism (a tile's: the whole)
                "trainable": zc.spec.trainable,
                "group": zc.spec.group,
                "dtype": str(zc.dtype).removeprefix("torch."),
                "stage": stage,
                "tp_rank": cut.stored_rank if cut is not None else None,
            }
            if cut is not None and hasattr(cut, "to_dict"):  # a grid block: every rank's block indices
                cuts[info.name] = cut.to_dict()
            elif cut is not None:
                cuts[info.name] = {
                    "dim": cut.dim,
                    "parts": cut.parts,
                    "degree": cut.degree,
                    "full_shape": list(cut.full_shape),
                }
    buffers = {
        n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for n, t in _buffers(engine).items()
    }
    by_id = {id(t): n for n, t in _buffers(engine).items()}
    keys = []
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in canonical:
            keys.append([name, "tp_param" if canonical[id(t)] in cuts else "param", canonical[id(t)]])
        elif id(t) in by_id:
            keys.append([name, "buffer", by_id[id(t)]])
        else:  # an empty parameter (no elements: in no chunk)
            keys.append([name, "empty", list(t.shape), str(t.dtype).removeprefix("torch.")])
    return {
        "params": params,
        "buffers": buffers,
        "state_dict": keys,
        "tp": cuts,
        "hf_config": _hf_config(engine.module),
    }


def _hf_config(model: torch.nn.Module) -> dict[str, Any] | None:
    """A Hugging Face model's config, so that a consolidated export loads with `from_pretrained`."""
    cfg = getattr(model, "config", None)
    if cfg is None or not (hasattr(cfg, "to_dict") and hasattr(cfg, "to_json_string")):
        return None
    try:
        return mf.loads(mf.dumps(cfg.to_dict()))
    except (TypeError, ValueError):
        return None


def _test_pause(point: str) -> None:
    """Test hook: with HETERO_CHECKPOINT_TEST_PAUSE="<point>:<marker>", create the marker and wait here to be
    killed. Never set outside tests."""
    spec = os.environ.get(_PAUSE_ENV)
    if not spec:
        return
    where, _, marker = spec.partition(":")
    if where != point:
        return
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)
