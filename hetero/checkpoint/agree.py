"""Every rank of a checkpoint load (or a save's planning) ends it the same way: all done, or all raising.

[Note: a load every rank agrees on]
A load reads files each rank sees for itself: the `latest` it follows, the manifest, every rank's file, the
checksums of the ranges it keeps. One rank alone can fail there (a node's copy of the checkpoint short of a file, a
checksum that fails in one rank's range, a model that differs on one pipeline stage), or follow an older `latest`
than the others. Stages 1-2 all-gather each chunk's parameters as they load: a rank that raised before its
gather left the others waiting in it until the group's timeout, with nothing said about the checkpoint, and at
stages 0 and 3 they went on to train while it stopped; ranks that followed different tags mixed two checkpoints
without a word. So a load agrees twice over the control group of every rank of the job: after the checks (which
checkpoint, and whether each rank can load it) and after the reads, before any parameter is gathered. A rank that
failed raises its own error; every other rank raises a CheckpointError that names it and says what it saw. A save
agrees the same way on its plan and its tag before anything is written (the writes and the commit agree already).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from hetero.errors import CheckpointError

_LOAD = "Fix what those ranks report (every rank must see the same checkpoint at the same path), then load again"
SAVE = "Nothing was written: fix what those ranks report, then save again on every rank"


def identity(directory: str, manifest: dict[str, Any]) -> tuple[str, str]:
    """What tells one checkpoint from another: its directory's name (the tag) and the digest of its manifest."""
    text = json.dumps(manifest, sort_keys=True, default=str)
    return os.path.basename(os.path.normpath(directory)), hashlib.sha256(text.encode()).hexdigest()[:16]


def agree(comm: Any, error: BaseException | None, what: str, *, value: Any = None, advice: str = _LOAD) -> list[Any]:
    """Every rank of `comm` learns whether any failed: raise on all of them if one did (this rank's own `error` where
    it failed, else a CheckpointError naming the ranks that did, with `advice`), else return every rank's `value` in
    rank order. `what`: the step agreed on, for the message."""
    if comm.size == 1:
        if error is not None:
            raise error
        return [value]
    told = None if error is None else f"{type(error).__name__}: {error}"
    seen = comm.all_gather_object((told, value))
    failed = [(r, msg) for r, (msg, _) in enumerate(seen) if msg is not None]
    if error is not None:
        raise error
    if failed:
        ranks = ", ".join(str(r) for r, _ in failed)
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise CheckpointError(f"{what} failed on rank(s) {ranks}, so no rank goes on with it: {detail}. {advice}")
    return [v for _, v in seen]


def same_checkpoint(seen: list[tuple[str, str]]) -> None:
    """Every rank resolved the same checkpoint (`identity`, one a rank, as `agree` gathered them), or this rank
    raises, as every other does from the same list."""
    if all(s == seen[0] for s in seen):
        return
    listed = "; ".join(f"rank {r}: {tag} (manifest {digest})" for r, (tag, digest) in enumerate(seen))
    raise CheckpointError(
        f"the ranks would load different checkpoints: {listed}. A load follows `latest` on each rank: every rank "
        "must see one checkpoint root on a file system all of them mount at the same path (or name one checkpoint "
        "directory explicitly)"
    )
