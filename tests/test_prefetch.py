"""Prefetch under a full host: reads chained behind write-backs, and an update that streams its states from NVMe."""

import concurrent.futures
import threading

import pytest
import torch

import hetero
from hetero.errors import NvmeError
from hetero.memory import ChunkState, TensorState, Tier

try:
    from tests import parity
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]

NUMEL = 4096


def _filled(m, *, tier=Tier.HOST, seed=0):
    c = m.new_chunk(dtype=torch.float32, capacity=NUMEL)
    s = c.add_tensor(f"t{c.id}", (NUMEL,))
    m.access(c, Tier.HOST)
    c.view(s).copy_(torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)))
    c.set_state(s, TensorState.HOLD)
    values = c.view(s).clone()
    if tier is not Tier.HOST:
        m.move(c, tier)
    return c, s, values


def _held(m, tier=Tier.HOST) -> int:
    """Bytes of `tier` the chunks hold, counted independently: a buffer handed from a move out of the tier to a
    chained copy into it counts once."""
    held = 0
    for c in m.chunks:
        if c.move is None:
            held += c.nbytes if c.tier is tier and c.state is ChunkState.RESIDENT else 0
        elif c.move.dst is tier or (c.move.src is tier and not c.move.handed_off):
            held += c.nbytes
    return held


class _GatedWrites:
    """Wraps the NVMe store so writes wait for a gate (and optionally fail): keeps a write-back in flight."""

    def __init__(self, store, fail: bool = False):
        self.store, self.gate, self.fail = store, threading.Event(), fail

    def write(self, key, src):
        held = concurrent.futures.Future()

        def gated():
            try:
                assert self.gate.wait(10), "test gate never opened"
                if self.fail:
                    raise NvmeError("injected write failure")
                self.store.write(key, src).result()
                held.set_result(None)
            except BaseException as e:
                held.set_exception(e)

        threading.Thread(target=gated).start()
        return held

    def __getattr__(self, name):
        return getattr(self.store, name)


def _full_host_with_a_write_back_in_flight(make_manager, fail=False):
    m = make_manager(nvme=True, host_budget=2 * NUMEL * 4)
    wanted, ws, wbits = _filled(m, tier=Tier.NVME, seed=1)
    a, sa, abits = _filled(m, seed=2)
    b, _, _ = _filled(m, seed=3)  # the host is full of dirty chunks
    gated = _GatedWrites(m.storage.store, fail=fail)
    m.storage.store = gated
    m.move(a, Tier.NVME, wait=False)  # its write waits at the gate
    m.prefetch([wanted], Tier.HOST)
    return m, gated, (wanted, ws, wbits), (a, sa, abits), b


def test_prefetch_into_a_full_host_chains_behind_a_write_back(make_manager):
    m, gated, (wanted, ws, wbits), (a, sa, abits), b = _full_host_with_a_write_back_in_flight(make_manager)
    # Without the chain the prefetch could not start: a's room is not free until its write ends.
    assert wanted.moving and m.counters["chained_reads"] == 1
    assert b.tier is Tier.HOST and not b.moving  # nothing else was evicted for it
    ledger = m.ledgers[Tier.HOST]
    assert ledger.current == _held(m) and ledger.used <= ledger.budget
    gated.gate.set()
    m.access(wanted, Tier.HOST)  # a hit: waits for the chained read, issues no read of its own
    assert m.counters["prefetch_hits"] == 1 and m.counters.get("prefetch_misses", 0) == 0
    assert torch.equal(wanted.view(ws), wbits)
    m.synchronize()
    assert a.tier is Tier.NVME and ledger.current == _held(m) == 2 * NUMEL * 4
    m.storage.store = gated.store
    m.access(a, Tier.HOST)  # the write-back that gave its buffer away wrote the right bytes
    assert torch.equal(a.view(sa), abits)
    assert ledger.peak <= ledger.budget and ledger.current == _held(m)


def test_a_failed_write_back_fails_its_chained_read_and_keeps_its_buffer(make_manager):
    m, gated, (wanted, ws, wbits), (a, sa, abits), b = _full_host_with_a_write_back_in_flight(make_manager, True)
    assert wanted.moving
    gated.gate.set()
    with pytest.raises(NvmeError, match="injected") as raised:
        m.synchronize()  # both end before it raises: the write-back's error, the chained read's noted on it
    assert any("another move failed too" in n for n in raised.value.__notes__)
    assert not a.moving and not wanted.moving
    m.storage.store = gated.store
    assert a.tier is Tier.HOST and torch.equal(a.view(sa), abits)  # the donor keeps its buffer and data
    assert wanted.tier is Tier.NVME and wanted.payload is None
    assert m.ledgers[Tier.HOST].current == _held(m) == 2 * NUMEL * 4
    m.access(wanted, Tier.HOST)  # and it can still be read, into memory of its own
    assert torch.equal(wanted.view(ws), wbits)


