"""HeteroTrainer: Hugging Face's Trainer training through hetero gives the plain Trainer's logs, resumes exactly,
and runs under torchrun with ZeRO-3 and the optimizer on NVMe (examples/train_trainer.py).

Tolerance: both trainers do the same fp32 operations in the same order on one process, except that hetero computes
the clipping norm in float64 and steps AdamW with torch's fused kernel; each perturbs an update by an fp32 ulp or
two (~1e-7 relative), so over a dozen updates the losses agree to far better than rtol 1e-5 (measured: equal).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("accelerate")

from hetero.errors import ConfigError  # noqa: E402
from hetero.integrations.transformers import HETERO_DIR, HeteroTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-5


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    model = transformers.GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    return model


def _args(out: Path, **kw) -> transformers.TrainingArguments:
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=3,
        num_train_epochs=2,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        weight_decay=0.1,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _logs(trainer) -> list[tuple]:
    keys = ("loss", "grad_norm", "learning_rate", "eval_loss")
    return [tuple(h.get(k) for k in keys) for h in trainer.state.log_history if "loss" in h or "eval_loss" in h]


def _close(a: list[tuple], b: list[tuple]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            assert (u is None) == (v is None)
            if u is not None:
                assert abs(u - v) <= RTOL * abs(u) + 1e-12, (x, y)


def _both(tmp_path, args: dict, rows: int, *, model=_model, before_hetero=None) -> tuple:
    """The plain Trainer, then HeteroTrainer at ZeRO-3, each on a fresh `model()` with the same arguments, trained;
    before_hetero() runs between the two."""
    plain = transformers.Trainer(model=model(), args=_args(tmp_path / "a", **args), train_dataset=Rows(rows, 1))
    plain.train()
    if before_hetero is not None:
        before_hetero()
    het = HeteroTrainer(
        model=model(),
        args=_args(tmp_path / "b", **args),
        train_dataset=Rows(rows, 1),
        hetero_config={"zero_stage": 3, "chunk_size": 4096},
    )
    het.train()
    return plain, het


@pytest.mark.parametrize("stage", [0, 3])
def test_matches_plain_trainer(tmp_path, stage):
    """26 rows, 4 per micro-batch, 3 per accumulation: each epoch ends with a 1-batch accumulation; evaluation,
    cosine schedule with warmup, clipping at 1.0 (the Trainer's default), grad norms and learning rates logged."""
    plain = transformers.Trainer(
        model=_model(), args=_args(tmp_path / "a"), train_dataset=Rows(26, 1), eval_dataset=Rows(8, 2)
    )
    plain.train()
    het = HeteroTrainer(
        model=_model(),
        args=_args(tmp_path / "b"),
        train_dataset=Rows(26, 1),
        eval_dataset=Rows(8, 2),
        hetero_config={"zero_stage": stage, "chunk_size": 4096},
    )
    het.train()
    _close(_logs(plain), _logs(het))
    assert het.engine.global_steps == plain.state.global_step == 6
    # trainer.predict: the trained model's logits and the test loss, as the plain Trainer's (same tolerance).
    want, got = plain.predict(Rows(6, 3)), het.predict(Rows(6, 3))
    assert got.predictions.shape == want.predictions.shape == (6, 16, 64)
    logits, ref = torch.from_numpy(got.predictions), torch.from_numpy(want.predictions)
    torch.testing.assert_close(logits, ref, rtol=RTOL, atol=1e-6)
    _close([(want.metrics["test_loss"],)], [(got.metrics["test_loss"],)])
    # The saved model is the trained one: same weights as the plain Trainer's (the gathered fp32 values).
    het.save_model(str(tmp_path / "export"))
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "export"))
    for (n, p), q in zip(plain.model.named_parameters(), back.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), n
    het.engine.close()


