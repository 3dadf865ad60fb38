"""A strict CPU stand-in for an accelerator: GPU-only bugs fail on a machine without a GPU.

[Note: the CPU stand-in]
On a CPU-only machine the "device" tier is the CPU under its own budget: host and device memory are the same, copies
are synchronous and gloo takes any tensor, so a collective on a host tensor, a copy ordered after nothing, or a read
of a buffer already handed back all pass silently, and fail on the first GPU node. With `HETERO_STANDIN=1` in the
environment, `hetero.device.make_device()` returns a `StandinDevice` instead, and every process group hetero makes
follows NCCL's rules. It behaves like a separate accelerator:

  - Device memory comes from its own allocator and is told apart from host memory: every buffer hetero allocates
    through the device is registered as device memory, every host-tier buffer as host memory (`kind_of`).
  - Inside the engine's compute (`compute_context`: forward and backward, with the updates that run there) every
    tensor an operation makes is device memory, as on a GPU, and an operation that mixes a host-tier tensor with
    device memory fails, as CUDA refuses to compute across devices (0-dim tensors excepted, as CUDA accepts CPU
    scalars). There, and in the update (`watch`: `Engine.step` at an update), every operation that makes the host wait
    for the device is recorded ([Note: host waits]), a tensor made from Python data with a
    `device=` among them.
  - A collective on anything but device memory fails (NCCL's rule, `collective_rule`); small host-side messages go
    through the control group, as they must with NCCL.
  - A copy that touches device memory runs on a copy engine thread after a random delay and must carry a compute
    marker recorded after the destination buffer was last handed back to a pool: a copy ordered after nothing, or
    after a marker older than its buffer's reuse, fails (`StandinOrderingError`), where a GPU would give wrong
    values some of the time. So does a copy of device memory that the compute wrote after its marker: every write
    an operation makes (its outputs, the arguments its schema marks written) is stamped with the compute clock, and
    the copy stream would run ahead of that write on a GPU.
  - A copy from host memory queued on the compute stream (`to_device`) reads that memory late, when the device gets
    there: until the host has waited for the compute past it, the buffer may be neither handed back nor changed by
    the host ([Note: the compute stream reads host memory late]).
  - Buffers given back to a pool, and transient storage grown back, are poisoned (all bytes 0xFF: NaN in floating
    point), so a read of memory that is no longer the reader's gives NaN instead of yesterday's values.
  - Host buffers are "pinned": the bytes registered are counted (`pinned_bytes`), so the host ledger can be checked
    against what is really pinned, as it is against cudaHostRegister on a GPU.

Everything here is process-wide by nature (memory is), keyed by storage address, with weak references so that a
freed and reused address is never mistaken for the old buffer.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils._pytree import tree_flatten

from hetero.standin_memory import (  # noqa: F401 (the registry's names are the stand-in's: `standin.kind_of`, ...)
    DEVICE,
    HOST,
    address,
    collective_rule,
    kind_of,
    parts,
    poison,
    register,
    registry,
    unregister,
)

ENV = "HETERO_STANDIN"
_MAX_DELAY_S = 0.002  # a copy waits up to this long on the copy engine before it runs


def active() -> bool:
    """Whether this process runs with the stand-in (`HETERO_STANDIN=1`)."""
    return os.environ.get(ENV, "") not in ("", "0")


def watching(device: Any) -> contextlib.AbstractContextManager:
    """`Standin.watch` where `device` is the stand-in's; nothing elsewhere."""
    s = getattr(device, "standin", None)
    return s.watch() if s is not None else contextlib.nullcontext()


class StandinError(RuntimeError):
    """A rule of the stand-in was broken: code that would fail, or compute wrong values, on a GPU."""


class StandinOrderingError(StandinError):
    """A copy touching device memory was not ordered after the compute that last used its buffers."""


# ---- events and the copy engine ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Marker:
    """The compute stream's progress when recorded: everything computed before `clock` is done."""

    clock: int


class _CopyEngine:
    """One thread that runs copies in submission order, each after a random delay (a DMA engine's latency)."""

    def __init__(self, seed: int) -> None:
        self._jobs: SimpleQueue = SimpleQueue()
        self._random = random.Random(seed)
        self._thread = threading.Thread(target=self._run, name="hetero-standin-copy", daemon=True)
        self._thread.start()

    def submit(self, dst: torch.Tensor | None, src: torch.Tensor | None) -> Future:
        done: Future = Future()
        self._jobs.put((dst, src, done, self._random.uniform(0, _MAX_DELAY_S)))
        return done

    def _run(self) -> None:
        while True:
            dst, src, done, delay = self._jobs.get()
            time.sleep(delay)
            try:
                with torch.no_grad():
                    if dst is not None:  # None: a marker of the stream's progress, no copy
                        dst.copy_(src)
                done.set_result(None)
            except BaseException as e:  # reported to the waiter
                done.set_exception(e)


