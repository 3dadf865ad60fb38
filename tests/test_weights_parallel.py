"""weights= under tensor parallelism: the files hold whole tensors, each tensor rank keeps its own shard of every cut
weight (and the whole of a replicated one). Loaded values are compared exactly with `from_pretrained` of the same
folder: they are copied and sliced, not computed."""

from __future__ import annotations

import os

import pytest
import torch

import hetero
from tests.dist import NEEDS_DEGREES, ranks_apart, run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


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
        got = engine.full_state_dict()
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
    read = [0]
    plain = os.preadv

    def counted(fd: int, buffers: list, offset: int) -> int:
        n = plain(fd, buffers, offset)
        read[0] += n
        return n

    ref = transformers.LlamaForCausalLM.from_pretrained(folder).state_dict()
    with hetero.lazy_init():
        model = transformers.LlamaForCausalLM(_config(False))
    os.preadv = counted
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = hetero.initialize(model, opt, {"zero_stage": stage, "chunk_size": 3000}, weights=folder)
    finally:
        os.preadv = plain
    got = engine.full_state_dict()
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
