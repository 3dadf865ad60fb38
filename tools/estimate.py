"""Will it fit, and where? The bytes a hetero run needs per tier, before running it.

    python tools/estimate.py --hf-config config.json --zero-stage 3 --world-size 8
    python tools/estimate.py --params 13e9 --zero-stage 3 --offload-optimizer nvme --nvme-dir /mnt/nvme
    python tools/estimate.py --params 7e9 --device-memory 80GiB --host-memory 1TiB --nvme-space 4TiB --json
    python tools/estimate.py --hf-config llama-70b.json --world-size 8 --tensor 4 --pipeline 2 --microbatches 8
    python tools/estimate.py --hf-config llama-7b.json --world-size 8 --recommend --device-memory 80GiB \
        --host-memory 1TiB --nvme-space 4TiB      # layouts that fit, ranked by predicted step time

Without --device-memory / --host-memory / --nvme-space it checks this machine (its first GPU, its RAM and the free
space of --nvme-dir). --json prints one JSON object (hetero.Estimate.to_dict()) instead of the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import hetero  # noqa: E402
from hetero.config import parse_size  # noqa: E402
from hetero.config_values import nvme_dir_problem  # noqa: E402
from hetero.profiler import Machine  # noqa: E402
from hetero.profiler.estimate_args import NVME_PLACEHOLDER  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--hf-config", help="a Hugging Face config.json (or its directory): the model is built on meta")
    what.add_argument("--params", type=float, help="a parameter count, e.g. 13e9 (a GPT-3-shaped model is assumed)")
    ap.add_argument("--config", help="a hetero config file (.json/.yaml); the flags below override its keys")
    ap.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3))
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--offload-params", choices=("device", "host", "nvme"))
    ap.add_argument("--offload-optimizer", choices=("device", "host", "nvme"))
    ap.add_argument(
        "--params-host-bytes", metavar="SIZE", help="with --offload-params nvme: shard bytes kept on the host ('4GiB')"
    )
    ap.add_argument("--nvme-dir", help="swap directory: its free space is the NVMe tier's capacity")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd"))
    ap.add_argument("--world-size", type=int, default=1, help="ranks in all (data x tensor x pipeline)")
    ap.add_argument("--tensor", type=int, help="tensor-parallel degree")
    ap.add_argument("--tensor-mode", default="1d", choices=("1d", "2d", "2.5d", "3d"), help="tensor-parallel mode")
    ap.add_argument("--pipeline", type=int, help="pipeline degree")
    ap.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved_1f1b", "chimera"), help="pipeline schedule")
    ap.add_argument("--microbatches", type=int, help="micro-batches per batch (each of --batch-size sequences)")
    ap.add_argument(
        "--sequence",
        nargs="?",
        const="megatron",
        choices=("none", "megatron", "ulysses", "ring"),
        help="sequence parallelism (bare --sequence: megatron, with the tensor ranks)",
    )
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing of the blocks")
    ap.add_argument(
        "--ranks-per-node", type=int, help="ranks sharing a node's RAM and NVMe (default: min(world, GPUs))"
    )
    ap.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch per rank")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's context, at most 2048)")
    ap.add_argument("--device-memory", help="memory of one GPU of the target machine, e.g. 80GiB")
    ap.add_argument("--host-memory", help="host RAM of one node of the target machine, e.g. 1TiB")
    ap.add_argument("--nvme-space", help="free NVMe space of one node, e.g. 4TiB")
    ap.add_argument(
        "--gpus",
        type=int,
        default=8,
        help="GPUs per node of the target machine, with --device-memory (default 8: a node, whatever --world-size "
        "uses of it)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    rec = ap.add_argument_group("--recommend: rank every layout that fits (hetero.plan)")
    rec.add_argument("--recommend", action="store_true", help="list the layouts that fit, fastest predicted first")
    rec.add_argument("--global-batch", type=int, help="sequences per optimizer step (default 2 per rank)")
    rec.add_argument("--top", type=int, default=15, help="layouts to print")
    rec.add_argument(
        "--figure",
        choices=("confirm", "step", "saved"),
        default="confirm",
        help="activation figure layouts are checked with: 'step' hetero.estimate's for every layout (20-40x slower), "
        "'saved' the saved bytes only (cheaper, lower), 'confirm' (default) saved, then step for the first --confirm",
    )
    rec.add_argument("--confirm", type=int, default=15, help="with --figure confirm: fitting layouts checked by step")
    rec.add_argument("--max-tensor", type=int, help="largest tensor degree to try (default: GPUs per node)")
    rec.add_argument(
        "--pipeline-split",
        help="the pipeline cut the pasted configs give: 'auto' or 'params' (the engine balances at run time), or the "
        "FQNs where stages begin, comma-separated (default: the cut each layout was measured with)",
    )
    rec.add_argument(
        "--tensor-modes",
        help="tensor modes to try, e.g. 1d,2d,2.5d,3d (default: those hetero's config runs; others from their papers)",
    )
    for flag, what in (
        ("--device-flops", "FLOP/s one GPU sustains, e.g. 445e12"),
        ("--link-bandwidth", "collective bytes/s per GPU inside a node, e.g. 360GB"),
        ("--network-bandwidth", "collective bytes/s per GPU across nodes, e.g. 25GB"),
        ("--pcie-bandwidth", "GPU <-> host bytes/s, e.g. 50GB"),
        ("--host-bandwidth", "host memory bytes/s for one rank's CPU optimizer step"),
        ("--nvme-bandwidth", "a node's NVMe bytes/s"),
    ):
        rec.add_argument(flag, help=f"{what} (default: an 8-GPU H100 node's with --device-memory, else measured)")
    args = ap.parse_args(argv)
    for flag in ("batch_size", "seq_len", "gpus", "global_batch", "top", "ranks_per_node", "max_tensor"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            ap.error(f"--{flag.replace('_', '-')}: expected an integer >= 1, got {value}")
    if args.tensor_modes:
        unknown = sorted(set(args.tensor_modes.split(",")) - {"1d", "2d", "2.5d", "3d"})
        if unknown:
            ap.error(f"--tensor-modes: unknown {', '.join(unknown)}; choose from 1d, 2d, 2.5d, 3d")
    try:
        return _run(ap, args)
    except hetero.ConfigError as e:  # a bad value in --config's file or in a size: the message says which
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    config = dict(hetero.Config.from_any(args.config).to_dict()) if args.config else {}
    if args.zero_stage is not None:
        config["zero_stage"] = args.zero_stage
    if args.precision is not None:
        config["precision"] = args.precision
    offload = dict(config.get("offload", {}))
    if args.offload_params:
        offload["params"] = args.offload_params
    if args.offload_optimizer:
        offload["optimizer"] = args.offload_optimizer
    if args.params_host_bytes is not None:
        offload["params_host_bytes"] = args.params_host_bytes
    config["offload"] = offload
    if args.nvme_dir:
        config["memory"] = {**config.get("memory", {}), "nvme_dir": args.nvme_dir}
    if args.schedule:
        config["parallel"] = {**config.get("parallel", {}), "schedule": args.schedule}
    if args.checkpointing:
        config["activation_checkpointing"] = True

    given = (args.device_memory, args.host_memory, args.nvme_space)
    if any(given) and not all(given[:2]):
        ap.error("describe the target machine with both --device-memory and --host-memory (and --nvme-space)")
    # This machine: the directory's free space is read, so it must be one (a described machine's is only a name).
    problem = None if any(given) or not args.nvme_dir else nvme_dir_problem(args.nvme_dir)
    if problem:
        ap.error(f"--nvme-dir: {problem}")
    if "nvme" in offload.values() and not config.get("memory", {}).get("nvme_dir") and not args.recommend:
        if not any(given):
            ap.error(
                "offload to nvme: give --nvme-dir DIR (its free space is this machine's NVMe tier), or describe the "
                "target machine with --device-memory, --host-memory and --nvme-space"
            )
        # A machine described by its sizes: the directory is only a name in the config (as --recommend prints it)
        config["memory"] = {**config.get("memory", {}), "nvme_dir": NVME_PLACEHOLDER}
    machine: Machine | bool = True
    if any(given):
        machine = Machine(
            device_bytes=args.device_memory,
            host_bytes=args.host_memory,
            nvme_bytes=args.nvme_space or 0,
            gpus=args.gpus,
        )
    model = args.hf_config if args.hf_config is not None else args.params
    if args.recommend:
        return _recommend(args, model, config, machine)
    try:
        est = hetero.estimate(
            model,
            config,
            world_size=args.world_size,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            optimizer=args.optimizer,
            machine=machine,
            ranks_per_node=args.ranks_per_node,
            tensor=args.tensor,
            tensor_mode=args.tensor_mode,
            pipeline=args.pipeline,
            microbatches=args.microbatches,
            sequence=args.sequence,
        )
    except hetero.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(est.to_dict()) if args.json else est.table())
    return 0


def _split(flag: str | None) -> str | list[str] | None:
    """--pipeline-split as hetero.plan takes it: None, "auto"/"params", or a list of FQNs."""
    if flag is None or flag in ("auto", "params"):
        return flag
    return [name.strip() for name in flag.split(",") if name.strip()]


def _recommend(args: argparse.Namespace, model: object, config: dict, machine: Machine | bool) -> int:
    from hetero.profiler import Rates

    overrides = {
        "device_flops": args.device_flops,
        "intra_bandwidth": args.link_bandwidth,
        "inter_bandwidth": args.network_bandwidth,
        "pcie_bandwidth": args.pcie_bandwidth,
        "host_bandwidth": args.host_bandwidth,
        "nvme_bandwidth": args.nvme_bandwidth,
    }
    if machine is True:
        machine = Machine.detect(nvme_dir=args.nvme_dir)
        rates = Rates.measure(nvme_dir=args.nvme_dir)
        given = {k: float(parse_size(v, key=k)) for k, v in overrides.items() if v is not None}  # '360GB' as Rates.node
        rates = Rates(**{**rates.to_dict(), **given})
    else:
        rates = Rates.node(**overrides)
    try:
        result = hetero.plan(
            model,
            args.world_size,
            machine=machine,
            rates=rates,
            global_batch=args.global_batch,
            seq_len=args.seq_len,
            precision=config.get("precision", "bf16"),
            optimizer=args.optimizer,
            checkpointing=True if args.checkpointing else config.get("activation_checkpointing", True),
            max_tensor=args.max_tensor,
            tensor_modes=tuple(args.tensor_modes.split(",")) if args.tensor_modes else None,
            nvme_dir=args.nvme_dir,
            figure=args.figure,
            confirm=args.confirm,
            pipeline_split=_split(args.pipeline_split),
        )
    except hetero.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict()) if args.json else result.table(args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
