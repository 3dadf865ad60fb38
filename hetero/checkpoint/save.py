"""`engine.save_checkpoint`: every rank streams its own shard to disk in parallel; rank 0 commits the checkpoint.

[Note: an atomic save]
1. Before a byte is written, rank 0 checks that the root is a writable directory, that the tag is new (or that
   replace=True allows replacing the latest checkpoint), and that the file system has room for every rank's
   planned bytes; the outcome is broadcast, so every rank raises the same error and nothing already saved is
   touched. Rank 0 makes ROOT/.tmp-<tag>-<nonce>/, and every rank reserves the bytes of its own part there
   ([Note: each rank's room] in space.py); all ranks agree on the outcome.
2. Each rank writes rank-<global rank>.safetensors into it chunk by chunk
   (written on I/O threads while the next chunk is brought to the host; a chunk on NVMe is read back and returned
   there) and fsyncs it.
3. The ranks' sizes and checksums are gathered on rank 0, which writes state.pt and manifest.json, fsyncs them and
   the directory, renames the directory to ROOT/<tag>, fsyncs the root, and only then replaces ROOT/latest
   atomically (temporary file, fsync, rename, fsync).
A process killed at any point leaves ROOT/latest naming the previous complete checkpoint: before the rename the new
one exists only as a .tmp-* directory, which no reader opens; after it, `latest` is either old or new, both complete.
A checkpoint already under the tag (replace=True, or one `latest` never moved to) stays in place until the new one
is complete: it is renamed to ROOT/.stale-<tag>-<nonce>/ just before the new one takes its name, and deleted once
`latest` has moved. A kill between those two renames leaves <tag> missing: readers then take the set-aside one
(`manifest.resolve`), and the next save puts it back (`settle_stale`) before anything else. The next save also
deletes the .tmp-* directories of saves killed midway whose rank 0 is gone, so kills do not fill the disk, and never
a live save's ([Note: staging directories a stopped job left] in staging.py). A commit
that fails (a full disk, a spent quota) undoes itself on every rank: commit.py, [Note: a commit that fails].
"""

from __future__ import annotations

import io
import logging
import os
import secrets
import shutil
from typing import TYPE_CHECKING, Any

import torch

from hetero.checkpoint import blocks, space, staging
from hetero.checkpoint import manifest as mf
from hetero.checkpoint import model_parallel as par
from hetero.checkpoint.agree import SAVE, agree
from hetero.checkpoint.commit import finish, pause_for_test, settle_stale, worded
from hetero.checkpoint.describe import engine_state, layout, rank_info
from hetero.checkpoint.format import DIRECT_ALIGN, TensorWriter
from hetero.checkpoint.plan import Item, chunk_runs, file_size, item_views, plan_items, read_tier, residue
from hetero.comm.patience import Meeting
from hetero.errors import CheckpointError, RankFailedError, RankTimeoutError
from hetero.memory import Tier
from hetero.progress import bar

if TYPE_CHECKING:
    from hetero.engine import Engine

log = logging.getLogger("hetero.checkpoint")
_SPACE_MARGIN = 1.02  # planned bytes times this (plus the manifest's estimate) must be free


