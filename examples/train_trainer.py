"""Train a Hugging Face GPT-2 with `transformers.Trainer` through hetero (HeteroTrainer), on the shipped corpus.

The Trainer keeps its loop (gradient accumulation, LR schedule, logging, evaluation, save_steps, resume); hetero
holds the model's states in chunks: by default ZeRO stage 3 with the optimizer states on NVMe (a temporary directory
unless --nvme-dir). With --compare the plain `transformers.Trainer` trains the same model on the same data first,
and the script checks that both logged the same losses (fp32).

    pip install 'hetero[transformers]'
    python examples/train_trainer.py --compare
    torchrun --nproc_per_node=2 examples/train_trainer.py --compare
    python examples/train_trainer.py --save-steps 4 --output-dir out && \\
        python examples/train_trainer.py --output-dir out --resume out/checkpoint-4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

import torch

try:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
except ImportError:
    sys.exit("this example needs transformers and accelerate: pip install 'hetero[transformers]'")

# corpus.py, next to this file (on sys.path when run as a script), reads the shipped byte-level corpus.
from corpus import VOCAB_SIZE, encode, load_corpus
from train_gpt import memory_report, non_negative_int, positive_int, run_cli
from transformers.trainer_utils import get_last_checkpoint

from hetero.integrations.transformers import HeteroTrainer

# Why --compare's tolerance is what it is: both runs do the same fp32 arithmetic except the order of a few
# reductions (the gradient mean over ranks, the clipping norm in float64 here, fused vs foreach AdamW), which perturbs
# each update by a few fp32 ulps (~1e-7 relative); over a few dozen updates that stays far below 1e-4.
RTOL = 1e-4
EVAL_WINDOWS = 8  # the evaluation set: the windows right after the training ones


class Windows(torch.utils.data.Dataset):
    """Non-overlapping windows of the byte-level corpus; labels are the inputs (the model shifts them)."""

    def __init__(self, text: str, block: int, first: int, count: int) -> None:
        data = encode(text).long()
        self.rows = [data[(first + i) * block : (first + i + 1) * block] for i in range(count)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def build_model(args: argparse.Namespace) -> GPT2LMHeadModel:
    torch.manual_seed(args.seed)
    cfg = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=args.block_size,
        n_embd=args.embd,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,  # no dropout: --compare checks the two Trainers' losses step by step
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    return model


def train_windows(args: argparse.Namespace, corpus_bytes: int) -> int:
    """How many training windows: one per sample of the run, or as many as the corpus holds beside the evaluation's
    (the Trainer then goes over them for several epochs until max_steps)."""
    wanted = args.steps * args.batch_size * args.grad_accum * int(os.environ.get("WORLD_SIZE", "1"))
    return min(wanted, corpus_bytes // args.block_size - EVAL_WINDOWS)


def datasets(args: argparse.Namespace) -> tuple[Windows, Windows]:
    """The training windows and, after them, the evaluation's."""
    text = load_corpus()
    # Windows past the corpus' end came out short or empty, and the collator failed on them ("stack expects each
    # tensor to be equal size") once --steps x batch asked for more text than the corpus holds.
    n_train = train_windows(args, len(encode(text)))
    return Windows(text, args.block_size, 0, n_train), Windows(text, args.block_size, n_train, EVAL_WINDOWS)


