"""State machines of tensors and chunks, each an enum plus a table of legal transitions.

[Note: why tensor states decide where a chunk may go]
A chunk is a unit of movement, but what it may do is decided by the tensors inside it. A tensor being computed on
(COMPUTE) pins its chunk to the device; a chunk whose tensors all hold data (HOLD, HOLD_AFTER_FWD, HOLD_AFTER_BWD)
may be moved to any tier; a chunk whose tensors are all FREE holds nothing worth keeping, so evicting it costs no
copy at all: its memory is simply released. The two HOLD_AFTER_* states carry the phase a tensor left: a parameter
released after forward will be needed again in backward, one released after backward will next be needed by the
optimizer; the engine uses this, the manager only needs "movable or not".
"""

from __future__ import annotations

import enum

from hetero.errors import IllegalTransitionError


class TensorState(enum.Enum):
    FREE = "free"  # no meaningful data: not yet computed, or released
    HOLD = "hold"  # valid data, not in use
    COMPUTE = "compute"  # in use by computation now: its chunk must stay on the device
    HOLD_AFTER_FWD = "hold_after_fwd"  # valid data, used in forward, needed again in backward
    HOLD_AFTER_BWD = "hold_after_bwd"  # valid data, used in backward, next needed by the optimizer

    # Enum hashes a member by its name in Python; every state change looks its state up in the table below, a
    # thousand times a step. Members are singletons compared by identity, so identity's C hash is the same contract.
    __hash__ = object.__hash__


_T = TensorState
TENSOR_TRANSITIONS: dict[TensorState, frozenset[TensorState]] = {
    _T.FREE: frozenset({_T.HOLD, _T.COMPUTE}),  # loaded/initialised, or about to be written (a gradient)
    _T.HOLD: frozenset({_T.COMPUTE, _T.FREE}),
    _T.COMPUTE: frozenset({_T.HOLD, _T.HOLD_AFTER_FWD, _T.HOLD_AFTER_BWD}),  # never straight to FREE: finish first
    _T.HOLD_AFTER_FWD: frozenset({_T.COMPUTE, _T.HOLD, _T.FREE}),
    _T.HOLD_AFTER_BWD: frozenset({_T.COMPUTE, _T.HOLD, _T.FREE}),
}


def check_tensor_transition(name: str, old: TensorState, new: TensorState) -> None:
    if new not in TENSOR_TRANSITIONS[old]:
        legal = ", ".join(s.name for s in sorted(TENSOR_TRANSITIONS[old], key=lambda s: s.name))
        raise IllegalTransitionError(
            f"tensor {name!r}: illegal state change {old.name} -> {new.name}; from {old.name} it may go to {legal}"
        )


class ChunkState(enum.Enum):
    EMPTY = "empty"  # no payload anywhere: every tensor is FREE and the memory was released
    RESIDENT = "resident"  # the payload is valid on `chunk.tier`
    MOVING = "moving"  # a move to `chunk.move.dst` is in flight; the source copy stays valid until it ends

    __hash__ = object.__hash__  # as TensorState's


_C = ChunkState
CHUNK_TRANSITIONS: dict[ChunkState, frozenset[ChunkState]] = {
    _C.EMPTY: frozenset({_C.RESIDENT}),  # allocated on first use
    _C.RESIDENT: frozenset({_C.MOVING, _C.EMPTY}),
    _C.MOVING: frozenset({_C.RESIDENT}),  # a move always ends (on failure the chunk stays where it was)
}


def check_chunk_transition(chunk_id: int, old: ChunkState, new: ChunkState) -> None:
    if new not in CHUNK_TRANSITIONS[old]:
        legal = ", ".join(s.name for s in CHUNK_TRANSITIONS[old])
        raise IllegalTransitionError(
            f"chunk {chunk_id}: illegal state change {old.name} -> {new.name}; from {old.name} it may go to {legal}"
        )
