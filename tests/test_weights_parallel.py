"""weights= under tensor parallelism: the files hold whole tensors, each tensor rank reads only its own shard of every
cut weight (and the whole of a replicated one). Loaded values are compared exactly with `from_pretrained` of the same
folder: they are copied and sliced, not computed."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hetero
from tests.dist import NEEDS_DEGREES, ranks_apart, run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@contextlib.contextmanager
def _bytes_read() -> Iterator[list[int]]:
    """Counts the bytes `os.preadv` reads inside the block (the weight loader's positioned reads): [total]."""
    read, plain = [0], os.preadv

    def counted(fd: int, buffers: list, offset: int) -> int:
        n = plain(fd, buffers, offset)
        read[0] += n
        return n

    os.preadv = counted
    try:
        yield read
    finally:
        os.preadv = plain


def _config(tie: bool) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )


TP = {"zero_stage": 3, "chunk_size": 4096, "parallel": {"tensor": 2}}


def _step(engine: hetero.Engine) -> float:
    ids = torch.arange(16).reshape(2, 8) * 3 % 64
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    norm = engine.last_grad_norm
    engine.close()
    return norm


def _rank_loads_its_shards(rank: int, world: int, folders: dict[bool, str]) -> list[str]:
    from hetero.parallel import unshard

    wrong = []
    for tie, folder in folders.items():
        ref = transformers.LlamaForCausalLM.from_pretrained(folder).state_dict()
        with hetero.lazy_init():
            model = transformers.LlamaForCausalLM(_config(tie))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = hetero.initialize(model, opt, TP, weights=folder, strict_weights=True)
        cuts = {n: getattr(p, "_hetero_tp", None) for n, p in model.named_parameters(remove_duplicate=False)}
        got = engine.local_state_dict()
        shards = engine.mesh.tp.all_gather_object(got)
        assert sum(c is not None for c in cuts.values()) >= 4 * _config(tie).num_hidden_layers  # the layers are cut
        for name, want in ref.items():
            cut = cuts.get(name)
            whole = unshard([s[name] for s in shards], cut) if cut is not None else got[name]
            if not torch.equal(whole, want):
                wrong.append(f"tie={tie} {name}")
        # A step after: the same gradient norm as the model from_pretrained built, for which hetero cut the same
        # values the same way (the norm counts a shard once and a replicated weight once over the tensor ranks).
        norms = [_step(engine)]
        built = transformers.LlamaForCausalLM.from_pretrained(folder)
        norms.append(_step(hetero.initialize(built, torch.optim.SGD(built.parameters(), lr=0.1), TP)))
        if norms[0] != norms[1]:
            wrong.append(f"tie={tie} gradient norm {norms[0]} after weights=, {norms[1]} built")
    return wrong


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(240)
def test_tensor_parallel_ranks_load_their_shards_of_whole_files(tmp_path):
    folders = {}
    for tie in (True, False):
        torch.manual_seed(3)
        src = transformers.LlamaForCausalLM(_config(tie))
        folders[tie] = str(tmp_path / f"tie{int(tie)}")
        src.save_pretrained(folders[tie], max_shard_size="20KB")  # sharded, with an index
    for wrong in run_distributed(_rank_loads_its_shards, 2, folders, timeout=200):
        assert wrong == []


def _rank_reads_its_share(rank: int, world: int, folder: str, stage: int) -> tuple[int, list[str]]:
    ref = transformers.LlamaForCausalLM.from_pretrained(folder).state_dict()
    with hetero.lazy_init():
        model = transformers.LlamaForCausalLM(_config(False))
    with _bytes_read() as read:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = hetero.initialize(model, opt, {"zero_stage": stage, "chunk_size": 3000}, weights=folder)
    got = engine.local_state_dict()
    engine.close()
    return read[0], [k for k, v in ref.items() if not torch.equal(got[k], v)]


