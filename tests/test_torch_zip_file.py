"""torch.save's zip files read tensor by tensor with positioned reads ([Note: reading torch's zip format without
torch.load]): the values equal torch.load's bit for bit (compared as bytes: NaN payloads and -0.0 included), a range
reads exactly its bytes, a pickle calling anything but a state_dict's rebuild functions is refused before it runs, a
damaged file is named, and what the reader does not serve (the legacy format, compressed members, another byte
order, a sparse tensor) goes back to torch.load with a line saying why."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import hetero
from hetero.errors import WeightsError
from hetero.zero.torch_zip_file import NotServed, TorchZipFile
from hetero.zero.weights import WeightSource
from tests.dist import run_distributed


def _bits(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""  # (an empty slice keeps its strides, which view() refuses)
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g)
    w[0, 0], w[0, 1], w[0, 2] = float("nan"), -0.0, float("inf")
    shared = torch.randn(40, generator=g).to(torch.float16)
    state = {
        "fp32": w,
        "bf16": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "fp16": shared,
        "fp16.tied": shared,  # the same tensor under two names (a tied weight): one storage
        "fp16.view": shared[8:20].view(3, 4),  # a view at an offset into that storage
        "int64": torch.arange(-5, 11, dtype=torch.int64).reshape(4, 4),  # a buffer (position ids)
        "transposed": w.t(),  # not contiguous: strides (1, 5) into the fp32 storage
        "column": w[:, 3],  # not contiguous and at an offset
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),  # 0-d
        "bool": torch.tensor([True, False, True]),
        "param": torch.nn.Parameter(torch.randn(4, generator=g)),
    }
    if hasattr(torch, "float8_e4m3fn"):  # saved through _rebuild_tensor_v3 on an untyped storage
        state["fp8"] = torch.randn(9, generator=g).to(torch.float8_e4m3fn)
        state["uint16"] = torch.arange(7, dtype=torch.int32).to(torch.uint16)
    return state


def test_values_equal_torch_loads_bit_for_bit(tmp_path):
    path = tmp_path / "w.bin"
    state = _state()
    torch.save(state, path)
    ref = torch.load(path, weights_only=True)
    f = TorchZipFile(path)
    try:
        assert f.names() == list(ref)
        for k, want in ref.items():
            got = f.read(k)
            assert (got.dtype, tuple(got.shape), f.shape(k), f.dtype(k)) == (
                want.dtype,
                tuple(want.shape),
                tuple(want.shape),
                want.dtype,
            ), k
            assert _bits(got) == _bits(want), k
            n = want.numel()
            for a, b in ((0, n), (1, n - 1), (n // 2, n), (n, n)):  # ranges, as a rank's share or a tile's rows
                assert _bits(f.read_elements(k, a, b)) == _bits(want.reshape(-1)[a:b]), (k, a, b)
                buf = bytearray(max(b - a, 0) * want.element_size())
                f.read_elements(k, a, b, memoryview(buf))
                assert bytes(buf) == _bits(want.reshape(-1)[a:b]), (k, a, b)
    finally:
        f.close()


def test_a_state_dict_under_state_dict_and_an_ordered_dict(tmp_path):
    state = OrderedDict(a=torch.arange(4.0), b=torch.ones(2, 2))
    torch.save({"state_dict": state, "epoch": 3, "name": "run"}, tmp_path / "ckpt.pt")
    with WeightSource([tmp_path / "ckpt.pt"]) as source:
        assert source.keys() == ["a", "b"]
        assert torch.equal(source.read("b"), state["b"])


@contextlib.contextmanager
def _preads() -> Iterator[list[tuple[int, int]]]:
    """(offset, bytes) of every os.preadv inside the block."""
    calls, plain = [], os.preadv

    def counted(fd: int, buffers: list, offset: int) -> int:
        n = plain(fd, buffers, offset)
        calls.append((offset, n))
        return n

    os.preadv = counted
    try:
        yield calls
    finally:
        os.preadv = plain


def test_a_range_reads_exactly_its_bytes_and_torch_load_is_not_called(tmp_path, monkeypatch):
    path = tmp_path / "pytorch_model.bin"
    big = torch.randn(256, 64)
    torch.save({"big": big, "small": torch.arange(10)}, path)

    def refused(*args, **kwargs):
        raise AssertionError("torch.load was called for a zip file")

    monkeypatch.setattr(torch, "load", refused)
    with _preads() as calls:
        source = WeightSource([path])
    opened = sum(n for _, n in calls)
    assert opened == 4 + 30 * 2  # the zip magic and each storage's local header: no tensor data
    with source, _preads() as calls:
        got = source.read_elements("big", 1000, 1300)
        assert sum(n for _, n in calls) == 300 * 4  # its bytes, no more
        assert torch.equal(got, big.reshape(-1)[1000:1300])


def _evil_file(path: Path, payload: object) -> None:
    """A torch zip file whose data.pkl unpickles `payload` (its __reduce__ calls what it likes)."""
    torch.save({"w": torch.zeros(2)}, path)
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    prefix = next(iter(members)).split("/")[0]
    members[f"{prefix}/data.pkl"] = pickle.dumps({"w": payload}, protocol=2)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)


class _MakesADirectory:
    def __init__(self, where: str) -> None:
        self.where = where

    def __reduce__(self):
        return (os.mkdir, (self.where,))


def test_a_pickle_calling_anything_else_is_refused_before_it_runs(tmp_path):
    where = tmp_path / "created"
    _evil_file(tmp_path / "evil.bin", _MakesADirectory(str(where)))
    with pytest.raises(WeightsError, match=r"evil\.bin.*cannot be loaded safely.*(posix|os)\.mkdir.*weights_only"):
        TorchZipFile(tmp_path / "evil.bin")
    with pytest.raises(WeightsError, match="cannot be loaded safely"):
        WeightSource([tmp_path / "evil.bin"])
    assert not where.exists()
    # A global named as a value, not called, is refused the same way.
    _evil_file(tmp_path / "odd.bin", eval)
    with pytest.raises(WeightsError, match=r"odd\.bin.*(__builtin__|builtins)\.eval"):
        TorchZipFile(tmp_path / "odd.bin")


def test_a_damaged_file_is_named(tmp_path):
    path = tmp_path / "w.bin"
    torch.save({"a": torch.randn(1000), "b": torch.randn(1000)}, path)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])  # an interrupted download: no zip directory
    with pytest.raises(WeightsError, match=r"w\.bin.*damaged or was not fully written"):
        WeightSource([path])
    # Cut short after it was opened: the read names it.
    path.write_bytes(whole)
    with WeightSource([path]) as source:
        os.truncate(path, 2000)
        with pytest.raises(WeightsError, match=r"w\.bin.*damaged or was not fully written"):
            source.read("b")
    # A storage member that holds fewer bytes than its tensor needs.
    torch.save({"a": torch.randn(10)}, path)
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    data = next(n for n in members if n.endswith("/data/0"))
    members[data] = members[data][:8]
    with zipfile.ZipFile(tmp_path / "short.bin", "w") as z:
        for name, b in members.items():
            z.writestr(name, b)
    with pytest.raises(WeightsError, match=r"short\.bin.*holds 8 bytes"):
        TorchZipFile(tmp_path / "short.bin")


def _rewritten(src: Path, dst: Path, compress: int = zipfile.ZIP_STORED, byteorder: bytes | None = None) -> None:
    with zipfile.ZipFile(src) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    with zipfile.ZipFile(dst, "w") as z:
        for name, data in members.items():
            if byteorder is not None and name.endswith("/byteorder"):
                data = byteorder
            z.writestr(name, data, compress_type=compress if "/data/" in name else zipfile.ZIP_STORED)


@pytest.mark.parametrize("case", ["legacy", "compressed", "big-endian", "sparse"])
def test_what_it_does_not_serve_goes_to_torch_load(tmp_path, caplog, case):
    state = {"w": torch.randn(5, 3), "n": torch.arange(4)}
    path = tmp_path / "w.bin"
    if case == "legacy":
        torch.save(state, path, _use_new_zipfile_serialization=False)
        why = "legacy format"
    elif case == "sparse":
        state["s"] = torch.eye(3).to_sparse()
        torch.save(state, path)
        why = "_rebuild_sparse_tensor"
    else:
        torch.save(state, tmp_path / "plain.bin")
        if case == "compressed":
            _rewritten(tmp_path / "plain.bin", path, compress=zipfile.ZIP_DEFLATED)
            why = "compressed"
        else:
            _rewritten(tmp_path / "plain.bin", path, byteorder=b"big")
            why = "big-endian"
    with pytest.raises(NotServed, match=why):
        TorchZipFile(path)
    if case == "big-endian":
        return  # torch.load would swap bytes that were never big-endian
    with caplog.at_level(logging.WARNING, logger="hetero.zero"), WeightSource([path]) as source:
        for k in ("w", "n"):
            assert _bits(source.read(k)) == _bits(state[k]), k
    lines = [r.getMessage() for r in caplog.records if "w.bin" in r.getMessage()]
    assert len(lines) == 1, lines  # one line, saying why
    assert why in lines[0] or "legacy format" in lines[0]


# ---- at stage 3, each rank reads its share of a .bin ---------------------------------------------------------
def _llama_config():
    pytest.importorskip("transformers")
    from tests.test_weights_parallel import _config  # the tensor ranks' tiny Llama, untied

    return _config(tie=False)


def _rank_reads(rank: int, world: int, path: str, stage: int) -> tuple[int, list[str]]:
    import transformers

    ref = torch.load(path, weights_only=True)
    with hetero.lazy_init():
        model = transformers.LlamaForCausalLM(_llama_config())
    with _preads() as calls:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = hetero.initialize(model, opt, {"zero_stage": stage, "chunk_size": 3000}, weights=path)
    got = engine.full_state_dict()
    engine.close()
    return sum(n for _, n in calls), [k for k, v in ref.items() if _bits(got[k]) != _bits(v)]


@pytest.mark.timeout(240)
def test_stage_3_ranks_read_only_their_shares_of_a_bin(tmp_path):
    """A .bin was mapped whole by every rank; now, as from .safetensors ([Note: each rank reads its share]), two
    stage-3 ranks read the tensors' bytes once between them, plus each its zip magic and the storages' local headers.
    Stage 2 keeps whole parameters: each rank reads everything."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(4)
    state = transformers.LlamaForCausalLM(_llama_config()).state_dict()
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    data = sum(t.numel() * t.element_size() for t in state.values())
    headers = 4 + 30 * len(state)  # every tensor has a storage of its own here
    for stage in (3, 2):
        results = run_distributed(_rank_reads, 2, str(path), stage, timeout=200)
        assert [wrong for _, wrong in results] == [[], []]
        total = sum(n for n, _ in results)
        want = data + 2 * headers if stage == 3 else 2 * (data + headers)
        assert total == want, f"stage {stage}: the ranks read {total} bytes, {want} expected"