# ---- compute on the device ----------------------------------------------------------------------------------------
# [Note: host waits]
# On a GPU the host queues kernels and runs ahead; an operation that needs a device value on the host (`item()`, a
# condition on a tensor, `nonzero` and other ops whose output size depends on the data, a copy to pageable host
# memory) makes it wait until the device has run everything queued before, and the device then idles while the host
# catches up. The stand-in records each such operation on device memory made in the compute (`Standin.waits`), so a
# test can say how many waits a step may have and where (one H200 profile found a wait per tile of an embedding,
# and one per chunk in the update, costing tens of milliseconds a step).
_WAITS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
}


class _Made(TorchFunctionMode):
    """[Note: host waits]: `torch.tensor(data, device=d)` (or `as_tensor`) copies Python data from pageable memory,
    and on a GPU that copy waits for the device's queue to run dry; `torch.full((), v, device=d)` does not (the
    value goes with the kernel). Each is recorded as a wait, whatever the device (here the CPU stands for it). And a
    tensor made with a `device=` is device memory, as the caller asked (in the update, where other factories make
    host memory): read back, it is a wait."""

    def __init__(self, standin: Standin) -> None:
        super().__init__()
        self.standin = standin

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        placed = kwargs.get("device") is not None
        if placed and func in _FROM_DATA:
            data = args[0] if args else kwargs.get("data")
            if not (isinstance(data, torch.Tensor) and kind_of(data) == DEVICE):
                self.standin.waited(f"torch.{func.__name__}(..., device=...)")
        out = func(*args, **kwargs)
        if placed:
            _claim(out)
        return out


_FROM_DATA = (torch.tensor, torch.as_tensor)
_COPY = torch.ops.aten.copy_.default


def _non_blocking(args: tuple, kwargs: dict) -> bool:
    """`copy_`'s `non_blocking` (its third argument)."""
    return bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))


def _claim(t: Any, clock: int | None = None) -> None:
    """Memory the stand-in never saw becomes device memory (written at compute clock `clock`, where given)."""
    if not isinstance(t, torch.Tensor):
        return
    for part in parts(t):
        if part.untyped_storage().nbytes() and kind_of(part) is None:
            register(part, DEVICE)
            if clock is not None:
                registry.mark_written(part, clock)


class _Compute(TorchDispatchMode):
    """See the note: outputs of operations are device memory; host-tier operands next to device memory fail; what
    an operation writes in device memory is stamped with the compute clock. rules=False: only the waits are
    recorded (the update, which computes on the host tier as well)."""

    def __init__(self, standin: Standin, *, rules: bool = True) -> None:
        super().__init__()
        self.standin = standin
        self.rules = rules

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        every = [kind_of(t) for t in tensors]
        kinds = [k if t.dim() > 0 else None for t, k in zip(tensors, every)]
        if HOST in every and not func.is_view:  # a view reads nothing yet
            for t, k in zip(tensors, every):
                if k == HOST:
                    self.standin.check_landed(t)
        if func in _WAITS and DEVICE in every:
            self.standin.waited(str(func))
        elif func is _COPY and DEVICE in kinds and HOST in kinds and not _non_blocking(args, kwargs):
            # A blocking copy between host and device memory returns once the bytes have landed, behind everything
            # queued on the stream before it (one H200 found a wait a chunk where an update wrote a master from the
            # host into a device shard with a plain `copy_`).
            self.standin.waited(f"{func} between host and device memory, blocking")
        if self.rules and DEVICE in kinds and HOST in kinds:
            host = next(t for t, k in zip(tensors, kinds) if k == HOST)
            raise StandinError(
                f"{func} computes on device memory and a host-tier tensor of shape {tuple(host.shape)} at once: on "
                "a GPU this fails (tensors on different devices). Move the host tensor to the device first "
                "(Device.to_device) or keep the whole operation on the host"
            )
        out = func(*args, **kwargs)
        clock = self.standin.clock
        # A tensor made from nothing (a factory) is device memory, as the model's `device=x.device` makes it (in the
        # update, host memory: a factory there asks for the device by name, `_Made`); one computed only from memory
        # the stand-in never saw (a CPU tensor of the engine's bookkeeping) stays where a GPU would leave it, on the
        # host.
        made = DEVICE in every or (self.rules and not tensors)
        for t in tree_flatten(out)[0] if made else ():
            _claim(t, clock if self.rules else None)
        if not self.rules:
            return out
        # What the operation wrote in place (its schema says which arguments): device memory written at this point of
        # the compute stream, which a copy may read only after a marker recorded since.
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor) and kind_of(t) == DEVICE:
                    registry.mark_written(t, clock)
        return out


