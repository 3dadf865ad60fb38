"""NvmeStore at its edges: sizes about a page and a block, one-byte dtypes from unaligned memory, and a slot freed while
a read of it is still queued."""

from __future__ import annotations

import threading

import pytest
import torch

try:
    from tests.test_nvme import BLOCK, random_tensor, round_trip, same_bytes, shm_dir, store, stores  # noqa: F401
except ImportError:  # tests/ itself on sys.path
    from test_nvme import BLOCK, random_tensor, round_trip, same_bytes, shm_dir, store, stores  # type: ignore  # noqa: F401

pytestmark = pytest.mark.timeout(60)

PAGE = 4096
SIZES = [0, 1, PAGE - 1, PAGE, PAGE + 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + PAGE + 1]


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool], ids=str)
def test_page_and_block_edges_from_unaligned_memory(store, dtype):
    """Every size about a page and a block, from memory one byte off any alignment (staged under O_DIRECT) and from
    aligned memory, into the other kind: the bytes come back exactly, and rewriting the key with each new size leaves
    nothing of the previous value."""
    for i, n in enumerate(SIZES):
        data = random_tensor(n, torch.uint8)
        odd = torch.empty(n + 1, dtype=torch.uint8)[1:]
        odd.copy_(data)
        src, dst = (
            (odd, torch.empty(n, dtype=torch.uint8)) if i % 2 else (data, torch.empty(n + 1, dtype=torch.uint8)[1:])
        )
        store.write(0, src.view(dtype)).result()  # key 0 rewritten with every size in turn
        store.read(0, dst.view(dtype)).result()
        assert same_bytes(dst, data), n
        assert store.nbytes(0) == n
    assert store.used_bytes == SIZES[-1]


def test_a_slot_freed_by_a_rewrite_waits_for_the_read_queued_on_it(stores, tmp_path):
    """A key rewritten with another size moves to a new slot; its old slot goes back to the free list only once the
    read queued on it has run, though a write of another key, which would take that very slot, reaches the disk
    first (writes go before reads by default)."""
    s = stores(tmp_path, io_threads=1, cpu_threads=1)
    old = random_tensor(4 * BLOCK, torch.uint8)
    s.write(0, old).result()
    hold, started = threading.Event(), threading.Event()

    def blocker():
        started.set()
        assert hold.wait(10)

    s._blocks.io.submit(blocker)  # the only I/O worker is busy: everything below queues
    assert started.wait(10)
    out = torch.empty_like(old)
    read = s.read(0, out)
    new = random_tensor(9 * BLOCK, torch.uint8)
    rewrite = s.write(0, new)  # too large for the slot: a new one, the old retired behind the read
    other = random_tensor(4 * BLOCK, torch.uint8)
    taker = s.write(1, other)  # the size of the old slot
    hold.set()
    for f in (read, rewrite, taker):
        f.result(10)
    assert same_bytes(out, old)
    assert same_bytes(round_trip(s, 2, new), new)
    back = torch.empty_like(new)
    s.read(0, back).result()
    assert same_bytes(back, new)
    back = torch.empty_like(other)
    s.read(1, back).result()
    assert same_bytes(back, other)
    # Once the read is done the old slot is free again: a key of its size takes it and the file does not grow.
    size = s.file_bytes
    assert same_bytes(round_trip(s, 3, old), old) and s.file_bytes == size
