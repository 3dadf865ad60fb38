"""LoRA fine-tuning through PEFT (`peft.get_peft_model`): the base weights frozen, the adapters trained, at every
stage and with offload to the host and NVMe, against plain PyTorch's float64 and fp32 runs (tests/tolerance.py); the
frozen weights come out bit for bit as they went in, and the state dict keeps PEFT's names; the adapters saved by
PEFT's `save_pretrained` from a stage-3 engine load back with `PeftModel.from_pretrained`, bit for bit."""

from __future__ import annotations

import pytest
import torch

import hetero
from hetero.errors import ReleasedParameterError
from tests import test_unmodified_models as unmodified

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
# PEFT asks transformers for the attribute by its name before 5.x (peft's own, not ours)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _lora() -> torch.nn.Module:
    model = unmodified.tiny_hf()
    torch.manual_seed(1)
    # init_lora_weights=False: B random too, so the adapters change the loss from the first step
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    return peft.get_peft_model(model, config)


@pytest.mark.timeout(300)
def test_lora_every_stage_and_placement(tmp_path):
    model = _lora()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and any(p.requires_grad for p in model.parameters())
    batches = unmodified._lm_batches(96)
    refs = unmodified._references(model, batches, unmodified._lm_loss)
    both = {"optimizer": "nvme", "params": "nvme"}
    configs = {
        **{f"z{k}": {"zero_stage": k} for k in range(4)},
        "z2-host": {"zero_stage": 2, "offload": {"optimizer": "host"}},
        "z3-host": {"zero_stage": 3, "offload": {"optimizer": "host", "params": "host"}},
        "z3-nvme": {"zero_stage": 3, "offload": both, "memory": {"nvme_dir": str(tmp_path)}},
    }
    for name, cfg in configs.items():
        losses, state = unmodified._train(model, batches, engine_cfg=cfg, loss_of=unmodified._lm_loss)
        unmodified._compare((losses, state), refs)
        assert state.keys() == refs[1][1].keys(), name
        changed = [n for n, p in frozen.items() if not torch.equal(state[n], p)]
        assert not changed, (name, changed[:3])


@pytest.mark.timeout(300)
def test_lora_adapters_saved_from_stage_3_load_into_peft(tmp_path):
    model = _lora()
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine = hetero.initialize(model, torch.optim.AdamW(trainable, lr=1e-2), {"zero_stage": 3, "chunk_size": 8192})
    for ids in unmodified._lm_batches(96, n=2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    with pytest.raises(ReleasedParameterError, match=r"save_pretrained\(out, state_dict=engine.full_state_dict\(\)\)"):
        model.save_pretrained(tmp_path / "direct")  # it reads every weight, sharded between uses
    state = engine.full_state_dict()
    model.save_pretrained(tmp_path / "adapter", state_dict=state)
    engine.close()
    loaded = peft.PeftModel.from_pretrained(unmodified.tiny_hf(), tmp_path / "adapter").state_dict()
    adapters = [k for k in state if "lora_" in k]
    assert len(adapters) == 2 * 3 * 2  # A and B of three projections in each of two layers
    assert all(torch.equal(loaded[k], state[k]) for k in adapters)
    assert not torch.equal(state[adapters[0]], _lora().state_dict()[adapters[0]])  # trained: not the initial values


def test_lora_on_a_meta_model_is_refused_with_what_works(tmp_path):
    """get_peft_model on a model built under lazy_init leaves the adapters on meta too. Replaying the base model's
    initialiser gave LoRA's B small random values (Llama's _init_weights), not PEFT's zeros: the model did not start
    as its base model, silently. Weight files of the base model do not name PEFT's layers either. Both refused."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    base = unmodified.tiny_hf()
    state = {k: v.contiguous() for k, v in base.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    for weights in (None, tmp_path):
        with hetero.lazy_init():
            model = peft.get_peft_model(unmodified.tiny_hf(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        with pytest.raises(hetero.WeightsError, match=r"PEFT adapters on the meta device .*q_proj.*from_pretrained"):
            hetero.initialize(model, opt, {"chunk_size": 8192}, weights=weights)
