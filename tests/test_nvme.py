"""NvmeStore: the NVMe swap tier (O_DIRECT and buffered paths, slots, ordering, privacy, errors)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time

import pytest
import torch

from hetero.errors import NvmeCorruptError, NvmeError, NvmeSpaceError, NvmeUnavailableError
from hetero.memory import nvme, swap_file
from hetero.memory.aligned import ALIGN, AlignedBuffer, StagingPool, align_up
from hetero.memory.nvme import NvmeStore
from hetero.memory.swap_file import Slots

pytestmark = pytest.mark.timeout(60)

BLOCK = 64 << 10  # small blocks, so modest tensors still span several blocks and an odd tail
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]
# Bit patterns a float round trip must keep exactly: NaN with payload, +-inf, -0.0, a subnormal.
SPECIAL = {
    4: [0x7FC00001, 0x7F800000, -0x800000, -0x80000000, 0x00000001],
    2: [0x7E01, 0x7C00, -0x400, -0x8000, 0x0001],
}


def random_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    t = torch.randint(0, 256, (numel * size,), dtype=torch.uint8).view(dtype)
    if dtype.is_floating_point:
        special = SPECIAL[size]
        n = min(numel, len(special))
        t.view(torch.int32 if size == 4 else torch.int16)[:n] = torch.tensor(special[:n])
    return t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def round_trip(store: NvmeStore, key: int, t: torch.Tensor) -> torch.Tensor:
    store.write(key, t).result()
    out = torch.empty_like(t)
    store.read(key, out).result()
    return out


@pytest.fixture
def shm_dir():
    """A directory on tmpfs (the buffered-I/O case on kernels whose tmpfs refuses O_DIRECT)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = tempfile.mkdtemp(prefix="hetero-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def stores():
    """Make stores that are closed at the end of the test even when it fails."""
    made: list[NvmeStore] = []

    def make(directory, **kwargs) -> NvmeStore:
        kwargs.setdefault("block_bytes", BLOCK)
        s = NvmeStore(directory, **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture(params=["direct", "buffered"])
def store(request, stores, tmp_path, shm_dir):
    """A store on each I/O path: O_DIRECT on the disk under /tmp, buffered I/O on tmpfs."""
    if request.param == "direct":
        s = stores(tmp_path)
        if not s.direct:
            pytest.skip(f"O_DIRECT unsupported on {tmp_path}")
        return s
    s = stores(shm_dir, direct=False)
    assert not s.direct
    return s


def swap_dirs(parent) -> list[str]:
    return [n for n in os.listdir(parent) if n.startswith("hetero-swap-")]


# ------------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 4097, 3 * BLOCK + 5], ids=["one", "4097", "multiblock+tail"])
def test_round_trip_bit_exact(store, dtype, numel):
    t = random_tensor(numel, dtype)
    out = round_trip(store, 7, t)
    assert same_bytes(t, out)
    assert store.nbytes(7) == t.numel() * t.element_size()


def test_round_trip_odd_shapes_and_empty(store):
    for key, t in enumerate([torch.randn(3, 5, 7), torch.rand(()), torch.empty(0), torch.rand(100) > 0.5]):
        assert same_bytes(t, round_trip(store, key, t))
    assert store.nbytes(2) == 0


def test_direct_is_the_default_on_a_disk_that_supports_it(stores, tmp_path):
    s = stores(tmp_path)
    probe = os.path.join(tmp_path, "probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            supported = os.pwrite(fd, AlignedBuffer(ALIGN).view, 0) == ALIGN
        finally:
            os.close(fd)
    except OSError:
        supported = False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    assert s.direct == supported


def test_aligned_memory_skips_staging_and_unaligned_memory_is_staged(stores, tmp_path):
    s = stores(tmp_path)
    if not s.direct:
        pytest.skip("O_DIRECT unsupported here")
    n = 2 * BLOCK
    src, dst = AlignedBuffer(n).tensor, AlignedBuffer(n).tensor  # page-aligned, like pinned memory
    src.copy_(random_tensor(n, torch.uint8))
    s.write(1, src).result()
    s.read(1, dst).result()
    assert same_bytes(src, dst)
    assert s._staging.created == 0  # went straight between the tensors and the disk
    # A 1-byte offset breaks every alignment O_DIRECT could accept: these must go through staging buffers.
    unaligned = random_tensor(n + 1, torch.uint8)[1:]
    out = torch.empty(n + 1, dtype=torch.uint8)[1:]
    s.write(2, unaligned).result()
    s.read(2, out).result()
    assert same_bytes(unaligned, out)
    assert s._staging.created > 0


def test_staging_pool_is_bounded(stores, tmp_path):
    s = stores(tmp_path, io_threads=4, staging_buffers=2)
    if not s.direct:
        pytest.skip("O_DIRECT unsupported here")
    data = [random_tensor(4 * BLOCK + 1, torch.uint8)[1:] for _ in range(16)]  # unaligned: all staged
    for f in [s.write(i, t) for i, t in enumerate(data)]:
        f.result()
    outs = [torch.empty(4 * BLOCK + 1, dtype=torch.uint8)[1:] for _ in data]
    for f in [s.read(i, o) for i, o in enumerate(outs)]:
        f.result()
    assert all(same_bytes(a, b) for a, b in zip(data, outs))
    assert 0 < s._staging.created <= 2


def test_staging_pool_queues_instead_of_allocating():
    pool = StagingPool(1, 100)
    got: list = []
    pool.acquire_async(got.append)
    pool.acquire_async(got.append)  # none left: queued, not allocated
    pool.acquire_async(got.append)
    assert len(got) == 1 and pool.created == 1
    first = got[0]
    assert first.size == ALIGN and align_up(1) == ALIGN
    pool.release(first)  # handed straight to the oldest waiter
    assert got == [first, first] and pool.created == 1
    pool.release(first)
    pool.release(first)
    assert len(got) == 3
    pool.acquire_async(got.append)
    assert len(got) == 4  # a released buffer with no waiter is kept for the next request


# ------------------------------------------------------------------------------------------------ concurrency


def test_many_requests_in_flight(store):
    data = [random_tensor(BLOCK * (i % 5) + 17 * i + 1, DTYPES[i % len(DTYPES)]) for i in range(32)]
    writes = [store.write(i, t) for i, t in enumerate(data)]  # all queued before any is waited for
    outs = [torch.empty_like(t) for t in data]
    reads = [store.read(i, o) for i, o in enumerate(outs)]  # queued behind the writes of their keys
    for f in writes + reads:
        assert f.result() is None
    assert all(same_bytes(a, b) for a, b in zip(data, outs))
    assert store.stats.writes == 32 and store.stats.reads == 32
    assert store.stats.bytes_written == store.stats.bytes_read == sum(t.numel() * t.element_size() for t in data)
    assert store.used_bytes == store.stats.bytes_written


def test_read_right_after_write_sees_the_new_data(store):
    old = random_tensor(3 * BLOCK + 5, torch.float32)
    store.write(0, old).result()
    for _ in range(20):
        new = random_tensor(3 * BLOCK + 5, torch.float32)
        store.write(0, new)  # not waited for
        out = torch.empty_like(new)
        store.read(0, out).result()
        assert same_bytes(out, new)


def test_overwrite_does_not_clobber_a_queued_read(store):
    # The overwrite reuses the slot in place, so it must wait for the read queued before it.
    for _ in range(20):
        old, new = random_tensor(8 * BLOCK, torch.uint8), random_tensor(8 * BLOCK, torch.uint8)
        store.write(0, old).result()
        out = torch.empty_like(old)
        r = store.read(0, out)
        w = store.write(0, new)
        r.result()
        w.result()
        assert same_bytes(out, old)
        assert same_bytes(round_trip(store, 1, new), new)


def test_calls_from_several_threads(store):
    errors = []

    def worker(base: int) -> None:
        try:
            for i in range(8):
                t = random_tensor(BLOCK + 13 * i, torch.float16)
                store.write(base + i % 3, t)
                out = torch.empty_like(t)
                store.read(base + i % 3, out).result()
                assert same_bytes(out, t)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(100 * k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# ------------------------------------------------------------------------------------------------ slots


def _queue_behind_a_busy_worker(s, writes: int):
    """The store's only I/O worker held busy; `writes` write-backs and then one read queued behind it. Returns
    (release, done): release() lets the worker go and waits for every request; done lists them in completion order."""
    s.write(0, random_tensor(1 << 18, torch.float32)).result()
    hold, started = threading.Event(), threading.Event()

    def blocker():
        started.set()
        assert hold.wait(10)

    s._blocks.io.submit(blocker)  # the only I/O worker is busy: everything below queues
    assert started.wait(10)
    done: list[str] = []
    keys = range(1, writes + 1)
    futures = [s.write(k, random_tensor(1 << 18, torch.float32)) for k in keys]
    for k, f in zip(keys, futures):
        f.add_done_callback(lambda _f, k=k: done.append(f"write {k}"))
    read = s.read(0, torch.empty(1 << 18))
    read.add_done_callback(lambda _f: done.append("read 0"))

    def release():
        hold.set()
        read.result(10)
        for f in futures:
            f.result(10)

    return release, done


def test_reads_are_served_before_queued_writes(stores, tmp_path):
    """[Note: reads before writes]: a read queued behind write-backs within the backlog reaches the disk first."""
    # Buffered and unverified: each request is one I/O stage, so completion order is the disk's order.
    s = stores(tmp_path, io_threads=1, cpu_threads=1, block_bytes=1 << 20, direct=False, verify=False, write_backlog=3)
    release, done = _queue_behind_a_busy_worker(s, writes=3)
    release()
    assert done[0] == "read 0", done


def test_writes_beyond_the_backlog_go_before_reads(stores, tmp_path):
    """[Note: a bounded write backlog]: with more writes waiting than the backlog, the oldest go first until it is
    down to the backlog; then the read. Reads first without a bound let write-backs (and their host buffers) pile up
    for as long as reads keep coming."""
    s = stores(tmp_path, io_threads=1, cpu_threads=1, block_bytes=1 << 20, direct=False, verify=False, write_backlog=1)
    release, done = _queue_behind_a_busy_worker(s, writes=4)
    release()
    assert done == ["write 1", "write 2", "write 3", "read 0", "write 4"], done


def test_writes_go_first_by_default(stores, tmp_path, monkeypatch):
    """[Note: writes first by default]: a store made without a backlog serves queued writes before a queued read."""
    monkeypatch.delenv("HETERO_NVME_WRITE_BACKLOG", raising=False)
    s = stores(tmp_path, io_threads=1, cpu_threads=1, block_bytes=1 << 20, direct=False, verify=False)
    release, done = _queue_behind_a_busy_worker(s, writes=3)
    release()
    assert done == ["write 1", "write 2", "write 3", "read 0"], done


def test_write_backlog_default_and_environment(stores, tmp_path, monkeypatch):
    monkeypatch.delenv("HETERO_NVME_WRITE_BACKLOG", raising=False)
    s = stores(tmp_path, io_threads=3, direct=False)
    assert s._blocks.io.backlog == 0 and s._blocks.cpu.backlog == 0  # writes first
    monkeypatch.setenv("HETERO_NVME_WRITE_BACKLOG", "none")
    assert stores(tmp_path, direct=False)._blocks.io.backlog is None
    monkeypatch.setenv("HETERO_NVME_WRITE_BACKLOG", "5")
    assert stores(tmp_path, direct=False)._blocks.io.backlog == 5
    monkeypatch.setenv("HETERO_NVME_WRITE_BACKLOG", "lots")
    with pytest.raises(ValueError, match="HETERO_NVME_WRITE_BACKLOG='lots'.*number of blocks"):
        stores(tmp_path, direct=False)
    with pytest.raises(ValueError, match="write_backlog: expected a number of blocks >= 0"):
        stores(tmp_path, direct=False, write_backlog=-2)


def _lane_order(backlog, background: int, urgent: int) -> list[str]:
    """The order a one-worker LanePool runs `background` then `urgent` jobs queued while its worker is busy."""
    from hetero.memory.lanes import LanePool

    pool = LanePool(1, name="t", backlog=backlog)
    hold, order = threading.Event(), []
    pool.submit(lambda: hold.wait(10))
    for i in range(background):
        pool.submit(order.append, f"bg{i}")
    for i in range(urgent):
        pool.submit(order.append, f"urgent{i}", urgent=True)
    hold.set()
    pool.shutdown(wait=True)  # the queued jobs still run
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(order.append, "late")
    return order


def test_lane_pool_order_and_shutdown():
    assert _lane_order(None, 3, 2) == ["urgent0", "urgent1", "bg0", "bg1", "bg2"]


def test_lane_pool_backlog():
    """Background jobs beyond the backlog run first, oldest first; within it urgent ones do."""
    from hetero.memory.lanes import LanePool

    assert _lane_order(2, 4, 2) == ["bg0", "bg1", "urgent0", "urgent1", "bg2", "bg3"]
    with pytest.raises(ValueError, match="backlog"):
        LanePool(1, name="t", backlog=-1)


def test_same_size_overwrite_reuses_the_slot(store):
    store.write(0, random_tensor(2 * BLOCK, torch.uint8)).result()
    size = store.file_bytes
    for _ in range(5):
        t = random_tensor(2 * BLOCK, torch.uint8)
        assert same_bytes(round_trip(store, 0, t), t)
    assert store.file_bytes == size
    bigger = random_tensor(5 * BLOCK, torch.uint8)
    assert same_bytes(round_trip(store, 0, bigger), bigger)
    assert store.nbytes(0) == store.used_bytes == 5 * BLOCK


def test_discard_frees_the_slot_for_reuse(store):
    data = [random_tensor(BLOCK + 100, torch.float32) for _ in range(8)]
    for f in [store.write(i, t) for i, t in enumerate(data)]:
        f.result()
    size, used = store.file_bytes, store.used_bytes
    assert size > 0
    for i in range(4):
        store.discard(i)
    assert 0 not in store and 4 in store and len(store) == 4
    assert store.used_bytes == used // 2
    store.discard(12345)  # unknown keys are ignored
    for i in range(10, 14):
        store.write(i, data[i - 10]).result()
    assert store.file_bytes == size  # the freed slots were reused, the file did not grow
    for i in range(10, 14):
        out = torch.empty_like(data[i - 10])
        store.read(i, out).result()
        assert same_bytes(out, data[i - 10])
    with pytest.raises(KeyError):
        store.read(0, torch.empty_like(data[0]))


def test_discard_while_the_write_is_in_flight(store):
    for _ in range(5):
        a, b = random_tensor(4 * BLOCK, torch.uint8), random_tensor(4 * BLOCK, torch.uint8)
        fa = store.write(0, a)
        store.discard(0)  # the slot must not be handed out before this write is done with it
        fb = store.write(1, b)
        fa.result()
        fb.result()
        out = torch.empty_like(b)
        store.read(1, out).result()
        assert same_bytes(out, b)
        store.discard(1)
    assert store.used_bytes == 0


def test_slot_allocator_coalesces_and_reuses():
    slots = Slots()
    offs = [slots.alloc(ALIGN) for _ in range(4)]
    assert offs == [0, ALIGN, 2 * ALIGN, 3 * ALIGN] and slots.end == 4 * ALIGN
    slots.release(ALIGN, ALIGN)
    slots.release(2 * ALIGN, ALIGN)
    assert slots.free == [(ALIGN, 2 * ALIGN)]  # neighbours merged
    assert slots.growth(2 * ALIGN) == 0 and slots.alloc(2 * ALIGN) == ALIGN
    slots.release(3 * ALIGN, ALIGN)
    assert slots.growth(3 * ALIGN) == 2 * ALIGN  # the free tail is extended, not skipped
    assert slots.alloc(3 * ALIGN) == 3 * ALIGN and slots.end == 6 * ALIGN


# ------------------------------------------------------------------------------------------------ privacy, cleanup


def test_files_are_private(stores, tmp_path):
    s = stores(tmp_path)
    s.write(0, torch.ones(10)).result()
    assert os.path.dirname(s.directory) == str(tmp_path)
    assert os.path.basename(s.directory).startswith("hetero-swap-")
    assert stat.S_IMODE(os.stat(s.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600


def test_close_removes_everything_and_is_idempotent(tmp_path):
    s = NvmeStore(tmp_path, block_bytes=BLOCK)
    futures = [s.write(i, random_tensor(3 * BLOCK, torch.uint8)) for i in range(8)]
    s.close()  # waits for the queued writes first
    assert all(f.done() and f.exception() is None for f in futures)
    assert swap_dirs(tmp_path) == [] and not os.path.exists(s.directory)
    s.close()
    assert s.closed and s.file_bytes == 0
    with pytest.raises(NvmeError, match="closed"):
        s.write(0, torch.ones(1))


def test_context_manager_closes(tmp_path):
    with NvmeStore(tmp_path) as s:
        s.write(0, torch.ones(10)).result()
        assert swap_dirs(tmp_path)
    assert swap_dirs(tmp_path) == []


def test_dropped_store_removes_its_files(tmp_path):
    s = NvmeStore(tmp_path)
    s.write(0, torch.ones(1000)).result()
    directory = s.directory
    del s
    # A worker may still be running the done-callbacks of that write (holding the store) for a moment.
    deadline = time.monotonic() + 10
    while os.path.exists(directory) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert not os.path.exists(directory) and swap_dirs(tmp_path) == []


# ------------------------------------------------------------------------------------------------ O_DIRECT choice


def test_direct_true_on_tmpfs(stores, shm_dir):
    if stores(shm_dir).direct:
        pytest.skip("this kernel's tmpfs accepts O_DIRECT (Linux >= 6.6)")
    with pytest.raises(NvmeUnavailableError, match="O_DIRECT"):
        NvmeStore(shm_dir, direct=True)
    assert swap_dirs(shm_dir) == []


def test_no_o_direct_falls_back_to_buffered(stores, tmp_path, monkeypatch):
    real_open = os.open

    def open_without_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)  # what tmpfs said before Linux 6.6
        return real_open(path, flags, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "open", open_without_direct)
        s = stores(tmp_path)
        with pytest.raises(NvmeUnavailableError, match="O_DIRECT") as info:
            NvmeStore(tmp_path, direct=True)
    assert str(tmp_path) in str(info.value)
    assert not s.direct
    t = random_tensor(3 * BLOCK + 5, torch.bfloat16)
    assert same_bytes(round_trip(s, 0, t), t)
    assert swap_dirs(tmp_path) == [os.path.basename(s.directory)]  # the refused store left nothing behind


def test_o_direct_that_fails_on_io_falls_back(stores, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(errno.EINVAL, "Invalid argument")

    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", refuse)  # open accepts O_DIRECT but the probe write fails
        s = stores(tmp_path)
    assert not s.direct
    t = random_tensor(BLOCK + 1, torch.uint8)
    assert same_bytes(round_trip(s, 0, t), t)


@pytest.mark.parametrize("how", ["refused", "lies"])
def test_o_direct_whose_reads_fail_falls_back(stores, tmp_path, monkeypatch, how):
    # A file system that takes direct writes (the open's probe) but refuses direct reads, or answers them without
    # moving the bytes: the store must not pick O_DIRECT and then fail (or corrupt) every read.
    real_preadv = os.preadv

    def preadv(fd, buffers, offset, *args):
        if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            return real_preadv(fd, buffers, offset, *args)
        if how == "refused":
            raise OSError(errno.EINVAL, "Invalid argument")
        return sum(len(b) for b in buffers)  # claims the read, moves nothing

    with monkeypatch.context() as m:
        m.setattr(os, "preadv", preadv)
        s = stores(tmp_path)
        with pytest.raises(NvmeUnavailableError, match="O_DIRECT is not supported"):
            NvmeStore(tmp_path, direct=True)
        assert not s.direct
        t = random_tensor(3 * BLOCK + 5, torch.bfloat16)
        assert same_bytes(round_trip(s, 0, t), t)


# ------------------------------------------------------------------------------------------------ errors


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(NvmeUnavailableError, match="does not exist") as info:
        NvmeStore(missing)
    assert str(missing) in str(info.value)


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NvmeUnavailableError, match="not a directory") as info:
        NvmeStore(f)
    assert str(f) in str(info.value)


def test_unwritable_directory(tmp_path, monkeypatch):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    immutable = False
    try:
        if os.access(d, os.W_OK):
            # Root ignores the mode bits. The immutable attribute stops root too, where chattr is allowed;
            # otherwise make mkdtemp fail the way the kernel would for an ordinary user.
            with contextlib.suppress(OSError):
                immutable = subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0
            if not immutable:

                def denied(*args, **kwargs):
                    raise PermissionError(errno.EACCES, "Permission denied", str(d))

                monkeypatch.setattr(nvme.tempfile, "mkdtemp", denied)
        with pytest.raises(NvmeUnavailableError, match="writable|cannot create") as info:
            NvmeStore(d)
        assert str(d) in str(info.value)
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(d)], check=True)
        d.chmod(0o700)
    assert os.listdir(d) == []


def test_budget_exceeded(stores, tmp_path):
    s = stores(tmp_path, budget=10_000)
    s.write(0, torch.zeros(8_000, dtype=torch.uint8)).result()
    with pytest.raises(NvmeSpaceError) as info:
        s.write(1, torch.zeros(4_000, dtype=torch.uint8))
    msg = str(info.value)
    assert "4000" in msg and "2000" in msg and "budget" in msg
    assert 1 not in s and s.used_bytes == 8_000
    s.write(0, torch.zeros(10_000, dtype=torch.uint8)).result()  # an overwrite gives its old bytes back
    s.discard(0)
    s.write(1, torch.zeros(4_000, dtype=torch.uint8)).result()


def test_file_system_too_full(stores, tmp_path, monkeypatch):
    s = stores(tmp_path)
    s.write(0, torch.zeros(BLOCK, dtype=torch.uint8)).result()
    monkeypatch.setattr(swap_file, "free_bytes", lambda fd: 100)  # asked of the open file, not of a path
    with pytest.raises(NvmeSpaceError) as info:
        s.write(1, torch.zeros(BLOCK, dtype=torch.uint8))
    assert "100 B free" in str(info.value) and str(BLOCK) in str(info.value)
    assert s.directory in str(info.value) and 1 not in s
    s.discard(0)  # a freed slot needs no new disk space
    t = random_tensor(BLOCK, torch.uint8)
    assert same_bytes(round_trip(s, 2, t), t)


def test_enospc_during_write_fails_the_future(store, monkeypatch):
    t = random_tensor(3 * BLOCK, torch.uint8)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    f = store.write(0, t)
    with pytest.raises(NvmeSpaceError, match="No space"):
        f.result(timeout=10)
    assert 0 not in store and store.used_bytes == 0  # a failed write leaves no key behind
    monkeypatch.undo()
    assert same_bytes(round_trip(store, 0, t), t)
    assert store.file_bytes == 3 * BLOCK  # the failed write's slot was given back and taken again


def test_read_queued_behind_a_failing_write(store, monkeypatch):
    gate = threading.Event()

    def slow_eio(*args, **kwargs):
        gate.wait(10)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwrite", slow_eio)
    w = store.write(0, torch.ones(1000))
    r = store.read(0, torch.empty(1000))
    gate.set()
    with pytest.raises(NvmeError, match="Input/output"):
        w.result(timeout=10)
    with pytest.raises(NvmeError, match="write failed"):
        r.result(timeout=10)


def test_io_error_during_read(store, monkeypatch):
    store.write(0, torch.ones(1000)).result()

    def eio(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", eio)
    with pytest.raises(NvmeError, match="Input/output") as info:
        store.read(0, torch.empty(1000)).result(timeout=10)
    assert not isinstance(info.value, NvmeCorruptError)


@pytest.mark.parametrize("verify", [True, False])
def test_truncated_swap_file(stores, tmp_path, shm_dir, verify):
    for directory, direct in [(tmp_path, None), (shm_dir, False)]:
        s = stores(directory, verify=verify, direct=direct)
        s.write(0, random_tensor(BLOCK, torch.uint8)).result()
        t = random_tensor(3 * BLOCK + 5, torch.uint8)
        s.write(1, t).result()
        os.truncate(s.path, BLOCK + 2 * BLOCK + 100)  # cuts key 1's last two blocks
        with pytest.raises(NvmeCorruptError, match="truncated") as info:
            s.read(1, torch.empty_like(t)).result(timeout=10)
        msg = str(info.value)
        assert s.path in msg and "key 1" in msg and "offset" in msg


def test_flipped_byte_is_caught_by_the_checksum(store):
    t = random_tensor(3 * BLOCK + 5, torch.uint8)
    store.write(0, t).result()
    pos = BLOCK + 1234  # inside the second block of key 0, which sits at offset 0
    with open(store.path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0xFF]))
    with pytest.raises(NvmeCorruptError, match="checksum") as info:
        store.read(0, torch.empty_like(t)).result(timeout=10)
    msg = str(info.value)
    assert store.path in msg and "key 0" in msg and f"offset {BLOCK}" in msg


def test_without_verify_a_flipped_byte_goes_unnoticed(stores, tmp_path):
    s = stores(tmp_path, verify=False)
    t = random_tensor(2 * BLOCK, torch.uint8)
    s.write(0, t).result()
    with open(s.path, "r+b") as f:
        f.seek(10)
        byte = f.read(1)[0]
        f.seek(10)
        f.write(bytes([byte ^ 0xFF]))
    out = torch.empty_like(t)
    s.read(0, out).result()
    assert not same_bytes(out, t) and out[10] == t[10] ^ 0xFF


def test_bad_read_and_write_arguments(store):
    store.write(0, torch.ones(100)).result()
    with pytest.raises(KeyError):
        store.read(1, torch.empty(100))
    with pytest.raises(ValueError, match="400 B"):
        store.read(0, torch.empty(99))
    with pytest.raises(ValueError, match="contiguous"):
        store.read(0, torch.empty(200)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        store.write(2, torch.ones(10, 10).t())
    with pytest.raises(TypeError):
        store.write(2, b"bytes")  # type: ignore[arg-type]
    assert 2 not in store and store.used_bytes == 400
    with pytest.raises(KeyError):
        store.nbytes(2)


def test_constructor_arguments(tmp_path):
    with pytest.raises(ValueError, match="block_bytes"):
        NvmeStore(tmp_path, block_bytes=1000)
    with pytest.raises(ValueError, match="io_threads"):
        NvmeStore(tmp_path, io_threads=0)
    assert swap_dirs(tmp_path) == []
