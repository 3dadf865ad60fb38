"""What each ZeRO stage keeps, and where: the one table the chunks, the engine and the estimator read.

[Note: what each stage keeps]
Every chunk of `capacity` elements (a multiple of the data-parallel size N) has up to five buffers, all chunks of
the manager, so each lives on a tier under a budget:

  buffer      dtype    elements      stage 0      stage 1      stage 2        stage 3
  full        compute  capacity      persistent   persistent   persistent     gathered for use, then released
  shard       compute  capacity/N    -            -            -              persistent, on offload.params
  grad        fp32     cap or cap/N  full, local  full, local  shard          shard
  grad_full   fp32     capacity      -            -            per micro-batch, reduce-scattered into `grad`
  optim       fp32     (1+k)*S       master + k optimizer states, S = capacity (stage 0) or capacity/N

Stages 0 and 1 accumulate the full local gradient over micro-batches and communicate once, at the update (all-reduce
at stage 0; reduce-scatter at stage 1, since each rank only updates its shard). Stages 2 and 3 reduce-scatter every
micro-batch, so no rank ever holds more than a shard of accumulated gradient. After the update, stage 0 copies the
master into the full parameters; stages 1 and 2 copy their shard in and all-gather the rest; stage 3 writes its
shard only, and the full chunk is gathered again at its next use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetero.memory.tier import Tier

_TIERS = {"device": Tier.DEVICE, "host": Tier.HOST, "nvme": Tier.NVME}


@dataclass(frozen=True)
class StageLayout:
    """One column of the table above."""

    stage: int
    optim_sharded: bool  # master weights and optimizer states cover this rank's shard only (stages 1-3)
    grads_sharded: bool  # the accumulated gradient is this rank's shard, reduced every micro-batch (stages 2-3)
    params_sharded: bool  # parameters live as a shard per rank and are gathered for use (stage 3)

    def grad_numel(self, capacity: int, world: int) -> int:
        """Elements of the accumulated gradient buffer."""
        return capacity // world if self.grads_sharded else capacity

    def optim_numel(self, capacity: int, world: int) -> int:
        """Elements of the master weights (and of each optimizer state)."""
        return capacity // world if self.optim_sharded else capacity

    def kept_range(self, capacity: int, world: int, rank: int) -> tuple[int, int]:
        """The chunk elements [lo, hi) this rank keeps master weights and optimizer states for."""
        if not self.optim_sharded:
            return 0, capacity
        s = capacity // world
        return rank * s, (rank + 1) * s


STAGES = {
    0: StageLayout(stage=0, optim_sharded=False, grads_sharded=False, params_sharded=False),
    1: StageLayout(stage=1, optim_sharded=True, grads_sharded=False, params_sharded=False),
    2: StageLayout(stage=2, optim_sharded=True, grads_sharded=True, params_sharded=False),
    3: StageLayout(stage=3, optim_sharded=True, grads_sharded=True, params_sharded=True),
}


@dataclass(frozen=True)
class Placement:
    """Where each kind of buffer lives between uses, and where the optimizer computes."""

    params: Tier  # the stage-3 shard's home (full chunks are on the device while used)
    optim: Tier  # master weights and optimizer states
    compute: Tier  # where the optimizer step runs and gradients accumulate: the device, or the host

    @classmethod
    def of(cls, params: str, optimizer: str) -> Placement:
        """From the offload config's names. "auto" is the device: automatic placement then evicts down as the step's
        activations need the room (hetero/memory/auto.py). The optimizer steps where its states live, the host
        standing in for NVMe (states are streamed through it)."""
        p, o = _TIERS.get(params, Tier.DEVICE), _TIERS.get(optimizer, Tier.DEVICE)
        return cls(params=p, optim=o, compute=Tier.DEVICE if o is Tier.DEVICE else Tier.HOST)


def master_is_shard(layout: StageLayout, trainable: bool, dtype: torch.dtype, placement: Placement) -> bool:
    """Whether a chunk's master weights double as its stage-3 parameter shard.

    [Note: the master is the shard]
    Stage 3 in fp32 with parameters and states on the device: this rank's shard of the parameters and its fp32 master
    weights hold the same values at every moment outside the update (the write-back copies one into the other), so
    the master slot of the optim chunk is the shard that gathers read: one copy, not two (FSDP2 keeps one too). Not
    on the host or NVMe, where the shard and the states move separately (a gather would read the whole optim chunk
    up), nor in fp16/bf16, nor for a frozen chunk (no master).
    """
    return (
        layout.params_sharded
        and trainable
        and dtype == torch.float32
        and placement.params is Tier.DEVICE
        and placement.optim is Tier.DEVICE
    )


def shard_homes(
    capacities: list[int], placement: Placement, *, world: int, itemsize: int, host_bytes: int
) -> list[Tier]:
    """Each chunk's parameter-shard home, in layout order: `placement.params`, except that with shards on NVMe the
    chunks whose shards fit in what is left of `host_bytes`, taken in layout order, live on the host.

    [Note: parameter shards kept on the host]
    With parameters on NVMe every update writes each rank's shard to NVMe and every forward reads it back: the shard's
    bytes each way a step, on top of the optimizer states' (on an H100 with a 551M Llama in bf16, 1.1 GB of the 7.85 GB
    read and of the 7.85 GB written a step). DeepSpeed keeps up to `offload_param.max_in_cpu` parameter elements (1e9
    by default) in host memory even with parameters on NVMe, so a model under that size never swaps its parameters.
    `offload.params_host_bytes` gives hetero the same choice, explicitly and in bytes: taken in layout order (the order
    forward gathers them after an update, so the first ones, with the least time to be read ahead, come first), each
    chunk whose shard still fits keeps it on the host; the rest go to NVMe as before. A kept shard is an ordinary
    host-homed chunk: under the host budget, and if that budget runs short, evicted to NVMe like any host chunk. The
    choice depends on the layout and the config only, the same on every rank; where a shard lives never decides a
    collective.
    """
    homes = []
    left = host_bytes
    for capacity in capacities:
        nbytes = capacity // world * itemsize
        if placement.params is Tier.NVME and nbytes <= left:
            homes.append(Tier.HOST)
            left -= nbytes
        else:
            homes.append(placement.params)
    return homes
