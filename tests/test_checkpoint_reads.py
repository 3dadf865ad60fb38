"""What a checkpoint load reads, per rank: at ZeRO stages 1-2 a rank keeps only its shard of the master weights and
optimizer states, so it reads only that shard's bytes, except the one rank that reads and checks a saved segment
several ranks keep a part of ([Note: one rank checks a shared segment] in hetero/checkpoint/plan.py). Counted through
the reader's read functions; with the bit-exact resumes at world 2 that these reads must keep."""

from __future__ import annotations

import os
import shutil
from collections import Counter, defaultdict

import pytest
import torch

from hetero.checkpoint import format as fmt
from hetero.checkpoint import manifest as mf
from hetero.checkpoint import model_parallel as par
from hetero.errors import CheckpointError
from tests.dist import ONLY_SEVERAL, ranks_apart, run_distributed
from tests.test_checkpoint import M, N, _cfg, _check_resume, make_engine, resume_case, train

WORLD = 2
STAGES = (1, 2)
_KINDS = ("master", "state.")  # what a rank keeps a shard of at stages 1-2


def _counted_load(engine, path: str) -> Counter:
    """Load `path` into `engine`, counting the elements read of each master and optimizer-state tensor key."""
    read: Counter = Counter()
    into, many = fmt.TensorReader.read_into, fmt.TensorReader.read_many

    def read_into(self, name, out, *, start=0, crc=None):
        if name.startswith(_KINDS):
            read[name] += out.numel()
        return into(self, name, out, start=start, crc=crc)

    def read_many(self, items, *, check=True):
        for name, out, _ in items:
            if name.startswith(_KINDS):
                read[name] += out.numel()
        return many(self, items, check=check)

    fmt.TensorReader.read_into, fmt.TensorReader.read_many = read_into, read_many
    try:
        engine.load_checkpoint(path)
    finally:
        fmt.TensorReader.read_into, fmt.TensorReader.read_many = into, many
    return read


def _kept(engine) -> list[tuple[str, int, int]]:
    """The element ranges (stored name, start, end) of the parameters whose master and states this rank keeps."""
    out = []
    for zc in engine.chunks:
        if zc.optim is not None:
            lo, hi = zc.kept_range()
            out += [(par.stored_name(i), i.element(a), i.element(b)) for i, a, b in zc.spec.overlaps(lo, hi)]
    return out


def _job(rank: int, world: int, root: str, w1_ckpt: str) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    for stage in STAGES:
        e = make_engine(rank, _cfg(stage), root)
        read = _counted_load(e, w1_ckpt)
        state = e.full_state_dict()
        e.save_checkpoint(os.path.join(root, f"again-s{stage}"))  # what was loaded, saved back for the parent
        out[stage] = {"read": dict(read), "kept": _kept(e), "state": state if rank == 0 else None}
        e.close()
        # a resume in the layout that saved it stays bit-exact
        out[f"resume{stage}"] = resume_case(rank, world, _cfg(stage), os.path.join(root, f"r{stage}"), N, N + M)
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reads"))
    w1 = make_engine(0, _cfg(1), root)
    train(w1, 0, 1, 0, N)
    w1_ckpt = os.path.join(root, "w1")
    w1.save_checkpoint(w1_ckpt)
    saved_state = w1.full_state_dict()
    w1.close()
    results = run_distributed(_job, WORLD, root, w1_ckpt, timeout=400)
    yield root, w1_ckpt, saved_state, results
    shutil.rmtree(root, ignore_errors=True)


def _segments(ckpt: str) -> dict[str, tuple[str, int, int]]:
    """Every saved master and optimizer-state segment: key -> (stored name, start, end)."""
    directory = mf.resolve(ckpt)
    index = mf.Index(directory, mf.read_manifest(directory))
    return {
        s.key: (name, s.start, s.end)
        for (kind, name), segs in index.segments.items()
        if kind == "master" or kind.startswith("state.")
        for s in segs
    }


