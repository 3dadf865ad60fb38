"""Train a small GPT on the shipped corpus with hetero: ZeRO-3, optimizer states swapped to NVMe.

With no arguments this trains a 4-layer byte-level GPT (0.84M parameters) for a minute or two on a laptop CPU (on a
GPU when there is one). In fp32 its parameters and gradients (6.7 MB) do not fit the 6 MiB device budget: chunks move
between device and host as they are used, and the Adam states live in swap files. At the end it prints per-tier peak
memory, the bytes moved between tiers, and a greedy text sample.

    python examples/train_gpt.py                                  # optimizer states in a temporary NVMe directory
    python examples/train_gpt.py --offload-optimizer host --zero-stage 2
    python examples/train_gpt.py --nvme-dir /mnt/nvme --device-budget 64MiB --json
    python examples/train_gpt.py --data my.txt --save-dir ckpt --save-every 100    # then --resume to go on
    python examples/train_gpt.py --save-dir ckpt --save-every 100 --keep-last 3    # the 3 newest stay on disk
    torchrun --nproc_per_node=2 examples/train_gpt.py             # each rank trains on its slice of the batch

`train()` is shared with examples/train_hf.py, which trains a Hugging Face model the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from corpus import VOCAB_SIZE, batches, decode, encode, load_corpus
from torch import nn
from tqdm import tqdm

import hetero
from hetero.checkpoint import keep_last
from hetero.config import format_size, parse_size
from hetero.errors import CheckpointError, CommError, NvmeSpaceError, NvmeUnavailableError, TierOutOfMemoryError
from hetero.memory import swap_sigterm
from hetero.models import GPT, GPTConfig, generate_greedy
from hetero.profiler.recorder import check_writable

BLOCK_SIZE = 128
PROMPT = "Once upon a time"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def size(text: str) -> str:
    """A byte count as hetero's config reads it ("6MiB", "2GB", 1073741824), checked here so that a typo is a usage
    error; the text itself goes into the config."""
    try:
        parse_size(text)
    except hetero.ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("size: ")) from None
    return text


class UsageError(Exception):
    """An input the example cannot use; its message says which and what to do."""


def read_text(path: str | None, *, block_size: int) -> str:
    """The training text: `path` (--data), or the corpus shipped in examples/data; long enough for one sequence and
    its last label."""
    name = f"--data {path}" if path is not None else "the shipped corpus"
    try:
        text = load_corpus(path)
    except UnicodeDecodeError as e:
        raise UsageError(f"{name}: not UTF-8 text ({e.reason} at byte {e.start}); give a UTF-8 text file") from None
    n = len(text.encode("utf-8"))  # counted here: torch.frombuffer refuses an empty buffer
    if n == 0:
        raise UsageError(f"{name}: the file is empty; give a text of at least {block_size + 1} bytes")
    if n <= block_size:
        raise UsageError(
            f"{name}: {n} bytes is too short for one sequence of {block_size} bytes and its label; give a longer text"
        )
    return text


def add_data_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--data",
        metavar="FILE",
        default=None,
        help="a UTF-8 text file to train on, read as bytes (default: the corpus in examples/data)",
    )


def add_training_args(ap: argparse.ArgumentParser, *, steps: int, batch_size: int, lr: float) -> None:
    """The flags both examples share; defaults are chosen per model by the caller."""
    add_data_arg(ap)
    ap.add_argument(
        "--steps",
        type=positive_int,
        default=steps,
        help="optimizer updates, each of --grad-accum micro-batches (default %(default)s)",
    )
    ap.add_argument(
        "--batch-size",
        type=positive_int,
        default=batch_size,
        help="sequences per micro-batch per rank (default %(default)s)",
    )
    ap.add_argument(
        "--zero-stage",
        type=int,
        default=3,
        choices=(0, 1, 2, 3),
        help="what is sharded over the ranks: 1 optimizer states, 2 and gradients, 3 and parameters (default 3)",
    )
    ap.add_argument(
        "--precision",
        default="auto",
        choices=("auto", "fp32", "bf16", "fp16"),
        help="auto (the default): bf16 on a GPU that supports it, else fp32",
    )
    ap.add_argument(
        "--offload-optimizer",
        default="nvme",
        choices=("device", "host", "nvme"),
        help="where optimizer states live between updates (default %(default)s)",
    )
    ap.add_argument(
        "--offload-params",
        default="device",
        choices=("device", "host", "nvme"),
        help="where parameter chunks live between uses (default %(default)s)",
    )
    ap.add_argument("--nvme-dir", default=None, help="directory for swap files (default: a temporary directory)")
    ap.add_argument(
        "--device-budget", type=size, default="6MiB", help="bytes of chunks on the compute device (default %(default)s)"
    )
    ap.add_argument(
        "--host-budget", type=size, default="128MiB", help="bytes of chunks in host memory (default %(default)s)"
    )
    ap.add_argument(
        "--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer update (default %(default)s)"
    )
    ap.add_argument(
        "--grad-clip",
        type=non_negative_float,
        default=1.0,
        help="global gradient norm clip; 0 disables (default %(default)s)",
    )
    ap.add_argument(
        "--lr", type=float, default=lr, help="peak learning rate, linear warmup then cosine decay (default %(default)s)"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batches (default 0)")
    ap.add_argument(
        "--sample-tokens",
        type=non_negative_int,
        default=200,
        help="bytes to generate greedily at the end (default %(default)s)",
    )
    ap.add_argument(
        "--delayed-param-update",
        action="store_true",
        help="ZeRO-Offload's delayed update: the host/NVMe optimizer step overlaps the next forward and backward "
        "(parameters one step stale)",
    )
    ap.add_argument(
        "--delayed-update-warmup",
        type=non_negative_int,
        default=None,
        help="with --delayed-param-update: exact updates before the delay starts (default 40; 0: delayed from the "
        "first)",
    )
    ap.add_argument(
        "--delayed-update-prediction",
        action="store_true",
        help="with --delayed-param-update: run forward and backward on a prediction of the weights the pending update "
        "gives, not the stale ones (keeps Adam stable under the delay)",
    )
    ap.add_argument(
        "--save-dir",
        metavar="DIR",
        default=None,
        help="save a checkpoint (weights, optimizer, schedule, update count) under DIR every --save-every updates "
        "and at the end (default: none)",
    )
    ap.add_argument(
        "--save-every",
        type=non_negative_int,
        default=0,
        help="with --save-dir: updates between checkpoints (0: at the end)",
    )
    ap.add_argument(
        "--keep-last",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --save-dir: after each save, delete all but the N newest checkpoints (the latest always stays; "
        "default: keep all)",
    )
    ap.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="CKPT",
        help="continue up to --steps from --save-dir's latest checkpoint, or from CKPT (a checkpoint directory, "
        "e.g. DIR/step-00000200, or another run's DIR)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end instead of a report")


def check_training_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flag combinations that would be ignored silently."""
    if not args.delayed_param_update:
        given = {"--delayed-update-warmup": args.delayed_update_warmup is not None,
                 "--delayed-update-prediction": args.delayed_update_prediction}  # fmt: skip
        for flag in (flag for flag, on in given.items() if on):
            ap.error(f"{flag} applies to --delayed-param-update only: add --delayed-param-update or drop {flag}")
    for flag, given in (("--save-every", args.save_every), ("--keep-last", args.keep_last)):
        if given and args.save_dir is None:
            ap.error(f"{flag} needs --save-dir DIR, the checkpoints' directory")
    if args.resume is True and args.save_dir is None:
        ap.error("--resume without CKPT resumes the latest checkpoint in --save-dir: give --save-dir DIR (or CKPT)")
    resume_from = args.save_dir if args.resume is True else args.resume
    if resume_from is not None and not os.path.isdir(resume_from):
        ap.error(
            f"--resume: {resume_from} does not exist; give the --save-dir of an earlier run, or one of its checkpoints"
        )