@pytest.mark.timeout(240)
def test_stage_3_ranks_read_only_their_shares(tmp_path):
    """At stage 3 each rank keeps its range of every chunk and reads only that from the files: two ranks read the
    checkpoint about once between them (each read all of it before; for a model larger than the host each read went to
    the disk). Stage 2 keeps whole parameters on every rank: each reads everything. Values equal from_pretrained's."""
    torch.manual_seed(4)
    folder = str(tmp_path / "llama")
    transformers.LlamaForCausalLM(_config(False)).save_pretrained(folder, max_shard_size="20KB")
    data = sum(t.numel() * t.element_size() for t in transformers.LlamaForCausalLM.from_pretrained(folder).parameters())
    files = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    headers = files - data  # each file's header is read once by each rank
    for stage in (3, 2):
        results = run_distributed(_rank_reads_its_share, 2, folder, stage, timeout=200)
        assert [wrong for _, wrong in results] == [[], []]
        total = sum(n for n, _ in results)
        want = data + 2 * headers if stage == 3 else 2 * (data + headers)
        assert total == want, f"stage {stage}: the ranks read {total} bytes, {want} expected"


# ---- each tensor rank reads only its shard ([Note: reading a tensor-parallel shard]) ----------------------------
def _family(name: str) -> tuple[type, Any]:
    if name == "gpt2":  # a fused q/k/v (c_attn, cut by thirds) in Conv1D weights held [in, out]: column runs
        config = transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel, config
    return transformers.LlamaForCausalLM, _config(False)