def train(args: argparse.Namespace, hetero: bool, output_dir: str, nvme_dir: str) -> list[dict]:
    train_set, eval_set = datasets(args)
    targs = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 10),
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=1,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=args.json,
    )
    kw = {}
    cls = Trainer
    if hetero:
        cls = HeteroTrainer
        kw["hetero_config"] = {
            "zero_stage": args.zero_stage,
            "offload": {"optimizer": args.offload_optimizer, "params": args.offload_params},
            "memory": {"nvme_dir": nvme_dir},
        }
    trainer = cls(model=build_model(args), args=targs, train_dataset=train_set, eval_dataset=eval_set, **kw)
    trainer.train(resume_from_checkpoint=args.resume)
    logs = [h for h in trainer.state.log_history if "loss" in h or "eval_loss" in h]
    if hetero and trainer.engine is not None:
        logs.append({"memory": trainer.engine.memory_stats()})
        trainer.engine.close()
    return logs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zero-stage", type=int, default=3, choices=(0, 1, 2, 3))
    ap.add_argument("--offload-optimizer", default="nvme", choices=("device", "host", "nvme"))
    ap.add_argument("--offload-params", default="device", choices=("device", "host", "nvme"))
    ap.add_argument("--nvme-dir", default=None, help="swap directory (default: a temporary one)")
    ap.add_argument("--steps", type=positive_int, default=12, help="optimizer updates")
    ap.add_argument("--batch-size", type=positive_int, default=4, help="per rank and micro-batch")
    ap.add_argument("--grad-accum", type=positive_int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--layers", type=positive_int, default=2)
    ap.add_argument("--embd", type=positive_int, default=64)
    ap.add_argument("--heads", type=positive_int, default=4)
    ap.add_argument("--block-size", type=positive_int, default=64)
    ap.add_argument("--eval-steps", type=non_negative_int, default=6, help="0: no evaluation")
    ap.add_argument("--save-steps", type=non_negative_int, default=0, help="0: no checkpoints")
    ap.add_argument("--output-dir", default=None, help="default: a temporary directory")
    ap.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        help="resume from a checkpoint directory, or (no value) the last one in --output-dir",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", action="store_true", help="train with the plain Trainer first and compare losses")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end (rank 0)")
    args = ap.parse_args()
    if args.resume is True and args.output_dir is None:
        ap.error("--resume without a checkpoint directory resumes the last one in --output-dir: give --output-dir")
    # Checked before the runs: the Trainer's own refusals come as tracebacks, after the model is built.
    if isinstance(args.resume, str) and not os.path.isdir(args.resume):
        ap.error(
            f"--resume {args.resume}: no such checkpoint directory; give one of the checkpoint-N directories a run "
            "with --save-steps wrote, or --resume alone for the last one in --output-dir"
        )
    if args.resume is True and (not os.path.isdir(args.output_dir) or get_last_checkpoint(args.output_dir) is None):
        ap.error(f"--resume: {args.output_dir} holds no checkpoint-N directory; train with --save-steps first")
    if args.compare and args.resume:
        ap.error("--compare trains both Trainers from the start: drop --resume (or --compare)")
    corpus_bytes = len(encode(load_corpus()))
    if train_windows(args, corpus_bytes) < 1:
        ap.error(
            f"--block-size {args.block_size}: the corpus ({corpus_bytes} bytes) holds too few windows for training "
            f"and {EVAL_WINDOWS} for evaluation: give a smaller --block-size"
        )
    transformers.logging.set_verbosity_error()
    rank = int(os.environ.get("RANK", "0"))
    with tempfile.TemporaryDirectory() as tmp:
        out = args.output_dir or os.path.join(tmp, "out")
        nvme = args.nvme_dir or os.path.join(tmp, "nvme")
        os.makedirs(nvme, exist_ok=True)
        plain = train(args, False, os.path.join(tmp, "plain"), nvme) if args.compare else None
        logs = train(args, True, out, nvme)
    losses = [h["loss"] for h in logs if "loss" in h]
    result = {"losses": losses, "eval_losses": [h["eval_loss"] for h in logs if "eval_loss" in h]}
    result["memory"] = next((h["memory"] for h in logs if "memory" in h), None)
    ok = True
    if plain is not None:
        ref = [h["loss"] for h in plain if "loss" in h]
        ref_eval = [h["eval_loss"] for h in plain if "eval_loss" in h]
        pairs = list(zip(ref, losses)) + list(zip(ref_eval, result["eval_losses"]))
        worst = max((abs(a - b) / abs(a) for a, b in pairs), default=math.inf)
        ok = len(ref) == len(losses) and len(ref_eval) == len(result["eval_losses"]) and worst <= RTOL
        result.update(plain_losses=ref, plain_eval_losses=ref_eval, max_rel_diff=worst, match=ok)
    if rank == 0:
        if args.json:
            print(json.dumps(result))
        else:
            for i, loss in enumerate(losses):
                line = f"update {i + 1:3d}  loss {loss:.6f}"
                if plain is not None and i < len(result["plain_losses"]):
                    line += f"   plain Trainer {result['plain_losses'][i]:.6f}"
                print(line)
            if plain is not None:
                print(f"largest relative difference {result['max_rel_diff']:.2e} (tolerance {RTOL:g}): "
                      f"{'match' if ok else 'MISMATCH'}")  # fmt: skip
            if result["memory"] is not None:
                print(f"\nhetero's tiers (rank 0):\n{memory_report(result['memory'])}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    run_cli(main)
