"""Step 3 of a save ([Note: an atomic save] in save.py): rank 0 commits what every rank wrote, or undoes it whole.

[Note: a commit that fails]
The commit writes state.pt and manifest.json into the temporary directory, renames it to ROOT/<tag> (setting aside a
checkpoint already under the tag) and moves ROOT/latest (a temporary file, then a rename). A full disk, a spent
quota or an I/O error can stop any of these steps. Left as it was, such a failure kept `latest.tmp-<pid>` in the
root, and after the directory's rename a complete checkpoint that `latest` never named, on a disk already full.
So until `latest` has moved, a failure undoes everything the commit did: the new checkpoint goes (renamed back to
a .tmp-* name, then deleted, so a kill while deleting leaves only what the next save drops), the set-aside one
takes its tag again, and no temporary file stays; `latest` and every checkpoint before are as they were. Once
`latest` names the new checkpoint the save has happened: what fails after (syncing the root, deleting the set-aside
copy) is logged, not undone. Rank 0 words the failure ([Note: what a failed disk operation means] in errors.py)
and broadcasts it, whatever happened, so every rank raises the same CheckpointError.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from typing import Any

from hetero.checkpoint import blocks, staging
from hetero.checkpoint import manifest as mf
from hetero.checkpoint.describe import NOT_PER_RANK
from hetero.errors import CheckpointError, disk_trouble

log = logging.getLogger("hetero.checkpoint")
_PAUSE_ENV = "HETERO_CHECKPOINT_TEST_PAUSE"  # "<point>:<marker path>": tests pause a save there to kill it
# What makes room under a checkpoint root, said after a full disk or a spent quota
_ROOM = (
    "To make room, hetero.checkpoint.keep_last(root, n) deletes all but the newest n (--keep-last N in the examples)"
)
_NO_ROOM = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}  # a full disk, a spent quota


def finish(comm: Any, root: str, tag: str, tmp: str, infos: list[dict[str, Any]], state: bytes, head: Any) -> str:
    """3. Every rank's file written (`infos`, gathered; an "error" where a rank failed): rank 0 commits, `head(infos)`
    giving the manifest's description of the engine, or drops the temporary directory; every rank learns which."""
    errors = [i["error"] for i in infos if "error" in i]
    outcome = ("ok", "")
    if comm.rank == 0:
        try:
            if errors:
                raise CheckpointError("; ".join(errors) + ". Nothing was committed: the previous checkpoint stands")
            _commit(root, tag, tmp, infos, state, head)
        except Exception as e:  # told to every rank below: none may wait for a rank 0 that raised on its own
            outcome = ("error", str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")
            try:
                staging.remove(tmp)
                settle_stale(root, tag)
            except Exception as again:  # noqa: BLE001 (said, then the broadcast below)
                outcome = ("error", f"{outcome[1]}; cleaning up after it failed too: {type(again).__name__}: {again}")
    status, value = comm.broadcast_object(outcome, src=0)
    if status != "ok":
        raise CheckpointError(f"saving checkpoint {tag!r} under {root} failed: {value}")
    return os.path.join(root, tag)


def _commit(root: str, tag: str, tmp: str, infos: list[dict[str, Any]], data: bytes, head: Callable) -> None:
    """Write the small files, rename, move `latest`; on a failure before `latest` moved, undo it all and raise a
    CheckpointError naming the file ([Note: a commit that fails])."""
    final, pointer = os.path.join(root, tag), os.path.join(root, mf.LATEST)
    before = mf.latest_tag(root)
    doing = tmp  # the file or directory written at the moment: named by the error
    renamed = False  # whether the new checkpoint holds the tag
    try:
        files: dict[str, Any] = {}
        for info in infos:
            files[info["file"]] = {k: info[k] for k in ("size", "header_crc32", "tensors")}
            files[info["file"]].update({k: info[k] for k in blocks.FILE_KEYS if k in info})  # none without blocks
        doing = os.path.join(tmp, mf.STATE_FILE)
        files[mf.STATE_FILE] = {"size": len(data), "crc32": mf.write_durable(doing, data)}
        manifest = {
            **head(infos),
            "created": time.time(),
            "ranks": [{k: v for k, v in i.items() if k not in NOT_PER_RANK} for i in infos],
            "files": files,
        }
        doing = os.path.join(tmp, mf.MANIFEST)
        mf.write_durable(doing, mf.sealed(manifest))
        doing = tmp
        mf.fsync_dir(tmp)
        if os.path.exists(final):
            # Set aside only now, the new checkpoint complete beside it: the old one stays readable under its tag for
            # the whole write, and a kill between these two renames leaves it whole under its new name.
            doing = final
            os.rename(final, os.path.join(root, f"{mf.STALE}{tag}-{secrets.token_hex(4)}"))
            pause_for_test("set-aside")
        doing = final
        os.rename(tmp, final)
        renamed = True
        doing = root
        mf.fsync_dir(root)
        pause_for_test("before-latest")
        # replace_atomic's temporary file, which it removes on a failure
        doing = f"{pointer} (through its temporary file {mf.LATEST}.tmp-{os.getpid()}, removed)"
        mf.replace_atomic(pointer, (tag + "\n").encode())
    except Exception as e:
        if renamed and mf.latest_tag(root) == tag and before != tag:  # `latest` moved, its directory's sync failed
            log.warning("%s: checkpoint %s is committed, but syncing %s failed: %s", root, tag, root, e)
        else:
            raise CheckpointError(_undone(root, tag, tmp, final if renamed else None, doing, before, e)) from e
    staging.release(tmp)  # the directory is the checkpoint now: [Note: staging directories a stopped job left]
    try:
        settle_stale(root, tag)
    except OSError as e:  # the next save settles it
        log.warning("%s: checkpoint %s is committed; deleting the one it replaced failed: %s", root, tag, e)


def _undone(root: str, tag: str, tmp: str, new: str | None, doing: str, before: str | None, e: Exception) -> str:
    """Undo a commit that failed before `latest` moved (`new`: the new checkpoint, where it took the tag already);
    returns what to tell the user."""
    why = worded(e, root)  # before the new checkpoint is deleted: the free space the commit met
    pointer = os.path.join(root, mf.LATEST)
    left = []
    try:
        if new is not None:
            os.rename(new, tmp)  # the name a kill mid-deletion leaves to the next save, then the space back
        staging.remove(tmp)
        settle_stale(root, tag)  # a checkpoint of the same tag set aside: back under its tag
        left += [os.path.join(root, n) for n in os.listdir(root) if n.startswith(f"{mf.LATEST}.tmp-")]
    except OSError as again:
        left.append(f"what {root} holds, as undoing failed too ({again}): check it by hand")
    stands = f"{pointer} still names {before!r}, which loads as before" if before else f"{root} held none before"
    note = f"; left behind: {', '.join(left)}" if left else ""
    return (
        f"rank 0 could not commit it, writing {doing}: {why}. Nothing was committed: the new checkpoint and its "
        f"temporary files were removed, {stands}{note}"
    )


def worded(e: BaseException, directory: str) -> str:
    """`e`, raised writing a checkpoint under `directory`, for a message: an OSError as what it means and what to do
    ([Note: what a failed disk operation means] in errors.py), the room old checkpoints take among it."""
    if not isinstance(e, OSError):
        return f"{type(e).__name__}: {e}"
    if e.errno in _NO_ROOM:
        return f"{disk_trouble(e, directory)}. {_ROOM}"
    return disk_trouble(e, directory)


def settle_stale(root: str, tag: str | None = None) -> None:
    """Put back a checkpoint set aside (`_commit`) whose tag is missing, a save having failed or been killed
    between the renames: nothing saved before stays hidden by a save that did not happen. Delete one whose tag
    holds a complete checkpoint again: the new one took its place. tag: only that tag's; default, every one."""
    for name in sorted(os.listdir(root)):
        t = mf.stale_tag(name)
        if t is None or (tag is not None and t != tag):
            continue
        aside, final = os.path.join(root, name), os.path.join(root, t)
        if not os.path.exists(final):
            os.rename(aside, final)
        elif os.path.isfile(os.path.join(final, mf.MANIFEST)):
            shutil.rmtree(aside, ignore_errors=True)


def pause_for_test(point: str) -> None:
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
