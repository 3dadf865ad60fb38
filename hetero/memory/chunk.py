"""A chunk: a contiguous, fixed-capacity flat buffer of one dtype holding many tensors.

Tensors are placed back to back in a chunk; each has a slot (offset, numel, shape) and a lifecycle state (see
`states.py`). The chunk's payload lives on exactly one tier at a time, or is in flight between two. The manager owns
all movement; a chunk only knows its layout and derives what it may do from its tensors' states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hetero.memory.states import (
    ChunkState,
    TensorState,
    check_chunk_transition,
    check_tensor_transition,
)
from hetero.memory.tier import Tier

if TYPE_CHECKING:
    from concurrent.futures import Future


@dataclass(eq=False)
class TensorSlot:
    """One tensor's place in a chunk."""

    chunk: Chunk  # the chunk holding this tensor
    name: str  # a label for errors and profiles (a parameter's FQN, or "adam.exp_avg:layer.0.weight")
    offset: int  # first element within the chunk
    shape: torch.Size  # the tensor's shape; numel elements starting at offset
    state: TensorState = TensorState.FREE  # lifecycle state; changed only through Chunk.set_state

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(eq=False)
class Move:
    """A move in flight: the payload is being copied from src to dst by a worker."""

    src: Tier
    dst: Tier
    future: Future[None]  # completes when the bytes are in place at dst
    new_payload: torch.Tensor | None  # the buffer at dst (None when dst is NVMe)
    staging: torch.Tensor | None = None  # a host buffer borrowed for a device<->NVMe hop
    prefetch: bool = False  # started ahead of use by the trace, not by an access
    after: Future[tuple[float, float]] | None = None  # a write-back whose source buffer this read fills once it is done
    handed_off: bool = False  # this write-back's source buffer goes to a chained read, not back to the pool
    skipped: int = 0  # bytes of a FREE head the swap I/O leaves out ([Note: FREE slots are not stored])


@dataclass(eq=False)
class Chunk:
    id: int  # unique within its manager; also the key of its swap slot
    dtype: torch.dtype
    capacity: int  # elements
    kind: str = "param"  # what it holds (param, grad, master, optim, ...): for accounting and profiles
    transient: bool = False  # device payload is one storage that shrinks and grows back ([Note: transient chunks])
    kept: torch.Tensor | None = None  # a transient chunk's payload, kept across drops (its storage resized to 0)
    lent: torch.Tensor | None = None  # the pooled buffer whose memory `kept` holds now (a CPU device; device.py)
    slots: list[TensorSlot] = field(default_factory=list)
    state: ChunkState = ChunkState.EMPTY
    tier: Tier | None = None  # where the payload is valid now (the source while MOVING); None while EMPTY
    payload: torch.Tensor | None = None  # flat buffer of `capacity` elements on `tier` (None on NVMe / EMPTY)
    move: Move | None = None  # the move in flight, while MOVING
    on_nvme: bool = False  # a clean copy of the payload sits in the swap store
    dirty: bool = True  # the payload may differ from the swap copy (set whenever a tensor is computed on)
    prefetched: bool = False  # brought by a prefetch and not yet accessed (for hit accounting)
    last_access: int = 0  # the manager's access clock at the last access, for LRU
    used: int = 0  # elements of capacity taken by slots
    computing: int = 0  # slots in COMPUTE now; a chunk with any is pinned to the device
    pins: int = 0  # holds by `ChunkManager.pinned`: kept in place without marking the payload written
    # Its FREE head slots hold nothing worth keeping: NVMe does not store them (free_head). Only for a chunk whose
    # owner says so: elsewhere a slot's state may lag its data (a gathered chunk keeps values a FREE slot had).
    skip_free_head: bool = False
    stored_from: int = 0  # first element the swap copy holds: the FREE slots before it were not written (see free_head)
    traced: bool = True  # its accesses go into the access trace; its owner says False for a chunk of one step

    @property
    def nbytes(self) -> int:
        return self.capacity * self.dtype.itemsize

    @property
    def free_numel(self) -> int:
        return self.capacity - self.used

    @property
    def movable(self) -> bool:
        return self.computing == 0 and self.pins == 0

    @property
    def all_free(self) -> bool:
        return all(s.state is TensorState.FREE for s in self.slots)

    def free_head(self) -> int:
        """Elements at the head of the payload held only by FREE slots, with data after them: a write to NVMe skips
        them and a read leaves them as they are ([Note: FREE slots are not stored]). 0 when the first slot holds data
        or none does (an all-FREE chunk is not copied at all), and for a chunk that did not ask (`skip_free_head`)."""
        if not self.skip_free_head:
            return 0
        head = 0
        for s in self.slots:
            if s.state is not TensorState.FREE:
                return head
            head = s.offset + s.numel
        return 0

    @property
    def moving(self) -> bool:
        return self.state is ChunkState.MOVING

    def add_tensor(self, name: str, shape: torch.Size | tuple[int, ...]) -> TensorSlot:
        """Reserve room for a tensor; it starts FREE. Raises if it does not fit."""
        shape = torch.Size(shape)
        numel = math.prod(shape)
        if numel > self.free_numel:
            raise ValueError(
                f"tensor {name!r} ({numel} elements) does not fit chunk {self.id}: "
                f"{self.free_numel} of {self.capacity} elements left"
            )
        slot = TensorSlot(chunk=self, name=name, offset=self.used, shape=shape)
        self.slots.append(slot)
        self.used += numel
        return slot

    def set_state(self, slot: TensorSlot, new: TensorState) -> None:
        check_tensor_transition(slot.name, slot.state, new)
        if new is TensorState.COMPUTE:
            self.computing += 1
            self.dirty = True  # computation may write it: the swap copy is stale from here on
        if slot.state is TensorState.COMPUTE:
            self.computing -= 1
        slot.state = new

    def transition(self, new: ChunkState) -> None:
        check_chunk_transition(self.id, self.state, new)
        self.state = new

    def view(self, slot: TensorSlot) -> torch.Tensor:
        """The slot's tensor as a view into the payload (resident on the device or host tier only)."""
        if self.state is not ChunkState.RESIDENT or self.payload is None:
            where = self.tier.label if self.tier is not None else "nowhere"
            raise RuntimeError(
                f"chunk {self.id} ({slot.name!r}) is {self.state.name} on {where}; access it before viewing"
            )
        return self.payload.narrow(0, slot.offset, slot.numel).view(slot.shape)

    def describe(self) -> str:
        names = ", ".join(s.name for s in self.slots[:3]) + (", ..." if len(self.slots) > 3 else "")
        return f"chunk {self.id} [{self.kind}, {self.nbytes} B: {names}]"
