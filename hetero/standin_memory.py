"""The stand-in's memory registry: which storage is device memory and which host memory, when each was last handed
back and last written ([Note: the CPU stand-in] in standin.py)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

DEVICE, HOST = "device", "host"


# ---- the memory registry -------------------------------------------------------------------------------------------
class _Registry:
    """Storage address -> (kind, the storage's identity, the tensor that owns it).

    hetero's own buffers (pools, transient storage, host tier) are held strongly until the device frees them;
    anything else (compute outputs, copies to and from the device) weakly, its entry dropped the moment its tensor
    dies, so that a freed address taken by a new allocation is never mistaken for the old one. The storage's
    identity (its C++ object) guards the one case left: a storage that grew elsewhere (transient chunks)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # copy workers register and look up too
        self._entries: dict[int, tuple[str, int, Any]] = {}
        self._released: dict[int, int] = {}  # storage address -> compute clock when last handed back to a pool
        self._written: dict[int, int] = {}  # storage address -> compute clock when compute last wrote device memory

    def add(self, t: torch.Tensor, kind: str, *, strong: bool) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        # A weak entry lives as long as the storage, not the tensor registered: a view or a detached alias (a
        # gradient autograd reshaped, a stage output sent on) outlives the operation's own output. torch keeps one
        # Python object per live storage, so a weak reference to it dies with the storage's last tensor.
        owner: Any = t if strong else weakref.ref(storage, lambda _, k=key: self._forget(k))
        with self._lock:
            self._entries[key] = (kind, storage._cdata, owner)
            self._released.pop(key, None)
            self._written.pop(key, None)

    def _forget(self, key: int) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and isinstance(entry[2], weakref.ref) and entry[2]() is None:
                del self._entries[key]
                self._released.pop(key, None)
                self._written.pop(key, None)

    def remove(self, t: torch.Tensor) -> None:
        key = address(t)
        with self._lock:
            self._entries.pop(key, None)
            self._released.pop(key, None)
            self._written.pop(key, None)

    def kind(self, t: torch.Tensor) -> str | None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry[1] != storage._cdata:  # another storage at this address: the registered one moved on
                del self._entries[key]
                self._released.pop(key, None)
                return None
            return entry[0]

    def mark_released(self, t: torch.Tensor, clock: int) -> None:
        with self._lock:
            self._released[address(t)] = clock

    def released_at(self, t: torch.Tensor) -> int:
        with self._lock:
            return self._released.get(address(t), -1)

    def mark_written(self, t: torch.Tensor, clock: int) -> None:
        with self._lock:
            self._written[address(t)] = clock

    def written_at(self, t: torch.Tensor) -> int:
        with self._lock:
            return self._written.get(address(t), -1)


def address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


registry = _Registry()


def parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors holding `t`'s memory: itself, or a sparse COO tensor's values and indices (an
    `nn.Embedding(sparse=True)` gradient)."""
    if t.layout is torch.sparse_coo:
        return [t._values(), t._indices()]
    return [t]


def kind_of(t: torch.Tensor) -> str | None:
    """DEVICE, HOST, or None for memory the stand-in never saw (made outside the engine's compute)."""
    t = parts(t)[0]
    if t.numel() == 0 and t.untyped_storage().nbytes() == 0:
        return None
    return registry.kind(t)


def register(t: torch.Tensor, kind: str, *, strong: bool = False) -> torch.Tensor:
    """Record `t`'s memory as DEVICE or HOST. strong: hetero's own buffer, held until `unregister`."""
    registry.add(t, kind, strong=strong)
    return t


def unregister(t: torch.Tensor) -> None:
    registry.remove(t)


def collective_rule(t: torch.Tensor) -> str | None:
    """Why NCCL would refuse `t` in a collective, or None: only device memory is accepted."""
    kind = kind_of(t)
    if kind == DEVICE:
        return None
    if kind == HOST:
        return "a host-tier tensor (host memory): NCCL takes device tensors only"
    return "a tensor not on the device (made outside the device's compute): NCCL takes device tensors only"


def poison(buf: torch.Tensor) -> None:
    """Fill with 0xFF bytes: NaN in every floating dtype, -1 in integers."""
    buf.reshape(-1).view(torch.uint8).fill_(0xFF)  # flat first: torch < 2.5 cannot view a 0-dim tensor as bytes