def save_checkpoint(
    engine: Engine,
    path: str | os.PathLike,
    client_state: Any = None,
    *,
    lr_scheduler: Any = None,
    tag: str | None = None,
    replace: bool = False,
    async_save: bool = False,
) -> str:
    """Save everything a bit-exact resume needs under the root directory `path`; returns the checkpoint's directory.
    lr_scheduler: default, the one given to `hetero.initialize`. replace: save over the checkpoint of the same tag
    even when it is the latest (refused by default, since it discards that checkpoint); the old one stands until
    the new one is committed ([Note: an atomic save]). async_save: return once this rank's state is copied to host
    memory, the files written while training goes on and committed at a later update boundary or
    `engine.wait_checkpoint()` ([Note: a save written while training goes on] in background.py)."""
    from hetero.checkpoint import background  # it builds on this module's steps

    if engine.pending_save is not None:  # one save at a time: the one still being written is committed first
        engine.pending_save.wait()
    if lr_scheduler is None:
        lr_scheduler = getattr(engine, "lr_scheduler", None)
    comm = par.world(engine)  # every rank of the job; engine.comm is the data-parallel group
    root = os.path.abspath(os.fspath(path))
    tag = tag if tag is not None else default_tag(engine)
    # Every rank's plan, or what stopped it, and its tag: no rank may wait for one that failed here, nor commit
    # under a tag the others do not share (a tag from a clock or a host name differs between ranks).
    error: Exception | None = None
    fits = True  # whether host memory takes an async save's copy: agreed below, as the choice changes collectives
    try:
        _check_tag(tag)
        plan = plan_items(engine)
        writer_size = file_size(plan)
        fits = not async_save or background.host_room(sum(it.numel * it.dtype.itemsize for it in plan))
    except Exception as e:
        error, writer_size = e, -1
    what = f"planning checkpoint {tag!r} under {root}"
    planned = agree(comm, error, what, value=(writer_size, tag, fits), advice=SAVE)
    tags = [t for _, t, _ in planned]
    if any(t != tag for t in tags):
        named = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        raise CheckpointError(f"the ranks name this checkpoint differently ({named}): pass the same tag on every rank")
    sizes = [size for size, _, _ in planned]
    short = [r for r, (_, _, f) in enumerate(planned) if not f]
    if async_save and short:
        log.warning(
            "checkpoint %r is saved synchronously on every rank: rank(s) %s lack the host memory to copy their part "
            "for a save in the background (async_save=True)",
            tag,
            short,
        )
    # 1. checks, then the temporary directory, decided on rank 0 for everyone
    outcome: tuple[str, str] = ("", "")
    state_bytes = b""  # rank 0's state.pt
    part = sizes[comm.rank]  # the bytes this rank writes: its file, and on rank 0 state.pt and the manifest
    if comm.rank == 0:
        try:
            state_bytes = _small_state(engine, client_state, lr_scheduler)
            part += len(state_bytes) + _extra_estimate(engine, plan, comm.size)
            outcome = ("ok", _prepare(root, tag, sum(sizes) - sizes[0] + part, replace))
        except Exception as e:  # any failure here is every rank's error: none may wait on rank 0
            outcome = ("error", str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")
    status, value = comm.broadcast_object(outcome, src=0)
    if status != "ok":
        raise CheckpointError(value)
    tmp = os.path.join(root, os.path.basename(value))  # rank 0's directory, as this rank sees the root
    _check_shared(comm, root, tmp, int(part * _SPACE_MARGIN))
    if async_save and not short:
        return background.start(engine, comm, root, tag, tmp, plan, state_bytes)
    # 2. every rank writes its shard, however long that takes it ([Note: patient meetings] in hetero/comm/patience.py)
    fname = mf.rank_file(comm.global_rank(comm.rank))
    mine = os.path.join(tmp, fname)
    try:
        what = f"writing its part of checkpoint {tag!r} under {root}"
        with Meeting(comm, "checkpoint-write", what, limit_s=engine.config.checkpoint_patience):
            try:
                info = _write_rank(engine, mine, plan)
                info.update(rank_info(engine, fname))
                pause_for_test("shard-written")
            except Exception as e:  # reported to every rank below, so none waits for a rank that failed
                info = {"error": f"rank {comm.rank} could not write {mine}: {worded(e, root)}"}
        infos = comm.all_gather_object(info)
    except BaseException as e:  # a rank dead or hung: nothing is committed
        if comm.rank == 0:
            staging.remove(tmp)
            settle_stale(root, tag)
        note = f" Checkpoint {tag!r} was not committed: the checkpoints under {root} are as they were."
        if isinstance(e, RankTimeoutError):
            raise RankTimeoutError(str(e) + note, missing_ranks=e.missing_ranks, timeout_s=e.timeout_s) from e
        if isinstance(e, RankFailedError):  # a rank killed outright: [Note: a dead peer on this host]
            raise RankFailedError(str(e) + note, failed_rank=e.failed_rank, cause=e.cause) from e
        raise
    return finish(comm, root, tag, tmp, infos, state_bytes, lambda infos: manifest_head(engine, tag, infos))


def _check_shared(comm: Any, root: str, tmp: str, nbytes: int) -> None:
    """[Note: a shared file system]
    Every rank writes its file into the temporary directory rank 0 made, and a load reads every rank's file: across
    nodes the root must be one file system that all of them mount at the same path (NFS, Lustre, GPFS, ...). A rank
    that does not see rank 0's directory is on another file system; every rank stops with the same error before a
    byte is written. The same gather carries each rank's reservation of its `nbytes` ([Note: each rank's room] in
    space.py): one rank short, every rank raises the same error naming it."""
    seen = os.path.isdir(tmp)
    held = space.reserve(tmp, nbytes, rank=comm.global_rank(comm.rank), root=root) if seen else None
    try:
        told = comm.all_gather_object((seen, held.short if held is not None else ""))
    finally:
        space.release(held)  # after the gather: every rank held its part at once
    short = [why for ok, why in told if ok and why]
    if all(ok for ok, _ in told) and not short:
        return
    if comm.rank == 0:
        staging.remove(tmp)
    blind = [r for r, (ok, _) in enumerate(told) if not ok]
    if not blind:
        raise CheckpointError(
            f"{'; '.join(short)}. Nothing was written: the checkpoints under {root} are as they were, and training "
            "can go on"
        )
    raise CheckpointError(
        f"{root} is not one shared directory: ranks {blind} do not see the directory rank 0 made in it "
        f"({os.path.basename(tmp)}). Checkpoints of a job on several nodes need a file system every node mounts at "
        "the same path (NFS, Lustre, GPFS, ...): save under such a path. Nothing was written"
    )


def default_tag(engine: Engine) -> str:
    tag = f"step-{engine.global_steps:08d}"
    if engine.accumulated:
        tag += f"-micro-{engine.micro_steps:08d}"  # saved in the middle of gradient accumulation
    return tag


def _check_tag(tag: str) -> None:
    bad = not tag or tag.startswith(".") or tag == mf.LATEST or os.sep in tag or (os.altsep and os.altsep in tag)
    if bad:
        raise CheckpointError(f"tag {tag!r}: must be a plain directory name, not starting with '.', not {mf.LATEST!r}")


# ---- what a rank writes ------------------------------------------------------------------------------------------
def _write_rank(engine: Engine, path: str, plan: list[Item]) -> dict[str, Any]:
    """Stream this rank's tensors, a chunk at a time; returns the file's entry for the manifest.

    A chunk's run is written on the writer's I/O threads while the next chunk is made resident (read back from NVMe,
    copied off the device), so the disk and the chunk moves overlap ([Note: overlapped writes] in format.py). A chunk
    stays pinned, and so unchanged, until its run is written; at most two are held on the host at once, and only
    one when the host has no room for a second."""
    m = engine.manager
    in_flight: list[tuple[Any, bool, Any]] = []  # (chunk or None, read back from NVMe, future), in submission order
    total = sum(it.numel * it.dtype.itemsize for it in plan)
    shown = bar(
        total, "hetero: saving checkpoint", unit="B", rank=par.world(engine).rank, config=engine.config.progress
    )
    sizes: dict[int, int] = {}  # chunk id -> bytes of its run, for the bar
    for it in plan:
        sizes[id(it.chunk)] = sizes.get(id(it.chunk), 0) + it.numel * it.dtype.itemsize

    def retire() -> None:
        chunk, was_nvme, future = in_flight.pop(0)
        try:
            future.result()
        finally:
            if chunk is not None:
                m.unpin(chunk)
        shown.update(sizes.get(id(chunk), 0) if chunk is not None else 0)
        if was_nvme:
            m.move(chunk, Tier.NVME)  # back home; clean, so no write

    with open_writer(path, planned_of(plan)) as w:  # block checksums: [Note: block checksums] in blocks.py
        try:
            for chunk, items in chunk_runs(plan):
                if chunk is None:
                    in_flight.append((None, False, w.submit([(items[0].key, items[0].tensor.reshape(-1))])))
                    continue
                tier, was_nvme = read_tier(chunk)
                if was_nvme and m.ledgers[Tier.HOST].free < chunk.nbytes:
                    while in_flight:  # no room for a second chunk on the host: let the ones written go first
                        retire()
                m.access(chunk, tier, write=False)  # only read: a clean swap copy stays valid
                m.pin(chunk)
                try:
                    future = w.submit(item_views(chunk, items))
                except BaseException:
                    m.unpin(chunk)
                    raise
                in_flight.append((chunk, was_nvme, future))
                while len(in_flight) > 2:
                    retire()
            while in_flight:
                retire()
        finally:
            shown.close()
            for chunk, _, future in in_flight:  # after an error: wait for the threads before letting go of memory
                future.exception()
                if chunk is not None:
                    m.unpin(chunk)
    return file_entry(w, [(it.key, it.numel) for it in plan])


def planned_of(plan: list[Item]) -> list[tuple]:
    """The writer's plan: each tensor's key, dtype, shape and residue ([Note: aligned layout] in format.py)."""
    return [(it.key, it.dtype, (it.numel,), residue(it)) for it in plan]


def open_writer(path: str, planned: list[tuple]) -> TensorWriter:
    return TensorWriter(path, planned, align=DIRECT_ALIGN, block_bytes=blocks.BLOCK_BYTES)


def file_entry(w: TensorWriter, numels: list[tuple[str, int]]) -> dict[str, Any]:
    """A written rank file's entry for the manifest: size, checksums (of the header, each tensor, their blocks)."""
    return {
        "file": os.path.basename(w.path),
        "size": w.size,
        "header_crc32": w.header_crc,
        "tensors": {key: [numel, w.crcs[key]] for key, numel in numels},
        **blocks.file_entry(w.block_bytes, {k: v for k, v in w.blocks.items() if v is not None}),
    }


def _extra_estimate(engine: Engine, plan: list[Item], world: int) -> int:
    return (1 << 20) + 200 * len(plan) * world  # manifest and state.pt


def _prepare(root: str, tag: str, nbytes: int, replace: bool) -> str:
    """Check the root and the free space, then make the temporary directory; returns its path."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(
            f"{root} is a file, not a directory: save_checkpoint's path is a checkpoint root, the directory that "
            "holds one subdirectory per checkpoint and the `latest` file. Pass the path of a directory (made if "
            "missing), or move the file away. Nothing was written"
        )
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        above = os.path.dirname(root)
        while not os.path.exists(above) and above != os.path.dirname(above):
            above = os.path.dirname(above)
        why = f"{above} is a file, not a directory" if os.path.isfile(above) else (e.strerror or str(e))
        raise CheckpointError(f"cannot create the checkpoint directory {root}: {why}") from None
    if not os.path.isdir(root) or not os.access(root, os.W_OK | os.X_OK):
        raise CheckpointError(f"{root} is not a writable directory: choose another path or fix its permissions")
    settle_stale(root)  # what a save killed between its renames left: before the tag is looked at
    staging.sweep(root)  # what saves stopped midway left, their rank 0 gone
    final = os.path.join(root, tag)
    if os.path.exists(final) and mf.latest_tag(root) == tag and not replace:
        raise CheckpointError(
            f"{final} exists already and is the latest: pass another tag, or replace=True to save over it (it stays "
            "until the new one is complete), or remove it first"
        )
    free = shutil.disk_usage(root).free
    need = int(nbytes * _SPACE_MARGIN)
    if free < need:
        raise CheckpointError(
            f"not enough disk space under {root} for the checkpoint: it needs about {need / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB are free. Free space, delete old checkpoints, or save elsewhere. Nothing was "
            "written"
        )
    if os.path.exists(final) and not replace:
        # A checkpoint `latest` never moved to (a save killed between its rename and the pointer's move, or a run
        # that went back to an earlier checkpoint): replaced, at the commit.
        log.warning("%s was not the latest checkpoint: replaced by this save", final)
    tmp = os.path.join(root, f"{mf.UNFINISHED}{tag}-{secrets.token_hex(4)}")
    try:
        staging.claim(tmp)  # before the directory: [Note: staging directories a stopped job left]
        os.makedirs(tmp)
    except OSError as e:
        staging.remove(tmp)
        raise CheckpointError(
            f"cannot write under {root} (the checkpoint needs about {need / 2**20:.1f} MiB): {worded(e, root)}. "
            "Nothing was written"
        ) from None
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


def manifest_head(engine: Engine, tag: str, infos: list[dict[str, Any]]) -> dict[str, Any]:
    """What the manifest says of the engine and its model, from every rank's `rank_info` (taken with the state
    saved: an async save takes it at the call, [Note: a save written while training goes on])."""
    return {
        "format": mf.FORMAT,
        "version": mf.VERSION,
        "tag": tag,
        "created": 0.0,  # set at the commit
        "engine": engine_state(engine, infos),
        "layout": layout(engine),
        "model": par.merge_tables([i["model"] for i in infos]),
    }