# Errors a user's flags, launch or machine cause (a bad config value, a missing or full NVMe directory, budgets too
# small, a broken launch, an unreadable checkpoint): their messages say what was wrong and what to do, so the
# examples print them without a traceback. Any other exception is a bug and keeps its traceback.
USER_ERRORS = (
    UsageError,
    hetero.ConfigError,
    NvmeUnavailableError,
    NvmeSpaceError,
    TierOutOfMemoryError,
    CommError,
    CheckpointError,
    FileNotFoundError,
)


def run_cli(main: Callable[[], object]) -> None:
    """Run an example's main: a user error ends it with its message and status 2, Ctrl-C with status 130; the
    engine's cleanup (swap files, temporary directories) has run by then, as the exception unwound through it.
    SIGTERM ends it at once, its swap files and temporary NVMe directory removed first (see `train`)."""
    try:
        main()
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def resolve_precision(precision: str) -> str:
    if precision != "auto":
        return precision
    # bf16 needs no loss scaling; on the CPU, fp32 is both faster and exact.
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"


def build_config(args: argparse.Namespace, nvme_dir: str | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "zero_stage": args.zero_stage,
        "precision": resolve_precision(args.precision),
        "grad_accumulation_steps": args.grad_accum,
        "grad_clip_norm": args.grad_clip or None,
        "offload": {"params": args.offload_params, "optimizer": args.offload_optimizer},
        "memory": {"device_budget": args.device_budget, "host_budget": args.host_budget, "nvme_dir": nvme_dir},
        "delayed_param_update": getattr(args, "delayed_param_update", False),
    }
    if config["delayed_param_update"]:
        warmup = getattr(args, "delayed_update_warmup", None)
        config["delayed_param_update_warmup"] = 40 if warmup is None else warmup
        config["delayed_param_update_prediction"] = getattr(args, "delayed_update_prediction", False)
    return config


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices and embeddings only: decaying biases and LayerNorm gains only hurts (GPT-2, nanoGPT)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(optimizer: torch.optim.Optimizer, *, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over the first 10% of updates, then cosine decay to 10% of the peak rate."""
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def memory_report(stats: dict[str, Any]) -> str:
    """A table of per-tier peak and budget bytes, then the bytes moved between each pair of tiers."""
    rows = [f"{'tier':<8}{'peak':>14}{'budget':>14}"]
    for tier in ("device", "host", "nvme"):
        if tier in stats:
            budget = stats[tier].get("budget")
            rows.append(f"{tier:<8}{format_size(stats[tier]['peak']):>14}{format_size(budget) if budget else '-':>14}")
    moved = {pair: n for pair, n in stats.get("moved", {}).items() if n}
    rows.append("")
    rows.append(f"{'moved':<16}{'bytes':>14}")
    rows += [f"{pair:<16}{format_size(n):>14}" for pair, n in moved.items()] or [f"{'(nothing)':<16}"]
    return "\n".join(rows)


def train(args: argparse.Namespace, model: nn.Module, *, block_size: int, hf_labels: bool = False) -> dict[str, Any]:
    """Train `model` with hetero as `args` say; return the results (loss, time, memory stats, a sample)."""
    text = read_text(getattr(args, "data", None), block_size=block_size)  # before the engine: a bad file fails fast
    save_dir, save_every = getattr(args, "save_dir", None), getattr(args, "save_every", 0)
    if save_dir is not None:  # made and written to now: a directory that cannot take checkpoints fails before training
        check_writable(Path(save_dir), what="--save-dir")
    with ExitStack() as stack:
        nvme_dir = args.nvme_dir
        if nvme_dir is None and "nvme" in (args.offload_params, args.offload_optimizer):
            temporary = tempfile.TemporaryDirectory(prefix="train-gpt-nvme-")
            stack.callback(swap_sigterm.disown, temporary.name)  # last: after the directory's removal
            nvme_dir = stack.enter_context(temporary)
            # SIGTERM (kill, a timeout, a scheduler's preemption) ends the process without the unwinding that removes
            # this directory on Ctrl-C: hetero removes it then with its own swap directories, even while the main
            # thread is blocked in a C call ([Note: swap directories removed on SIGTERM] in memory/swap_sigterm.py).
            swap_sigterm.own(nvme_dir)
        config = build_config(args, nvme_dir)
        optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
        # The engine steps the schedule once per real update: not after an fp16 update skipped for overflow.
        scheduler = warmup_cosine(optimizer, steps=args.steps)
        t_init = time.perf_counter()
        engine = hetero.initialize(model, optimizer, config, lr_scheduler=scheduler)
        # Registered after the temporary directory, so it runs first: swap files go before their directory.
        stack.callback(engine.close)
        init_seconds = time.perf_counter() - t_init
        # hetero joined torchrun's process group (if any): each rank trains on its own slice of the global batch.
        rank, world = engine.data_parallel_rank, engine.data_parallel_size
        data = batches(
            text,
            block_size=block_size,
            batch_size=args.batch_size,
            seed=args.seed,
            rank=rank,
            world_size=world,
            hf_labels=hf_labels,
        )

        start = resume(engine, args, data) if getattr(args, "resume", None) else 0
        keep = getattr(args, "keep_last", None)
        losses: list[float] = []
        # disable=None: shown on a terminal only, as hetero's own bars; a log or pipe gets no carriage-return lines.
        quiet = True if rank != 0 or args.json else None
        bar = tqdm(
            range(start, args.steps), desc="train", initial=start, total=args.steps, disable=quiet, dynamic_ncols=True
        )
        t0 = time.perf_counter()
        for step in bar:
            total = 0.0
            for _ in range(args.grad_accum):
                out = engine(**next(data))  # hetero moves the batch to its device (cuda:LOCAL_RANK or the CPU)
                engine.backward(out.loss)
                engine.step()  # after every micro-batch; hetero updates (and steps the schedule) at the boundary
                total += out.loss.item()
            losses.append(total / args.grad_accum)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{scheduler.get_last_lr()[0]:.1e}")
            if save_dir is not None and (step + 1 == args.steps or save_every and (step + 1) % save_every == 0):
                # Atomic: a run stopped during the save (Ctrl-C, a crash) leaves the previous checkpoint the latest.
                engine.save_checkpoint(save_dir, client_state={"step": step + 1})
                if keep is not None and rank == 0:  # one rank: the directory is every rank's
                    keep_last(save_dir, keep)
        seconds = time.perf_counter() - t0

        # With delayed_param_update the last update is still pending: apply it before the model is used.
        engine.settle_update()
        # Every rank generates: with ZeRO-3 each forward gathers parameter shards from all ranks.
        engine.module.eval()
        prompt = encode(PROMPT).long()[None]
        ids = generate_greedy(engine, prompt, max_new_tokens=args.sample_tokens, block_size=block_size)
        engine.module.train()
        stats = engine.memory_stats()

    tokens = len(losses) * args.grad_accum * args.batch_size * world * block_size
    return {
        "final_loss": losses[-1],
        "first_loss": losses[0],
        "losses": losses,
        "steps": len(losses),
        "first_step": start,
        "seconds": seconds,
        "init_seconds": init_seconds,
        "tokens_per_second": tokens / seconds,
        "world_size": world,
        "rank": rank,
        "config": config,
        "memory": stats,
        "sample": decode(ids[0]),
    }


def resume(engine: hetero.Engine, args: argparse.Namespace, data: Iterator[dict[str, torch.Tensor]]) -> int:
    """Load --resume's checkpoint (--save-dir's latest, or the one named) and skip the batches it trained on; return
    its update count."""
    path = args.save_dir if args.resume is True else args.resume
    state = engine.load_checkpoint(path)  # a corrupt one: CheckpointError, naming the file
    start = state.get("step") if isinstance(state, dict) else None
    if not isinstance(start, int):
        raise UsageError(f"--resume: the checkpoint in {path} was not saved by this example (no update count)")
    if start >= args.steps:
        raise UsageError(f"--resume: {path} holds update {start} already; give --steps above {start}")
    for _ in range(start * args.grad_accum):  # the stream depends on the seed alone: the run goes on as unbroken
        next(data)
    return start


def report(result: dict[str, Any], *, as_json: bool) -> None:
    """Rank 0 prints the results: one JSON object, or a closing report for people."""
    if result["rank"] != 0:
        return
    if as_json:
        print(json.dumps(result, default=str))
        return
    world = result["world_size"]
    # Under torchrun the loss is rank 0's micro-batches' and the table rank 0's tiers; tokens/s counts every rank.
    whose = f" (loss and memory of rank 0 of {world})" if world > 1 else ""
    updates = f"{result['steps']} update{'s' if result['steps'] != 1 else ''}"
    print(
        f"\n{updates} in {result['seconds']:.1f} s ({result['tokens_per_second']:,.0f} tokens/s), "
        f"loss {result['first_loss']:.3f} -> {result['final_loss']:.3f}{whose}\n"
    )
    print(memory_report(result["memory"]))
    print(f"\nsample (greedy):\n{result['sample']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_args(ap, steps=1000, batch_size=8, lr=3e-3)
    args = ap.parse_args()
    check_training_args(ap, args)
    torch.manual_seed(args.seed)  # reproducible initial weights (hetero then gives every rank rank 0's)
    model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, n_layer=4, n_head=4, n_embd=128, block_size=BLOCK_SIZE))
    report(train(args, model, block_size=BLOCK_SIZE), as_json=args.json)


if __name__ == "__main__":
    run_cli(main)
