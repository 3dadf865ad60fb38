"""python -m hetero.checkpoint {consolidate,verify} ..."""

from __future__ import annotations

import argparse
import sys

from hetero.checkpoint.consolidate import DTYPES, consolidate, verify
from hetero.errors import CheckpointError


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
    v = sub.add_parser("verify", help="read every tensor of a checkpoint and check its checksum")
    v.add_argument("ckpt_dir", metavar="CKPT_DIR")
    args = parser.parse_args(argv)
    try:
        if args.command == "consolidate":
            for path in consolidate(args.ckpt_dir, args.out, dtype=args.dtype):
                print(f"wrote {path}")
        else:
            n = verify(args.ckpt_dir)
            print(f"ok: {n} bytes of tensors checked")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
