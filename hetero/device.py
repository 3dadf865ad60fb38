"""The compute device: the only module of hetero that touches `torch.cuda`.

Everything else asks a `Device` for buffers and copies, so the CPU-only path (no CUDA: the "device" tier is the CPU
under its own budget, host memory is pageable) and the CUDA path (pinned host memory, a side stream for copies,
events to order them against compute) are chosen here, once.

[Note: copies off the compute stream]
Chunk moves run in worker threads (`hetero.memory.manager`). On CUDA a worker issues its copy on a dedicated copy
stream, after that stream has waited for an event recorded on the compute stream when the move was *submitted* (so a
gradient written by a kernel that is still queued is copied only once written), and then blocks on the copy
stream: the worker, not the compute stream, waits. When the manager later sees the move finished, the bytes are
already in place, so the compute stream needs no further wait and never blocks on a copy.

[Note: pinned host memory counted as it is]
PyTorch's caching host allocator (`pin_memory=True`) rounds every request up to a power of two and keeps freed
blocks for itself, so a ledger of the bytes asked for undercounts what is pinned by up to half, and freeing a buffer
gives nothing back to the system. Host buffers are instead our own page-aligned anonymous mappings (huge pages for
large ones), registered with CUDA (`cudaHostRegister`) for exactly their size and unregistered when the pool frees
them (`free_host`): the host ledger is what is pinned, and `trim` returns it. `pinned_bytes()` says how much is.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import torch

from hetero import standin
from hetero.io import hugepages, swap
from hetero.io.hugepages import fresh

_HUGE_PAGE = 2 << 20  # buffers at least this large ask for transparent huge pages (see `Device.empty_host`)


class Device:
    """The compute device hetero places chunks on, with its copy machinery."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if device is None:
            device = default_device()
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        self.torch_device = torch.device(device)  # where the DEVICE tier lives
        if self.torch_device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"device {self.torch_device} was asked for but CUDA is not available")
            if self.torch_device.index is None:
                self.torch_device = torch.device("cuda", torch.cuda.current_device())
        elif self.torch_device.type != "cpu":
            raise ValueError(f"unsupported device {self.torch_device}; use 'cuda[:N]' or 'cpu'")
        self.is_cuda = self.torch_device.type == "cuda"  # selects every CUDA-specific path below
        # One copy stream per worker thread: copies from different workers may overlap each other.
        self._streams = threading.local()
        self._registered: dict[int, tuple[mmap.mmap, int]] = {}  # pinned host buffers: address -> (mapping, bytes)

    def __repr__(self) -> str:
        return f"Device({self.torch_device})"

    # ---- what kind of device ------------------------------------------------------------------------------
    @property
    def separate_memory(self) -> bool:
        """The device tier's memory is not host memory: moves between them are copies through a bus, NVMe traffic
        is staged through host memory, and NCCL's collectives read device memory only."""
        return self.is_cuda

    @property
    def pins_host_memory(self) -> bool:
        """Host buffers are page-locked only with CUDA: without it `pin_memory=True` raises."""
        return self.is_cuda

    # ---- memory -------------------------------------------------------------------------------------------
    def empty_bytes(self, nbytes: int) -> torch.Tensor:
        """An uninitialised flat uint8 buffer on the compute device."""
        return fresh(torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device))

    def free_bytes(self, buf: torch.Tensor) -> None:
        """A buffer from `empty_bytes` is no longer used (its memory goes when its last view does)."""

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor on the compute device (hetero allocates device memory only through here)."""
        return fresh(torch.empty(shape, dtype=dtype, device=self.torch_device))

    def to_device(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`t` on the compute device (the same tensor where it already is), optionally cast."""
        return t.to(self.torch_device, dtype=dtype, non_blocking=True)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """`dst` (device memory) takes `src` on the compute stream, the host going on at once; returns a handle for
        `ChunkManager.land_later(reads=True)` where that reads host memory late, else None ([Note: writing
        parameters up without a wait] in hetero/zero/copy_up.py)."""
        moved = self.to_device(src)  # converted to dst's dtype on the device, in dst.copy_
        dst.copy_(moved)
        return None if moved is src else self.compute_reached()

    def to_host(self, t: torch.Tensor, dtype: torch.dtype | None = None, *, copy: bool = False) -> torch.Tensor:
        """`t` in host memory (the same tensor where it already is, unless `copy`), optionally cast."""
        return t.to("cpu", dtype=dtype, copy=copy)

    def to_host_all(self, ts: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Each of `ts` in host memory (cast), the host waiting for the device once for them all rather than once a
        tensor: the copies are queued (into pinned memory torch allocates) and the compute stream waited for after."""
        if not self.is_cuda or not any(t.is_cuda for t in ts):
            return [self.to_host(t, dtype) for t in ts]
        out = [t.to("cpu", dtype=dtype, non_blocking=True) for t in ts]
        torch.cuda.current_stream(self.torch_device).synchronize()
        return out

    def empty_host(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 host buffer, page-aligned: anonymous mmap memory, registered with CUDA (pinned) when CUDA is
        present; see [Note: pinned host memory counted as it is]. Give it back with `free_host`.

        Page alignment lets the NVMe tier and checkpoint loads read into it with O_DIRECT straight, with no staging
        copy. A large buffer asks for transparent huge pages: an O_DIRECT read into 4 KiB pages that first touch
        scattered over physical memory goes out as one DMA segment per page, and was measured at a third of the
        speed of one into huge pages (0.9 vs 3.1 GB/s on a virtio disk); first touch also faults once per 2 MiB.
        """
        private = getattr(mmap, "MAP_PRIVATE", None)
        anonymous = getattr(mmap, "MAP_ANONYMOUS", None)
        if private is None or anonymous is None:  # Windows: its mmap takes no flags
            if self.pins_host_memory:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8, count=nbytes)
        buf = mmap.mmap(-1, max(nbytes, 1), flags=private | anonymous)
        if nbytes >= _HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # a kernel without transparent huge pages: small pages then
                buf.madvise(mmap.MADV_HUGEPAGE)
        t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
        if nbytes >= _HUGE_PAGE:  # memory_stats() says whether the kernel granted them ([Note: huge host pages])
            hugepages.track(buf, t.data_ptr(), nbytes)
        if self.pins_host_memory and nbytes:
            self._pin(t, buf)
        return t

    def free_host(self, buf: torch.Tensor) -> None:
        """A host buffer from `empty_host` is no longer used: unpin it (its memory goes when its last view does)."""
        entry = self._registered.pop(buf.data_ptr(), None)
        if entry is not None:
            self._unpin(buf, entry[1])

    def pinned_bytes(self) -> int:
        """Bytes of host memory this device has pinned now."""
        return sum(n for _, n in self._registered.values())

    def released(self, buf: torch.Tensor) -> None:
        """A buffer went back to a pool for reuse (the stand-in poisons it here)."""

    def regrow(self, kept: torch.Tensor, nbytes: int) -> None:
        """Give a transient chunk's storage its bytes back (contents undefined)."""
        kept.untyped_storage().resize_(nbytes)
        fresh(kept)

    @property
    def lends_buffers(self) -> bool:
        """A transient chunk's storage takes a pooled buffer's memory for a while (`exchange`) instead of growing
        back: see [Note: transient storage on pooled memory]."""
        return not self.separate_memory and swap.storages_exchange()

    def exchange(self, kept: torch.Tensor | None, buf: torch.Tensor) -> torch.Tensor:
        """Swap the memory behind a transient chunk's storage and a pooled buffer's (`hetero.io.swap.exchange`)."""
        return swap.exchange(kept, buf)

    @contextlib.contextmanager
    def compute_context(self) -> Iterator[None]:
        """Around the engine's compute (forward, backward, update); the stand-in checks device placement in it."""
        yield

    @contextlib.contextmanager
    def update_context(self) -> Iterator[None]:
        """Around an optimizer step run inside backward (update_in_backward): the step's own copies between tiers,
        as after backward, not the compute's placement rules (the stand-in suspends its check)."""
        yield

    def _pin(self, t: torch.Tensor, buf: mmap.mmap) -> None:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {t.numel()} bytes failed (error {int(err)})")
        self._registered[t.data_ptr()] = (buf, t.numel())

    def _unpin(self, t: torch.Tensor, nbytes: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

    def total_memory(self) -> int:
        """Bytes of memory the compute device has (physical RAM for the CPU)."""
        if self.is_cuda:
            return torch.cuda.get_device_properties(self.torch_device).total_memory
        return psutil.virtual_memory().total

    def available_memory(self) -> int:
        """Bytes free on the compute device now."""
        return torch.cuda.mem_get_info(self.torch_device)[0] if self.is_cuda else psutil.virtual_memory().available

    def allocated_bytes(self) -> int:
        """Bytes the CUDA caching allocator has handed out on the device now (0 without CUDA: not measurable)."""
        return torch.cuda.memory_allocated(self.torch_device) if self.is_cuda else 0

    def reserved_bytes(self) -> int:
        """Bytes the CUDA caching allocator holds from the driver (allocated + cached free blocks); 0 without CUDA."""
        return torch.cuda.memory_reserved(self.torch_device) if self.is_cuda else 0

    # ---- ordering -----------------------------------------------------------------------------------------
    def compute_marker(self) -> Any:
        """A marker of the compute stream's progress now; a copy given it starts after that point."""
        if not self.is_cuda:
            return None  # the CPU executes eagerly: everything submitted so far is already done
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.torch_device))
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any = None) -> None:
        """Copy src into dst and return once the bytes are in place. Safe to call from worker threads.

        On CUDA the copy runs on this thread's copy stream after `after` (a `compute_marker`), never on the compute
        stream; see [Note: copies off the compute stream]. A copy touching device memory must be given the marker
        recorded when it was submitted (the stand-in enforces it).
        """
        if not self.is_cuda or (dst.device.type == "cpu" and src.device.type == "cpu"):
            dst.copy_(src)
            return
        stream = self._copy_stream()
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            for t in (t for t in (dst, src) if t.is_cuda):  # the caching allocator keeps them until the copy is done
                t.record_stream(stream)
        stream.synchronize()

    def copy_later(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any) -> Any:
        """Start copying `src` into `dst` (either way between host and device) after `after` (a `compute_marker`);
        return a handle for `landed` (or `compute_waits`) at once: until it has landed nothing may read or reuse `dst`.
        See [Note: copies the host does not wait for] in hetero/memory/moves.py. None: already done (no CUDA)."""
        if not self.is_cuda:
            dst.copy_(src)
            return None
        stream = self._copy_stream()
        with torch.cuda.stream(stream):
            stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            for t in (t for t in (dst, src) if t.is_cuda):  # the caching allocator keeps them until the copy is done
                t.record_stream(stream)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def landed(self, handle: Any, *, wait: bool = True) -> bool:
        """Whether a `copy_later` is done; wait: block until it is."""
        if handle is None:
            return True
        if wait:
            handle.synchronize()
            return True
        return bool(handle.query())

    def compute_waits(self, handle: Any) -> None:
        """Compute queued from now on runs after a `copy_later` (its handle) has landed; the host does not wait."""
        if handle is not None:
            torch.cuda.current_stream(self.torch_device).wait_event(handle)

    def compute_reached(self) -> Any:
        """A handle for `landed` that lands once the compute queued so far has run: what keeps host memory that a copy
        on the compute stream reads (`to_device`) unchanged until then (`ChunkManager.land_later`). None on the CPU,
        where compute is done when queued."""
        return self.compute_marker()  # a CUDA event: `landed` waits for it or asks whether it is done

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)

    # ---- random state (checkpoints) -----------------------------------------------------------------------
    def rng_state(self) -> torch.Tensor | None:
        """This device's CUDA generator state; None on the CPU (torch's CPU generator is saved on its own)."""
        if not self.is_cuda:
            return None
        return torch.cuda.get_rng_state(self.torch_device)

    def set_rng_state(self, state: torch.Tensor) -> None:
        if self.is_cuda:
            torch.cuda.set_rng_state(state.cpu(), self.torch_device)

    def _copy_stream(self) -> Any:
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = torch.cuda.Stream(self.torch_device)
            self._streams.stream = stream
        return stream


