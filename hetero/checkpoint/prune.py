"""Keeping the last N checkpoints of a root: `keep_last(root, n)` after each save, so that a long run with frequent
saves does not fill the disk ([Note: pruning checkpoints]).

[Note: pruning checkpoints]
Only the tags the engine gives by default (`step-<N>`, `step-<N>-micro-<M>`) are counted and removed, oldest first by
their update (and micro-step) numbers, as Hugging Face's `save_total_limit` orders `checkpoint-<N>`; a tag of the
user's own ("best", "pretrain-final") is theirs to keep. Never removed: the checkpoint `latest` names (a run resumed
from an earlier step saves below the numbers of the run it left, and its newest save is still the one to keep), and
a save in progress (a `.tmp-*` directory whose save's process lives); one a stopped job left goes, as at the next
save ([Note: staging directories a stopped job left] in staging.py). A checkpoint goes in two steps: renamed to a
`.tmp-*` name, its owner file saying it is being deleted (atomic: a reader sees it whole under its tag or not at
all; a kill during the deletion leaves only that `.tmp-*` directory, which the next save or keep_last deletes),
then deleted. A complete checkpoint a replacing save set aside (`.stale-<tag>-*`) goes with its tag, or the next
save would put it back in the tag's place. Call it on one rank (the checkpoint root is shared by every rank), after
`save_checkpoint` has returned.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil

from hetero.checkpoint import manifest as mf
from hetero.checkpoint import staging
from hetero.errors import CheckpointError

log = logging.getLogger("hetero.checkpoint")

_DEFAULT_TAG = re.compile(r"step-(\d+)(?:-micro-(\d+))?")  # hetero.checkpoint.save.default_tag's names


def keep_last(root: str | os.PathLike, n: int) -> list[str]:
    """Delete all but the `n` newest complete checkpoints under `root` that carry default tags, keeping the one
    `latest` names in any case ([Note: pruning checkpoints]); returns the paths removed, oldest first."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"keep_last: n is the number of checkpoints to keep, an integer >= 1; got {n!r}")
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise CheckpointError(f"keep_last: {root} is not a directory; pass the root that save_checkpoint wrote to")
    ordered = sorted((_order(t), t) for t in mf.complete_tags(root) if _order(t) is not None)
    keep = {t for _, t in ordered[-n:]} | {mf.latest_tag(root)}
    removed = []
    for _, tag in ordered:
        if tag in keep:
            continue
        names = [tag] + [s for s in sorted(os.listdir(root)) if mf.stale_tag(s) == tag]
        for name in names:
            doomed = os.path.join(root, f"{mf.UNFINISHED}{name}-{secrets.token_hex(4)}")
            staging.claim(doomed, doomed=True)  # first: a kill after the rename leaves it marked for deletion
            os.rename(os.path.join(root, name), doomed)
            mf.fsync_dir(root)
            shutil.rmtree(doomed, ignore_errors=True)
            staging.release(doomed)  # last: [Note: staging directories a stopped job left]
        removed.append(os.path.join(root, tag))
        log.info("%s: removed checkpoint %s, keeping the last %d", root, tag, n)
    staging.sweep(root)
    return removed


def _order(tag: str) -> tuple[int, int] | None:
    m = _DEFAULT_TAG.fullmatch(tag)
    return None if m is None else (int(m.group(1)), int(m.group(2) or 0))
