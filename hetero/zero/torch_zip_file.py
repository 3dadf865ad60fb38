"""One torch.save file (torch's zip format), read tensor by tensor with positioned reads, as .safetensors files are.

[Note: reading torch's zip format without torch.load]
`torch.load(mmap=True)` maps the file and every page a rank touches stays resident until the load ends: initialising
a 136 MiB Llama from a .bin under 32/16 MiB budgets grew the RSS peak by 161 MiB (29 MiB read this way, as from
sharded safetensors; benchmarks/init_weights_rss.py), and at stage 3 two ranks held 117 and 82 MiB of its pages.
torch.save's format since torch 1.6 is a zip archive of uncompressed members: `<archive>/data.pkl`, a pickle of the
state_dict in which each tensor is a call to `_rebuild_tensor_v2` (or v3) with a storage (a persistent id naming
member `<archive>/data/<key>`, its dtype and size), an element offset, a shape and strides; and `<archive>/byteorder`.
So the pickle is read with an unpickler that builds no tensor and knows only what a state_dict holds (the rebuild calls,
storage types, dtypes, OrderedDict): any other global is refused, as `weights_only=True` refuses it; each storage
member's data starts after its zip local header (whose extra fields, torch's 64-byte alignment padding and a zip64 field
past 4 GiB, are not its central directory entry's); and each tensor, or an element range of it, is read with positioned
reads (`PositionedFile`, shared with .safetensors). What this reader does not serve goes back to torch.load with a line
saying why (`NotServed`): the legacy format (not a zip) and compressed members loaded whole (mapped, a compressed
member's bytes would be taken for its values), another byte order, a zip64 end record with extensible data (which
zipfile cannot find), or globals torch allows that are not a plain tensor (a sparse or quantized tensor, a user's
`add_safe_globals`), memory-mapped. A non-contiguous tensor is read as the storage span it covers. Damaged zip64 end
records and extra fields are named (`_end_records`, `_zip64_checked`), not passed over as zipfile does.
"""

from __future__ import annotations

import codecs
import collections
import io
import math
import os
import pickle
import struct
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from hetero.errors import WeightsError
from hetero.zero.safetensors_file import Entries, PositionedFile, unreadable

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, (version .. sizes), name length, extra field length
_ZIP_MAGIC = b"PK\x03\x04"
_END = struct.Struct("<4s4x2H2LH")  # signature, (disks), entries (this disk, all), directory size, offset, comment
_LOCATOR = struct.Struct("<4sLQL")  # signature, disk holding the zip64 end record, its offset, number of disks
_END64 = struct.Struct("<4sQ20x3Q")  # signature, size of what follows, (versions, disks, ...), entries, directory
_MAX16, _MAX32 = 0xFFFF, 0xFFFFFFFF  # a field too small for its value: the value is in a zip64 record (APPNOTE 4.4.1.4)


class NotServed(Exception):
    """A file this reader leaves to torch.load; the message says why."""

    def __init__(self, why: str, mappable: bool = True) -> None:
        super().__init__(why)
        self.mappable = mappable  # False: torch.load(mmap=True) would read compressed bytes as the tensor's values


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class _Storage:
    key: str  # its member is <archive>/data/<key>
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True, slots=True)
class _View:
    storage: _Storage
    dtype: Any  # the tensor's: the storage's (_rebuild_tensor_v2) or its own (v3: an untyped storage's bytes)
    offset: int  # in elements of the tensor's dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]


_TYPED = {  # torch.save's typed storages (torch.storage._dtype_to_storage_type_map), quantized ones left to torch
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128, "ComplexFloatStorage": torch.complex64,
}  # fmt: skip
_TENSOR, _PARAMETER = object(), object()  # torch.Tensor and nn.Parameter, as _rebuild_from_type_v2 names them


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> _View:
    return _View(storage, getattr(storage, "dtype", None), offset, tuple(size), tuple(stride))  # checked later