def _rank_reads_its_shards(
    rank: int, world: int, folder: str, family: str, config: dict, path: str | None = None
) -> tuple[int, int, list]:
    """Bytes this rank read through os.preadv, the bytes of its own shards (and whole replicated weights) in the
    files, and the names whose loaded values differ from from_pretrained's (of `folder`; weights= `path` if given)."""
    from hetero.parallel import unshard

    cls, model_config = _family(family)
    ref = cls.from_pretrained(folder).state_dict()
    with hetero.lazy_init():
        model = cls(model_config)
    with _bytes_read() as read:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = hetero.initialize(model, opt, config, weights=path or folder)
    own = 0
    for p in model.parameters():  # a tied weight once, as the files hold it
        cut = getattr(p, "_hetero_tp", None)
        if cut is None:
            own += p.numel() * 4
        else:
            local = cut.local_shape() if callable(getattr(cut, "local_shape", None)) else None
            own += (math.prod(local) if local else math.prod(cut.full_shape) // cut.degree) * 4  # saved in fp32
    cuts = {n: getattr(p, "_hetero_tp", None) for n, p in model.named_parameters(remove_duplicate=False)}
    got = engine.local_state_dict()
    shards = engine.mesh.tp.all_gather_object(got)
    engine.close()
    wrong = []
    for name, want in ref.items():
        if name not in cuts:
            continue  # a buffer
        whole = unshard([s[name] for s in shards], cuts[name]) if cuts[name] is not None else got[name]
        if not torch.equal(whole, want):
            wrong.append(name)
    assert any(c is not None for c in cuts.values())
    return read[0], own, wrong


_LAYOUTS = {
    "1d tensor 2": (2, "llama", {"zero_stage": 2, "parallel": {"tensor": 2}}),
    "1d tensor 2 x data 2, stage 3": (4, "llama", {"zero_stage": 3, "chunk_size": 3000, "parallel": {"tensor": 2}}),
    "1d tensor 4, fused q/k/v": (4, "gpt2", {"zero_stage": 2, "parallel": {"tensor": 4}}),
    "2d grid": (4, "llama", {"zero_stage": 2, "parallel": {"tensor": 4, "tensor_mode": "2d"}}),
}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_tensor_ranks_read_only_their_shards(tmp_path, layout):
    """Each tensor rank reads its shards' bytes from the files (row splits one run per block, column splits one run
    per row), not every whole tensor: under T tensor ranks the files were read T times. At stage 3 the data ranks of
    a tensor rank split its shards between them. Loaded values equal from_pretrained's, bit for bit."""
    from safetensors import safe_open

    world, family, config = _LAYOUTS[layout]
    cls, model_config = _family(family)
    torch.manual_seed(5)
    folder = str(tmp_path / family)
    cls(model_config).save_pretrained(folder, max_shard_size="20KB")
    data = 0
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as st:
                data += sum(math.prod(st.get_slice(k).get_shape()) * 4 for k in st.keys())  # noqa: SIM118
    files = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    headers = files - data  # each rank reads each file's header
    results = run_distributed(_rank_reads_its_shards, world, folder, family, config, timeout=280)
    assert [wrong for _, _, wrong in results] == [[]] * world
    data_ranks = world // config["parallel"]["tensor"]
    if config["zero_stage"] == 3:  # a rank reads its range of each chunk: its tensor rank's shards once over the data
        total, want = sum(n for n, _, _ in results), sum(own for _, own, _ in results) // data_ranks
        assert total == want + world * headers, f"the ranks read {total} bytes, {want + world * headers} expected"
    else:
        for rank, (n, own, _) in enumerate(results):
            assert n == own + headers, f"rank {rank} read {n} bytes, its shards hold {own} (+ {headers} of headers)"
            assert own < data  # a shard is less than the whole


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("legacy", [False, True])
def test_torch_files_give_each_tensor_rank_its_shards(tmp_path, legacy):
    """torch's zip format is read as .safetensors are ([Note: reading torch's zip format without torch.load]): each
    tensor rank reads its shards, plus the zip's magic and each storage's local header; the legacy format is loaded
    whole by torch.load on every rank. Each rank keeps its shards, the same values as from_pretrained's."""
    torch.manual_seed(6)
    folder = str(tmp_path / "llama")
    model = transformers.LlamaForCausalLM(_config(False))
    model.save_pretrained(folder)
    path = str(tmp_path / "pytorch_model.bin")
    torch.save(model.state_dict(), path, _use_new_zipfile_serialization=not legacy)
    config = {"zero_stage": 2, "parallel": {"tensor": 2}}
    results = run_distributed(_rank_reads_its_shards, 2, folder, "llama", config, path, timeout=200)
    assert [wrong for _, _, wrong in results] == [[]] * 2
    # The 4 bytes that tell a zip file, and each storage's local header (one storage per tensor here).
    headers = 4 + (0 if legacy else 30 * len(model.state_dict()))
    assert [n for n, _, _ in results] == [headers + (0 if legacy else own) for _, own, _ in results]


class _Cut:
    """A parameter stand-in carrying a tensor-parallel cut, for read_part."""

    def __init__(self, cut: Any) -> None:
        self._hetero_tp = cut


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("parts", [1, 3])
def test_a_shard_range_reads_only_its_bytes(tmp_path, dim, parts):
    """A range of a rank's shard (its part of a stage-3 chunk) is read as the runs it covers, each straight into
    the result: exactly its bytes, equal to slicing the whole tensor. Grid blocks (both dimensions, thirds of a fused
    dimension) alike."""
    from safetensors.torch import save_file

    from hetero.parallel.grid.shard import BlockShard
    from hetero.parallel.tensor import TPShard
    from hetero.zero import weights

    whole = torch.randn(24, 36).to(torch.bfloat16)
    save_file({"w": whole}, str(tmp_path / "w.safetensors"))
    cuts = [TPShard(dim=dim, parts=parts, degree=2, rank=r, full_shape=(24, 36)) for r in range(2)]
    blocks = tuple((i, j) for i in range(2) for j in range(2))
    cuts += [BlockShard((24, 36), (0, 1), (2, 2), blocks, rank=r, fused=parts, fused_dim=dim) for r in range(4)]
    with weights.WeightSource([tmp_path / "w.safetensors"]) as source:
        for cut in cuts:
            want = (cut.shard_of(whole) if isinstance(cut, BlockShard) else _tp_slice(whole, cut)).reshape(-1)
            for a, b in ((0, want.numel()), (5, want.numel() - 7), (13, 14), (3, 3)):
                with _bytes_read() as read:
                    got = weights.read_part(source, "w", _Cut(cut), a, b)
                assert torch.equal(got, want[a:b]), (cut, a, b)
                assert read[0] == (b - a) * whole.element_size(), (cut, a, b, read[0])


def _tp_slice(whole: torch.Tensor, cut: Any) -> torch.Tensor:
    blocks = whole.chunk(cut.parts, cut.dim)
    return torch.cat([b.chunk(cut.degree, cut.dim)[cut.rank] for b in blocks], cut.dim)
