"""The `hetero.initialize` config of a planner's option (planner.py): its layout, ZeRO stage and placement."""

from __future__ import annotations

from typing import Any

from hetero.profiler.estimate_args import NVME_PLACEHOLDER


def option_config(
    lay: dict[str, Any],
    stage: int,
    params_at: str,
    optim_at: str,
    precision: str,
    checkpointing: bool,
    nvme_dir: str | None,
) -> dict[str, Any]:
    """The config that runs layout `lay` (an option's) at this stage and placement; NVMe offload writes `nvme_dir`
    (a placeholder to replace without one)."""
    parallel: dict[str, Any] = {"microbatches": lay["microbatches"]}
    if lay["tensor"] > 1:
        parallel.update(tensor=lay["tensor"], sequence=lay["sequence"] or False)
        if lay["tensor_mode"] != "1d":
            parallel["tensor_mode"] = lay["tensor_mode"]
        if lay["tensor_depth"] is not None:
            parallel["tensor_depth"] = lay["tensor_depth"]
    if lay["pipeline"] > 1:
        parallel.update(pipeline=lay["pipeline"], schedule=lay["schedule"], pipeline_split="auto")
        if lay["virtual_stages"] > 1:
            parallel["virtual_stages"] = lay["virtual_stages"]
    config = {
        "zero_stage": stage,
        "precision": precision,
        "offload": {"params": params_at, "optimizer": optim_at},
        "activation_checkpointing": checkpointing,
        "parallel": parallel,
    }
    if "nvme" in (params_at, optim_at):
        config["memory"] = {"nvme_dir": nvme_dir or NVME_PLACEHOLDER}
    return config
