"""Full values of sharded parameters on demand: `engine.gathered_parameters()` blocks and `full_state_dict()`.

At stage 3 a parameter's values live on its rank only as a shard; these views gather whole chunks, hold every
parameter of them in use for the duration, and release what they gathered. The gathers are collectives: every rank
enters with the same chunks, in layout order, each announced to the checker ([Note: every rank in step]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from hetero.comm import Comm
from hetero.device import Device
from hetero.memory import ChunkManager, TensorState
from hetero.zero.protocol import SUMMON, Checker
from hetero.zero.tiling import Tiled, assembled
from hetero.zero.units import Entry
from hetero.zero.zero_chunk import ZeroChunk

if TYPE_CHECKING:
    from hetero.parallel.mesh import Mesh


class ParameterViews:
    def __init__(
        self,
        module: nn.Module,
        chunks: list[ZeroChunk],
        entries: dict[int, Entry],
        *,
        check: Checker,
        comm: Comm,
        device: Device,
        dtype: torch.dtype,
        tiled: dict[int, Tiled],
        manager: ChunkManager,
        mesh: Mesh | None = None,
    ) -> None:
        self.module, self.chunks, self.entries = module, chunks, entries
        # The tensor and pipeline groups `full_state_dict` joins the whole model over (hetero/parallel/full_state.py);
        # None, or degrees of 1: this rank's values are the whole model.
        self.mesh = mesh
        self.order: tuple[str, ...] = ()  # the whole model's keys in its order, under a pipeline (the engine sets it)
        self.tiled, self.manager = tiled, manager  # weights split over chunks ([Note: tiles]): assembled on demand
        self.check, self.comm, self.device, self.dtype = check, comm, device, dtype
        self.open = 0  # `gathered` blocks open now
        # The loop's own writes into parameters at stages 0-2 ([Note: the loop's writes into parameters]): taken into
        # the masters as a block opens (a read-only block must not pass them over), noted as seen after a block
        # whose writes `_adopt_rank0` took.
        self.on_enter: Callable[[], None] | None = None
        self.on_modified: Callable[[], None] | None = None

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """See `Engine.full_state_dict`: this rank's values (`local_state_dict`), joined over the tensor and pipeline
        groups into the whole model's, which every rank then holds on the CPU; rank0_only: global rank 0 alone gets
        it, the others an empty dict (`gather_full_state`)."""
        state = self.local_state_dict()
        if self.mesh is None:
            return {} if rank0_only and self.comm.rank != 0 else state
        from hetero.parallel.full_state import gather_full_state  # hetero.parallel is above hetero.zero

        return gather_full_state(state, self.module, self.mesh, rank0_only=rank0_only, order=self.order)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's module's state_dict with full chunk values: its pipeline stage's keys only, a
        tensor-parallel parameter as this rank's shard."""
        values: dict[int, torch.Tensor] = {}
        for zc in self.chunks:
            with self.summoned([zc]):
                for info, value in zip(zc.spec.params, zc.full_values().values()):
                    if info.tiled:  # a tile's rows of the whole value
                        whole = values.setdefault(id(info.param), torch.empty(info.param.shape, dtype=value.dtype))
                        a, b = info.rows
                        whole[a:b].copy_(value)
                    else:
                        values[id(info.param)] = value
        return {
            name: values[id(t)] if id(t) in values else t.detach().to("cpu", copy=True)
            for name, t in self.module.state_dict(keep_vars=True).items()
        }

    @contextlib.contextmanager
    def gathered(
        self,
        params: Iterable[torch.Tensor] | None = None,
        *,
        modify: bool = False,
        exact: dict[int, torch.Tensor] | None = None,
    ) -> Iterator[None]:
        """See `Engine.gathered_parameters`. exact: by parameter id, the values written in a precision finer than
        the compute dtype (a state dict loaded in fp32): the master weights take them where they round to what rank
        0 wrote ([Note: loading weights into a held model] in handed_over.py)."""
        wanted = None
        if params is None:
            chunks = list(self.chunks)
        else:
            wanted = {id(p) for p in params}
            unknown = wanted - set(self.entries) - set(self.tiled)
            if unknown:
                raise ValueError(
                    f"gathered_parameters: {len(unknown)} of the tensors given are not parameters this engine manages"
                )
            chunks = [zc for zc in self.chunks if any(id(i.param) in wanted for i in zc.spec.params)]
        tiled = [t for k, t in self.tiled.items() if wanted is None or k in wanted]
        # Every rank enters, at every stage: where nothing needs gathering (stages 0-2), rank 0's broadcast of what was
        # modified is still a collective, and one rank alone in the block hung the others at it.
        self.check(SUMMON)
        if self.on_enter is not None:
            self.on_enter()
        self.open += 1
        try:
            with self.summoned(chunks):
                with assembled(tiled, self.manager, modify=modify):
                    yield
                if modify:
                    self._adopt_rank0(chunks, exact or {})
                    if self.on_modified is not None:
                        self.on_modified()
        finally:
            self.open -= 1

    @contextlib.contextmanager
    def summoned(self, chunks: list[ZeroChunk]) -> Iterator[None]:
        """Gather the chunks (if not gathered) and hold every parameter of them in use; release what was gathered
        for the purpose on the way out."""
        fresh = [zc for zc in chunks if not zc.gathered]
        entries = [self.entries[id(i.param)] for zc in chunks for i in zc.spec.params if not i.tiled]
        for zc in chunks:
            if not zc.gathered:
                self.check(SUMMON, chunk=zc.spec.index)
            zc.unshard()
            for e in entries:
                if e.chunk is zc:
                    zc.enter(e)
        try:
            yield
        finally:
            for e in entries:
                e.chunk.exit(e, TensorState.HOLD)
            for zc in fresh:
                zc.reshard()

    def _adopt_rank0(self, chunks: list[ZeroChunk], exact: dict[int, torch.Tensor]) -> None:
        """After `gathered(modify=True)`: every rank takes rank 0's values, shards and master weights included (an
        element whose compute-dtype value did not change keeps its fp32 master; one given in `exact` takes that)."""
        for zc in chunks:
            full = zc.full.payload
            self.comm.broadcast(full, src=0)
            if zc.optim is None:  # frozen: no master weights
                if zc.stage == 3:
                    zc.write_shard(full)
                continue
            master, new = adopt_full(zc, self.device, self.dtype)
            if exact and self.dtype != torch.float32:
                self._exact_masters(zc, master, new, exact)
            if zc.stage == 3:
                zc.write_shard(full)

    def _exact_masters(
        self, zc: ZeroChunk, master: torch.Tensor, new: torch.Tensor, exact: dict[int, torch.Tensor]
    ) -> None:
        """The master weights of this rank's range take the finer values given, where those round to the adopted
        compute-dtype value (rank 0's: a rank given other values keeps rank 0's)."""
        lo, hi = zc.kept_range()
        for info, a, b in zc.spec.overlaps(lo, hi):
            given = exact.get(id(info.param))
            if given is None:
                continue
            src = given.detach().reshape(-1)[info.element(a) : info.element(b)].to(master.device, torch.float32)
            here = slice(a - lo, b - lo)
            agree = src.to(self.dtype).to(torch.float32) == new[here]
            master[here] = torch.where(agree, src, master[here])


