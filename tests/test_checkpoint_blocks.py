"""Block checksums ([Note: block checksums] in hetero/checkpoint/blocks.py): a rank that needs part of a saved segment
reads and checks only the blocks overlapping it; a corrupt block is named by file and offset; checkpoints saved before
blocks (no block checksums in the manifest) load as they did."""

from __future__ import annotations

import json
import os
import random
import shutil
from collections import defaultdict

import pytest
import torch

from hetero.checkpoint import blocks
from hetero.checkpoint import format as fmt
from hetero.checkpoint import manifest as mf
from hetero.checkpoint import model_parallel as par
from hetero.checkpoint.consolidate import verify
from hetero.errors import CheckpointError
from hetero.io.checksum import checksum_fn
from tests.dist import ONLY_SEVERAL, ranks_apart, run_distributed
from tests.test_checkpoint import N, _cfg, make_engine, train
from tests.test_checkpoint_reads import _kept

SMALL = 1024  # bytes a block in these tests: the tiny model's segments (a few KiB) then span several blocks


def _spans_read(reader_cls=fmt.TensorReader):
    """Record every (path, file offset, bytes) that `TensorReader.read_spans` reads: every read of a checkpoint
    file's tensors goes through it."""
    seen: list[tuple[str, int, int]] = []
    real = reader_cls.read_spans

    def read_spans(self, spans, names):
        seen.extend((self.path, off, t.numel() * t.element_size()) for off, t in spans)
        return real(self, spans, names)

    reader_cls.read_spans = read_spans
    return seen, lambda: setattr(reader_cls, "read_spans", real)


def _write(path: str, tensors: dict[str, torch.Tensor], block_bytes: int | None) -> fmt.TensorWriter:
    plan = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    with fmt.TensorWriter(path, plan, block_bytes=block_bytes) as w:
        for k, t in tensors.items():
            w.write(k, t)
    return w


def _segment(w: fmt.TensorWriter, key: str, numel: int, block_bytes: int) -> mf.Segment:
    return mf.Segment(os.path.basename(w.path), key, 0, numel, w.crcs[key], tuple(w.blocks[key] or ()), block_bytes)


def test_blocks_leave_the_tensor_checksum_as_it_was(tmp_path):
    torch.manual_seed(0)
    tensors = {"a": torch.randn(3000), "b": torch.randn(10).to(torch.bfloat16), "c": torch.arange(700)}
    plain = _write(str(tmp_path / "plain.safetensors"), tensors, None)
    blocked = _write(str(tmp_path / "blocked.safetensors"), tensors, SMALL)
    assert blocked.crcs == plain.crcs  # what older hetero versions check stays
    fn = checksum_fn(blocked.checksum)
    for k, t in tensors.items():
        raw = fmt.as_bytes(t)
        want = [fn(raw[i : i + SMALL]) for i in range(0, len(raw), SMALL)]
        assert blocked.blocks[k] == (want if len(want) > 1 else None), k
        assert plain.blocks[k] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_range_reads_only_the_blocks_it_overlaps(tmp_path, dtype):
    torch.manual_seed(1)
    t = (torch.randn(5000) * 100).to(dtype)
    w = _write(str(tmp_path / "f.safetensors"), {"k": t}, SMALL)
    seg = _segment(w, "k", t.numel(), SMALL)
    isz, nbytes = t.element_size(), t.numel() * t.element_size()
    rng = random.Random(2)
    cases = [(0, t.numel()), (0, 1), (t.numel() - 1, 1), (SMALL // isz, SMALL // isz), (SMALL // isz - 1, 2)]
    cases += [(a, rng.randrange(1, t.numel() - a + 1)) for a in (rng.randrange(t.numel()) for _ in range(40))]
    with fmt.TensorReader(w.path) as r:
        begin = r.entry("k").begin
        for a, n in cases:
            out = torch.full((n,), 7, dtype=dtype)
            seen, undo = _spans_read()
            try:
                blocks.read_checked(r, seg, a, out)
            finally:
                undo()
            assert torch.equal(out, t[a : a + n]), (a, n)
            first, last = a * isz // SMALL * SMALL, min(-(-(a + n) * isz // SMALL) * SMALL, nbytes)
            got = sorted((off - begin, off - begin + size) for _, off, size in seen)
            assert got[0][0] == first and got[-1][1] == last, (a, n, got)  # the overlapping blocks, no more
            assert all(x[1] == y[0] for x, y in zip(got, got[1:])), got  # and each byte once
        # into another dtype (a frozen parameter's compute dtype) through scratch memory
        out = torch.empty(100, dtype=torch.float64)
        blocks.read_checked(r, seg, 1234, out)
        assert torch.equal(out, t[1234:1334].to(torch.float64))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x04]))


