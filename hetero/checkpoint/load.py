"""`engine.load_checkpoint`: verify, check compatibility, then fill each chunk of this engine from the saved segments.

[Note: resharding for free]
A checkpoint stores tensors by parameter name and element range. Loading walks this engine's own chunks and, for
the element range each rank keeps (the whole chunk at stage 0, its shard otherwise), reads from whichever saved
segments cover it, whatever layout wrote them. So a different data-parallel world size, ZeRO stage, chunk size,
offload placement or precision needs no special path: the fp32 master weights and optimizer states are exact, and
parameters are re-derived from the master as the update's write-back does (cast to the compute dtype, then
all-gathered or kept as a shard by stage). A saved segment that several ranks keep parts of is read whole and checked
by one of them, the others reading only their part ([Note: one rank checks a shared segment] in plan.py); one saved
with block checksums is cut into its blocks first ([Note: block checksums] in blocks.py). Only a
gradient pending in the middle of accumulation is not resharded: it is rank-local (unreduced at stages 0-1), so it
loads only into the same world size and stage.
"""

from __future__ import annotations

import logging
import os
import random
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from hetero.checkpoint import manifest as mf
from hetero.checkpoint import model_parallel as par
from hetero.checkpoint.agree import agree, identity, same_checkpoint
from hetero.checkpoint.describe import check_cut
from hetero.checkpoint.plan import Checkers, model_buffers, read_part
from hetero.checkpoint.read_faults import read_state
from hetero.comm.patience import Meeting
from hetero.errors import CheckpointError
from hetero.memory import TensorState, Tier
from hetero.progress import bar

if TYPE_CHECKING:
    from hetero.engine import Engine

log = logging.getLogger("hetero.checkpoint")
_SHOW = 10  # mismatches listed by name in an error
_AHEAD = 3  # trainable chunks whose reads are queued beside the one being finished (memory permitting)


