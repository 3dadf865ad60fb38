"""Checkpoint errors: truncated, corrupt or missing files, unsafe pickles, incompatible models, no disk space, paths
that are not writable. Each says what is wrong, names the file, and leaves what was saved before intact."""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections import namedtuple

import pytest
import torch

from hetero.checkpoint import consolidate
from hetero.checkpoint import manifest as mf
from hetero.errors import CheckpointError
from tests.dist import ONE_RANK_FAULTS, ranks_apart

try:
    from tests.test_checkpoint import _cfg, make_engine, train
    from tests.two_saves import copy_root, save_two
except ImportError:  # tests/ itself on sys.path
    from test_checkpoint import _cfg, make_engine, train  # type: ignore[no-redef]
    from two_saves import copy_root, save_two  # type: ignore[no-redef]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A root with two checkpoints (step 1 and step 2, `latest` at step 2) of a stage-1 engine, and that engine's
    state after step 2."""
    root = str(tmp_path_factory.mktemp("ckpt") / "root")
    e = save_two(root)
    state = e.full_state_dict()
    e.close()
    return root, state


def _copy(saved, tmp_path) -> str:
    return copy_root(saved[0], tmp_path)


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


@pytest.mark.parametrize("field", ["step-count", "name"])
def test_flipped_byte_in_the_manifest_is_refused(saved, tmp_path, capsys, field):
    """The manifest holds what no other file checks (step counts, random states, the files' checksums): a flipped
    byte that leaves it valid JSON loaded before, a step count of 2 read as 3 (Adam's bias correction off from then
    on), and a flipped parameter name failed consolidation with a KeyError ([Note: the manifest's own checksum])."""
    from hetero.checkpoint.__main__ import main

    root = _copy(saved, tmp_path)
    path = os.path.join(root, "step-00000002", mf.MANIFEST)
    with open(path, "rb") as f:
        data = f.read()
    if field == "step-count":  # the first parameter's step count
        at = data.index(b'"embed.weight": 2', data.index(b'"param_steps"')) + len(b'"embed.weight": ')
    else:  # a parameter's name in the model's state_dict table
        at = data.index(b'"layers.0.attn.q_proj.weight"', data.index(b'"state_dict"')) + len(b'"layers.0.a')
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x01]))  # '2' -> '3', 't' -> 'u': still valid JSON
    with open(path, "rb") as f:
        json.loads(f.read())
    match = r"manifest\.json: fails its CRC32 check: the manifest is corrupt"
    with pytest.raises(CheckpointError, match=match):
        _load(root)
    capsys.readouterr()
    assert main(["consolidate", root, str(tmp_path / "out.safetensors")]) == 1
    assert re.search(match, capsys.readouterr().err)
    cs, _ = _load(os.path.join(root, "step-00000001"))  # the earlier checkpoint is untouched and loads
    assert cs == {"epoch": 1}