def _share(kept: list, name: str, start: int, end: int) -> int:
    return sum(max(0, min(b, end) - max(a, start)) for n, a, b in kept if n == name)


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(500)
@pytest.mark.parametrize("stage", STAGES)
def test_each_rank_reads_its_shard_and_one_rank_checks_a_shared_segment(loaded, stage):
    # A world-1 checkpoint loaded at world 2: segments are whole parameters, the ranks' shards cut some of them. At
    # stages 1-2 the shards are disjoint, so each element is kept by one rank: a rank must read exactly its share
    # of each segment, but for the one rank reading a shared segment whole to check it. Before, every rank that
    # kept a part of a segment read all of it.
    _, w1_ckpt, _, results = loaded
    segments = _segments(w1_ckpt)
    shared = 0
    for key, (name, start, end) in segments.items():
        shares = [_share(r[stage]["kept"], name, start, end) for r in results]
        assert sum(shares) == end - start, f"{key}: the shards do not cover it"
        reads = [r[stage]["read"].get(key, 0) for r in results]
        whole = [r for r in range(WORLD) if reads[r] == end - start and shares[r] < end - start]
        if sum(1 for s in shares if s) > 1:
            shared += 1
            assert len(whole) == 1, f"{key} (elements {start}-{end}, shares {shares}) read whole by ranks {whole}"
            # the checker keeps the largest share, so what it reads beyond its share is at most 1 - 1/WORLD of it
            assert shares[whole[0]] == max(shares)
        else:
            assert not whole
        for r in range(WORLD):
            assert reads[r] == (end - start if r in whole else shares[r]), f"{key}: rank {r} read {reads[r]}"
    assert shared, "the test needs segments that the shards cut"


def _all_tensors(ckpt: str) -> dict[tuple[str, str], torch.Tensor]:
    directory = mf.resolve(ckpt)
    index = mf.Index(directory, mf.read_manifest(directory))
    ends: dict[tuple[str, str], int] = defaultdict(int)
    for k, segs in index.segments.items():
        if k[0] == "master" or k[0].startswith("state."):
            ends[k] = max(s.end for s in segs)
    out = {}
    for (kind, name), n in ends.items():
        t = torch.empty(n, dtype=torch.float32)
        index.fill(kind, name, 0, t)
        out[kind, name] = t
    index.close()
    return out


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(500)
@pytest.mark.parametrize("stage", STAGES)
def test_resharded_load_and_resume_are_bit_exact(loaded, stage):
    root, w1_ckpt, saved_state, results = loaded
    # what the world-2 engine loaded from parts read by offset, saved back, is the world-1 checkpoint bit for bit
    before, after = _all_tensors(w1_ckpt), _all_tensors(os.path.join(root, f"again-s{stage}"))
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed through a load at world {WORLD}, stage {stage}"
    loaded_state = results[0][stage]["state"]
    assert all(torch.equal(saved_state[k], loaded_state[k]) for k in saved_state)
    for r in results:
        _check_resume(r[f"resume{stage}"], N, N + M)


def _load_job(rank: int, world: int, root: str, ckpt: str) -> str:
    torch.set_num_threads(1)
    e = make_engine(rank, _cfg(1), root)
    try:
        e.load_checkpoint(ckpt)
    except CheckpointError as err:
        return str(err)
    finally:
        e.close()
    return "loaded"


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(300)
def test_a_flipped_byte_in_a_part_read_unchecked_stops_every_rank(loaded, tmp_path):
    # The rank that reads only its part of a shared segment does not check it: the rank that reads it whole does,
    # and every rank learns of its error. Flip a byte in the part the other rank keeps.
    _, w1_ckpt, _, results = loaded
    ckpt = str(tmp_path / "w1")
    shutil.copytree(mf.resolve(w1_ckpt), ckpt)
    for key, (name, start, end) in sorted(_segments(ckpt).items()):
        shares = [_share(r[1]["kept"], name, start, end) for r in results]
        reads = [r[1]["read"].get(key, 0) for r in results]
        if sum(1 for s in shares if s) > 1:
            part = next(r for r in range(WORLD) if reads[r] < end - start)  # a rank that read only its share
            first = next(a for n, a, b in results[part][1]["kept"] if n == name and start <= a < end)
            break
    path = os.path.join(ckpt, mf.rank_file(0))
    with fmt.TensorReader(path) as r:
        offset = r.entry(key).begin + (first - start) * 4
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    said = run_distributed(_load_job, WORLD, str(tmp_path), ckpt, timeout=200)
    assert all(key in s or "failed on rank" in s for s in said), said
    assert any(key in s and "fails its" in s for s in said), said