def load_checkpoint(engine: Engine, path: str | os.PathLike, *, lr_scheduler: Any = None) -> Any:
    """Restore everything `save_checkpoint` saved into this engine; returns the saved client_state.

    path: a checkpoint root (its `latest` is followed) or one checkpoint's directory. If a tensor fails its checksum
    midway, the error says so and the engine's state is partly loaded: load a good checkpoint before training on.
    lr_scheduler: default, the one given to `hetero.initialize` (restored when the checkpoint holds one).
    """
    own_scheduler = lr_scheduler is None
    if own_scheduler:
        lr_scheduler = getattr(engine, "lr_scheduler", None)
    comm = par.world(engine)  # every rank of the job: [Note: a load every rank agrees on] (agree.py)
    try:
        directory, manifest, extra = _open(engine, path, scheduler=None if own_scheduler else lr_scheduler)
        error, which = None, identity(directory, manifest)
    except Exception as e:  # every rank learns of it below, so none waits in a gather for this one
        error, which = e, None
    same_checkpoint(agree(comm, error, f"checking checkpoint {os.fspath(path)!r}", value=which))
    pending = manifest["engine"]["pending_grads"]
    mine = par.find_mine(engine, manifest)
    index: mf.Index | None = None
    error = None
    # Each rank reads its ranges, however long that takes it ([Note: patient meetings] in hetero/comm/patience.py)
    what = f"reading its part of checkpoint {directory!r}"
    with Meeting(comm, "checkpoint-read", what, limit_s=engine.config.checkpoint_patience):
        try:
            index = mf.Index(directory, manifest)
            steps = manifest["engine"]["param_steps"]
            kept = set(manifest["engine"].get("kept_grads", ()))  # older checkpoints: none kept
            keeps = bool(manifest["engine"].get("keeps_zero_grads", False))
            used = set(mine["used"]) if (pending and mine) else set()
            reading: list[tuple[int, Any, list]] = []  # trainable chunks whose reads are in flight, in chunk order
            checkers = Checkers(engine)  # [Note: one rank checks a shared segment] in plan.py

            def finish() -> None:
                shown.update()
                i, zc, futures = reading.pop(0)
                _finish_trainable(engine, zc, futures)
                state: dict[str, Any] = {
                    "param_steps": [steps.get(par.stored_name(info), 0) for info in zc.spec.params],
                    "kept_grads": [int(par.stored_name(info) in kept) for info in zc.spec.params],
                    "keeps_zero_grads": keeps,
                }
                if pending and zc.grad is not None:
                    _fill_grad(engine, zc, index, mine["file"])
                    state["used"] = [1 if p.name in used else 0 for p in zc.spec.params]
                    state["grad_is_zero"] = bool(mine["grad_fresh"][i])
                zc.load_state_dict(state)

            shown = bar(
                len(engine.chunks),
                "hetero: loading checkpoint",
                unit="chunk",
                rank=par.world(engine).rank,
                config=engine.config.progress,
            )
            threads = torch.get_num_threads()
            if engine.device.torch_device.type == "cpu":
                # The parameter copies below run while the I/O threads read and checksum: torch's own worker threads
                # would oversubscribe the cores (a 4 MB copy was measured taking 10 ms instead of 0.4 ms on 2 cores).
                torch.set_num_threads(1)
            parts = ThreadPoolExecutor(1, thread_name_prefix="hetero-ckpt-parts")  # see `_start_trainable`
            try:
                # [Note: chunks ahead]
                # While chunk i is finished (checksums, parameters from its master), the reads of
                # the next _AHEAD chunks are queued, as long as their optimizer buffers fit beside on the compute tier:
                # the reading thread never waits for the main thread.
                for i, zc in enumerate(engine.chunks):
                    if zc.optim is None:
                        while reading:
                            finish()
                        _fill_frozen(engine, zc, index)
                        zc.load_state_dict({"param_steps": [steps.get(par.stored_name(i), 0) for i in zc.spec.params]})
                        shown.update()
                        continue
                    ledger = engine.manager.ledgers[zc.placement.compute]
                    while reading and zc.optim.tier is not zc.placement.compute and ledger.free < 2 * zc.optim.nbytes:
                        finish()  # no room to bring this chunk in beside those being read: let them go first
                    reading.append((i, zc, _start_trainable(engine, zc, index, manifest, checkers, parts)))
                    while len(reading) > _AHEAD:
                        finish()
                while reading:
                    finish()
            finally:
                shown.close()
                torch.set_num_threads(threads)
                for _, zc, futures in reading:  # after an error: no thread may go on writing into a buffer let go
                    for f in futures:
                        f.exception()
                    engine.manager.unpin(zc.optim)
                parts.shutdown()
            _fill_buffers(engine, index)
            if mine is not None:
                _restore_rng(engine, index, mine, mine["file"])
            else:
                log.warning(
                    "%s has no rank %d: its random state is left as it is",
                    directory,
                    engine.comm.rank,
                    extra={"all_ranks": True},
                )
        except Exception as e:  # agreed below: no rank gathers parameters beside one that stopped
            error = e
        finally:
            if index is not None:
                index.close()
    agree(comm, error, f"loading checkpoint {directory!r}")
    for zc in engine.chunks:  # stages 1-2: the other ranks' parts of the parameters, in layout order on every rank
        if zc.optim is not None:
            zc.gather_params()
    engine.load_state_dict(manifest["engine"])
    if engine.algorithm.generic is not None:
        st = manifest["engine"]
        engine.algorithm.generic.load_scalars(engine.chunks, par.stored_name, st.get("optim_scalars", {}))
    engine.optimizer.load_hyperparameters(extra["param_groups"])
    if lr_scheduler is not None:
        if extra["lr_scheduler"] is None:  # the engine's own (checked in `_open`): it starts where it is
            log.warning("%s holds no LR scheduler state: the engine's scheduler starts where it is", directory)
        else:
            lr_scheduler.load_state_dict(extra["lr_scheduler"])
    engine.manager.synchronize()
    return extra["client_state"]


