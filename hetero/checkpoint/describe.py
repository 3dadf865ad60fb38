"""What a checkpoint's manifest says about the engine that saved it: its counters, its layout, every rank's part of
the model and its small state (random states, mid-accumulation bookkeeping), a Hugging Face config to export with."""

from __future__ import annotations

import logging
import os
import random
from typing import TYPE_CHECKING, Any

import torch

from hetero.checkpoint import blocks
from hetero.checkpoint import manifest as mf
from hetero.checkpoint import model_parallel as par
from hetero.checkpoint.plan import model_buffers
from hetero.errors import CheckpointError
from hetero.parallel.pipeline.split import Cut

if TYPE_CHECKING:
    from hetero.engine import Engine

log = logging.getLogger("hetero.checkpoint")


def rank_info(engine: Engine, fname: str) -> dict[str, Any]:
    """This rank's small state: its place in the layout, RNG states, and mid-accumulation bookkeeping."""
    import numpy as np

    py = random.getstate()
    npst = np.random.get_state(legacy=True)
    states = [zc.state_dict() for zc in engine.chunks]
    used = [info.name for zc, st in zip(engine.chunks, states) for info, u in zip(zc.spec.params, st["used"]) if u]
    return {
        "global_rank": par.world(engine).global_rank(par.world(engine).rank),
        "data_parallel_rank": engine.comm.rank,
        "coordinates": par.coordinates(engine),
        # This rank's chunk layout: pipeline stages (and tensor shards) differ from rank 0's in the layout's "chunks".
        "chunks": [zc.spec.capacity for zc in engine.chunks],
        "rng": {
            "python": [py[0], list(py[1]), py[2]],
            "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
        },
        "used": used,
        "grad_fresh": [
            st["grad_is_zero"] for st in states
        ],  # the manifest key keeps its old name: old checkpoints load
        # This rank's part of the model and its step counts, merged on rank 0 (each stage knows only its own).
        "model": model_table(engine),
        "param_steps": {
            par.stored_name(info): n
            for zc, st in zip(engine.chunks, states)
            for info, n in zip(zc.spec.params, st["param_steps"])
        },
        # Parameters whose zero gradient the loop keeps ([Note: zero gradients kept]), agreed over the ranks.
        "kept_grads": [
            par.stored_name(info)
            for zc, st in zip(engine.chunks, states)
            for info, k in zip(zc.spec.params, st["kept_grads"])
            if k
        ],
        "keeps_zero_grads": any(st["keeps_zero_grads"] for st in states),
        # 0-d per-parameter states of an optimizer on the generic path (NAdam's mu_product, ...), by name.
        "optim_scalars": (
            engine.algorithm.generic.scalars_by_name(engine.chunks, par.stored_name)
            if engine.algorithm.generic is not None
            else {}
        ),
    }


# ---- rank 0: checks and commit -----------------------------------------------------------------------------------
NOT_PER_RANK = (
    "size",
    "header_crc32",
    "tensors",
    *blocks.FILE_KEYS,
    "model",
    "param_steps",
    "optim_scalars",
    "kept_grads",
    "keeps_zero_grads",
)  # in the manifest's files and model


def engine_state(engine: Engine, infos: list[dict[str, Any]]) -> dict[str, Any]:
    steps = {k: v for i in infos for k, v in i["param_steps"].items()}
    return {
        **engine.state_dict(),  # micro_steps, accumulated, global_steps, skipped_steps, last_grad_norm, scaler
        "grad_accumulation_steps": engine.config.grad_accumulation_steps,
        "pending_grads": engine.accumulated != 0,
        "optim_scalars": {k: v for i in infos for k, v in i["optim_scalars"].items()},
        "param_steps": steps,
        "kept_grads": sorted({k for i in infos for k in i["kept_grads"]}),
        "keeps_zero_grads": any(i["keeps_zero_grads"] for i in infos),
        "config": engine.config.to_dict(),
    }


def layout(engine: Engine) -> dict[str, Any]:
    mesh = getattr(engine, "mesh", None)
    return {
        "world_size": engine.comm.size,  # the data-parallel degree (what ZeRO shards over)
        "global_ranks": engine.comm.global_ranks,
        "zero_stage": engine.stage,
        "precision": engine.config.precision,
        "compute_dtype": str(engine.dtype).removeprefix("torch."),
        "offload": {"params": engine.config.offload.params, "optimizer": engine.config.offload.optimizer},
        "algorithm": engine.algorithm.name,
        "state_names": list(engine.algorithm.state_names),
        "tensor_parallel": mesh.tp_size if mesh is not None else 1,
        "pipeline_parallel": mesh.pp_size if mesh is not None else 1,
        "tensor_mode": par.tensor_mode(engine),
        "chunks": [zc.spec.capacity for zc in engine.chunks],
        "ranks": par.world(engine).size,  # every rank of the job: one file each
        # Where the pipeline's stages begin and why (None without one): [Note: the cut a checkpoint records]
        "pipeline_cut": engine.stages[0].cut.record() if engine.stages and engine.stages[0].cut else None,
    }


