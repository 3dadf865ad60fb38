"""The chunk manager under random small budgets: seeded workloads of accesses, computation, prefetches, moves,
pins, releases, budget changes and steps whose access order changes (another branch, a shorter or a longer step),
checking after every call that the ledgers equal what the chunks hold, that no tier ever holds more than its budget
(a move's two copies included), that every tensor keeps its values, that an out-of-memory error names a budget
larger than the one it ran out of, and that nothing hangs."""

import random
import re
import threading

import pytest
import torch

from hetero.config import parse_size
from hetero.errors import TierOutOfMemoryError
from hetero.memory import ChunkState, TensorState, Tier

UNIT = 1024  # elements: chunks of a quarter to two units, budgets of two to six
SEEDS = range(8)


def _held(m, tier: Tier) -> int:
    """Bytes the chunks hold on a tier, counted from the chunks alone: a resident payload, both ends of a move in
    flight (the source until it ends, the destination from its start), a device<->NVMe hop's host staging buffer, and
    once a write-back's buffer handed to the read chained behind it."""
    held = 0
    for c in m.chunks:
        move = c.move
        if move is None:
            held += c.nbytes if c.state is ChunkState.RESIDENT and c.tier == tier and c.payload is not None else 0
            continue
        held += c.nbytes if move.dst == tier else 0
        held += c.nbytes if move.src == tier and not move.handed_off else 0
        held += c.nbytes if move.staging is not None and tier is Tier.HOST else 0
    return held


def _check(m, values: dict, top: dict) -> None:
    for tier in (Tier.DEVICE, Tier.HOST):
        ledger = m.ledgers[tier]
        assert ledger.current == _held(m, tier), tier
        assert ledger.used <= ledger.budget, (tier, ledger.used, ledger.budget)
        assert ledger.peak <= top[tier], (tier, ledger.peak, top[tier])  # budgets move (set_budget), never above
    nvme = m.ledgers[Tier.NVME]
    assert nvme.current == sum(c.nbytes for c in m.chunks if c.on_nvme) and nvme.used <= nvme.budget
    for c in m.chunks:
        assert c.computing == sum(s.state is TensorState.COMPUTE for s in c.slots)
        assert (c.state is ChunkState.MOVING) == (c.move is not None)
        assert (c.state is ChunkState.EMPTY) == (c.tier is None)


def _values_kept(chunk, slots, values: dict) -> None:
    for s in slots:
        if s.name in values and s.state is not TensorState.FREE:
            assert torch.equal(chunk.view(s), values[s.name]), s.name


def _fair(error: TierOutOfMemoryError) -> None:
    """An out-of-memory error of the device or host tier names a budget larger than the one that ran out."""
    if error.tier == "nvme":
        return
    found = re.search(r"A budget of ([0-9.]+) (\w+) would have been enough", str(error))
    assert found, str(error)
    assert parse_size(found.group(1) + found.group(2), key="enough") > error.budget, str(error)