def _open(engine: Engine, path: str | os.PathLike, *, scheduler: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """This rank's checks of the checkpoint `path` names: its directory, manifest and small state (the files all
    there, the model, optimizer and layout fitting this engine), or a CheckpointError. scheduler: an LR scheduler
    the caller passed, which the checkpoint must hold the state of."""
    directory = mf.resolve(path)
    manifest = mf.read_manifest(directory)
    try:
        mf.check_files(directory, manifest)
    except CheckpointError as e:
        if par.world(engine).size > 1 and "missing" in str(e):
            raise CheckpointError(
                f"{e}. Every rank reads every rank's file: a job on several nodes needs the checkpoint on a file "
                "system all of them mount at the same path"
            ) from None
        raise
    extra = read_state(os.path.join(directory, mf.STATE_FILE))  # [Note: a disk error reading a checkpoint]
    _check_compatible(engine, manifest, directory)
    check_cut(engine, manifest, directory)  # before the chunk sizes: a cut of its own names what to set
    groups = len(engine.optimizer.param_groups)
    if len(extra["param_groups"]) != groups:
        raise CheckpointError(
            f"{directory}: the optimizer had {len(extra['param_groups'])} param groups, this one has {groups}: build "
            "the optimizer with the same groups"
        )
    if scheduler is not None and extra["lr_scheduler"] is None:
        raise CheckpointError(f"{directory} holds no LR scheduler state: it was saved without lr_scheduler=")
    layout = manifest["layout"]
    chunks = [zc.spec.capacity for zc in engine.chunks]
    same = layout["world_size"] == engine.comm.size and layout["zero_stage"] == engine.stage
    # Compared with this rank's own chunks where the checkpoint has them: rank 0's (the layout's) are another
    # pipeline stage's, so a mid-accumulation checkpoint of a pipeline was refused in the layout that saved it.
    entry = par.find_mine(engine, manifest) if same else None
    saved_chunks = entry["chunks"] if entry is not None and "chunks" in entry else layout["chunks"]
    if manifest["engine"]["pending_grads"] and not (same and saved_chunks == chunks):
        raise CheckpointError(
            f"{directory} was saved in the middle of gradient accumulation (micro-step "
            f"{manifest['engine']['micro_steps']}) with data-parallel size {layout['world_size']} at ZeRO stage "
            f"{layout['zero_stage']}; its pending gradients are per rank and load only into the same data-parallel "
            f"size, stage and chunk layout (this engine: {engine.comm.size}, stage {engine.stage}"
            f"{', other chunk sizes' if same else ''}). Load a checkpoint saved at an "
            "accumulation boundary to change the layout"
        )
    return directory, manifest, extra


# ---- compatibility ---------------------------------------------------------------------------------------------
def _check_compatible(engine: Engine, manifest: dict[str, Any], directory: str) -> None:
    saved = manifest["model"]["params"]
    mine = {par.stored_name(info): info for zc in engine.chunks for info in zc.spec.params}
    problems = []
    layout = manifest["layout"]
    saved_degrees = (layout.get("tensor_parallel", 1), layout.get("pipeline_parallel", 1))
    if saved_degrees != par.degrees(engine):
        raise CheckpointError(
            f"{directory} was saved with tensor x pipeline degrees {saved_degrees[0]} x {saved_degrees[1]}, this "
            f"engine runs {par.degrees(engine)[0]} x {par.degrees(engine)[1]}"
            f"{par.sequence_note(manifest['engine'].get('config', {}), 'the checkpoint ran')}"
            f"{par.sequence_note(engine.config.to_dict(), 'this engine runs')}: a checkpoint loads only into the same "
            "tensor and pipeline degrees (the data-parallel degree, ZeRO stage and offload may change). To change "
            "them, consolidate it (python -m hetero.checkpoint consolidate) and load the full state_dict into the "
            "model before wrapping it"
        )
    saved_mode, mode = layout.get("tensor_mode", "1d"), par.tensor_mode(engine)
    if saved_mode != mode:
        raise CheckpointError(
            f"{directory} was saved with tensor_mode {saved_mode}, this engine runs {mode}: their shards are cut "
            "differently. Consolidate it (python -m hetero.checkpoint consolidate) and load the full state_dict into "
            "the model before wrapping it"
        )
    me = par.coordinates(engine)
    # Under pipeline (tensor) parallelism this rank holds one stage (one shard): only that part must match. Another
    # cut of the same model (pipeline_split "auto" times the units: two runs can cut apart) saved some of this stage's
    # names on other stages and theirs here; tensors are read by name, so only names the whole model lacks are extra.
    whole = {n for chunk in engine.stages or () for n in chunk.model_params}
    unexpected = [
        n
        for n, p in saved.items()
        if n not in mine
        and p.get("stage", 0) == me["pp"]
        and p.get("tp_rank") in (None, me["tp"])
        and n.partition(par.TP_MARK)[0] not in whole
    ]
    missing = [n for n in mine if n not in saved]
    shapes = [
        f"{n}: checkpoint {tuple(saved[n]['shape'])}, model {tuple(mine[n].param.shape)}"
        for n in mine
        if n in saved and tuple(saved[n]["shape"]) != tuple(mine[n].param.shape)
    ]
    buffers = manifest["model"]["buffers"]
    my_buffers = model_buffers(engine)
    missing += [f"buffer {n}" for n in my_buffers if n not in buffers]
    shapes += [
        f"buffer {n}: checkpoint {tuple(buffers[n]['shape'])}, model {tuple(t.shape)}"
        for n, t in my_buffers.items()
        if n in buffers and tuple(buffers[n]["shape"]) != tuple(t.shape)
    ]
    for label, names in (("missing from the checkpoint", missing), ("not in the model", unexpected)):
        if names:
            problems.append(f"{len(names)} {label}: {', '.join(names[:_SHOW])}{' ...' if len(names) > _SHOW else ''}")
    if shapes:
        problems.append(
            f"{len(shapes)} with other shapes: {'; '.join(shapes[:_SHOW])}{' ...' if len(shapes) > _SHOW else ''}"
        )
    if layout["state_names"] != list(engine.algorithm.state_names):
        problems.append(
            f"optimizer: the checkpoint holds {layout['algorithm']} states {layout['state_names']}, this engine's "
            f"optimizer needs {list(engine.algorithm.state_names)}"
        )
    if problems:
        raise CheckpointError(
            f"{directory} does not fit this model: " + "; ".join(problems) + ". Build the same model (and optimizer) "
            "that saved it"
        )


# ---- filling chunks --------------------------------------------------------------------------------------------
def _start_trainable(
    engine: Engine, zc: Any, index: mf.Index, manifest: dict[str, Any], checkers: Checkers, parts: ThreadPoolExecutor
) -> list:
    """Make the chunk's optimizer buffer resident and pinned, zero what the checkpoint does not fill, and start
    reading the rest; `_finish_trainable` completes it. checkers, parts: who reads a shared segment whole, and the
    thread reading the parts of those this rank does not ([Note: one rank checks a shared segment] in plan.py)."""
    m = engine.manager
    saved = manifest["model"]["params"]
    if engine.stage == 3:
        zc.reshard()  # a gathered copy would be stale once the shard is replaced
    lo, hi = zc.kept_range()
    kinds = ["master"] + [f"state.{n}" for n in engine.algorithm.state_names]
    _access_whole(m, zc.optim, zc.placement.compute)  # every element is read from the checkpoint or zeroed below
    m.pin(zc.optim)
    requests: list[tuple] = []  # read and checked by `Index`
    parts_only: list[tuple] = []  # parts of segments another rank checks
    for j, kind in enumerate(kinds):
        view = zc.optim.view(zc.optim.slots[j])
        filled = lo  # every element not read from the checkpoint is zeroed: padding, fresh states
        for info, a, b in zc.spec.overlaps(lo, hi):
            target = view[a - lo : b - lo]
            sname = par.stored_name(info)
            if saved[sname]["trainable"] or kind == "master":  # unfrozen since the save: its saved values
                wanted = (kind if saved[sname]["trainable"] else "frozen", sname, info.element(a), target)
                checkers.split(index, zc.comm, wanted, requests, parts_only)
            else:  # unfrozen since the save: fresh states
                target.zero_()
            view[filled - lo : a - lo].zero_()
            filled = b
        view[filled - lo :].zero_()
    futures = index.fill_async(requests)
    for fname in {seg.file for seg, _, _ in parts_only}:
        index.reader(fname)  # opened here: the reader cache is not shared between threads
    return futures + [parts.submit(read_part, index, *p) for p in parts_only]


def _finish_trainable(engine: Engine, zc: Any, futures: list) -> None:
    m = engine.manager
    try:
        mf.wait_all(futures)
        # Parameters from the master, as after an update; the gradient is cleared only if it is not zero already.
        # Gathered once every rank has read its part ([Note: a load every rank agrees on] in agree.py).
        zc.write_back(zc.optim.view(zc.optim.slots[0]), clear_grad=False, gather=False, source=zc.optim)
        if not zc.grad_is_zero or bool(zc.used.any()) or zc.grads_seen:
            zc.zero_grad()
    finally:
        m.unpin(zc.optim)
    if zc.placement.optim is Tier.NVME:
        m.move(zc.optim, Tier.NVME)


def _fill_frozen(engine: Engine, zc: Any, index: mf.Index) -> None:
    m = engine.manager
    saved = index.manifest["model"]["params"]
    if engine.stage == 3:
        zc.reshard()
        lo, hi = zc.kept_range()
        tier = Tier.DEVICE if zc.placement.params is Tier.DEVICE else Tier.HOST
        buf = _access_whole(m, zc.shard, tier)  # every element is read from the checkpoint or zeroed below
        chunk, base = zc.shard, lo
    else:
        lo, hi = 0, zc.spec.capacity
        buf = m.access(zc.full, Tier.DEVICE)
        chunk, base = zc.full, 0
    with m.pinned(chunk):
        filled = lo  # the shard's elements no parameter covers (padding) are zeroed: fresh memory holds anything
        for info, a, b in zc.spec.overlaps(lo, hi):
            sname = par.stored_name(info)
            kind = "master" if saved[sname]["trainable"] else "frozen"
            index.fill(kind, sname, info.element(a), buf[a - base : b - base])
            if chunk is zc.shard:
                buf[filled - base : a - base].zero_()
            filled = b
        if chunk is zc.shard:
            buf[filled - base :].zero_()
    if engine.stage == 3 and zc.placement.params is Tier.NVME:
        m.move(zc.shard, Tier.NVME)


# [Note: a load reads no stale copy]
# A load writes every element of the chunks it fills: an optimizer chunk's master and states (read from the checkpoint
# or zeroed), a stage-3 frozen shard (its parameters read, its padding zeroed). Accessed as they were, those whose home
# is NVMe were first read back from their swap copies, only for every byte to be overwritten: a load of the model of
# tests/test_checkpoint_nvme_reads.py read 384 KiB from NVMe at stage 1, world 1; now it reads none. So their slots
# are made FREE first, as the update does for a shard its write-back overwrites whole (update.py, copy_up.py): the
# manager gives a chunk whose slots are all FREE fresh memory where it is wanted, with no read, and the slots are HOLD
# again from there (the chunk stays pinned until the reads into it are done). The stale swap copy is overwritten
# when the chunk goes back (the access marked it written). Stage 3's trainable shards need nothing here: the
# write-back from the loaded master marks them FREE already.
def _access_whole(m: Any, chunk: Any, tier: Tier) -> torch.Tensor:
    """`m.access(chunk, tier)` for a caller about to write every element of it: no read of a stale swap copy
    ([Note: a load reads no stale copy]). Its slots are HOLD after, and as before if the access fails."""
    held = [slot for slot in chunk.slots if slot.state is not TensorState.FREE]
    for slot in held:
        chunk.set_state(slot, TensorState.FREE)
    try:
        buf = m.access(chunk, tier)
    except BaseException:
        for slot in held:  # nothing was brought in: the copy where it was still holds their data
            chunk.set_state(slot, TensorState.HOLD)
        raise
    for slot in chunk.slots:
        chunk.set_state(slot, TensorState.HOLD)
    return buf


def _fill_grad(engine: Engine, zc: Any, index: mf.Index, own_file: str) -> None:
    m = engine.manager
    buf = zc.grad_buffer()  # valid (HOLD) from here, so the next accumulation adds to what is loaded
    with m.pinned(zc.grad):
        buf.zero_()
        glo, ghi = zc.kept_range() if engine.stage >= 2 else (0, zc.spec.capacity)
        for info, a, b in zc.spec.overlaps(glo, ghi):
            index.fill("grad", par.stored_name(info), info.element(a), buf[a - glo : b - glo], grad_file=own_file)


def _fill_buffers(engine: Engine, index: mf.Index) -> None:
    for name, t in model_buffers(engine).items():
        tmp = torch.empty(t.numel(), dtype=index.reader(_buffer_file(index, name)).entry(mf.key("buffer", name)).dtype)
        index.fill("buffer", name, 0, tmp)
        with torch.no_grad():
            t.copy_(tmp.view(t.shape))


def _buffer_file(index: mf.Index, name: str) -> str:
    segs = index.segments.get(("buffer", name))
    if not segs:
        raise CheckpointError(f"{index.directory}: holds no buffer {name!r}")
    return segs[0].file


def _restore_rng(engine: Engine, index: mf.Index, mine: dict[str, Any], own_file: str) -> None:
    import numpy as np

    py = mine["rng"]["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = mine["rng"]["numpy"]
    np.random.set_state((npst[0], np.array(npst[1], dtype=np.uint32), npst[2], npst[3], npst[4]))
    reader = index.reader(own_file)
    cpu = index.segments[("rng", "torch_cpu")]
    crc = next(s.crc for s in cpu if s.file == own_file)
    torch.set_rng_state(reader.read(mf.key("rng", "torch_cpu"), crc=crc))
    cuda = [s for s in index.segments.get(("rng", "cuda"), ()) if s.file == own_file]
    if cuda and engine.device.is_cuda:
        engine.device.set_rng_state(reader.read(mf.key("rng", "cuda"), crc=cuda[0].crc))
