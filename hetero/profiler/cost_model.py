"""The planner's cost model: a layout's predicted step time on a machine, term by term.

[Note: the planner's cost model]
A layout is a tensor degree t and mode (and sequence form), a pipeline degree p and schedule, micro-batches m of b
sequences, ZeRO stage and offload placement; the data-parallel degree is d = world / (t p), and d m b sequences of s
tokens make the global batch. Whether it fits is the estimator's arithmetic for every pipeline rank (the engine's
own chunk layout, [Note: a layout's bytes per rank]). Its step time, with the machine's `Rates`, is

  compute   6 N + 12 L s h FLOPs per token (the matrices, forward and backward, plus attention's scores; 8/6 of
            it with activation checkpointing), over all ranks at the device's rate; N counts a key/value head held by
            t / kv tensor ranks that many times, as they all compute it (`replicated_kv_params`);
  bubble    the compute stretched by 1 / (1 - idle), idle the schedule's idle fraction simulated with the backward
            taking twice the forward (`schedule.simulate_programs`);
  tensor    per block and micro-batch, 4 linear layers each moving the mode's share of their activation
            (`tensor_modes.py`), over the node's links (across nodes when t exceeds the node), plus a latency per
            collective; not overlapped; with key/value heads replicated, two more per block and micro-batch: the
            all-reduces of k's and v's weight gradients over each head's t / kv ranks;
  pipeline  per micro-batch, one activation forward and one gradient back per rank, plus latencies;
  data      ZeRO's collectives over the d (2d under Chimera) replicas: stage 0 all-reduces fp32 gradients, stages 1-2
            reduce-scatter them and all-gather the updated parameters, stage 3 reduce-scatters once and gathers the
            parameters in every micro-batch's forward and backward; one collective per chunk each time, each with
            its latency;
  offload   optimizer states on the host: gradients down and parameters up over PCIe and the update streaming 28
            bytes per element through host memory (on the device: through device memory); on NVMe the states read
            and written at the node's NVMe rate shared by its ranks; parameters on the host or NVMe read for every
            forward and backward.

The terms add up (nothing is assumed to overlap), and the ranking is what the model is for: the benchmark
`benchmarks/planner_ranking.py` measures a handful of layouts on a machine and reports the rank correlation of
predicted against measured step times.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hetero.parallel.pipeline import schedule as S
from hetero.profiler.rates import Rates
from hetero.profiler.tensor_modes import SEQUENCE_FORMS, TENSOR_MODES


@dataclass(frozen=True)
class Shape:
    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0  # 0: hidden / heads


def shape_of(model: nn.Module) -> Shape:
    cfg = getattr(model, "config", None)

    def get(*names: str, default: int = 0) -> int:
        return next((int(v) for n in names if isinstance(v := getattr(cfg, n, None), int)), default)

    heads = get("num_attention_heads", "n_head", default=1)
    hidden = get("hidden_size", "n_embd", default=1)
    return Shape(
        params=sum(p.numel() for p in model.parameters()),
        layers=get("num_hidden_layers", "n_layer", default=1),
        hidden=hidden,
        heads=heads,
        kv_heads=get("num_key_value_heads", default=heads),
        vocab=get("vocab_size", default=1),
        head_dim=get("head_dim", default=hidden // heads),
    )


def kv_replicas(shape: Shape, lay: dict[str, Any]) -> int:
    """Tensor ranks holding each key/value head in layout `lay`: t / kv where 1D tensor parallelism (with or without
    Megatron-SP) has fewer key/value heads than ranks ([Note: key/value heads replicated over tensor ranks] in
    hetero/parallel/kv_replicas.py), else 1 (the grid modes and the sequence splits cut heads evenly or refuse)."""
    t, kv = lay["tensor"], shape.kv_heads
    one_d = lay.get("tensor_mode", "1d") == "1d" and lay.get("sequence") in (None, "megatron")
    return t // kv if one_d and 0 < kv < t and t % kv == 0 else 1


def replicated_kv_params(shape: Shape, replicas: int) -> int:
    """Parameters held more than once over the tensor ranks when each key/value head is held by `replicas` of them:
    k_proj's and v_proj's rows of each head count `replicas` - 1 more times (N in the compute term counts every
    copy: each rank computes with its own)."""
    return shape.layers * 2 * shape.kv_heads * (replicas - 1) * _head_dim(shape) * shape.hidden


def _head_dim(shape: Shape) -> int:
    return shape.head_dim or shape.hidden // max(shape.heads, 1)


@functools.cache
def idle_fraction(sched: str, p: int, m: int, virtual: int) -> float:
    if p == 1:
        return 0.0
    return S.simulate_programs(p, S.programs(sched, p, m, virtual), t_f=1.0, t_b=2.0).idle_fraction


def step_cost(
    shape: Shape,
    lay: dict[str, Any],
    stage: int,
    params_at: str,
    optim_at: str,
    chunks: tuple[int, int],
    zero_world: int,
    idle: float,
    r: Rates,
    dtype: torch.dtype,
    gpus: int,
    ranks_per_node: int,
    seq: int,
    batch: int,
    world: int,
    checkpointing: bool,
) -> dict[str, float]:
    """The cost model's terms in seconds ([Note: the planner's cost model]); chunks: elements in the busiest rank's
    chunks, and how many (each a collective of its own)."""
    psi, n_chunks = chunks
    t, p, m, rows = lay["tensor"], lay["pipeline"], lay["microbatches"], lay["rows"]
    tokens = batch * seq
    kv = kv_replicas(shape, lay)
    params = shape.params + replicated_kv_params(shape, kv)
    flops = (6 * params + 12 * shape.layers * seq * shape.hidden) * tokens * (8 / 6 if checkpointing else 1)
    compute = flops / (world * r.device_flops)
    bubble = compute * idle / (1 - idle) if idle < 1 else float("inf")
    size = dtype.itemsize
    x = rows * seq * shape.hidden * size  # one micro-batch's activation at a block boundary
    blocks = shape.layers / p
    link = r.intra_bandwidth if t <= gpus else r.inter_bandwidth
    tensor = 0.0
    if t > 1:
        factor = SEQUENCE_FORMS[lay["sequence"]][2](t) if lay["sequence"] else TENSOR_MODES[lay["tensor_mode"]].comm(t)
        tensor = m * blocks * 4 * (factor * x / link + r.latency)  # 4 linear layers, one collective each
        if kv > 1:  # k's and v's weight gradients summed over each head's replicas (an all-reduce each)
            head = _head_dim(shape) * shape.hidden * size
            tensor += m * blocks * 2 * (2 * (kv - 1) / kv * head / link + r.latency)
    pipe = 0.0
    if p > 1:
        per = x / t if lay["sequence"] == "megatron" else x
        pipe = m * 2 * (per / (r.intra_bandwidth if t * p <= gpus else r.inter_bandwidth) + 2 * r.latency)
    d = zero_world
    span = r.intra_bandwidth if world <= gpus else r.inter_bandwidth
    share = (d - 1) / d if d > 1 else 0.0
    if stage == 0:
        moved, calls = 2 * share * 4 * psi, 1
    elif stage < 3:
        moved, calls = share * (4 + size) * psi, 2
    else:
        moved, calls = share * (4 * psi + m * 2 * size * psi), 1 + 2 * m
    data = moved / span + (calls * n_chunks * r.latency if d > 1 else 0.0)  # a collective per chunk, each time
    shard = psi if stage == 0 else psi / d
    offload = 0.0
    if optim_at == "device":
        offload += 28 * shard / r.device_memory_bandwidth
    else:
        offload += (4 + size) * shard / r.pcie_bandwidth + 28 * shard / r.host_bandwidth
        if optim_at == "nvme":
            offload += 24 * shard * ranks_per_node / max(r.nvme_bandwidth, 1.0)
    if stage == 3 and params_at != "device":
        reads = m * 2 * size * shard
        offload += reads / r.pcie_bandwidth
        if params_at == "nvme":
            offload += reads * ranks_per_node / max(r.nvme_bandwidth, 1.0)
    return {"compute": compute, "bubble": bubble, "tensor": tensor, "pipeline": pipe, "data": data, "offload": offload}