def test_a_prefetch_read_does_not_wait_for_write_backs(make_manager):
    """[Note: swap moves skip the workers]: with both move workers' worth of write-backs held at the disk, a
    prefetch read still completes (it used to queue behind them in the workers' FIFO)."""
    m = make_manager(nvme=True, host_budget=8 * NUMEL * 4)
    wanted, ws, wbits = _filled(m, tier=Tier.NVME, seed=1)
    dirty = [_filled(m, seed=2 + i) for i in range(3)]
    gated = _GatedWrites(m.storage.store)
    m.storage.store = gated
    for c, _, _ in dirty:
        m.move(c, Tier.NVME, wait=False)  # every write waits at the gate
    m.prefetch([wanted], Tier.HOST)
    assert wanted.moving
    try:
        wanted.move.future.result(timeout=10)  # done while every write-back is still held
        assert all(c.moving for c, _, _ in dirty)
    finally:
        gated.gate.set()
    m.access(wanted, Tier.HOST)
    assert torch.equal(wanted.view(ws), wbits)
    m.synchronize()
    m.storage.store = gated.store
    for c, s, bits in dirty:
        m.access(c, Tier.HOST)
        assert torch.equal(c.view(s), bits)


def _nvme_step_bytes(engine, x, y) -> tuple[int, int, float]:
    before = dict(engine.memory_stats()["moved"])
    loss = engine(x, labels=y).loss
    engine.backward(loss)
    engine.step()
    engine.manager.synchronize()
    moved = engine.memory_stats()["moved"]
    delta = {k: v - before.get(k, 0) for k, v in moved.items()}
    read = sum(v for k, v in delta.items() if k.startswith("nvme->"))
    write = sum(v for k, v in delta.items() if k.endswith("->nvme"))
    return read, write, loss.item()


@pytest.mark.timeout(120)
def test_update_streams_states_near_the_minimum_nvme_traffic(tmp_path):
    """Stage 3, parameters and states on NVMe, states 3x the host budget: a step reads every shard (forward) and every
    optimizer chunk's states once and writes each of them once (the master follows the shard and is not stored),
    plus only the few gradients the host cannot hold through the update; nothing is read only to be overwritten, no
    gradient is read twice for the norm, and the losses are plain PyTorch's. (Before the update joined the trace and
    reads could chain behind write-backs, the same run moved 35-70% more than the minimum.)"""
    steps = 4
    model = parity.build()
    opt = parity.make_optimizer(model)
    nb = parity.CHUNK * 4
    cfg = {
        "zero_stage": 3,
        "chunk_size": parity.CHUNK,
        "offload": {"params": "nvme", "optimizer": "nvme"},
        "memory": {"device_budget": 4 * nb, "host_budget": 10 * nb, "nvme_dir": str(tmp_path)},
    }
    engine = hetero.initialize(model, opt, cfg)
    shards = sum(zc.shard.nbytes for zc in engine.chunks if zc.shard is not None)
    every = shards + sum(zc.optim.nbytes for zc in engine.trainable)  # every buffer once, the master included
    assert every >= 3 * 10 * nb  # the states are 3x the host budget
    # The master follows the shard on NVMe and is not stored: the optimizer chunks move their states only.
    master = sum(zc.shard_numel * 4 for zc in engine.trainable if zc.master_follows)
    assert master > 0
    minimum = every - master
    losses, traffic = [], []
    for x, y in parity.batches(steps, 4):
        read, write, loss = _nvme_step_bytes(engine, x, y)
        losses.append(loss)
        traffic.append((read / minimum, write / minimum))
    stats = engine.memory_stats()
    engine.close()
    ref, _ = parity.reference(steps=steps, rows=4)
    assert losses == pytest.approx(ref, rel=1e-5)
    assert stats["host"]["peak"] <= 10 * nb and stats["device"]["peak"] <= 4 * nb
    for read, write in traffic:
        # Reads: the update reads a shard the host could not keep since backward where it read the master before,
        # so no more than before that (1.3x every buffer once). Writes: the master's bytes fewer than before.
        assert minimum <= read * minimum <= 1.3 * every, traffic
        assert minimum <= write * minimum <= minimum + 0.25 * every, traffic
    # Whether a read chains behind a write-back depends on whether that write is still in flight when the prefetch
    # wants its room: timing, not behaviour (with swap moves queued on the store at once, writes often end first).
    # The chaining itself is tested deterministically above, behind a gated store.