def test_a_corrupt_block_names_the_file_and_offset(tmp_path):
    t = torch.randn(4000)
    w = _write(str(tmp_path / "f.safetensors"), {"k": t}, SMALL)
    seg = _segment(w, "k", t.numel(), SMALL)
    with fmt.TensorReader(w.path) as r:
        begin = r.entry("k").begin
    bad = begin + 3 * SMALL + 17  # in block 3: elements 768-1023
    _flip(w.path, bad)
    with fmt.TensorReader(w.path) as r:
        out = torch.empty(500)
        blocks.read_checked(r, seg, 0, out)  # blocks 0-1: intact, and read without the bad one
        assert torch.equal(out, t[:500])
        with pytest.raises(CheckpointError) as e:
            blocks.read_checked(r, seg, 1000, out[:10])
        said = str(e.value)
        assert w.path in said and "block 3" in said and f"{begin + 3 * SMALL}-{begin + 4 * SMALL}" in said, said
        assert "corrupt" in said and "earlier checkpoint" in said
        with pytest.raises(CheckpointError, match="fails its"):  # read whole, the tensor's own checksum
            r.read("k", crc=seg.crc)


def test_a_manifest_whose_block_list_does_not_fit_is_refused(tmp_path):
    t = torch.randn(4000)
    w = _write(str(tmp_path / "f.safetensors"), {"k": t}, SMALL)
    seg = _segment(w, "k", t.numel(), SMALL)
    short = mf.Segment(seg.file, seg.key, seg.start, seg.end, seg.crc, seg.blocks[:-1], SMALL)
    with fmt.TensorReader(w.path) as r, pytest.raises(CheckpointError, match="lists 15 checksums of 1024-byte"):
        blocks.read_checked(r, short, 0, torch.empty(10))


# ---- a world-1 checkpoint loaded at world 2 -------------------------------------------------------------------
STAGES = (1, 3)


def _load(rank: int, world: int, root: str, ckpt: str, stage: int) -> dict:
    torch.set_num_threads(1)
    e = make_engine(rank, _cfg(stage), root)
    seen, undo = _spans_read()
    try:
        e.load_checkpoint(ckpt)
    except CheckpointError as err:
        return {"error": str(err)}
    finally:
        undo()
        kept = _kept(e)
        state = e.full_state_dict()
        e.close()
    return {"spans": seen, "kept": kept, "state": state if rank == 0 else None}


def _save_world_1(root: str, block_bytes: int | None) -> tuple[str, dict]:
    """A world-1 checkpoint with blocks of `block_bytes` (None: as saved before block checksums)."""
    saved, blocks.BLOCK_BYTES = blocks.BLOCK_BYTES, block_bytes
    try:
        e = make_engine(0, _cfg(1), root)
        train(e, 0, 1, 0, N)
        path = os.path.join(root, f"w1-{block_bytes}")
        e.save_checkpoint(path)
        state = e.full_state_dict()
        e.close()
    finally:
        blocks.BLOCK_BYTES = saved
    return mf.resolve(path), state