def test_consolidate_to_a_path_it_cannot_write(saved, tmp_path, capsys, monkeypatch):
    """The output's faults are CheckpointErrors naming the output and what to do (the CLI printed an OSError's
    traceback), found before any tensor is read where they can be; a disk that fills midway leaves no partial file
    behind (it was left as OUT.tmp, holding the space the user had just run out of)."""
    import errno

    from hetero.checkpoint import part_writer
    from hetero.checkpoint.__main__ import main

    root = saved[0]
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
        ([str(tmp_path / "no" / "such" / "out.safetensors")], r"its directory .*no/such does not exist"),
        ([str(afile)], r"afile exists and is not a directory"),
        ([str(afile), "--hf"], r"afile exists and is not a directory"),
        ([str(tmp_path) + "/.safetensors"], r"is a directory"),
    ]
    os.makedirs(tmp_path / ".safetensors")
    for out, match in cases:
        capsys.readouterr()
        assert main(["consolidate", root, *out]) == 1, out
        assert re.search(match, capsys.readouterr().err), out

    def full(fd, view, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(part_writer, "write_full", full)
    for out in ("model.safetensors", "model.pt", "folder"):
        if out.endswith(".pt"):
            monkeypatch.setattr(torch, "save", lambda obj, f: full(0, b"", 0))
        with pytest.raises(CheckpointError, match=r"cannot write .*No space left on device.*Free space") as err:
            consolidate(root, str(tmp_path / "out" / out) if out == "folder" else str(tmp_path / out))
        assert "removed" in str(err.value)
    leftover = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert leftover == [], leftover


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
        with pytest.raises(
            CheckpointError, match="cannot create the checkpoint directory .*a-file is a file, not a directory"
        ):
            e.save_checkpoint(str(afile / "ckpt"))
        with pytest.raises(CheckpointError, match=r"a-file is a file, not a directory: .*Pass the path of a directory"):
            e.save_checkpoint(str(afile))
        assert afile.read_text() == "x"
        root = _copy(saved, tmp_path)
        with pytest.raises(
            CheckpointError, match=r"exists already and is the latest: pass another tag, .*replace=True"
        ):
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
    with open(os.path.join(tag, mf.MANIFEST), "wb") as f:
        f.write(mf.sealed(manifest))
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
        with pytest.raises(CheckpointError, match="middle of gradient accumulation .* same data-parallel size, stage"):
            e.load_checkpoint(path)
    finally:
        e.close()


def _one_rank_fails(rank: int, world: int, root: str, stage: int) -> dict:
    """World 2: train and save twice, then load three times with rank 1 alone in trouble: a file its node lacks
    (the checks), a checksum failing in its range (the reads, between stage 1-2's gathers), an older tag (what
    `latest` names). Each load must end on both ranks with an error naming rank 1, well before the group's timeout;
    the last, good load must still work on both."""
    import time

    from hetero.checkpoint import load as load_mod

    torch.set_num_threads(1)
    config = {**_cfg(stage), "comm_timeout": 60}
    e = make_engine(rank, config, root)
    train(e, rank, world, 0, 1)
    e.save_checkpoint(os.path.join(root, "ckpt"))  # step 1
    train(e, rank, world, 1, 2)
    e.save_checkpoint(os.path.join(root, "ckpt"))  # step 2, `latest`
    out: dict = {}

    def attempt(name: str, path: str) -> None:
        t0 = time.monotonic()
        try:
            e.load_checkpoint(path)
            out[name] = ("loaded", "", time.monotonic() - t0)
        except Exception as err:  # noqa: BLE001 (the type is part of what is checked)
            out[name] = (type(err).__name__, str(err), time.monotonic() - t0)

    latest = os.path.join(root, "ckpt")
    check_files = mf.check_files
    if rank == 1:
        mf.check_files = lambda d, m: (_ for _ in ()).throw(CheckpointError(f"{d}: rank-00001.bin missing"))
    attempt("checks", latest)
    mf.check_files = check_files
    finish = load_mod._finish_trainable
    calls = []

    def failing_finish(engine, zc, futures):
        calls.append(zc)
        if rank == 1 and len(calls) == 2:  # after one chunk loaded (and, before the fix, gathered) on both ranks
            for f in futures:
                f.exception()
            engine.manager.unpin(zc.optim)
            raise CheckpointError("checksum mismatch in rank-00000.bin: key 7 (a range only rank 1 reads)")
        finish(engine, zc, futures)

    load_mod._finish_trainable = failing_finish
    attempt("reads", latest)
    load_mod._finish_trainable = finish
    tags = sorted(t for t in os.listdir(latest) if t.startswith("step-"))
    attempt("tags", os.path.join(latest, tags[0]) if rank == 1 else latest)
    attempt("good", latest)
    try:  # a tag each rank makes for itself (a clock, a host name): no rank commits under its own
        e.save_checkpoint(os.path.join(root, "ckpt"), tag=f"mine-{rank}")
        out["save"] = ("saved", "")
    except Exception as err:  # noqa: BLE001
        out["save"] = (type(err).__name__, str(err))
    out["dirs"] = sorted(os.listdir(latest))
    e.close()
    return out


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [2, 3])
def test_a_load_that_fails_on_one_rank_stops_every_rank(tmp_path, stage):
    """[Note: a load every rank agrees on]: a load that one rank cannot do ends with an error on every rank, naming
    that rank and what it saw, instead of leaving the others in a gather until the group's timeout (stages 1-2
    gather parameters as they load) or training on alone; ranks that would load different checkpoints all stop, and
    so do ranks that would save one under different tags."""
    try:
        from tests.dist import run_distributed
    except ImportError:
        from dist import run_distributed  # type: ignore[no-redef]

    results = run_distributed(_one_rank_fails, 2, str(tmp_path), stage, timeout=200)
    for rank, out in enumerate(results):
        for name in ("checks", "reads", "tags"):
            kind, message, seconds = out[name]
            assert kind == "CheckpointError", (rank, name, kind, message)
            assert seconds < 30, (rank, name, seconds)  # not the group's 60 s timeout
            if name == "tags":
                assert "different checkpoints" in message and "step-00000001" in message, (rank, message)
            elif rank == 0:
                assert "rank(s) 1" in message, (name, message)
                assert ("missing" if name == "checks" else "checksum mismatch") in message, (name, message)
        assert out["good"][0] == "loaded", (rank, out["good"])
        assert out["save"][0] == "CheckpointError" and "name this checkpoint differently" in out["save"][1], out["save"]
        assert not any(d.startswith(("mine-", ".tmp")) for d in out["dirs"]), out["dirs"]


