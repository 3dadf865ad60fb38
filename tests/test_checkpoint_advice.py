"""A damaged checkpoint's error names the checkpoint to load instead (the newest intact one saved before it beside
it) and the call that loads it; `verify` names the checkpoint a root's `latest` led it to.

A truncated file said "load an earlier checkpoint" and a truncated manifest only "the manifest is corrupt", leaving
the user to find one that loads (`hetero/checkpoint/earlier.py`)."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from hetero.checkpoint.__main__ import main
from hetero.errors import CheckpointError

try:
    from tests.test_checkpoint import _cfg, make_engine, train
except ImportError:  # tests/ itself on sys.path
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]

TAGS = ["step-00000002", "step-00000004", "step-00000006"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A root with checkpoints after steps 2, 4 and 6 of a stage-1 engine (`latest`: step 6), each holding its step
    as client_state."""
    root = str(tmp_path_factory.mktemp("ckpt") / "ckpt")
    e = make_engine(0, _cfg(1))
    try:
        for step in (2, 4, 6):
            train(e, 0, 1, step - 2, step)
            e.save_checkpoint(root, client_state={"step": step})
    finally:
        e.close()
    assert sorted(os.listdir(root)) == ["latest", *TAGS]
    return root


@pytest.fixture
def root(saved, tmp_path) -> str:
    """A copy of `saved` to damage."""
    dst = str(tmp_path / "ckpt")
    shutil.copytree(saved, dst)
    return dst


def _load(path: str, tag: str | None = None) -> object:
    e = make_engine(0, _cfg(1))
    try:
        return e.load_checkpoint(path, tag)
    finally:
        e.close()


def _damage(directory: str, how: str) -> None:
    shard = os.path.join(directory, "rank-00000.safetensors")
    manifest = os.path.join(directory, "manifest.json")
    if how == "truncate":
        os.truncate(shard, os.path.getsize(shard) - 100)
    elif how == "truncate-manifest":
        os.truncate(manifest, os.path.getsize(manifest) // 2)
    elif how == "delete":
        os.remove(shard)
    else:  # a flipped bit: the file's size stays, only the checksums tell
        path, at = {"flip-data": (shard, -7), "flip-manifest": (manifest, -40)}[how]
        with open(path, "r+b") as f:
            f.seek(at, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x04]))


def _advice(root: str, tag: str) -> list[str]:
    """What the error must say to load the checkpoint `tag` of `root` instead."""
    return [
        f"the newest intact one before step-00000006 is {os.path.join(root, tag)}",
        f"engine.load_checkpoint({root!r}, tag={tag!r})",
        f"--resume {os.path.join(root, tag)}",
    ]


@pytest.mark.parametrize(
    "how, said",
    [
        ("truncate", r"rank-00000\.safetensors: truncated \(\d+ bytes, the manifest says \d+\)"),
        ("truncate-manifest", r"manifest\.json: not valid JSON .*: the manifest is corrupt"),
        ("delete", r"rank-00000\.safetensors: missing"),
        ("flip-data", r"rank-00000\.safetensors: tensor .* fails its XXH3_64 check"),
        ("flip-manifest", r"manifest\.json: (fails its CRC32 check|not valid JSON)"),
    ],
)
def test_a_damaged_checkpoint_names_the_newest_intact_one_before_it(root, how, said):
    _damage(os.path.join(root, TAGS[2]), how)
    with pytest.raises(CheckpointError, match=said) as info:
        _load(root)  # through `latest`
    message = str(info.value)
    missing = [part for part in _advice(root, TAGS[1]) if part not in message]
    assert not missing, f"{missing} not in {message!r}"
    assert _load(root, TAGS[1]) == {"step": 4}  # the call the error gives loads
    # ... and says why the damaged one must go first: a resumed run saving at its step would be refused.
    assert f"move {os.path.join(root, TAGS[2])} aside first" in message
    e = make_engine(0, _cfg(1))
    try:
        e.load_checkpoint(root, TAGS[1])
        with pytest.raises(CheckpointError, match="exists already and is the latest"):
            e.save_checkpoint(root, tag=TAGS[2])
    finally:
        e.close()


@pytest.mark.parametrize("how", ["truncate", "truncate-manifest", "flip-manifest"])
def test_a_damaged_earlier_checkpoint_is_passed_over(root, how):
    """A checkpoint whose manifest does not parse or whose files have other sizes than it records is no advice."""
    _damage(os.path.join(root, TAGS[2]), "truncate")
    _damage(os.path.join(root, TAGS[1]), how)
    with pytest.raises(CheckpointError, match="truncated") as info:
        _load(root)
    message = str(info.value)
    assert all(part in message for part in _advice(root, TAGS[0])), message
    assert TAGS[1] not in message


def test_no_intact_checkpoint_before_it(root):
    _damage(os.path.join(root, TAGS[0]), "truncate")
    with pytest.raises(CheckpointError, match="truncated") as info:
        _load(root, TAGS[0])  # the first one: the later ones are not "earlier"
    assert f"{root} holds no intact one saved before {TAGS[0]}" in str(info.value)


def test_a_trainer_folder_names_the_folder_to_resume_from(saved, tmp_path):
    """HeteroTrainer's checkpoint-N/hetero/ holds one checkpoint: the advice is the Trainer folder before it."""
    out = str(tmp_path / "out")
    for n, tag in ((2, TAGS[0]), (6, TAGS[2]), (10, None)):  # checkpoint-10 sorts after checkpoint-6
        nested = os.path.join(out, f"checkpoint-{n}", "hetero")
        if tag is not None:
            shutil.copytree(os.path.join(saved, tag), os.path.join(nested, tag))
            with open(os.path.join(nested, "latest"), "w") as f:
                f.write(tag)
    _damage(os.path.join(out, "checkpoint-6", "hetero", TAGS[2]), "truncate")
    with pytest.raises(CheckpointError, match="truncated") as info:
        _load(os.path.join(out, "checkpoint-6"))
    want = f"trainer.train(resume_from_checkpoint={os.path.join(out, 'checkpoint-2')!r})"
    assert want in str(info.value)


def test_verify_names_the_checkpoint_latest_led_to(saved, capsys):
    assert main(["verify", saved]) == 0
    said = capsys.readouterr().out
    tag = os.path.join(saved, TAGS[2])
    assert re.fullmatch(rf"ok: {re.escape(tag)} \(from {re.escape(saved)}\): \d+ bytes of tensors checked\n", said)
    assert main(["verify", tag]) == 0  # named directly: nothing followed
    assert re.fullmatch(rf"ok: {re.escape(tag)}: \d+ bytes of tensors checked\n", capsys.readouterr().out)
