"""Where a partial step (`step_end(keep=False)`) leaves the chunks does not depend on when its copies landed
([Note: a partial step takes its prefetches back] in hetero/memory/prefetch.py).

The move workers are replaced by the `copies` fixture (tests/conftest.py), which runs their jobs on the driving
thread, either at once (every eviction is done before room-making looks again, so a prefetch starts in the same
access: the ordering that came in 1-5% of runs) or held until the driving thread waits for a move (room-making never
sees its evictions done: the usual ordering). Either is forced, not hoped for. (Swap moves skip the workers: with
NVMe the store's threads copy.)"""

import pytest
import torch

from hetero.memory import TensorState, Tier

NUMEL = 1024
LAYERS = 8


def _layers(m, tier):
    chunks = []
    for i in range(LAYERS):
        c = m.new_chunk(dtype=torch.float32, capacity=NUMEL)
        s = c.add_tensor(f"layer{i}", (NUMEL,))
        m.access(c, Tier.HOST)
        c.set_state(s, TensorState.HOLD)
        if tier is Tier.HOST:
            m.move(c, Tier.NVME)  # the layers start on NVMe, and are computed on in host memory
        chunks.append(c)
    return chunks


def _step(m, chunks, kind, tier):
    """As tests/test_trace_modes.py's: a training step (forward, backward) or an evaluation; its demand loads."""
    before = m.counters["prefetch_misses"]
    m.step_begin(kind)
    m.synchronize()
    for c in chunks + chunks[::-1] if kind == "train" else chunks:
        m.access(c, tier, write=False)
        m.synchronize()
    m.step_end()
    return m.counters["prefetch_misses"] - before


def _partial(m, copies, tier, at_once):
    """Training and evaluation steps replaying, then a training step that stops after three accesses, its copies
    landing `at_once` or held, every one landed before it ends. Returns the layers."""
    chunks = _layers(m, tier)
    for kind in ("train", "eval", "train", "eval"):
        _step(m, chunks, kind, tier)
    copies.at_once = at_once
    m.step_begin("train")
    for c in chunks[:3]:
        m.access(c, tier)
        m.synchronize()
    copies.at_once = False
    return chunks


def _partial_then_eval(m, copies, tier, at_once):
    """The partial step ended, then an evaluation, its copies held (its `step_begin` cannot see an eviction it
    started done). Returns where the chunks were after the partial step, and the evaluation's demand loads."""
    chunks = _partial(m, copies, tier, at_once)
    m.step_end(keep=False)
    m.synchronize()
    placed = [c.id for c in chunks if c.tier is tier]
    return placed, _step(m, chunks, "eval", tier)


@pytest.mark.timeout(60)
def test_a_partial_step_leaves_the_same_placement_whenever_its_copies_landed(make_manager, copies):
    """A device of three layers, prefetch 2 ahead. The partial step's last access prefetches the next layers of a
    training trace it then drops. Copies landing at once, room-making saw the eviction for the farthest one done and
    started its copy: before, the partial step left the device full of prefetches for a future not coming (layers
    2, 3, 4 against 2, 3 with copies held), and the evaluation after it could only start evicting at its `step_begin`
    and loaded its first layer on demand. Now the unused prefetches go back where they came from: the device holds
    what the partial step used last, either way, and the evaluation loads nothing on demand."""
    results = [
        _partial_then_eval(make_manager(device_budget=3 * NUMEL * 4, prefetch_depth=2), copies, Tier.DEVICE, at_once)
        for at_once in (False, True)
    ]
    assert results[0] == results[1]
    placed, loads = results[0]
    assert placed == [2]  # the partial step's last access; its prefetches (3, and 4 when copies landed at once) left
    assert loads == 0


@pytest.mark.timeout(60)
def test_unused_prefetches_from_nvme_go_back_without_a_write(make_manager, copies):
    """The layers on NVMe, computed on in a host of three: the partial step's last access prefetches layers 3 and 4
    from NVMe (the farther one read into the buffer of a write-back in flight, or into the room it left: the store's
    threads run swap moves, so either). Unused, they are clean: taking them back frees their buffers and writes
    nothing (their swap copies are still there), and the evaluation after finds room for its first layers."""
    m = make_manager(host_budget=3 * NUMEL * 4, prefetch_depth=2, nvme=True)
    chunks = _partial(m, copies, Tier.HOST, at_once=True)
    written, clean = m.moved[(Tier.HOST, Tier.NVME)], m.counters["clean_evictions"]
    m.step_end(keep=False)
    assert m.counters["prefetches_withdrawn"] == 2  # layers 3 and 4
    assert m.counters["clean_evictions"] == clean + 2
    assert m.moved[(Tier.HOST, Tier.NVME)] == written
    assert [c.id for c in chunks if c.tier is Tier.HOST] == [2]
    assert _step(m, chunks, "eval", Tier.HOST) == 0


@pytest.mark.timeout(60)
def test_a_complete_step_waits_for_no_copy(make_manager, copies):
    """Taking prefetches back is for a partial step only: a complete step ends with the moves it started for the next
    step (an evaluation's last access makes room for the next one's first layers) still in flight, and takes none
    back: the hot path waits for nothing more."""
    m = make_manager(device_budget=3 * NUMEL * 4, prefetch_depth=2)
    chunks = _layers(m, Tier.DEVICE)
    _step(m, chunks, "eval", Tier.DEVICE)  # recorded
    m.step_begin("eval")
    for c in chunks:
        m.access(c, Tier.DEVICE, write=False)
    m.step_end()
    assert copies.held and any(c.moving for c in chunks)
    assert m.counters["prefetches_withdrawn"] == 0
    m.synchronize()