def _bytes_by_key(directory: str, spans: list) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges read of each master and optimizer-state tensor, relative to its first byte."""
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    with fmt.TensorReader(os.path.join(directory, mf.rank_file(0))) as r:
        for _, off, n in spans:
            for k, e in r.entries.items():
                if k.startswith(("master", "state.")) and off < e.end and off + n > e.begin:
                    out[k].append((max(off, e.begin) - e.begin, min(off + n, e.end) - e.begin))
    return out


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("blocks"))
    blocked, state = _save_world_1(root, SMALL)
    old, _ = _save_world_1(root, None)
    out = {}
    for stage in STAGES:
        for name, ckpt in (("blocked", blocked), ("old", old)):
            out[name, stage] = run_distributed(_load, 2, root, ckpt, stage, timeout=200)
    yield root, blocked, old, state, out
    shutil.rmtree(root, ignore_errors=True)


def _blocks_in(a: int, b: int, nbytes: int) -> set[int]:
    """The blocks lying whole in bytes [a, b) of a tensor of nbytes."""
    last = min(b // SMALL + 1, -(-nbytes // SMALL))
    return {k for k in range(a // SMALL, last) if k * SMALL >= a and min((k + 1) * SMALL, nbytes) <= b}


def _union(ranges: list[tuple[int, int]]) -> int:
    total, end = 0, 0
    for a, b in sorted(ranges):
        total += max(0, b - max(a, end))
        end = max(end, b)
    return total


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", STAGES)
def test_each_rank_reads_the_blocks_of_its_range(loads, stage):
    root, blocked, old, state, out = loads
    with open(os.path.join(blocked, mf.MANIFEST)) as f:
        entry = json.load(f)["files"][mf.rank_file(0)]
    assert entry["blocks"]["bytes"] == SMALL and entry["blocks"]["sums"]
    with open(os.path.join(old, mf.MANIFEST)) as f:
        assert "blocks" not in json.load(f)["files"][mf.rank_file(0)]  # the old format, as saved before blocks
    totals = {}
    with fmt.TensorReader(os.path.join(blocked, mf.rank_file(0))) as r:
        sizes = {k: e.nbytes for k, e in r.entries.items() if k.startswith(("master", "state."))}
    for name, directory in (("blocked", blocked), ("old", old)):
        results = out[name, stage]
        assert all("error" not in res for res in results), results
        assert all(torch.equal(state[k], results[0]["state"][k]) for k in state), f"{name}: the load changed values"
        reads = [_bytes_by_key(directory, res["spans"]) for res in results]
        totals[name] = sum(_union(r[k]) for r in reads for k in r)
        cut = 0
        for key, nbytes in sizes.items():
            _, start, pname = mf.split_key(key)
            shares = [
                sum(max(0, min(b, start + nbytes // 4) - max(a, start)) * 4 for n, a, b in res["kept"] if n == pname)
                for res in results
            ]
            assert sum(shares) == nbytes, key  # stages 1 and 3 keep disjoint shards
            got = [_union(r.get(key, [])) for r in reads]
            if sum(1 for s in shares if s) == 1:
                continue
            if name == "old":  # as before blocks: one rank reads the cut segment whole, the other only its share
                assert sorted(got) == sorted([nbytes, min(shares)]), (key, shares, got)
                continue
            cut += 1
            for rank in range(2):  # its share, and at most the block cut at each end of it
                assert shares[rank] <= got[rank] <= shares[rank] + 2 * SMALL, (key, shares, got)
            # every block of a cut segment is read whole by a rank (which checked it)
            whole = {k for r in reads for a, b in r.get(key, []) for k in _blocks_in(a, b, nbytes)}
            assert whole == set(range(-(-nbytes // SMALL))), (key, sorted(whole))
        if name == "blocked":
            assert cut, "the test needs segments that the shards cut"
    # Before: one rank read each cut segment whole. With blocks, a block at most per cut.
    assert totals["blocked"] < totals["old"], totals


def _corrupt_copy(src: str, dst: str, key: str, byte: int) -> int:
    shutil.copytree(src, dst)
    path = os.path.join(dst, mf.rank_file(0))
    with fmt.TensorReader(path) as r:
        offset = r.entry(key).begin + byte
    _flip(path, offset)
    return offset


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(300)
def test_a_corrupt_block_stops_every_rank_naming_file_and_offset(loads, tmp_path):
    # A byte flipped in the last block of a segment that the shards cut at stage 3: the rank reading that block says
    # which file and bytes, and the other ranks that it failed.
    root, blocked, _, _, _ = loads
    with fmt.TensorReader(os.path.join(blocked, mf.rank_file(0))) as r:
        key, nbytes = max(((k, e.nbytes) for k, e in r.entries.items() if k.startswith("master")), key=lambda x: x[1])
    assert nbytes > 2 * SMALL
    ckpt = str(tmp_path / "bad")
    offset = _corrupt_copy(blocked, ckpt, key, nbytes - 5)
    said = [res.get("error", "loaded") for res in run_distributed(_load, 2, root, ckpt, 3, timeout=200)]
    assert all("fails its" in s or "failed on rank" in s for s in said), said
    first = offset - (nbytes - 5) + (nbytes - 1) // SMALL * SMALL
    assert any(os.path.join(ckpt, mf.rank_file(0)) in s and f"file bytes {first}-" in s for s in said), said


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(300)
def test_verify_checks_the_blocks(loads, tmp_path):
    _, blocked, _, _, _ = loads
    assert verify(blocked) > 0
    ckpt = str(tmp_path / "edited")
    shutil.copytree(blocked, ckpt)
    with open(os.path.join(ckpt, mf.MANIFEST)) as f:
        manifest = json.load(f)
    sums = manifest["files"][mf.rank_file(0)]["blocks"]["sums"]
    key = sorted(sums)[0]
    sums[key][1] ^= 1  # a block checksum that no longer fits its bytes, in a manifest sealed again
    with open(os.path.join(ckpt, mf.MANIFEST), "wb") as f:
        f.write(mf.sealed(manifest))
    with pytest.raises(CheckpointError, match=f"{key}.* in block 1 "):
        verify(ckpt)


# ---- frozen parameters at stage 3: each rank's shard of a frozen chunk, through `Index.fill` ---------------------
TINY = 256  # bytes a block: the tiny model's frozen embedding (4 KiB in bf16) spans several


def _frozen_engine(stage: int):
    import hetero
    from tests import parity

    model = parity.build()
    model.embed.weight.requires_grad_(False)  # tied to lm_head: both frozen, in a frozen chunk
    opt = parity.make_optimizer(model)
    return hetero.initialize(model, opt, {"zero_stage": stage, "precision": "bf16", "chunk_size": 3000})


def _load_frozen(rank: int, world: int, ckpt: str) -> dict:
    torch.set_num_threads(1)
    e = _frozen_engine(3)
    kept = []
    for zc in e.chunks:
        if zc.optim is None:
            lo, hi = zc.kept_range()
            kept += [(par.stored_name(i), i.element(a), i.element(b)) for i, a, b in zc.spec.overlaps(lo, hi)]
    seen, undo = _spans_read()
    try:
        e.load_checkpoint(ckpt)
    finally:
        undo()
    state = e.full_state_dict()
    e.close()
    return {"spans": seen, "kept": kept, "state": state}


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(300)
def test_frozen_shards_read_their_blocks(tmp_path):
    saved, blocks.BLOCK_BYTES = blocks.BLOCK_BYTES, TINY
    try:
        e = _frozen_engine(1)
        train(e, 0, 1, 0, N)
        ckpt = mf.resolve(e.save_checkpoint(str(tmp_path / "ckpt")))
        state = e.full_state_dict()
        e.close()
    finally:
        blocks.BLOCK_BYTES = saved
    results = run_distributed(_load_frozen, 2, ckpt, timeout=200)
    for res in results:
        assert all(torch.equal(state[k], res["state"][k]) for k in state)
    with fmt.TensorReader(os.path.join(ckpt, mf.rank_file(0))) as r:
        key = next(k for k in r.entries if k.startswith("frozen:") and "embed" in k)
        entry, begin = r.entries[key], r.entries[key].begin
        isz = entry.dtype.itemsize
    assert entry.nbytes > 2 * TINY
    name, shares, got = mf.split_key(key)[2], [], []
    for res in results:
        shares.append(sum((b - a) * isz for n, a, b in res["kept"] if n == name))
        spans = [(max(o, begin), min(o + n, entry.end)) for _, o, n in res["spans"]]
        got.append(_union([(a, b) for a, b in spans if a < b]))
    assert sum(shares) == entry.nbytes and all(shares), shares  # the shards cut it
    for rank in range(2):  # its shard and at most a block at each end, where it read the whole tensor before
        assert shares[rank] <= got[rank] <= shares[rank] + 2 * TINY, (shares, got)