@pytest.mark.parametrize("ahead_bytes, most", [(1 << 40, 3), (1, 2)], ids=["small-chunks-two-ahead", "one-ahead"])
def test_the_update_reads_a_second_chunk_ahead_only_while_little_is_ahead(tmp_path, monkeypatch, ahead_bytes, most):
    """[Note: how far the update reads ahead]: with states on NVMe each of the update's reads asks for the chunk
    stepping and at most two ahead, and no second one once AHEAD_BYTES are ahead (the chunk after it is read later)."""
    import hetero.zero.read_ahead as read_ahead

    monkeypatch.setattr(read_ahead, "AHEAD_BYTES", ahead_bytes)
    model = parity.build()
    cfg = {
        "zero_stage": 3,
        "chunk_size": parity.CHUNK,
        "offload": {"optimizer": "nvme"},
        "memory": {"nvme_dir": str(tmp_path)},
    }
    engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
    optim = {zc.optim.id: zc for zc in engine.chunks if zc.optim is not None}
    assert len(optim) >= 4
    asked: list[int] = []
    real = engine.manager.prefetch

    def spy(chunks, tier, **kw):
        if any(c.id in optim for c in chunks):
            asked.append(sum(c.id in optim for c in chunks))  # the optimizer chunks this read asks for
        return real(chunks, tier, **kw)

    monkeypatch.setattr(engine.manager, "prefetch", spy)
    (x, y), _ = parity.batches(2, 4)
    engine.backward(engine(x, labels=y).loss)
    engine.step()
    engine.close()
    assert asked and max(asked) == most, asked


def test_a_prefetch_that_cannot_fit_the_budget_is_no_error(make_manager):
    """The trace wants a chunk on the device that no longer fits its budget at all (lowered since the step was
    recorded: `set_budget`). Prefetching it is only a wish: step_begin and the accesses of other chunks go on, and
    the error comes from the access of that chunk, naming it."""
    nb = NUMEL * 4
    m = make_manager(device_budget=4 * nb, prefetch_depth=2)
    a, b = (_filled(m, seed=i)[0] for i in range(2))
    big = m.new_chunk(dtype=torch.float32, capacity=2 * NUMEL)
    big.add_tensor("big", (2 * NUMEL,))
    m.step_begin()
    for c in (a, big, b):
        m.access(c)
    m.step_end()
    m.move(big, Tier.HOST)
    assert m.set_budget(Tier.DEVICE, nb) == nb
    m.step_begin()  # the replay's first chunks are a and big: big's prefetch cannot be
    m.access(a)
    with pytest.raises(hetero.TierOutOfMemoryError, match="exceeds the budget") as info:
        m.access(big)
    assert info.value.needed == 2 * nb and big.describe() in str(info.value)
    m.access(b)
    assert b.tier is Tier.DEVICE and m.ledgers[Tier.DEVICE].used <= nb


@pytest.mark.parametrize("held", ["compute", "pinned", "landing"])
def test_prefetch_leaves_a_chunk_held_where_it_is(make_manager, monkeypatch, held):
    """A chunk computed on where it is (an update stepping states in place on the host), pinned there, or with a copy
    still landing in it, stays there until it is let go, even when the trace or a prefetch wants it on the device next:
    moved, its buffer went back to the pool while the caller (or the copy) still wrote into it, and the values written
    were lost."""
    if held == "landing":
        monkeypatch.setenv("HETERO_STANDIN", "1")  # its device's copy handles are futures
    m = make_manager(prefetch_depth=2)
    (a, sa, _), (b, _, _), (c, _, _) = (_filled(m, seed=i) for i in range(3))
    m.step_begin()
    for x in (b, a, c):
        m.access(x, Tier.DEVICE)
    m.step_end()
    for x in (a, b, c):
        m.move(x, Tier.HOST)
    view = m.access(a, Tier.HOST)
    landed = concurrent.futures.Future()
    if held == "compute":
        a.set_state(sa, TensorState.COMPUTE)
    elif held == "pinned":
        m.pin(a)
    else:
        m.land_later(a, landed)  # a copy writing into it, done when `landed` is
    try:
        m.step_begin()  # the replay wants b and a on the device
        m.access(b, Tier.DEVICE)
        m.prefetch([a], Tier.DEVICE)
        assert a.tier is Tier.HOST and not a.moving
    finally:
        if held == "landing" and a.moving:
            landed.set_result(None)  # else closing the manager would wait for it
    view.fill_(42.0)  # the caller's (or the copy's) write
    if held == "compute":
        a.set_state(sa, TensorState.HOLD)
    elif held == "pinned":
        m.unpin(a)
    else:
        landed.set_result(None)
    assert torch.equal(m.access(a, Tier.DEVICE), torch.full((NUMEL,), 42.0))