def test_a_failed_save_puts_back_the_checkpoint_of_the_same_tag(saved, tmp_path, monkeypatch):
    """Saving under the tag of a checkpoint that is not the latest sets it aside until the new one is committed; a
    save that fails then puts it back, whole, instead of leaving it hidden under a temporary name."""
    from hetero.checkpoint import save as save_mod

    root = _copy(saved, tmp_path)
    old = os.path.join(root, "step-00000001")
    before = {n: os.path.getsize(os.path.join(old, n)) for n in os.listdir(old)}

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(save_mod, "_write_rank", fail)
    e = make_engine(0, _cfg(1))
    try:
        with pytest.raises(CheckpointError, match="No space left on device"):
            e.save_checkpoint(root, tag="step-00000001")
    finally:
        e.close()
    assert sorted(os.listdir(root)) == ["latest", "step-00000001", "step-00000002"]
    assert {n: os.path.getsize(os.path.join(old, n)) for n in os.listdir(old)} == before
    _load(old)  # it still loads


def test_replacing_the_latest_checkpoint(saved, tmp_path):
    """replace=True saves over the checkpoint `latest` names (as HeteroTrainer does when a resumed run saves a
    checkpoint-N folder again): the new one stands under the same tag, the old one is gone, nothing is left aside."""
    root = _copy(saved, tmp_path)
    e = make_engine(0, _cfg(1))
    try:
        e.save_checkpoint(root, client_state={"epoch": "again"}, tag="step-00000002", replace=True)
    finally:
        e.close()
    assert sorted(os.listdir(root)) == ["latest", "step-00000001", "step-00000002"]
    assert _load(root)[0] == {"epoch": "again"}


def test_trainer_folder_and_root_without_latest_resolve(saved, tmp_path, capsys):
    """A HeteroTrainer checkpoint folder (checkpoint-N/, the engine's root in its hetero/) is a checkpoint to every
    reader: load, verify, consolidate. A root that lost its `latest` names the complete checkpoints it holds."""
    from hetero.checkpoint.__main__ import main

    folder = tmp_path / "checkpoint-2"
    shutil.copytree(saved[0], folder / "hetero")
    (folder / "model.safetensors").write_bytes(b"")  # the Trainer's own files beside it
    assert mf.resolve(folder) == str(folder / "hetero" / "step-00000002")
    assert _load(str(folder))[0] == {"epoch": 2}
    assert main(["verify", str(folder)]) == 0
    assert main(["consolidate", str(folder), str(tmp_path / "x.safetensors")]) == 0
    assert capsys.readouterr().err == ""

    os.remove(folder / "hetero" / "latest")
    os.makedirs(folder / "hetero" / ".tmp-step-00000003-0123abcd")  # an interrupted save: not offered
    os.makedirs(folder / "hetero" / "notes")  # nor a folder that is no checkpoint
    for path in (folder, folder / "hetero"):
        with pytest.raises(CheckpointError) as err:
            mf.resolve(path)
        msg = str(err.value)
        assert "no latest file" in msg and "step-00000001, step-00000002" in msg, msg
        assert f"e.g. {folder / 'hetero' / 'step-00000002'}" in msg, msg
        assert ".tmp" not in msg and "notes" not in msg, msg
    assert main(["verify", str(folder)]) == 1
    assert "step-00000001, step-00000002" in capsys.readouterr().err
    assert _load(str(folder / "hetero" / "step-00000001"))[0] == {"epoch": 1}

    # The Trainer's output_dir: its checkpoint-N folders named, in step order.
    shutil.copytree(folder, tmp_path / "checkpoint-10")
    with pytest.raises(CheckpointError, match=r"checkpoints checkpoint-2, checkpoint-10: .*e\.g\. .*checkpoint-10"):
        mf.resolve(tmp_path)
    with pytest.raises(CheckpointError, match="neither a checkpoint"):  # a folder with no checkpoint in it
        mf.resolve(tmp_path / "checkpoint-2" / "hetero" / "notes")
