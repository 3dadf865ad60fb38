"""python -m hetero.checkpoint {consolidate,verify} ..."""

from __future__ import annotations

import argparse
import os
import sys

from hetero.checkpoint.consolidate import DTYPES, HF_SHARD_SIZE, consolidate, verify
from hetero.checkpoint.manifest import resolve
from hetero.errors import CheckpointError, ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetero.checkpoint", description="hetero checkpoint tools")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "consolidate",
        help="write one plain state_dict from a sharded checkpoint",
        description=(
            "Write the model's full state_dict (the model's own keys, tied parameters under each name, buffers "
            "included) from a sharded checkpoint, streaming tensor by tensor. OUT ending in .safetensors: one "
            "file, peak memory about the largest tensor. OUT ending in .pt: torch.save, which needs the whole state "
            "in memory. Any other OUT: a directory with model.safetensors, and config.json for a Hugging Face "
            "model (loadable with from_pretrained)."
        ),
    )
    c.add_argument(
        "ckpt_dir", metavar="CKPT_DIR", help="a checkpoint root (follows 'latest') or a checkpoint directory"
    )
    c.add_argument("out", metavar="OUT", help="output .safetensors / .pt file, or a directory")
    c.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="dtype of floating tensors (default: as saved)"
    )
    c.add_argument(
        "--hf",
        action="store_true",
        help="OUT is a directory in Hugging Face's layout: model-0000x-of-0000y.safetensors shards with "
        "model.safetensors.index.json (one model.safetensors if it fits), and config.json",
    )
    c.add_argument(
        "--max-shard-size",
        default=None,
        help=f"with --hf: the largest shard, in bytes or like '2GB' (default {HF_SHARD_SIZE})",
    )
    v = sub.add_parser(
        "verify",
        help="read every tensor of a checkpoint and check its checksums",
        description="Read every tensor of a checkpoint and check its checksums (each block's too, where saved); "
        "exits 1 naming the first file and byte range that fail.",
    )
    v.add_argument(
        "ckpt_dir", metavar="CKPT_DIR", help="a checkpoint root (follows 'latest') or a checkpoint directory"
    )
    args = parser.parse_args(argv)
    if args.command == "consolidate" and args.max_shard_size is not None and not args.hf:
        parser.error("--max-shard-size shards a --hf output; add --hf, or leave it out for one file")
    try:
        if args.command == "consolidate":
            shard = HF_SHARD_SIZE if args.max_shard_size is None else args.max_shard_size
            kw = {"hf": True, "max_shard_size": shard} if args.hf else {}
            for path in consolidate(args.ckpt_dir, args.out, dtype=args.dtype, **kw):
                print(f"wrote {path}")
        else:
            # A root's `latest` (or a Trainer folder) leads to one checkpoint: say which one was checked.
            directory = resolve(args.ckpt_dir)
            via = "" if os.path.samefile(directory, args.ckpt_dir) else f" (from {args.ckpt_dir})"
            print(f"ok: {directory}{via}: {verify(directory)} bytes of tensors checked")
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
