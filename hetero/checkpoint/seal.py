"""The manifest's checksum of itself: `sealed` writes it, `breaks_seal` checks it (manifest.read_manifest).

[Note: the manifest's own checksum]
Every other file of a checkpoint is checked against the manifest; the manifest holds what no file checks: the
per-parameter step counts (Adam's bias correction), the step and micro-step counters, each rank's random states and
the files' checksums themselves. A flipped digit there was valid JSON and loaded: a resume silently off (a step count
2 read as 3), or a consolidation that failed with a KeyError. So the manifest carries the CRC32 of the rest of
itself, taken over a canonical form (sorted keys, no spaces) of what a reader parses, which any JSON library
reproduces from the parsed values (Python's floats print as they parse back).
"""

from __future__ import annotations

import json
import zlib
from typing import Any

_SEAL = "manifest_crc32"
_KEYS = {"format", "version", "tag", "created", "engine", "layout", "model", "ranks", "files"}  # besides the seal


def _canonical(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, default=str).encode()


def sealed(manifest: dict[str, Any]) -> bytes:
    """The manifest's bytes with its own checksum ([Note: the manifest's own checksum]); `read_manifest` checks it."""
    plain = json.loads(dumps(manifest))  # as a reader parses it (dumps makes strings of what JSON cannot hold)
    plain.pop(_SEAL, None)
    plain[_SEAL] = zlib.crc32(_canonical(plain))
    return dumps(plain)


def breaks_seal(manifest: dict[str, Any]) -> bool:
    """Whether the parsed `manifest` fails its own checksum; the seal is taken out of it either way. One written
    before the seal existed passes unchecked, unless it holds a key of another name (the seal's own name with a
    flipped byte)."""
    seal = manifest.pop(_SEAL, None)
    if seal is None:
        return bool(set(manifest) - _KEYS)
    return zlib.crc32(_canonical(manifest)) != seal
