"""The device mesh: one object that owns every process group of a tensor x data x pipeline layout.

Ranks are laid out tensor-fastest, then data, then pipeline:

    global rank = tp_rank + T * (dp_rank + D * pp_rank)

so a tensor group (the chattiest: collectives inside every layer) is a run of neighbouring ranks, on one node when
T divides the GPUs per node, and pipeline neighbours (point-to-point once per micro-batch) are furthest apart. The
mesh is passed explicitly to whoever needs a group; nothing is global, so two meshes can coexist in one process.

Two refinements: a grid tensor mode (2D, 2.5D, 3D) carves its row, column, depth or cube groups out of the tensor
group (`grid`, hetero/parallel/grid/mesh.py); Ulysses or ring sequence parallelism splits the data-parallel group
into consecutive sequence groups (`sp`), whose ranks read the same samples (`batch_rank`) while ZeRO shards over
all of dp. `batch_group` holds every rank given one batch where a split computes on it (tensor or sequence ranks,
on every stage), which agree on each batch (`hetero/parallel/agree.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetero.comm import Comm
from hetero.errors import ConfigError


def check_degrees(world_size: int, *, tensor: int, pipeline: int) -> int:
    """The data-parallel degree left by the tensor and pipeline degrees; a clear error when they do not divide."""
    model_parallel = tensor * pipeline
    if world_size % model_parallel:
        raise ConfigError(
            f"parallel: tensor ({tensor}) x pipeline ({pipeline}) = {model_parallel} must divide the world size "
            f"({world_size}); the data-parallel degree is what is left. Launch a multiple of {model_parallel} "
            "processes or change the degrees"
        )
    return world_size // model_parallel


@dataclass(frozen=True, eq=False)
class Mesh:
    world: Comm  # every rank of the job
    tp: Comm  # ranks sharing this rank's data-parallel and pipeline coordinates
    dp: Comm  # ranks sharing this rank's tensor and pipeline coordinates: ZeRO shards over it
    pp: Comm  # ranks sharing this rank's tensor and data coordinates, in stage order
    tp_rank: int
    dp_rank: int
    pp_rank: int
    # Ulysses / ring: the ranks of dp that split one sample's sequence (consecutive in dp; ZeRO shards over all of dp).
    sp: Comm = field(default_factory=Comm)
    grid: Any = None  # the 2D / 2.5D / 3D grid carved out of tp (hetero/parallel/grid/mesh.py); None in 1D
    # Every rank given this rank's batch where a tensor or sequence split computes on it: tp x sp x pp of one
    # batch_rank, in stage order (tp or sp itself without a pipeline); Comm() where no split does. The group that
    # agrees on each batch ([Note: a batch agreed over the model-parallel group] in hetero/parallel/agree.py).
    batch_group: Comm = field(default_factory=Comm)
    # Equal parts a sequence split (Megatron-SP, Ulysses, ring) cuts each batch's sequence into; 1 without one. The
    # batch agreement refuses a length that does not divide on every stage at once (agree.py).
    sequence_parts: int = 1

    @property
    def batch_size(self) -> int:
        """Data-parallel ranks that take different samples: dp without the sequence split."""
        return self.dp.size // self.sp.size

    @property
    def batch_rank(self) -> int:
        return self.dp_rank // self.sp.size

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def dp_size(self) -> int:
        return self.dp.size

    @property
    def pp_size(self) -> int:
        return self.pp.size

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp.size - 1

    @staticmethod
    def rank_of(tp: int, dp: int, pp: int, *, tensor: int, data: int) -> int:
        """Global rank of mesh coordinates (tensor fastest, then data, then pipeline)."""
        return tp + tensor * (dp + data * pp)

    @classmethod
    def build(
        cls,
        world: Comm,
        *,
        tensor: int = 1,
        pipeline: int = 1,
        sequence: int = 1,
        tensor_mode: str = "1d",
        tensor_depth: int | None = None,
        sequence_parts: int = 1,
    ) -> Mesh:
        """Split `world` into its tensor, data and pipeline groups. Every rank of `world` must call this, with the
        same degrees (new process groups are made collectively). `sequence`: Ulysses / ring degree, a split of the
        data-parallel group (pass tensor=1 then). `tensor_mode`: a grid mode carves its groups out of tp.
        `sequence_parts`: the equal parts a sequence split cuts the sequence into (ring: 2 per rank)."""
        t, p = tensor, pipeline
        d = check_degrees(world.size, tensor=t, pipeline=p)
        r = world.rank
        tp_rank, dp_rank, pp_rank = r % t, (r // t) % d, r // (t * d)

        def at(a: int, b: int, c: int) -> int:
            return cls.rank_of(a, b, c, tensor=t, data=d)

        def group(degree: int, parts: list[list[int]]) -> Comm:
            if degree == 1:
                return Comm()  # nothing to exchange: no process group at all
            if degree == world.size:
                return world
            return world.split(parts)

        # The same sequence of splits on every rank, as new_group requires.
        tp = group(t, [[at(a, b, c) for a in range(t)] for c in range(p) for b in range(d)])
        dp = group(d, [[at(a, b, c) for b in range(d)] for c in range(p) for a in range(t)])
        pp = group(p, [[at(a, b, c) for c in range(p)] for b in range(d) for a in range(t)])
        sp = Comm()
        if sequence > 1:
            if d % sequence:
                raise ConfigError(
                    f"parallel: the sequence-parallel degree {sequence} must divide the data-parallel degree {d} "
                    f"(world {world.size} / pipeline {p}); launch a multiple of {sequence * p} processes"
                )
            sp = (
                dp
                if sequence == d
                else dp.split([[g * sequence + s for s in range(sequence)] for g in range(d // sequence)])
            )
        batch_group = tp if t > 1 else sp
        if p > 1 and t * sequence > 1:  # ordered by global rank: stage-major, as `BatchAgreement` reads it
            parts = [
                [at(a, g * sequence + s, c) for c in range(p) for s in range(sequence) for a in range(t)]
                for g in range(d // sequence)
            ]
            batch_group = group(t * sequence * p, parts)
        grid = None
        if tensor_mode != "1d":
            from hetero.parallel.grid.mesh import Grid

            grid = Grid.build(tp, tensor_mode, tensor_depth)
        return cls(
            world=world,
            tp=tp,
            dp=dp,
            pp=pp,
            tp_rank=tp_rank,
            dp_rank=dp_rank,
            pp_rank=pp_rank,
            sp=sp,
            grid=grid,
            batch_group=batch_group,
            sequence_parts=sequence_parts,
        )

    def __repr__(self) -> str:
        return (
            f"Mesh(world={self.world.size}, tp={self.tp_rank}/{self.tp_size}, dp={self.dp_rank}/{self.dp_size}, "
            f"pp={self.pp_rank}/{self.pp_size}"
            + (f", sp={self.sp.rank}/{self.sp.size}" if self.sp.size > 1 else "")
            + (f", {self.grid.mode}" if self.grid is not None else "")
            + ")"
        )