def test_one_process_on_a_machine_with_several_gpus(tmp_path):
    """`python train.py` on a machine with 2 GPUs: TrainingArguments count them (n_gpu = 2, set here by hand as
    `_setup_devices` sets it there) and the plain Trainer would use nn.DataParallel, with batches of 2 x
    per_device_train_batch_size and the loss multiplied by 2 for the replicas' mean. HeteroTrainer's engine is one
    device per process: it trains with the per-device batch and logs what the plain Trainer logs on one device (the
    loss and gradient norm were twice the plain Trainer's, on twice its batch)."""
    args = {"num_train_epochs": 1, "max_steps": 3, "eval_strategy": "no"}
    plain = transformers.Trainer(model=_model(), args=_args(tmp_path / "a", **args), train_dataset=Rows(26, 1))
    plain.train()
    two_gpus = _args(tmp_path / "b", **args)
    two_gpus._n_gpu = 2
    het = HeteroTrainer(model=_model(), args=two_gpus, train_dataset=Rows(26, 1), hetero_config={"zero_stage": 3})
    het.train()
    assert het.args.train_batch_size == 4
    _close(_logs(plain), _logs(het))
    het.engine.close()


@pytest.mark.filterwarnings("error:Seems like `optimizer.step\\(\\)` has been overridden:UserWarning")
@pytest.mark.filterwarnings("error:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_optimizers_argument(tmp_path):
    """`Trainer(optimizers=(optimizer, scheduler))`: the user's own optimizer and scheduler drive the engine's update
    as the plain Trainer's, and torch does not warn that the optimizer's step was replaced after the scheduler was
    built (hetero refuses that step on purpose: [Note: the optimizer handed over]); it did on every run."""

    def run(cls, out: Path, **kw) -> transformers.Trainer:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        args = _args(out, num_train_epochs=1, max_steps=3, eval_strategy="no")
        trainer = cls(model=model, args=args, train_dataset=Rows(26, 1), optimizers=(opt, sched), **kw)
        trainer.train()
        return trainer

    plain = run(transformers.Trainer, tmp_path / "a")
    het = run(HeteroTrainer, tmp_path / "b", hetero_config={"zero_stage": 3, "chunk_size": 4096})
    assert [x[2] for x in _logs(het)] == [3e-3, 1.5e-3, 1e-3]  # the user's schedule
    _close(_logs(plain), _logs(het))
    het.engine.close()


def test_model_init_trains_again_from_a_fresh_model(tmp_path):
    """`Trainer(model_init=...)` builds a fresh model for every train() (what hyperparameter_search's trials do) and
    drops its optimizer: the second train() logs what the first did, as with the plain Trainer; it failed building the
    scheduler on the first engine's optimizer, which the Trainer had set to None."""
    args = _args(tmp_path, num_train_epochs=1, max_steps=2, eval_strategy="no")
    het = HeteroTrainer(model_init=_model, args=args, train_dataset=Rows(26, 1), hetero_config={"zero_stage": 3})
    het.train()
    first, engine = _logs(het), het.engine
    het.train()
    assert het.engine is not engine and het.engine.module is het.model
    assert _logs(het)[-len(first) :] == first
    het.engine.close()


def test_fp16_overflow_is_logged_and_not_scheduled(tmp_path):
    """fp16 with the second update's loss made infinite (an overflow): that update is skipped, the LR schedule does not
    advance for it (accelerate's convention for a skipped step), and the log shows a non-finite gradient norm, as the
    plain Trainer logs the overflowed norm; it showed the first update's norm again, as if that step had trained."""
    calls = []

    def loss_fn(outputs, labels, num_items_in_batch=None):  # the causal LM loss; the second call's overflows
        calls.append(1)
        logits = outputs.logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return loss * float("inf") if len(calls) == 2 else loss

    args = _args(tmp_path, max_steps=4, fp16=True, eval_strategy="no", gradient_accumulation_steps=1)
    het = HeteroTrainer(
        model=_model(), args=args, train_dataset=Rows(26, 1), compute_loss_func=loss_fn, hetero_config={"zero_stage": 3}
    )
    het.train()
    logs = _logs(het)
    assert het.engine.skipped_steps == 1 and het.engine.global_steps == 3 and het.lr_scheduler.last_epoch == 3
    assert [x[2] for x in logs] == [0.0, 1.5e-3, 1.5e-3, 3e-3]  # warmup 2: the skipped update left the rate as it was
    assert math.isfinite(logs[0][1]) and not math.isfinite(logs[1][1]) and math.isfinite(logs[2][1])
    het.engine.close()


def test_activation_checkpointing_argument(tmp_path):
    """`TrainingArguments(activation_checkpointing=True)` (`gradient_checkpointing` before transformers 5.x renamed
    it): the Trainer turns on the model's own checkpointing before hetero wraps it; ZeRO-3 then logs what the plain
    Trainer logs with it."""
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    args = {"num_train_epochs": 1, "max_steps": 3, "eval_strategy": "no", name: True}
    plain, het = _both(tmp_path, args, 36)
    model = het.engine.module  # the model hetero trains recomputes its layers
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    _close(_logs(plain), _logs(het))
    het.engine.close()


def test_save_steps_and_resume(tmp_path):
    """save_steps writes the Trainer's checkpoint with hetero's inside; resuming from it continues bit-exactly. The
    resumed run saves into the same output directory, as a user resuming a run does: it saves checkpoint-6 again,
    replacing the first run's whole (the Trainer's files and hetero's), as the plain Trainer replaces its own."""
    args = dict(num_train_epochs=1, max_steps=6, save_strategy="steps", save_steps=3, eval_strategy="no")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    config = {"zero_stage": 3, "offload": {"optimizer": "nvme"}, "memory": {"nvme_dir": str(nvme)}}
    full = HeteroTrainer(
        model=_model(), args=_args(tmp_path / "full", **args), train_dataset=Rows(80, 1), hetero_config=config
    )
    full.train()
    ckpt = tmp_path / "full" / "checkpoint-3"
    assert (ckpt / HETERO_DIR / "latest").is_file() and (ckpt / "model.safetensors").is_file()
    last = tmp_path / "full" / "checkpoint-6"
    first_manifest = (last / HETERO_DIR / "step-00000006" / "manifest.json").read_bytes()
    resumed = HeteroTrainer(
        model=_model(), args=_args(tmp_path / "full", **args), train_dataset=Rows(80, 1), hetero_config=config
    )
    resumed.train(resume_from_checkpoint=str(ckpt))
    tail = [x for x in _logs(full)[3:]]
    again = [x for x in _logs(resumed)][-3:]
    assert tail == again  # bit-exact: the same master weights, Adam states, scheduler and data position
    assert resumed.lr_scheduler.last_epoch == full.lr_scheduler.last_epoch == 6
    full.engine.close()
    resumed.engine.close()
    # checkpoint-6 is the second run's throughout: hetero's checkpoint was replaced, nothing set aside is left,
    # and its weights (consolidated from the Trainer's folder itself) are those of the Trainer's model.safetensors.
    from safetensors.torch import load_file

    from hetero.checkpoint.__main__ import main

    assert (last / HETERO_DIR / "step-00000006" / "manifest.json").read_bytes() != first_manifest
    assert sorted(os.listdir(last / HETERO_DIR)) == ["latest", "step-00000006"]
    assert main(["consolidate", str(last), str(tmp_path / "x.safetensors")]) == 0
    hetero_weights, trainer_weights = load_file(tmp_path / "x.safetensors"), load_file(last / "model.safetensors")
    assert trainer_weights and set(trainer_weights) <= set(hetero_weights)
    for k, v in trainer_weights.items():
        assert torch.equal(hetero_weights[k], v), k


def test_config_conflicts_and_non_elementwise_optimizer(tmp_path):
    with pytest.raises(ConfigError, match="grad_accumulation_steps"):
        HeteroTrainer(
            model=_model(),
            args=_args(tmp_path, eval_strategy="no"),
            train_dataset=Rows(8, 1),
            hetero_config={"grad_accumulation_steps": 5},
        ).train()
    # update_in_backward cannot clip by the whole gradient's norm, and the Trainer clips at 1.0 unless told
    # otherwise: the error names the argument the user never set (before, only hetero's grad_clip_norm).
    with pytest.raises(ConfigError, match=r"grad_clip_norm is max_grad_norm \(here 1.0.*0 turns clipping off"):
        HeteroTrainer(
            model=_model(),
            args=_args(tmp_path, eval_strategy="no"),
            train_dataset=Rows(8, 1),
            hetero_config={"update_in_backward": True},
        ).train()
    # Tensor and pipeline layouts: the Trainer gives every rank a batch of its own, so a tensor group's ranks (2 under
    # torchrun) stopped at their first forward with a BatchMismatchError telling them to shard the data by
    # data-parallel rank, which the Trainer does not let them do; refused up front, before the engine is built.
    for parallel in ({"tensor": 2}, {"pipeline": 2}):
        with pytest.raises(ConfigError, match="HeteroTrainer trains data parallel only"):
            HeteroTrainer(
                model=_model(),
                args=_args(tmp_path, eval_strategy="no"),
                train_dataset=Rows(8, 1),
                hetero_config={"parallel": parallel},
            ).train()
    # transformers' own Adafactor factors its second moment: refused, saying why.
    trainer = HeteroTrainer(
        model=_model(), args=_args(tmp_path, optim="adafactor", eval_strategy="no"), train_dataset=Rows(8, 1)
    )
    with pytest.raises(ConfigError, match="cannot run on hetero's flat shards"):
        trainer.train()


@pytest.mark.timeout(400)
def test_example_under_torchrun_zero3_nvme(tmp_path):
    """The runnable example, 2 processes, ZeRO-3, optimizer states on NVMe: its losses match the plain Trainer's
    (DDP on gloo) under the example's own tolerance, and the optimizer states really went through the swap files."""
    from tests.dist import run_torchrun, torchrun_failure

    cmd = [str(ROOT / "examples" / "train_trainer.py"), "--compare", "--json", "--steps", "6", "--eval-steps", "3"]
    cmd += ["--nvme-dir", str(tmp_path), "--embd", "32", "--block-size", "32"]
    proc = run_torchrun(cmd, nproc=2, timeout=380, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, torchrun_failure(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["match"] and len(result["losses"]) == 6 and len(result["eval_losses"]) == 2
    assert result["memory"]["moved"].get("host->nvme", 0) > 0


def _lora() -> torch.nn.Module:
    import peft

    model = _model()
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True)
    return peft.get_peft_model(model, config)


# PEFT asks transformers for the attribute by its name before 5.x (peft's own, not ours)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_adapters(tmp_path):
    """A PEFT LoRA model under ZeRO-3 logs what the plain Trainer logs, and save_model writes PEFT's adapter files
    (the gathered values), which load back into the base model with the plain Trainer's adapters."""
    peft = pytest.importorskip("peft")
    plain, het = _both(tmp_path, {"num_train_epochs": 1, "max_steps": 4, "eval_strategy": "no"}, 48, model=_lora)
    _close(_logs(plain), _logs(het))
    het.save_model(str(tmp_path / "export"))
    het.engine.close()
    assert (tmp_path / "export" / "adapter_model.safetensors").exists()
    back = dict(peft.PeftModel.from_pretrained(_model(), str(tmp_path / "export")).named_parameters())
    trained = {n: p for n, p in plain.model.named_parameters() if "lora_" in n}
    assert len(trained) == 4  # A and B in each of two layers
    for n, p in trained.items():
        assert torch.allclose(back[n], p, rtol=1e-4, atol=1e-6), n


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_with_label_smoothing(tmp_path):
    """`label_smoothing_factor`: the Trainer smooths a causal LM's loss on shifted labels, finding the model's class
    through a PEFT model's base model; HeteroTrainer's wrapped model named the PeftModel's class instead, so the loss
    was smoothed on unshifted labels (another loss, gradient norms several times the plain Trainer's, no error)."""
    pytest.importorskip("peft")
    args = {"num_train_epochs": 1, "max_steps": 2, "eval_strategy": "no", "label_smoothing_factor": 0.1}
    plain, het = _both(tmp_path, args, 24, model=_lora)
    _close(_logs(plain), _logs(het))
    het.engine.close()


def test_torch_compile_argument(tmp_path):
    """`TrainingArguments(torch_compile=True)`: accelerate compiles only what it prepares, never hetero's model, so
    HeteroTrainer compiles the model in place; ZeRO-3 then logs what the plain compiled Trainer logs."""
    import torch._dynamo

    from hetero import standin

    if standin.active():
        pytest.skip("torch.compile falls back to eager under the stand-in's dispatch mode")
    args = {"num_train_epochs": 1, "max_steps": 3, "eval_strategy": "no", "torch_compile": True}
    args["torch_compile_backend"] = "aot_eager"  # traced as inductor would, run on torch's kernels: no C++ compiler

    def fresh_counts() -> None:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()

    plain, het = _both(tmp_path, args, 36, before_hetero=fresh_counts)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # hetero's model was compiled
    _close(_logs(plain), _logs(het))
    het.engine.close()