class StandinDevice(Device):
    """The CPU acting as a separate accelerator under strict rules: see [Note: the CPU stand-in] in
    `hetero/standin.py`. Chosen by `make_device()` when `HETERO_STANDIN=1`."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__("cpu")
        self.standin = standin.Standin(seed)

    def __repr__(self) -> str:
        return "StandinDevice(cpu)"

    @property
    def separate_memory(self) -> bool:
        return True

    def empty_bytes(self, nbytes: int) -> torch.Tensor:
        buf = fresh(torch.empty(nbytes, dtype=torch.uint8))
        standin.poison(buf)
        return standin.register(buf, standin.DEVICE, strong=True)

    def free_bytes(self, buf: torch.Tensor) -> None:
        standin.unregister(buf)

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        t = fresh(torch.empty(shape, dtype=dtype))
        standin.poison(t)
        return standin.register(t, standin.DEVICE)

    def to_device(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        if standin.kind_of(t) == standin.DEVICE:
            return t if dtype is None or t.dtype == dtype else standin.register(t.to(dtype), standin.DEVICE)
        with torch._C._DisableTorchDispatch():
            out = self.empty(t.shape, dtype or t.dtype)
            out.copy_(t)
        if standin.kind_of(t) == standin.HOST:  # pinned memory: a GPU reads it when it gets there
            self.standin.read_later(t)
        return out

    def to_host(self, t: torch.Tensor, dtype: torch.dtype | None = None, *, copy: bool = False) -> torch.Tensor:
        if standin.kind_of(t) == standin.DEVICE:
            self.standin.waited("to_host")  # a copy into pageable memory: the host waits for it
        if standin.kind_of(t) == standin.HOST and not copy:
            return t if dtype is None or t.dtype == dtype else standin.register(t.to(dtype), standin.HOST)
        return _host_copy(t, dtype)

    def to_host_all(self, ts: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        if any(standin.kind_of(t) == standin.DEVICE for t in ts):
            self.standin.waited("to_host_all")  # one wait for every copy queued before it
        return [_host_copy(t, dtype) for t in ts]

    def empty_host(self, nbytes: int) -> torch.Tensor:
        t = super().empty_host(nbytes)
        self.standin.pinned += nbytes
        self._registered[t.data_ptr()] = (None, nbytes)  # type: ignore[assignment]
        return standin.register(t, standin.HOST, strong=True)

    def _unpin(self, t: torch.Tensor, nbytes: int) -> None:
        self.standin.check_unread(t, "freed")
        self.standin.pinned -= nbytes
        standin.unregister(t)

    def released(self, buf: torch.Tensor) -> None:
        self.standin.released(buf)

    def regrow(self, kept: torch.Tensor, nbytes: int) -> None:
        kept.untyped_storage().resize_(nbytes)
        fresh(kept)
        standin.poison(kept)
        standin.register(kept, standin.DEVICE, strong=True)

    def compute_context(self) -> Any:
        return self.standin.compute()

    def update_context(self) -> Any:
        return self.standin.outside_compute()

    def compute_marker(self) -> Any:
        return self.standin.marker()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any = None) -> None:
        self.standin.copy(dst, src, after)

    def copy_later(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any) -> Any:
        return self.standin.copy(dst, src, after, wait=False)

    def compute_reached(self) -> Any:
        return self.standin.reached()

    def compute_waits(self, handle: Any) -> None:
        handle.result()  # the compute runs at once here: it can only start after the copy has landed

    def landed(self, handle: Any, *, wait: bool = True) -> bool:
        if handle is None:
            return True
        if wait:
            handle.result()
        if not handle.done():
            return False
        self.standin.landed_seen(handle)
        if getattr(handle, "clock", None) is not None:  # the copy ran after its marker: the compute had passed it
            self.standin.settle(handle.clock)
        return True

    def synchronize(self) -> None:
        self.standin.settle()
        self.standin.landed_seen(None)


def _host_copy(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The stand-in's copy of `t` in host memory."""
    with torch._C._DisableTorchDispatch():  # a host copy is not device memory, whatever the compute context
        out = torch.empty(t.shape, dtype=dtype or t.dtype)
        out.copy_(t)
    return standin.register(out, standin.HOST)


def make_device(device: torch.device | str | int | None = None) -> Device:
    """The engine's device: the stand-in when `HETERO_STANDIN=1` asks for it and no GPU is named, else `Device`."""
    if standin.active() and (device is None or torch.device(device).type == "cpu"):
        return StandinDevice()
    return Device(device)


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def select_gpu(index: int) -> None:
    """Make GPU `index` this process's current CUDA device (NCCL's groups use it)."""
    torch.cuda.set_device(index)


def gpu_count() -> int:
    """CUDA devices visible to this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def allocated_bytes(device: torch.device) -> int:
    """Bytes the caching allocator has handed out on a CUDA device now (0 on the CPU: no allocator to ask)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
