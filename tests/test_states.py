import itertools

import pytest
import torch

from hetero.errors import IllegalTransitionError
from hetero.memory import Chunk, ChunkState, TensorState
from hetero.memory.states import CHUNK_TRANSITIONS, TENSOR_TRANSITIONS, check_chunk_transition


@pytest.mark.parametrize("old,new", list(itertools.product(TensorState, TensorState)))
def test_every_tensor_transition_follows_the_table(old, new):
    chunk = Chunk(id=0, dtype=torch.float32, capacity=8)
    slot = chunk.add_tensor("w", (4,))
    slot.state = old
    chunk.computing = int(old is TensorState.COMPUTE)
    if new in TENSOR_TRANSITIONS[old]:
        chunk.set_state(slot, new)
        assert slot.state is new
        assert chunk.computing == int(new is TensorState.COMPUTE)
    else:
        with pytest.raises(IllegalTransitionError, match=f"{old.name} -> {new.name}"):
            chunk.set_state(slot, new)
        assert slot.state is old


@pytest.mark.parametrize("old,new", list(itertools.product(ChunkState, ChunkState)))
def test_every_chunk_transition_follows_the_table(old, new):
    if new in CHUNK_TRANSITIONS[old]:
        check_chunk_transition(0, old, new)
    else:
        with pytest.raises(IllegalTransitionError, match="illegal state change"):
            check_chunk_transition(0, old, new)


def test_compute_pins_a_chunk_and_marks_it_dirty():
    chunk = Chunk(id=0, dtype=torch.float32, capacity=8)
    a, b = chunk.add_tensor("a", (4,)), chunk.add_tensor("b", (4,))
    for s in (a, b):
        chunk.set_state(s, TensorState.HOLD)
    chunk.dirty = False
    assert chunk.movable
    chunk.set_state(a, TensorState.COMPUTE)
    chunk.set_state(b, TensorState.COMPUTE)
    assert not chunk.movable and chunk.dirty
    chunk.set_state(a, TensorState.HOLD_AFTER_FWD)
    assert not chunk.movable
    chunk.set_state(b, TensorState.HOLD_AFTER_FWD)
    assert chunk.movable


def test_compute_cannot_jump_to_free():
    chunk = Chunk(id=0, dtype=torch.float32, capacity=8)
    s = chunk.add_tensor("a", (8,))
    chunk.set_state(s, TensorState.COMPUTE)
    with pytest.raises(IllegalTransitionError, match="may go to"):
        chunk.set_state(s, TensorState.FREE)


def test_tensor_that_does_not_fit_is_refused():
    chunk = Chunk(id=3, dtype=torch.float16, capacity=10)
    chunk.add_tensor("a", (2, 3))
    with pytest.raises(ValueError, match="does not fit chunk 3: 4 of 10"):
        chunk.add_tensor("b", (5,))
