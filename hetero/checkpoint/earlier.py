"""Which checkpoint to load instead of a damaged one, named in the error that refuses it.

A damaged checkpoint (a truncated file, a failed checksum, a corrupt manifest) was refused with "load an earlier
checkpoint", leaving the user to find one that loads and the call that loads it. `damaged` ends every such error
with the newest checkpoint saved before it beside it (in the same root; for HeteroTrainer's checkpoint-N/hetero/,
the newest checkpoint-M folder before it) that looks intact, and how to load it. The look is cheap, as an error
path should be: the manifest parses and passes its own checksum, and every file it lists has the size it records;
no tensor is read (`python -m hetero.checkpoint verify` reads every byte).
"""

from __future__ import annotations

import os
import re

from hetero.errors import CheckpointError, disk_trouble


def damaged(path: str, what: str) -> CheckpointError:
    """The error for the damaged file `path` of a checkpoint directory: `what` is wrong with it, then `instead`."""
    return CheckpointError(f"{path}: {what}. {instead(os.path.dirname(path))}")


def instead(directory: str) -> str:
    """What to load in place of the damaged checkpoint `directory`: the newest intact one saved before it, and how."""
    # manifest.py (and format.py and blocks.py, which it imports) raise through this module: imported at an error.
    from hetero.checkpoint import manifest as mf

    directory = os.path.normpath(directory)
    root, tag = os.path.split(directory)
    root = root or os.curdir
    tag = mf.stale_tag(tag) or tag  # a set-aside copy read in place of its tag ([Note: checkpoint layout])
    if os.path.basename(root) == mf.NESTED:  # HeteroTrainer's checkpoint-N/hetero/<tag>: the folders beside N
        folder = os.path.dirname(root)
        out, name = os.path.split(folder)
        for other in reversed(_before(mf.trainer_checkpoints(out or os.curdir), name)):
            try:
                found = mf.resolve(os.path.join(out, other, mf.NESTED))
            except CheckpointError:
                continue
            if intact(found):
                return (
                    f"Load an earlier checkpoint: the newest intact one before {name} is {os.path.join(out, other)}: "
                    f"trainer.train(resume_from_checkpoint={os.path.join(out, other)!r})"
                )
        return f"Load an earlier checkpoint: no folder before {name} in {out or os.curdir} holds an intact one"
    for other in reversed(_before(mf.complete_tags(root), tag)):
        if intact(os.path.join(root, other)):
            return (
                f"Load an earlier checkpoint: the newest intact one before {tag} is {os.path.join(root, other)}: "
                f"engine.load_checkpoint({root!r}, tag={other!r}) (examples/train_gpt.py: --resume "
                f"{os.path.join(root, other)}){_aside(root, tag, directory)}"
            )
    return (
        f"Load an earlier checkpoint: {root} holds no intact one saved before {tag}; restore one from a copy, or "
        "train from the start"
    )


def choices(root: str) -> str:
    """The intact checkpoints under the root `root` (`intact`), in step order, and how to load one; for an error
    that finds no checkpoint where it looked (`latest` naming a missing one, a tag directory without its manifest)."""
    from hetero.checkpoint import manifest as mf  # as in `instead`

    tags = sorted((t for t in mf.complete_tags(root) if intact(os.path.join(root, t))), key=_order)
    if not tags:
        return f"{root} holds no intact checkpoint: restore one from a copy, or train from the start"
    last = os.path.join(root, tags[-1])
    return (
        f"The intact checkpoints under {root}: {', '.join(tags)}. Load one by its tag, e.g. {last}: "
        f"engine.load_checkpoint({root!r}, tag={tags[-1]!r}) (examples/train_gpt.py: --resume {last})"
    )


def unreadable(path: str, error: OSError) -> CheckpointError:
    """The error for a checkpoint file `path` that the system failed to read (an I/O error, a permission): the file,
    its checkpoint, what the errno means, and the checkpoint to load instead (`damaged`)."""
    directory = os.path.dirname(os.path.abspath(path))
    return damaged(
        path, f"cannot be read, so checkpoint {directory} cannot be loaded: {disk_trouble(error, directory)}"
    )


def _aside(root: str, tag: str, directory: str) -> str:
    """While `latest` names the damaged tag, a save under that tag is refused (save.py): a resumed run reaching the
    same step would stop at its save. Said here, where the user decides what to load."""
    from hetero.checkpoint import manifest as mf  # as in `instead`

    if mf.latest_tag(root) != tag:
        return ""
    return f"; move {directory} aside first: while `latest` names it, a save under {tag} is refused"


def intact(directory: str) -> bool:
    """Whether the checkpoint `directory` looks whole, cheaply: its manifest parses and passes its own checksum, and
    every file it lists has the size it records. The tensors are not read."""
    from hetero.checkpoint import manifest as mf  # as in `instead`

    try:
        files = mf.read_manifest(directory)["files"]
        return all(os.path.getsize(os.path.join(directory, f)) == info["size"] for f, info in files.items())
    except (CheckpointError, OSError, KeyError, TypeError, AttributeError):
        return False


def _before(names: list[str], name: str) -> list[str]:
    """The `names` that come before `name` in step order (step-10 after step-9), in that order."""
    return sorted((n for n in names if _order(n) < _order(name)), key=_order)


def _order(name: str) -> list[str | int]:
    # re.split with a group alternates text and digits, text first: two keys compare text with text, int with int.
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