def _rebuild_tensor_v3(storage: Any, offset: Any, size: Any, stride: Any, grad: Any, hooks: Any, dtype: Any, *_: Any):
    return _View(storage, dtype, offset, tuple(size), tuple(stride))  # torch's dtypes without a typed storage


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data  # requires_grad, hooks and Python state mean nothing to a weight's values


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if new_type not in (_TENSOR, _PARAMETER):
        raise pickle.UnpicklingError(f"_rebuild_from_type_v2 of {new_type!r}")
    return func(*args)


def _latin1(text: Any, encoding: Any = "latin1") -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):  # how protocol 2 pickles bytes
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r}")
    return codecs.encode(text, "latin1")


_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch", "UntypedStorage"): _StorageType(torch.uint8),
    ("torch.storage", "UntypedStorage"): _StorageType(torch.uint8),
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Tensor"): _TENSOR,
    ("torch.nn.parameter", "Parameter"): _PARAMETER,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("_codecs", "encode"): _latin1,
}


class _IndexUnpickler(pickle.Unpickler):
    """Reads data.pkl into `_View`s, calling nothing but the functions above (see the note)."""

    def __init__(self, data: bytes, path: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path
        self.storages: dict[str, _Storage] = {}  # one per key: views of one storage share it

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _GLOBALS:
            return _GLOBALS[(module, name)]
        if module == "torch":
            held = getattr(torch, name, None)
            if isinstance(held, torch.dtype):
                return held
            if name in _TYPED:
                return _StorageType(_TYPED[name])
        if module == "torch" or module.startswith("torch.") or _user_allowed(module, name):
            raise NotServed(f"its pickle calls {module}.{name}, which only torch.load rebuilds")
        raise WeightsError(
            f"weights: {str(self.path)!r} cannot be loaded safely: its pickle names {module}.{name}, which a "
            "state_dict of tensors never holds (torch.load(weights_only=True) refuses it too). It must hold a plain "
            "state_dict of tensors; convert it to .safetensors where it holds more, or load it yourself if you trust it"
        )

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"a persistent id {str(pid)[:80]} that is not a storage")
        _, kind, key, _, numel = pid  # the location is ignored: weights are read to the host
        if not isinstance(kind, _StorageType) or not isinstance(key, str) or not _count(numel):
            raise pickle.UnpicklingError(f"a storage id {str(pid)[:80]}")
        if key not in self.storages:
            self.storages[key] = _Storage(key, kind.dtype, numel)
        return self.storages[key]


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _user_allowed(module: str, name: str) -> bool:
    """Whether the user allowed this global for weights_only loads (torch.serialization.add_safe_globals)."""
    for g in torch.serialization.get_safe_globals():
        if isinstance(g, tuple):
            if g[1] == f"{module}.{name}":
                return True
        elif (getattr(g, "__module__", None), getattr(g, "__qualname__", None)) == (module, name):
            return True
    return False


