"""Values in configs: sizes ("2GiB", "512MB", 1.5e9) and the checks every config section shares, each error naming
the key, what was wrong and what to give instead."""

from __future__ import annotations

import os
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


def check_zero_stage(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value not in range(4):
        raise ConfigError(f"zero_stage: must be one of 0, 1, 2, 3, got {value!r}{_as_integer(value)}")


def check_chunk_size(value: object) -> None:
    """chunk_size counts elements: a size in bytes ("1MiB") is the usual mistake, so the error says what that many
    bytes would be in fp32 elements."""
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = _as_integer(value)
        if not hint and isinstance(value, str):
            try:
                nbytes = parse_size(value)
            except ConfigError:
                nbytes = 0
            if nbytes >= 4:
                hint = f" ({value!r} is a size in bytes: at fp32, 4 bytes an element, that is chunk_size {nbytes // 4})"
        raise ConfigError(
            f'chunk_size: expected an integer >= 1, a number of elements per chunk (not bytes), or "auto", got '
            f"{value!r}{hint}"
        )


def _as_integer(value: object) -> str:
    """A hint for an integer given as a string ("3") or a float (3.0): "" when `value` is no such thing."""
    if isinstance(value, float) and value.is_integer():
        return f" (an integer: {int(value)}, not {value!r})"
    if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*", value):
        return f" (a string: give the integer {int(value)}, without quotes)"
    return ""


# What a section looks like, for a section given as something other than a mapping ({"offload": "nvme"}).
_SECTION_EXAMPLES = {
    "offload": '{"optimizer": "nvme"} or {"params": "nvme", "optimizer": "nvme"}',
    "memory": '{"device_budget": "40GiB", "nvme_dir": "/mnt/nvme"}',
    "parallel": '{"tensor": 2, "pipeline": 2}',
    "log": '{"tensorboard": "runs/"}',
    "loss_scale": '{"initial_scale": 65536}',
}


def not_a_mapping(section: str, value: object, names: list[str]) -> ConfigError:
    """The error for a config (section) that is not a mapping: the form it takes, with an example where there is
    one."""
    example = _SECTION_EXAMPLES.get(section)
    form = f", e.g. {example}" if example else ""
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ConfigError(
        f"{section}: expected a mapping of its keys ({', '.join(names)}){form}; got the {type(value).__name__} {shown}"
    )


# Directory names the docs, the tools' --help and the planner's pasted configs write where the user's own NVMe
# directory goes ("/path/on/nvme", "/path/to/nvme", "<nvme-dir>", "/your/nvme"): pasted as they are, they reached the
# swap store's "does not exist; create it (mkdir -p)", which asks the user to make the placeholder.
_PLACEHOLDER_RE = re.compile(r"^/path/(on|to)/|<[^>]*>|(^|/)your[-_/]|(^|/)your$|^/?(nvme[-_]?dir|NVME_DIR)$", re.I)


def nvme_dir_problem(path: str | os.PathLike) -> str | None:
    """What to tell a user whose NVMe directory (memory.nvme_dir, --nvme-dir) for a run on this machine is the docs'
    placeholder (existing or not) or does not exist; None where it names an existing directory."""
    d = os.path.expanduser(os.fspath(path))
    if _PLACEHOLDER_RE.search(d):
        return (
            f"nvme_dir {d!r} is the placeholder from the docs: give a directory on your NVMe disk (where a local NVMe "
            "drive is mounted, as `df -h` or `lsblk` shows, or a directory you made under it)"
        )
    if not os.path.exists(d):
        return (
            f"nvme_dir {d!r} does not exist: give a directory on your NVMe disk (create it there first: mkdir -p "
            f"{d}, if that path is on the NVMe drive)"
        )
    return None
