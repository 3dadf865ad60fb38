"""One .safetensors file, read tensor by tensor with positioned reads (no memory map, no safetensors package)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from hetero.errors import WeightsError

# [Note: reading .safetensors without a memory map]
# safetensors' safe_open maps the whole file and copies each tensor out of the map: every page read stays in the
# process's resident memory (RSS) until the file is closed, so loading a checkpoint bigger than the host raised the
# RSS peak by the whole checkpoint (117 MiB for 97 MiB of shards under a 32 MiB host budget), whatever the budgets.
# The format is simple (an 8-byte little-endian header length, a JSON header of dtype, shape and byte range per
# tensor, the data), so each tensor, or a tile's rows of it, is read with positioned reads into memory of its own.
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


Entries = dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]  # key -> (dtype, shape, byte offset, byte size)


class PositionedFile:
    """A file holding each tensor contiguously at a byte range, read tensor by tensor (or element range by element
    range) with positioned reads; a subclass reads its format's index of those ranges (`_index`)."""

    kind = ""  # the format, for messages

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self._entries = self._index()
        except Exception:
            os.close(self._fd)
            raise

    def _index(self) -> Entries:
        raise NotImplementedError

    def _pread(self, n: int, offset: int, into: memoryview | None = None) -> bytearray | memoryview:
        buf = bytearray(n) if into is None else into
        view = memoryview(buf)
        done = 0
        while done < n:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise ValueError(f"the file ends at byte {offset + done}, {n - done} bytes short")
            done += got
        return buf

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][1]

    def dtype(self, key: str) -> torch.dtype:
        return self._entries[key][0]

    def read(self, key: str) -> torch.Tensor:
        shape = self._entries[key][1]
        return self.read_elements(key, 0, math.prod(shape)).reshape(shape)

    def read_elements(self, key: str, a: int, b: int, into: memoryview | None = None) -> torch.Tensor:
        dtype, _, offset, _ = self._entries[key]
        if b <= a:
            return torch.empty(0, dtype=dtype)
        try:
            data = self._pread((b - a) * dtype.itemsize, offset + a * dtype.itemsize, into)
        except (ValueError, OSError) as e:  # changed under us since its index was read
            raise unreadable(self.path, self.kind, e) from None
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype)  # shares data's memory

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class SafetensorsFile(PositionedFile):
    """One .safetensors file, read tensor by tensor with os.pread (see the note above)."""

    kind = ".safetensors"

    def _index(self) -> Entries:
        size = os.fstat(self._fd).st_size
        try:
            if size < 8:
                raise ValueError(f"{size} bytes: no header")
            n = int.from_bytes(self._pread(8, 0), "little")
            if n > size - 8:
                raise ValueError(f"the header says {n} bytes, the file holds {size - 8} after its length")
            header = json.loads(self._pread(n, 8))
            entries = {}
            for key, e in header.items():
                if key == "__metadata__":
                    continue
                if e["dtype"] not in _DTYPES:
                    raise WeightsError(
                        f"weights: {str(self.path)!r} holds {key!r} in dtype {e['dtype']}, which torch "
                        f"{torch.__version__} has no type for here; convert it to one of {', '.join(_DTYPES)}"
                    )
                dtype, shape, (a, b) = _DTYPES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
                if b - a != math.prod(shape) * dtype.itemsize or 8 + n + b > size:
                    raise ValueError(f"{key!r} holds bytes {a}..{b} of {size - 8 - n}, for {e['dtype']} {shape}")
                entries[key] = (dtype, shape, 8 + n + a, b - a)
            return entries
        except WeightsError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise unreadable(self.path, ".safetensors", e) from None


def unreadable(f: Path, kind: str, e: Exception) -> WeightsError:
    first = str(e).splitlines()[0] if str(e) else ""
    if isinstance(e, PermissionError):
        return WeightsError(f"weights: {str(f)!r} cannot be read ({first}): give this process read permission")
    return WeightsError(
        f"weights: {str(f)!r} is not a readable {kind} file ({type(e).__name__}: {first}): it is damaged or was not "
        "fully written (an interrupted download or copy); fetch it again"
    )
