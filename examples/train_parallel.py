"""Train a small GPT with tensor x pipeline x data parallelism (and ZeRO over the data-parallel ranks), under torchrun.

The world is split by the degrees given: `--tensor` ranks shard every layer (Megatron-style 1D, or on a 2D / 2.5D / 3D
grid with `--tensor-mode`; with `--sequence ulysses` or `ring` they split the sequence instead), `--pipeline` ranks
hold a run of the layers each, and the data-parallel degree is what is left of the world size. Every rank of a
data-parallel group reads that group's slice of the global batch (`engine.data_parallel_rank` / `_size`);
`engine.train_batch` splits it into micro-batches, runs the pipeline schedule and returns the global mean loss.
After training, `engine.eval_batch` evaluates a held-out batch through the same layout and greedily generates a few
tokens from prompts of the corpus: each step runs a forward only across the stages and returns the whole logits
(gathered from the tensor ranks) on every rank, so every rank appends the same tokens.

    torchrun --nproc_per_node=8 examples/train_parallel.py --tensor 2 --pipeline 2          # 2 x 2 x dp 2
    torchrun --nproc_per_node=4 examples/train_parallel.py --pipeline 4 --schedule interleaved_1f1b --microbatches 8 \
        --layers 6
    torchrun --nproc_per_node=4 examples/train_parallel.py --pipeline 4 --schedule chimera --microbatches 4
    torchrun --nproc_per_node=2 examples/train_parallel.py --tensor 2 --sequence --zero-stage 3
    torchrun --nproc_per_node=8 examples/train_parallel.py --tensor 4 --tensor-mode 2d --pipeline 2  # SUMMA x pp 2
    torchrun --nproc_per_node=8 examples/train_parallel.py --tensor 8 --tensor-mode 3d --zero-stage 3
    torchrun --nproc_per_node=4 examples/train_parallel.py --tensor 4 --sequence ring --zero-stage 3
    python examples/train_parallel.py                        # one process: micro-batches only
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from corpus import VOCAB_SIZE, batches, decode
from tqdm import tqdm

# train_gpt.py, next to this file (on sys.path when run as a script): the flag types it checks
from train_gpt import add_data_arg, non_negative_int, positive_int, read_text, run_cli

import hetero
from hetero.models.gpt import GPTConfig
from hetero.models.gpt_pipe import TP_PLAN, GPTPipe


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensor", type=positive_int, default=1, help="tensor-parallel degree (default 1)")
    ap.add_argument(
        "--tensor-mode", default="1d", choices=("1d", "2d", "2.5d", "3d"), help="how layers are cut (default 1d)"
    )
    ap.add_argument("--tensor-depth", type=positive_int, default=None, help="depth of --tensor-mode 2.5d")
    ap.add_argument(
        "--sequence",
        nargs="?",
        const="megatron",
        default=False,
        choices=("megatron", "ulysses", "ring"),
        help="sequence parallelism: megatron (the default when given alone) inside the tensor group; ulysses or ring "
        "over the --tensor ranks, layers whole",
    )
    ap.add_argument("--pipeline", type=positive_int, default=1, help="pipeline stages (default 1)")
    ap.add_argument(
        "--schedule",
        default="1f1b",
        choices=("gpipe", "1f1b", "interleaved_1f1b", "chimera"),
        help="pipeline schedule (default %(default)s)",
    )
    ap.add_argument(
        "--virtual-stages", type=positive_int, default=None, help="model chunks per rank (interleaved only)"
    )
    ap.add_argument(
        "--microbatches", type=positive_int, default=4, help="micro-batches per batch (default %(default)s)"
    )
    ap.add_argument(
        "--zero-stage",
        type=int,
        default=1,
        choices=(0, 1, 2, 3),
        help="ZeRO stage over the data-parallel ranks (default %(default)s)",
    )
    ap.add_argument(
        "--offload-optimizer",
        default="device",
        choices=("device", "host"),
        help="where optimizer states live between updates (default %(default)s)",
    )
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing of the blocks")
    ap.add_argument(
        "--generate",
        type=non_negative_int,
        default=24,
        help="tokens to generate greedily after training (default %(default)s)",
    )
    ap.add_argument("--steps", type=positive_int, default=200, help="batches to train on (default %(default)s)")
    ap.add_argument(
        "--batch-size",
        type=positive_int,
        default=8,
        help="sequences per data-parallel rank per batch (default %(default)s)",
    )
    ap.add_argument("--layers", type=positive_int, default=4, help="transformer blocks (default %(default)s)")
    ap.add_argument("--embd", type=positive_int, default=128, help="model width (default %(default)s)")
    ap.add_argument(
        "--heads", type=positive_int, default=4, help="attention heads; must divide --embd (default %(default)s)"
    )
    ap.add_argument("--block-size", type=positive_int, default=64, help="tokens per sequence (default %(default)s)")
    ap.add_argument("--lr", type=float, default=3e-3, help="learning rate, constant (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batches (default 0)")
    ap.add_argument("--json", action="store_true", help="rank 0 prints one JSON object at the end")
    add_data_arg(ap)
    args = ap.parse_args(argv)
    # Checked here, before the processes join and build the model: train_batch would refuse it at the first batch.
    if args.batch_size % args.microbatches:
        ap.error(f"--microbatches {args.microbatches} must divide --batch-size {args.batch_size}")

    text = read_text(args.data, block_size=args.block_size)  # before the processes join: a bad file fails fast
    torch.manual_seed(args.seed)  # every rank builds the same model; each keeps its own stage and shards
    try:
        cfg = GPTConfig(
            vocab_size=VOCAB_SIZE,
            n_layer=args.layers,
            n_head=args.heads,
            n_embd=args.embd,
            block_size=args.block_size,
            tie_weights=False,  # the embedding and the head live on different pipeline stages
        )
    except ValueError as e:  # the model's own shape checks (--embd must divide by --heads)
        ap.error(f"{e} (--embd, --heads)")
    model = GPTPipe(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    parallel: dict[str, Any] = {
        "tensor": args.tensor,
        "tensor_mode": args.tensor_mode,
        "tensor_depth": args.tensor_depth,
        "tensor_plan": TP_PLAN,
        "sequence": args.sequence,
        "pipeline": args.pipeline,
        "schedule": args.schedule,
        "microbatches": args.microbatches,
    }
    if args.virtual_stages is not None:
        parallel["virtual_stages"] = args.virtual_stages
    config = {
        "zero_stage": args.zero_stage,
        "grad_clip_norm": 1.0,
        "offload": {"optimizer": args.offload_optimizer},
        "activation_checkpointing": args.checkpointing,
        "parallel": parallel,
    }
    engine = hetero.initialize(model, optimizer, config)  # joins torchrun's process group, builds the mesh
    mesh = engine.mesh
    data = batches(
        text,
        block_size=args.block_size,
        batch_size=args.batch_size,
        seed=args.seed,
        rank=engine.data_parallel_rank,
        world_size=engine.data_parallel_size,
    )
    first = mesh.world.rank == 0
    losses: list[float] = []
    bar = tqdm(range(args.steps), desc="train", disable=not first or args.json, dynamic_ncols=True)
    t0 = time.perf_counter()
    for _ in bar:
        batch = next(data)
        loss = engine.train_batch(batch["input_ids"], batch["labels"])  # the global mean, on every rank
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    seconds = time.perf_counter() - t0
    held_out = next(data)
    eval_loss = float(engine.eval_batch(held_out["input_ids"], held_out["labels"]))  # the global mean, every rank
    # rows must split into the micro-batches, and each micro-batch into a grid mode's batch parts
    parts = mesh.grid.batch_parts if mesh.grid is not None else 1
    prompts = held_out["input_ids"][: args.microbatches * parts]
    text = generate(engine, prompts, args.generate)
    result = {
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "steps": args.steps,
        "seconds": seconds,
        # every data-parallel group trains on its own rows; the tensor and pipeline ranks of a group share them
        "tokens_per_second": args.steps * args.batch_size * mesh.dp_size * args.block_size / seconds,
        "world_size": mesh.world.size,
        "mesh": {"tensor": mesh.tp_size, "data": mesh.dp_size, "pipeline": mesh.pp_size},
        "layout": repr(mesh),
        "grad_norm": engine.last_grad_norm,
        "eval_loss": eval_loss,
        "generated": text,
    }
    engine.close()
    if first:
        if args.json:
            print(json.dumps(result))
        else:
            print(
                f"\n{args.steps} batches in {seconds:.1f} s ({result['tokens_per_second']:,.0f} tokens/s) on {mesh!r}: "
                f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, held-out {eval_loss:.3f}"
            )
            print(f"greedy continuation of the first prompt: {text!r}")
    return result


@torch.no_grad()
def generate(engine: hetero.Engine, prompts: torch.Tensor, tokens: int) -> str:
    """Greedy decoding through the engine's layout: a window of the last block_size tokens goes through every stage
    (`eval_batch` without labels), the most likely next token is appended. The window keeps its length, so every
    call has the same shape (sequence parallelism needs the length to divide by the tensor degree)."""
    window = prompts.clone()
    new = []
    for _ in tqdm(range(tokens), desc="generate", disable=engine.mesh.world.rank != 0, leave=False):
        out = engine.eval_batch(window)  # without a pipeline the model's own output (GPTOutput), else the logits
        logits = getattr(out, "logits", out)  # [rows, block_size, vocab], whole, on every rank
        nxt = logits[:, -1].argmax(-1).cpu()
        window = torch.cat([window[:, 1:], nxt[:, None]], dim=1)
        new.append(int(nxt[0]))
    return decode(new)


if __name__ == "__main__":
    run_cli(main)