class Standin:
    """The stand-in's clock, copy engine and pinned-byte count; one per StandinDevice."""

    def __init__(self, seed: int = 0) -> None:
        self._clock = 0  # compute markers recorded so far
        self._lock = threading.Lock()
        self._engine = _CopyEngine(seed)
        self.pinned = 0  # bytes of host memory registered as pinned
        self.waits: list[tuple[str, str]] = []  # (what, where): the host waiting for the device ([Note: host waits])
        # Host memory the compute stream reads late: storage address -> [(clock when queued, the memory, its bytes
        # then)] ([Note: the compute stream reads host memory late]).
        self._reads: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        # Host memory a copy writes that the host has not seen land: storage address -> the copy's Future
        # ([Note: host memory a copy has not landed in]).
        self._landing: dict[int, Future] = {}
        self._submitted = 0  # such copies submitted so far: the copy engine runs them in this order

    def waited(self, what: str) -> None:
        """The host waits here for the device's queue to run dry: record what and where (hetero's frames)."""
        frames = [f for f in traceback.extract_stack()[:-2] if "/hetero/" in f.filename and "standin" not in f.filename]
        where = " < ".join(f"{f.filename.rsplit('/hetero/', 1)[1]}:{f.lineno}" for f in reversed(frames[-4:]))
        self.waits.append((what, where))
        self.settle()

    # [Note: the compute stream reads host memory late]
    # A copy from pinned host memory queued on the compute stream (`Device.to_device` of a host-tier buffer) returns
    # at once, and the GPU reads the bytes when it gets there, which may be long after the host has gone on. Until
    # the host has waited for the compute past that copy (a copy ordered after a later marker has landed, a wait for
    # the device, a synchronize), the host may neither hand the buffer back to a pool, where an NVMe read or another
    # chunk may take it, nor write it: the GPU would read whichever bytes are there when it gets there. The
    # stand-in's compute runs at once, so it keeps each such read pending with a copy of the bytes it read: handing
    # the buffer back while one is pending fails, and so does finding, when a wait settles it, that the host has
    # changed those bytes since.
    def read_later(self, t: torch.Tensor) -> None:
        """The compute stream reads host memory `t` late: see the note."""
        with torch._C._DisableTorchDispatch():
            seen = t.detach().clone()
        with self._lock:
            self._reads.setdefault(address(t), []).append((self._clock, t.detach(), seen))

    def settle(self, before: int | None = None, *, address: int | None = None) -> None:
        """The host has seen the compute pass marker `before` (None: all of it): the reads queued before it are done
        (only those of `address`'s memory, if given); each must have read what the host left there."""
        with self._lock:
            keys = list(self._reads) if address is None else [address] if address in self._reads else []
            done = []
            for key in keys:
                for r in self._reads.pop(key):
                    if before is None or r[0] < before:
                        done.append(r)
                    else:
                        self._reads.setdefault(key, []).append(r)
        with torch._C._DisableTorchDispatch():
            for _, t, seen in done:
                if not torch.equal(t.reshape(-1).view(torch.uint8), seen.reshape(-1).view(torch.uint8)):
                    raise StandinOrderingError(
                        f"host memory of {t.numel()} elements that a copy queued on the compute stream reads was "
                        "changed by the host before it waited for that copy: on a GPU the copy may read either "
                        "bytes. Keep the memory unchanged (ChunkManager.land_later) until a wait covers the copy"
                    )

    def check_unread(self, buf: torch.Tensor, what: str) -> None:
        """`buf` is handed back or freed: fail if a read queued on the compute stream may still read it."""
        with self._lock:
            pending = self._reads.get(address(buf))
        if pending:
            raise StandinOrderingError(
                f"a host buffer of {buf.numel()} bytes was {what} while a copy queued on the compute stream "
                f"({len(pending)} of them) may still read it: on a GPU an NVMe read or another chunk taking it would "
                "change what that copy reads. Keep the chunk where it is (ChunkManager.land_later) until a wait covers "
                "the copy ([Note: the compute stream reads host memory late])"
            )

    def reached(self) -> Future:
        """A handle that lands once the compute queued so far has run (its `clock`: the marker it stands for)."""
        marker = self.marker()
        done = self._engine.submit(None, None)
        done.clock = marker.clock  # type: ignore[attr-defined]
        return done

    @property
    def clock(self) -> int:
        """Compute markers recorded so far: compute issued now runs after every one of them."""
        return self._clock

    def marker(self) -> Marker:
        with self._lock:
            self._clock += 1
            return Marker(self._clock)

    def released(self, buf: torch.Tensor) -> None:
        """A buffer went back to a pool: compute queued before now may still read it; poison it. Host memory is read
        by the compute only through `read_later`, whose reads must all be settled by now: a copy into it later needs
        no marker newer than this."""
        self.check_unread(buf, "handed back to its pool")
        if kind_of(buf) != HOST:
            with self._lock:
                clock = self._clock
            registry.mark_released(buf, clock)
        poison(buf)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any, *, wait: bool = True) -> Future | None:
        """A copy on the copy engine, after its checks; wait False: return at once with its Future (it lands late)."""
        touches = [t for t in (dst, src) if kind_of(t) != HOST]  # unknown memory counts as device: the strict side
        if touches:
            if not isinstance(after, Marker):
                raise StandinOrderingError(
                    f"a copy of {src.numel()} elements touching device memory was issued with no compute marker: on "
                    "a GPU it would race the kernels still queued on that memory. Pass "
                    "after=device.compute_marker(), recorded when the copy is submitted"
                )
            stale, which = max((registry.released_at(t), w) for t, w in ((dst, "destination"), (src, "source")))
            if after.clock <= stale:
                raise StandinOrderingError(
                    f"a copy of {src.numel()} elements was ordered after compute marker {after.clock}, but its {which} "
                    f"({kind_of(dst if which == 'destination' else src)} memory) was handed back to a pool at {stale}, "
                    "after that marker: record the marker when the copy is submitted, after the buffer was acquired"
                )
            written = max(registry.written_at(t) for t in touches)
            if written >= after.clock:
                raise StandinOrderingError(
                    f"a copy of {src.numel()} elements was ordered after compute marker {after.clock}, but compute "
                    "queued after that marker wrote its memory: on a GPU the copy would race that write. Record the "
                    "marker after the compute that produces what the copy moves"
                )
        if isinstance(after, Marker):  # the copy stream waits for the marker: reads queued before it are done
            self.settle(after.clock, address=address(dst))
        if self._reads.get(address(dst)):
            raise StandinOrderingError(
                f"a copy of {src.numel()} elements writes host memory that a copy queued on the compute stream after "
                "its marker may still read: record the marker after that read "
                "([Note: the compute stream reads host memory late])"
            )
        done = self._engine.submit(dst, src)
        done.clock = after.clock if isinstance(after, Marker) else None  # type: ignore[attr-defined]
        if not wait:
            if kind_of(dst) == HOST:
                with self._lock:
                    self._submitted += 1
                    done.seq = self._submitted  # type: ignore[attr-defined]
                    self._landing[address(dst)] = done
            return done
        done.result()
        return None

    # [Note: host memory a copy has not landed in]
    # A copy from the device into host memory (`Device.copy_later`) returns at once; on a GPU the bytes arrive when
    # the copy stream gets there, and until the host has seen it land (`Device.landed`, or a synchronize) the memory
    # may hold the old bytes, and a host write to it may be overwritten. The stand-in's copies land after a short
    # delay, usually before the host looks, so such a read would pass: each such destination is marked until the
    # host has seen its copy land, and an operation of the compute or the update on it fails.
    def landed_seen(self, handle: Future | None) -> None:
        """The host has seen `handle` land (or, for None, every copy): its destination, and those of copies
        submitted before it (one copy engine, in order), may be read."""
        with self._lock:
            if handle is None:
                self._landing.clear()
                return
            seq = getattr(handle, "seq", None)
            if seq is not None:
                self._landing = {a: f for a, f in self._landing.items() if f.seq > seq}  # type: ignore[attr-defined]

    def check_landed(self, t: torch.Tensor) -> None:
        """Fail where `t` is host memory a copy writes that the host has not seen land (see the note)."""
        if self._landing and address(t) in self._landing:
            raise StandinOrderingError(
                f"host memory of {t.numel()} elements that a copy from the device writes was used before the host "
                "saw that copy land: on a GPU it may still hold the old bytes (or lose what the host writes). Wait "
                "for the copy first (Device.landed)"
            )

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        with _Compute(self), _Made(self):
            yield

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Record the host's waits for the device ([Note: host waits]) without `compute`'s other rules."""
        with _Compute(self, rules=False), _Made(self):
            yield

    @contextlib.contextmanager
    def outside_compute(self) -> Iterator[None]:
        """Suspend `compute`'s check (the update's tier copies, run from a backward hook) and restore it after."""
        if not isinstance(_get_current_dispatch_mode(), _Compute):
            yield
            return
        with _pop_mode_temporarily():
            yield
