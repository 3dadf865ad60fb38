"""Two storages exchanging their memory: a transient chunk's storage borrowing a pooled buffer's on a CPU device.

[Note: transient storage on pooled memory]
A transient chunk's storage is resized to nothing when dropped and grows back when gathered again ([Note: transient
chunks] in the manager). With CUDA the caching allocator serves the growth; on a CPU device the C heap hands out a
fresh mapping (above its threshold, [Note: the heap keeps what the budgets free]; always above 32 MiB) whose pages
the kernel faults in and zeroes, twice a step for every parameter at stage 3 (the 416M Llama of
benchmarks/bigger_than_ram.py: 3.3 GB of fresh pages a step). So there the storage borrows a pooled buffer's memory
instead, by exchanging the two storages' data pointers: the storage object, and with it every view of it (the
parameters, what autograd saved), stays the same; the pool gets the buffer back, swapped back, when the chunk drops
it.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def storages_exchange() -> bool:
    """Whether this torch exchanges two storages' memory and sizes (`exchange`): probed once, so that a version
    without the method, or with other semantics, keeps transient storages growing back instead."""
    try:
        a, b = torch.UntypedStorage(0), torch.UntypedStorage(16)
        a._swap_data_ptr_(b)
        swapped = a.nbytes() == 16 and b.nbytes() == 0
        a._swap_data_ptr_(b)
        return swapped and a.nbytes() == 0 and b.nbytes() == 16
    except (AttributeError, RuntimeError, TypeError):
        return False


def exchange(kept: torch.Tensor | None, buf: torch.Tensor) -> torch.Tensor:
    """Swap the memory behind two storages: `kept`'s (a transient chunk's payload; None: a new one, empty) and
    `buf`'s (a pooled buffer, the same size). Called again with the same pair, it swaps them back. Returns `kept`, a
    flat uint8 tensor of `buf`'s size whose storage is the same object throughout ([Note: transient storage on pooled
    memory])."""
    if kept is None:
        shell = torch.UntypedStorage(0)
        shell._swap_data_ptr_(buf.untyped_storage())  # `buf` may be the head of a larger buffer (pool.py)
        return torch.empty(0, dtype=torch.uint8).set_(shell)[: buf.numel()]
    kept.untyped_storage()._swap_data_ptr_(buf.untyped_storage())
    return kept