def adopt_full(
    zc: ZeroChunk, device: Device, dtype: torch.dtype, new: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's master weights take the elements of its range of the full values (in the compute dtype, `dtype`)
    that differ from the master rounded to that dtype; an element that did not change keeps its finer master.
    Returns the master and those values in fp32. new: those values, already where the master is (`adopt_all`)."""
    master, _ = zc.optimizer_views()
    if new is None:
        mine = zc.kept(zc.full.payload)
        new = device.to_host(mine, torch.float32) if master.device.type == "cpu" else mine.float()
    changed = new != master.to(dtype).to(torch.float32)
    master[changed] = new[changed]
    return master, new


def adopt_all(chunks: list[ZeroChunk], device: Device, dtype: torch.dtype) -> None:
    """`adopt_full` for each chunk, the host waiting for the device once for every master on the host, not once a
    chunk (a loop clamping every parameter after each update waited once a chunk a step: `tools/gpu_waits.py`)."""
    down = [zc for zc in chunks if zc.optimizer_views()[0].device.type == "cpu"]
    values = device.to_host_all([zc.kept(zc.full.payload) for zc in down], torch.float32)
    fetched = {id(zc): v for zc, v in zip(down, values)}
    for zc in chunks:
        adopt_full(zc, device, dtype, fetched.get(id(zc)))
