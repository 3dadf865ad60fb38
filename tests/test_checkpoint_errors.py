"""Checkpoint errors: truncated, corrupt or missing files, unsafe pickles, incompatible models, no disk space, paths
that are not writable. Each says what is wrong, names the file, and leaves what was saved before intact."""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections import namedtuple

import pytest
import torch

from hetero.checkpoint import manifest as mf
from hetero.errors import CheckpointError

try:
    from tests.test_checkpoint import _cfg, make_engine, train
except ImportError:  # tests/ itself on sys.path
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A root with two checkpoints (step 1 and step 2, `latest` at step 2) of a stage-1 engine, and that engine's
    state after step 2."""
    root = str(tmp_path_factory.mktemp("ckpt") / "root")
    e = make_engine(0, _cfg(1))
    train(e, 0, 1, 0, 1)
    e.save_checkpoint(root, client_state={"epoch": 1})
    train(e, 0, 1, 1, 2)
    e.save_checkpoint(root, client_state={"epoch": 2})
    state = e.full_state_dict()
    e.close()
    return root, state


def _copy(saved, tmp_path) -> str:
    dst = str(tmp_path / "root")
    shutil.copytree(saved[0], dst)
    return dst


def _load(path: str, **model_overrides) -> tuple[object, dict]:
    e = make_engine(0, _cfg(1), **model_overrides)
    try:
        cs = e.load_checkpoint(path)
        return cs, e.full_state_dict()
    finally:
        e.close()


def test_layout_on_disk(saved):
    root, state = saved
    assert sorted(os.listdir(root)) == ["latest", "step-00000001", "step-00000002"]
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "step-00000002"
    files = sorted(os.listdir(os.path.join(root, "step-00000002")))
    assert files == ["manifest.json", "rank-00000.safetensors", "state.pt"]
    cs, got = _load(root)
    assert cs == {"epoch": 2}
    assert all(torch.equal(got[k], state[k]) for k in state)
    cs, _ = _load(os.path.join(root, "step-00000001"))  # a tag directory directly
    assert cs == {"epoch": 1}


@pytest.mark.parametrize(
    "damage", ["truncate", "flip-data", "flip-middle", "flip-header", "delete", "manifest", "latest"]
)
def test_damaged_checkpoint_is_refused_naming_the_file(saved, tmp_path, damage):
    root = _copy(saved, tmp_path)
    tag = os.path.join(root, "step-00000002")
    shard = os.path.join(tag, "rank-00000.safetensors")
    size = os.path.getsize(shard)
    if damage == "truncate":
        os.truncate(shard, size - 100)
        match = r"rank-00000\.safetensors: truncated"
    elif damage in ("flip-data", "flip-middle", "flip-header"):
        with open(shard, "r+b") as f:
            f.seek({"flip-data": size - 7, "flip-middle": size // 2, "flip-header": 20}[damage])
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))
        match = r"rank-00000\.safetensors: (tensor .* fails its XXH3_64 check|its header fails its CRC32)"
    elif damage == "delete":
        os.remove(shard)
        match = r"rank-00000\.safetensors: missing"
    elif damage == "manifest":
        with open(os.path.join(tag, "manifest.json"), "r+") as f:
            f.write("{garbage")
        match = r"manifest\.json: not valid JSON"
    else:
        shutil.rmtree(tag)
        match = r"latest names 'step-00000002'.*holds no manifest\.json"
    with pytest.raises(CheckpointError, match=match):
        _load(root)
    if damage != "latest":  # the earlier checkpoint is untouched and loads
        cs, _ = _load(os.path.join(root, "step-00000001"))
        assert cs == {"epoch": 1}


def test_incompatible_model_lists_names_and_shapes(saved):
    root, _ = saved
    with pytest.raises(CheckpointError) as err:
        _load(root, n_embd=48)
    msg = str(err.value)
    assert "with other shapes" in msg and "embed.weight: checkpoint (64, 32), model (64, 48)" in msg
    with pytest.raises(CheckpointError) as err:
        _load(root, n_layer=3)
    msg = str(err.value)
    assert "missing from the checkpoint" in msg and "layers.2.ln_1.weight" in msg


def test_not_enough_disk_space_writes_nothing(saved, tmp_path, monkeypatch):
    root = _copy(saved, tmp_path)
    before = sorted(os.listdir(root))
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr("hetero.checkpoint.save.shutil.disk_usage", lambda p: Usage(1 << 30, 1 << 30, 4096))
    e = make_engine(0, _cfg(1))
    try:
        with pytest.raises(CheckpointError, match="not enough disk space .* needs about .* MiB, 0.0 MiB are free"):
            e.save_checkpoint(root, tag="new")
    finally:
        e.close()
    assert sorted(os.listdir(root)) == before
    assert _load(root)[0] == {"epoch": 2}


def test_path_not_writable_and_existing_tag(saved, tmp_path):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    e = make_engine(0, _cfg(1))
    try:
        with pytest.raises(CheckpointError, match="cannot create the checkpoint directory"):
            e.save_checkpoint(str(afile / "ckpt"))
        root = _copy(saved, tmp_path)
        with pytest.raises(CheckpointError, match="exists already and is the latest: pass another tag"):
            e.save_checkpoint(root, tag="step-00000002")
        with pytest.raises(CheckpointError, match="weights_only"):
            e.save_checkpoint(root, client_state={"obj": object()})
        assert sorted(os.listdir(root)) == ["latest", "step-00000001", "step-00000002"]
    finally:
        e.close()


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # would create the marker file if unpickled


def test_load_never_executes_a_pickle(saved, tmp_path):
    root = _copy(saved, tmp_path)
    tag = os.path.join(root, "step-00000002")
    marker = str(tmp_path / "executed")
    path = os.path.join(tag, mf.STATE_FILE)
    torch.save({"client_state": _Evil(marker)}, path)
    # Make the manifest agree with the tampered file, so that only the safe load stands in the way.
    with open(os.path.join(tag, mf.MANIFEST)) as f:
        manifest = json.load(f)
    with open(path, "rb") as f:
        data = f.read()
    manifest["files"][mf.STATE_FILE] = {"size": len(data), "crc32": zlib.crc32(data)}
    with open(os.path.join(tag, mf.MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointError, match="cannot be read safely"):
        _load(root)
    assert not os.path.exists(marker)


def test_pending_gradients_do_not_reshard(tmp_path):
    e = make_engine(0, _cfg(1, accum=2))
    train(e, 0, 1, 0, 3)  # one update and one micro-batch of the next
    path = e.save_checkpoint(str(tmp_path / "ckpt"))
    e.close()
    assert path.endswith("step-00000001-micro-00000003")
    e = make_engine(0, _cfg(3, accum=2))
    try:
        with pytest.raises(CheckpointError, match="middle of gradient accumulation .* same world size, stage"):
            e.load_checkpoint(path)
    finally:
        e.close()
