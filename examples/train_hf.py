"""Train a Hugging Face causal LM, built from a config (no downloads), with hetero on the shipped corpus.

The same loop, flags and closing report as examples/train_gpt.py; only the model differs. Hugging Face models shift
labels themselves, so the batches carry labels = input_ids (`hf_labels=True`).

    pip install transformers
    python examples/train_hf.py                  # a 2-layer GPT-2
    python examples/train_hf.py --model llama    # a 2-layer Llama (RMSNorm, rotary positions, SwiGLU, GQA)
    torchrun --nproc_per_node=2 examples/train_hf.py
"""

from __future__ import annotations

import argparse
import sys

import torch
from corpus import VOCAB_SIZE
from torch import nn

# train_gpt.py, next to this file (on sys.path when run as a script), holds the shared loop and report.
from train_gpt import add_training_args, check_training_args, report, run_cli, train

BLOCK_SIZE = 128


def build_model(kind: str) -> nn.Module:
    try:
        import transformers
    except ImportError:
        sys.exit("this example needs Hugging Face transformers: pip install transformers")
    # Byte-level vocabulary: the special token ids must lie inside it; no KV cache while training.
    common = {"vocab_size": VOCAB_SIZE, "bos_token_id": 0, "eos_token_id": 0, "use_cache": False}
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=BLOCK_SIZE, **common)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=BLOCK_SIZE,
            **common,
        )
        model = transformers.LlamaForCausalLM(cfg)
    # Names the loss the model computes from labels (shifted next-token cross entropy, what it uses anyway):
    # left unset, transformers warns that it is unrecognized.
    model.loss_type = "ForCausalLM"
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="gpt2", choices=("gpt2", "llama"), help="a 2-layer GPT-2 or Llama (default %(default)s)"
    )
    add_training_args(ap, steps=1000, batch_size=8, lr=3e-3)
    args = ap.parse_args()
    check_training_args(ap, args)
    torch.manual_seed(args.seed)  # reproducible initial weights (hetero then gives every rank rank 0's)
    model = build_model(args.model)
    report(train(args, model, block_size=BLOCK_SIZE, hf_labels=True), as_json=args.json)


if __name__ == "__main__":
    run_cli(main)
