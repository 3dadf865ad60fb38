"""The system calls of [Note: collectives by cross-memory attach] (`cma.py`, `cma_link.py`): reading and writing
another process's memory, and whether that process still runs."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from typing import Any

import torch


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@functools.cache
def libc() -> Any:
    """libc with `process_vm_readv` and `process_vm_writev` declared, or None where it has them not (not Linux)."""
    try:
        lib = ctypes.CDLL(None, use_errno=True)  # a ctypes call releases the interpreter while it copies
        for fn in (lib.process_vm_readv, lib.process_vm_writev):
            iov, n = ctypes.POINTER(_IOVec), ctypes.c_ulong
            fn.argtypes = [ctypes.c_int, iov, n, iov, n, ctypes.c_ulong]  # pid, ours and count, its and count, flags
            fn.restype = ctypes.c_ssize_t
    except (OSError, AttributeError):
        return None
    return lib


def copy(pid: int, remote: int, local: int, nbytes: int, *, write: bool = False) -> None:
    """Copy `nbytes` from address `remote` of process `pid` to our address `local` (`write`: from ours to its)."""
    lib = libc()
    call = lib.process_vm_writev if write else lib.process_vm_readv
    while nbytes:
        lo, re = _IOVec(local, nbytes), _IOVec(remote, nbytes)
        got = call(pid, ctypes.byref(lo), 1, ctypes.byref(re), 1, 0)
        if got <= 0:
            code = ctypes.get_errno() if got < 0 else errno.EIO
            if code == errno.ESRCH or not alive(pid):
                # A process exiting loses its memory before its pid: a read then may fail with EFAULT or copy
                # nothing. Worded so that `rules.peer_gone` recognises it: the caller then names the rank.
                raise RuntimeError(f"connection closed: process {pid} is gone (cross-memory read)")
            way = "write to" if write else "read from"
            raise RuntimeError(f"cross-memory {way} process {pid} of {nbytes} bytes: {os.strerror(code)}")
        nbytes, local, remote = nbytes - got, local + got, remote + got


def fault_in(t: torch.Tensor) -> None:
    """Touch a page in every 4 KiB of the contiguous `t`, which a cross-memory read will overwrite whole.

    [Note: faulting a read's destination in first]
    `process_vm_readv` faults in the pages of its destination that are not yet resident itself, holding this process's
    memory-map lock as it goes; the compute thread's allocations and frees (mmap, munmap, madvise) wait for that lock
    and it for theirs. A write from here faults them in as any first touch does, under the mapping's own lock. Into
    fresh host buffers (states on NVMe on a CPU device, whose host pool gives its idle buffers back every step) the
    gradients' reduce-scatter took 0.32-0.53 s of wall a step a rank for 43 MB (the 22.6M Llama of the race, world 2),
    against 0.011 s with this; into resident memory the touch costs a store a page."""
    t.view(-1).view(torch.uint8)[::4096].fill_(0)


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (not gone, not a zombie, not exiting)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")
