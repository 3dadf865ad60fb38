"""[Note: hetero's memory under inference mode]: `model.generate` and an evaluation `engine(...)` under
`torch.inference_mode()` between training steps, at stage 3 with the parameters moving between tiers (on NVMe; on the
host under a device budget of a few chunks, as on a GPU), give what they give under `torch.no_grad()`, and training
goes on as after a no_grad one.

Before, the chunk buffers hetero made or viewed inside such a forward were inference tensors, kept after it: the next
NVMe read into one (on a worker thread, never in the mode) or the next step's write into one failed with "Inplace
update to inference tensor outside InferenceMode".

Both runs are the same program on the same data, inference mode being the only difference, so their tokens, logits
and losses are compared exactly."""

from __future__ import annotations

import pytest
import torch

import hetero
from tests import test_unmodified_models as unmodified

pytest.importorskip("transformers")

PLACEMENTS = {
    "nvme": lambda tmp: {"offload": {"params": "nvme"}, "memory": {"nvme_dir": str(tmp)}},
    # A few chunks of device memory: every forward moves chunks up from the host and back.
    "host": lambda tmp: {"offload": {"params": "host"}, "memory": {"device_budget": 50_000}},
}


def _run(model: torch.nn.Module, config: dict, mode) -> dict:
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    ids = torch.randint(1, 96, (2, 8), generator=torch.Generator().manual_seed(2))
    prompts = ids[:, :5]
    out: dict = {"losses": [], "tokens": [], "logits": []}
    for _ in range(2):
        model.train()
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
        model.eval()
        with mode():
            tokens = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=3, do_sample=False)
            logits = engine(ids).logits
        out["tokens"].append(tokens.tolist())
        out["logits"].append(logits)
    model.train()
    out["losses"].append(engine(ids, labels=ids).loss.item())
    engine.close()
    return out


def _folder(path):
    path.mkdir()
    return path


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.timeout(120)
def test_generate_and_evaluate_under_inference_mode_between_steps(placement, tmp_path):
    model = unmodified.tiny_hf()
    model.generation_config.pad_token_id = 0
    config = {"zero_stage": 3, "chunk_size": 1024, **PLACEMENTS[placement](_folder(tmp_path / "a"))}
    got = _run(model, config, torch.inference_mode)
    model = unmodified.tiny_hf()
    model.generation_config.pad_token_id = 0
    want = _run(model, {**config, **PLACEMENTS[placement](_folder(tmp_path / "b"))}, torch.no_grad)
    assert got["losses"] == want["losses"]
    assert got["tokens"] == want["tokens"]
    assert all(torch.equal(g, w) for g, w in zip(got["logits"], want["logits"]))
    assert all(g.is_inference() for g in got["logits"])  # the model's outputs stay the caller's mode's