class TorchZipFile(PositionedFile):
    """The tensors of one torch.save zip file, each read with positioned reads (see the note above)."""

    kind = "torch"

    def _index(self) -> Entries:
        self._strided: dict[str, tuple[int, ...]] = {}  # key -> its strides, for a tensor that is not contiguous
        self._last: tuple[str, torch.Tensor] | None = None  # the strided tensor read last: its ranges come in turn
        if bytes(self._pread(min(4, self._size()), 0)) != _ZIP_MAGIC:
            raise NotServed("it is in torch's legacy format (before torch 1.6), not a zip archive", mappable=False)
        try:
            with open(self.path, "rb") as f:
                count = _end_records(f, self._size())  # before zipfile, which passes over a damaged zip64 record
                with zipfile.ZipFile(f) as z:
                    members = {i.filename: _zip64_checked(i) for i in z.infolist()}
                    if count is not None and count != len(z.infolist()):
                        raise ValueError(f"its end records count {count} members, its central directory {len(members)}")
                    prefix = z.infolist()[0].filename.split("/", 1)[0]
                    order = z.read(f"{prefix}/byteorder").decode() if f"{prefix}/byteorder" in members else "little"
                    if order != sys.byteorder:
                        mine = sys.byteorder
                        raise NotServed(f"its tensors are stored {order}-endian, this machine is {mine}-endian")
                    reader = _IndexUnpickler(z.read(f"{prefix}/data.pkl"), self.path)
                    state = reader.load()
            if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
                state = state["state_dict"]  # a training checkpoint's common layout
            if not isinstance(state, dict):
                raise WeightsError(f"weights: {str(self.path)!r} holds a {type(state).__name__}, not a state_dict")
            starts = {k: self._data_start(members, f"{prefix}/data/{k}", s) for k, s in reader.storages.items()}
            return {k: self._entry(k, v, starts[v.storage.key]) for k, v in state.items() if isinstance(v, _View)}
        except (WeightsError, NotServed):
            raise
        except Exception as e:  # a damaged archive or pickle: zipfile, struct, pickle and our checks' errors
            raise unreadable(self.path, self.kind, e) from None

    def _size(self) -> int:
        return os.fstat(self._fd).st_size

    def _data_start(self, members: dict[str, zipfile.ZipInfo], name: str, storage: _Storage) -> int:
        info = members.get(name)
        if info is None:
            raise ValueError(f"no member {name} for a storage its pickle names")
        if info.compress_type != zipfile.ZIP_STORED:
            raise NotServed(f"its member {name} is compressed, so it cannot be read in place", mappable=False)
        signature, n, m = _LOCAL_HEADER.unpack(bytes(self._pread(_LOCAL_HEADER.size, info.header_offset)))
        start = info.header_offset + _LOCAL_HEADER.size + n + m
        if signature != _ZIP_MAGIC or start + info.file_size > self._size():
            raise ValueError(f"member {name}'s local header at byte {info.header_offset} is damaged or cut short")
        if info.compress_size != info.file_size:
            raise ValueError(f"member {name} is stored, yet its sizes differ: {info.compress_size}, {info.file_size}")
        if info.file_size != storage.numel * storage.dtype.itemsize:
            raise ValueError(f"member {name} holds {info.file_size} bytes, for {storage.numel} x {storage.dtype}")
        return start

    def _entry(self, key: str, v: _View, start: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        shape, stride, dtype = v.shape, v.stride, v.dtype
        if not (all(map(_count, shape + stride)) and len(shape) == len(stride) and _count(v.offset)):
            raise ValueError(f"{key!r} has shape {shape}, strides {stride}, offset {v.offset}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{key!r} has dtype {dtype!r}")
        numel = math.prod(shape)
        span = 0 if numel == 0 else 1 + sum((n - 1) * s for n, s in zip(shape, stride))  # elements it covers
        held = v.storage.numel * v.storage.dtype.itemsize
        if (v.offset + span) * dtype.itemsize > held:
            raise ValueError(f"{key!r} spans {dtype} elements {v.offset}..{v.offset + span} of {held} bytes")
        if not _contiguous(shape, stride):
            self._strided[key] = stride
        return dtype, shape, start + v.offset * dtype.itemsize, span * dtype.itemsize

    def read(self, key: str) -> torch.Tensor:
        if key not in self._strided:
            return super().read(key)
        dtype, shape, _, nbytes = self._entries[key]
        span = super().read_elements(key, 0, nbytes // dtype.itemsize)  # the storage elements it covers
        return span.as_strided(shape, self._strided[key]).contiguous()

    def read_elements(self, key: str, a: int, b: int, into: memoryview | None = None) -> torch.Tensor:
        if key not in self._strided or b <= a:
            return super().read_elements(key, a, b, into)
        if self._last is None or self._last[0] != key:
            self._last = None  # its memory goes before the next tensor's comes
            self._last = (key, self.read(key))
        part = self._last[1].reshape(-1)[a:b]
        return part if into is None else torch.frombuffer(into, dtype=torch.uint8).view(part.dtype).copy_(part)


def _end_records(f: BinaryIO, size: int) -> int | None:
    """The member count the end records give (None where none is sure), after checking the zip64 end records.

    A file over 4 GiB keeps its central directory's size and offset in a zip64 end record, found through the locator
    just before the end record (APPNOTE 4.3.14-4.3.16). zipfile reads the zip64 record from the 56 bytes before the
    locator and, where there is none, silently keeps the end record's 0xFFFFFFFF marks as the directory's size and
    offset, to fail later with "Bad offset for central directory": these checks say what is wrong instead."""
    tail = min(size, _END.size + _MAX16)  # the end record and the longest comment after it
    f.seek(size - tail)
    data = f.read(tail)
    at = data.rfind(b"PK\x05\x06")
    if at < 0 or at + _END.size > len(data) or at + _END.size + _END.unpack_from(data, at)[-1] != len(data):
        return None  # no end record (its comment, if any, ends the file): zipfile says it is not a zip file
    _, _, total, dir_size, dir_offset, _ = _END.unpack_from(data, at)
    locator = size - tail + at - _LOCATOR.size
    if locator < 0 or _read(f, locator, _LOCATOR.size)[:4] != b"PK\x06\x07":
        if _MAX32 in (dir_size, dir_offset):
            raise ValueError(
                "its end of central directory record keeps the directory's size and offset in zip64 records "
                f"(0xFFFFFFFF in its own), but no zip64 locator precedes it at byte {locator}"
            )
        return None if total == _MAX16 else total  # a true 65535 members or a count zipfile does not need
    _, disk, record, disks = _LOCATOR.unpack(_read(f, locator, _LOCATOR.size))
    if disk != 0 or disks > 1:
        raise ValueError(f"its zip64 locator names disk {disk} of {disks}: it is one part of a split archive")
    here = locator - _END64.size  # where zipfile reads the zip64 record
    if here >= 0 and _read(f, here, 4) == b"PK\x06\x06":
        _, length, total, dir_size, _ = _END64.unpack(_read(f, here, _END64.size))
        if length != _END64.size - 12 or dir_size > here:
            raise ValueError(f"its zip64 end record at byte {here} is damaged (length {length}, directory {dir_size})")
        return total
    if 0 <= record < here and _read(f, record, 4) == b"PK\x06\x06":
        length = _END64.unpack(_read(f, record, _END64.size))[1]
        if record + 12 + length == locator:  # miniz (torch.load) reads it through the locator, zipfile cannot
            extensible = length + 12 - _END64.size
            raise NotServed(f"its zip64 end record carries {extensible} bytes of extensible data, which zipfile misses")
    raise ValueError(f"no zip64 end record at byte {record}, where its zip64 locator (byte {locator}) places it")


def _read(f: BinaryIO, offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)  # short at the file's end: the signature checks above then fail


def _zip64_checked(info: zipfile.ZipInfo) -> zipfile.ZipInfo:
    """zipfile takes each 0xFFFFFFFF size or offset's value from the zip64 extra field, or keeps the mark without it."""
    marks = ("size", info.file_size), ("compressed size", info.compress_size), ("offset", info.header_offset)
    if any(v == _MAX32 for _, v in marks):
        missing = " and ".join(what for what, v in marks if v == _MAX32)
        raise ValueError(
            f"member {info.filename} keeps its {missing} in a zip64 extra field (0xFFFFFFFF in its central directory "
            "entry), but it has none"
        )
    return info


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """torch's rule: row-major strides, ignoring dimensions of size 1 (and any strides of an empty tensor)."""
    if math.prod(shape) == 0:
        return True
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True