def _full_device_with_an_eviction_in_flight(make_manager, copies):
    """A device of two chunks, both dirty; `a`'s eviction held on the driving thread (`copies`), then a prefetch of
    `wanted` from the host."""
    m = make_manager(device_budget=2 * NUMEL * 4)
    wanted, ws, wbits = _filled(m, seed=1)  # on the host
    a, sa, abits = _filled(m, tier=Tier.DEVICE, seed=2)
    b, _, _ = _filled(m, tier=Tier.DEVICE, seed=3)
    copies.at_once = False
    m.move(a, Tier.HOST, wait=False)  # its copy is held: its device buffer is still being read
    m.prefetch([wanted], Tier.DEVICE)
    return m, (wanted, ws, wbits), (a, sa, abits), b


def test_prefetch_into_a_full_device_chains_behind_an_eviction(make_manager, copies):
    """[Note: reads chained behind write-backs], device side: a prefetch from the host that finds the device full
    while an eviction of a chunk of its size is in flight copies into that chunk's device buffer as soon as the
    eviction is done, on the worker, instead of waiting for a later access to look again (with the eviction slower
    than the compute between two accesses, the chunk was loaded on demand: `test_a_pipelined_batch_records_its_update`
    in tests/test_trace_modes.py counted 3 such loads a step, now 2)."""
    m, (wanted, ws, wbits), (a, sa, abits), b = _full_device_with_an_eviction_in_flight(make_manager, copies)
    assert wanted.moving and m.counters["chained_reads"] == 1
    assert b.tier is Tier.DEVICE and not b.moving  # nothing else was evicted for it
    ledger = m.ledgers[Tier.DEVICE]
    assert ledger.current == _held(m, Tier.DEVICE) and ledger.used <= ledger.budget
    m.access(wanted, Tier.DEVICE)  # a hit: the eviction's copy runs first, then the chained copy
    assert m.counters["prefetch_hits"] == 1 and m.counters.get("prefetch_misses", 0) == 0
    assert torch.equal(wanted.view(ws), wbits)
    m.synchronize()
    assert a.tier is Tier.HOST and torch.equal(a.view(sa), abits)  # the eviction read its bytes before the copy
    assert ledger.current == _held(m, Tier.DEVICE) == 2 * NUMEL * 4 and ledger.peak <= ledger.budget


def test_a_failed_eviction_fails_its_chained_copy_and_keeps_its_buffer(make_manager, copies, monkeypatch):
    m, (wanted, ws, wbits), (a, sa, abits), b = _full_device_with_an_eviction_in_flight(make_manager, copies)
    assert wanted.moving and m.counters["chained_reads"] == 1
    real = m.device.copy
    failed = []

    def copy(dst, src, **kwargs):
        if not failed:  # the first copy run is the eviction's
            failed.append(True)
            raise RuntimeError("injected copy failure")
        real(dst, src, **kwargs)

    monkeypatch.setattr(m.device, "copy", copy)
    with pytest.raises(RuntimeError, match="injected") as raised:
        m.synchronize()
    assert any("another move failed too" in n for n in raised.value.__notes__)
    monkeypatch.setattr(m.device, "copy", real)
    assert a.tier is Tier.DEVICE and torch.equal(a.view(sa), abits)  # the donor keeps its buffer and data
    assert wanted.tier is Tier.HOST and torch.equal(wanted.view(ws), wbits)
    assert m.ledgers[Tier.DEVICE].current == _held(m, Tier.DEVICE) == 2 * NUMEL * 4
    m.access(wanted, Tier.DEVICE)  # and it can still come up, into memory of its own (b or a goes down)
    assert torch.equal(wanted.view(ws), wbits)


def test_a_transient_chunk_neither_lends_nor_takes_a_device_buffer(make_manager, copies):
    """A transient chunk's device storage is its own ([Note: transient chunks] in manager.py): views outside hetero
    hold it, so its buffer is never handed to another chunk, and it never takes one."""
    m = make_manager(device_budget=2 * NUMEL * 4)
    wanted, _, _ = _filled(m, seed=1)
    t = m.new_chunk(dtype=torch.float32, capacity=NUMEL, transient=True)
    st = t.add_tensor("gathered", (NUMEL,))
    m.access(t, Tier.DEVICE)
    t.view(st).fill_(1.0)
    t.set_state(st, TensorState.HOLD)
    _filled(m, tier=Tier.DEVICE, seed=3)
    copies.at_once = False
    m.move(t, Tier.HOST, wait=False)
    m.prefetch([wanted], Tier.DEVICE)
    assert m.counters.get("chained_reads", 0) == 0
    m.synchronize()
    assert torch.equal(t.view(st) if t.tier is Tier.HOST else t.payload, torch.ones(NUMEL))
