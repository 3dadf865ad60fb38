"""Values in configs: sizes ("2GiB", "512MB", 1.5e9) and the checks every config section shares, each error naming
the key, what was wrong and what to give instead."""

from __future__ import annotations

import re

from hetero.config_deepspeed import value_hint
from hetero.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
# A sign is read so that "-1GiB" is refused as negative, as the int -1 is, rather than as unreadable.
_SIZE_RE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, *, key: str = "size") -> int:
    """Bytes from an int, a float, or a string like "2GiB" / "512 MB" / "1e9"."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size in bytes or a string like '2GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(f"{key}: a size in bytes must be whole, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"{key}: cannot read {value!r} as a size; write bytes (e.g. 1073741824) or a number with a unit "
                f"from {sorted(u for u in _SIZE_UNITS if u)} (e.g. '2GiB', '512MB')"
            )
        n = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ConfigError(f"{key}: expected a size in bytes or a string like '2GiB', got {type(value).__name__}")
    if n < 0 or (isinstance(value, str) and value.strip().startswith("-")):  # "-0.5" truncates to 0
        raise ConfigError(f"{key}: a size cannot be negative, got {value!r}")
    return n


def format_size(n: int | float) -> str:
    """Human-readable bytes, binary units."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(
            f"{key}: {value!r} is not valid{value_hint(value)}; choose one of {', '.join(map(repr, choices))}"
        )


def check_int(key: str, value: object, *, minimum: int, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = f" {hint}" if hint else ""
        raise ConfigError(f"{key}: expected an integer >= {minimum}{extra}, got {value!r}")