def read_cut(path: str | os.PathLike) -> dict[str, Any]:
    """The pipeline cut the checkpoint `path` (a root or a checkpoint directory) records, for `hetero.initialize(...,
    pipeline_cut_from=path)`: {"source", "cut" (None if it records none), "error" (why it cannot be read, or None)};
    the error is returned, not raised, so that every rank learns of it before any raises."""
    try:
        directory = mf.resolve(path)
        return {"source": directory, "cut": mf.read_manifest(directory)["layout"].get("pipeline_cut"), "error": None}
    except Exception as e:  # noqa: BLE001 (said on every rank by the caller)
        return {"source": os.fspath(path), "cut": None, "error": f"{type(e).__name__}: {e}"}


def check_cut(engine: Engine, manifest: dict[str, Any], directory: str) -> None:
    """A checkpoint of another pipeline cut: refused with pending gradients, else loaded with a warning; both name
    the saved cut and the `pipeline_split` that reproduces it ([Note: the cut a checkpoint records])."""
    record = manifest["layout"].get("pipeline_cut")
    mine = engine.stages[0].cut if engine.stages else None
    if record is None or mine is None or list(record["split"]) == list(mine.split):
        return
    saved = Cut.of(record)
    what = f"{directory} was saved on the pipeline cut where {saved.describe()}; this engine's {mine.describe()}"
    fix = (
        f'parallel.pipeline_split: {list(saved.split)!r}, or pipeline_split "auto" with hetero.initialize(..., '
        f"pipeline_cut_from={directory!r})"
    )
    if manifest["engine"]["pending_grads"]:
        raise CheckpointError(
            f"{what}. It was saved in the middle of gradient accumulation (micro-step "
            f"{manifest['engine']['micro_steps']}): its pending gradients are each stage's own and load only into "
            f"the saved cut. Initialize the engine with {fix}, then load it; or load a checkpoint saved at an "
            "accumulation boundary"
        )
    log.warning(
        "%s. Weights and optimizer states load by name, so training goes on on this cut; a bit-exact resume needs "
        "the saved one (the gradient norm sums its squares stage by stage, grouped by the cut): initialize with %s",
        what,
        fix,
    )


def model_table(engine: Engine) -> dict[str, Any]:
    """This rank's part of the model: names (as stored), shapes and roles of every tensor, and the model's
    state_dict keys (tied parameters under each name); a tensor-parallel shard's cut under "tp"."""
    params = {}
    canonical: dict[int, str] = {}
    cuts: dict[str, Any] = {}
    stage = par.coordinates(engine)["pp"]
    for zc in engine.chunks:
        for info in zc.spec.params:
            canonical[id(info.param)] = info.name
            cut = par.tp_cut(info.param)
            params[par.stored_name(info)] = {
                "shape": list(info.param.shape),  # a shard's own shape under tensor parallelism (a tile's: the whole)
                "trainable": zc.spec.trainable,
                "group": zc.spec.group,
                "dtype": str(zc.dtype).removeprefix("torch."),
                "stage": stage,
                "tp_rank": cut.stored_rank if cut is not None else None,
            }
            if cut is not None:
                cuts[info.name] = par.describe_cut(cut)
    buffers = {
        n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        for n, t in model_buffers(engine).items()
    }
    by_id = {id(t): n for n, t in model_buffers(engine).items()}
    keys = []
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in canonical:
            keys.append([name, "tp_param" if canonical[id(t)] in cuts else "param", canonical[id(t)]])
        elif id(t) in by_id:
            keys.append([name, "buffer", by_id[id(t)]])
        else:  # an empty parameter (no elements: in no chunk)
            keys.append([name, "empty", list(t.shape), str(t.dtype).removeprefix("torch.")])
    return {
        "params": params,
        "buffers": buffers,
        "state_dict": keys,
        "tp": cuts,
        "hf_config": hf_config(engine.module),
        # The whole model's keys in its order, under a pipeline ([Note: the whole model's order]): for merge_tables.
        "order": list(engine.stages[0].model_keys) if engine.stages else [],
    }


def hf_config(model: torch.nn.Module) -> dict[str, Any] | None:
    """A Hugging Face model's config, so that a consolidated export loads with `from_pretrained`."""
    cfg = getattr(model, "config", None)
    if cfg is None or not (hasattr(cfg, "to_dict") and hasattr(cfg, "to_json_string")):
        return None
    try:
        return mf.loads(mf.dumps(cfg.to_dict()))
    except (TypeError, ValueError):
        return None