def _workload(m, seed: int) -> None:
    rng = random.Random(seed)
    chunks, values = [], {}
    for _ in range(rng.randint(4, 9)):
        n = rng.choice([UNIT, UNIT, 2 * UNIT, UNIT // 2])
        c = m.new_chunk(dtype=rng.choice([torch.float32, torch.float16]), capacity=n, transient=rng.random() < 0.2)
        k = rng.randint(1, 3)
        chunks.append((c, [c.add_tensor(f"c{c.id}.t{j}", (n // k,)) for j in range(k)]))
    first = [rng.randrange(len(chunks)) for _ in range(rng.randint(5, 16))]
    other = [rng.randrange(len(chunks)) for _ in range(rng.randint(5, 16))]
    orders = [first, first, other, first[: len(first) // 2], first + other]  # replayed, another branch, shorter, longer
    top = {t: m.ledgers[t].budget for t in (Tier.DEVICE, Tier.HOST)}

    def checked(call, *args, **kwargs):
        try:
            call(*args, **kwargs)
        except TierOutOfMemoryError as e:
            _fair(e)
        _check(m, values, top)

    def compute(i: int, c, slots) -> None:
        s = rng.choice(slots)
        if s.state is TensorState.COMPUTE:
            return
        if rng.random() < 0.6:
            where = c.tier  # the device, or the host (an update steps states in place there)
            c.set_state(s, TensorState.COMPUTE)
            values[s.name] = torch.randn(s.shape).to(c.dtype)
            c.view(s).copy_(values[s.name])
            j = rng.randrange(len(chunks))
            if j != i:  # another chunk wanted while this one is computed on: it must not be evicted
                checked(m.access, chunks[j][0], Tier.DEVICE)
                assert c.tier is where and c.state is ChunkState.RESIDENT
            c.set_state(s, rng.choice([TensorState.HOLD, TensorState.HOLD_AFTER_FWD, TensorState.HOLD_AFTER_BWD]))
        elif s.state is not TensorState.FREE and rng.random() < 0.3:
            c.set_state(s, TensorState.FREE)
            values.pop(s.name)

    for _ in range(8):
        m.step_begin()
        _check(m, values, top)
        for i in rng.choice(orders):
            c, slots = chunks[i]
            tier = Tier.DEVICE if c.transient else rng.choice([Tier.DEVICE, Tier.DEVICE, Tier.HOST])
            r = rng.random()
            if r < 0.65:
                try:
                    m.access(c, tier, write=rng.random() < 0.7)
                except TierOutOfMemoryError as e:
                    _fair(e)
                else:
                    _values_kept(c, slots, values)
                    compute(i, c, slots)
            elif r < 0.75:
                checked(m.prefetch, [rng.choice(chunks)[0] for _ in range(2)], tier)
            elif r < 0.85:
                if c.state is not ChunkState.EMPTY and not c.transient:
                    checked(m.move, c, rng.choice(list(Tier)), wait=rng.random() < 0.5)
            elif r < 0.9:
                checked(m.set_budget, Tier.DEVICE, rng.randint(1, top[Tier.DEVICE] // (UNIT * 4)) * UNIT * 4)
            elif r < 0.95:
                if c.all_free:
                    checked(m.release, c)
            else:
                other_chunk = rng.choice(chunks)[0]
                if other_chunk is not c:
                    with m.pinned(c):
                        where = c.tier if c.move is None else c.move.dst  # a move in flight ends
                        checked(m.access, other_chunk, Tier.DEVICE if other_chunk.transient else tier)
                        assert (c.tier if c.move is None else c.move.dst) is where  # pinned: it stayed
            _check(m, values, top)
        m.step_end(keep=rng.random() < 0.9)
        m.synchronize()
        _check(m, values, top)
    m.set_budget(Tier.DEVICE, top[Tier.DEVICE])
    for c, slots in chunks:  # every value computed is still there
        if c.state is not ChunkState.EMPTY:
            m.access(c, Tier.DEVICE if c.transient else Tier.HOST, write=False)
            _values_kept(c, slots, values)
            _check(m, values, top)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("standin", [False, True], ids=["cpu", "standin"])
def test_random_workloads_under_small_budgets_keep_every_invariant(make_manager, monkeypatch, seed, standin):
    if standin:  # a device with its own memory: device<->NVMe moves stage through host buffers
        monkeypatch.setenv("HETERO_STANDIN", "1")
    else:
        monkeypatch.delenv("HETERO_STANDIN", raising=False)
    rng = random.Random(seed)
    m = make_manager(
        nvme=True,
        device_budget=rng.randint(2, 6) * UNIT * 4,
        host_budget=rng.randint(2, 6) * UNIT * 4,
        nvme_budget=64 * UNIT * 4,
        prefetch_depth=rng.randint(0, 3),
    )
    failed: list[BaseException] = []

    def run() -> None:
        try:
            _workload(m, seed)
        except BaseException as e:  # reported on the test's thread
            failed.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the workload hung: a call into the manager never returned"
    if failed:
        raise failed[0]
