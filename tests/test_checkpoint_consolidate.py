"""Consolidation through the CLI: a Hugging Face GPT-2 trained at stage 3 exports to a directory that
`from_pretrained` loads, to .safetensors with --dtype, and `verify` checks every tensor."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import hetero
from hetero.checkpoint.__main__ import main
from hetero.checkpoint.format import TensorReader

transformers = pytest.importorskip("transformers")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "hetero.checkpoint", *args], env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.timeout(300)
def test_hf_gpt2_consolidates_for_from_pretrained(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = hetero.initialize(model, opt, {"zero_stage": 3, "chunk_size": 4096})
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 64, (2, 12), generator=g)
        engine.train_batch(x, labels=x)
    ckpt = str(tmp_path / "ckpt")
    engine.save_checkpoint(ckpt)
    want = engine.full_state_dict()
    engine.close()

    out = str(tmp_path / "export")
    r = _cli("consolidate", ckpt, out)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    got = loaded.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied

    half = str(tmp_path / "half.safetensors")
    # The rest in-process (the subprocess above is the real entry point; each costs seconds of imports).
    assert main(["consolidate", ckpt, half, "--dtype", "bf16"]) == 0
    with TensorReader(half) as reader:
        assert list(reader.entries) == list(want)
        for k, v in want.items():
            t = reader.read(k)
            assert t.dtype == (torch.bfloat16 if v.is_floating_point() else v.dtype)
            assert torch.equal(t, v.to(t.dtype)), k

    capsys.readouterr()
    assert main(["verify", ckpt]) == 0
    assert capsys.readouterr().out.startswith("ok:")
    assert main(["consolidate", str(tmp_path / "nothing-here"), str(tmp_path / "x.pt")]) == 1
    assert "no such checkpoint directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["consolidate", "--help"])
    assert "needs the whole state in memory" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    assert "follows 'latest'" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as usage:  # a shard size without --hf shards nothing: said, not ignored
        main(["consolidate", ckpt, str(tmp_path / "one.safetensors"), "--max-shard-size", "1MB"])
    assert usage.value.code == 2 and "--max-shard-size shards a --hf output" in capsys.readouterr().err
