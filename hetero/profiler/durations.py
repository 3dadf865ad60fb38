"""Durations for people: seconds in the unit that shows their digits (`0.000 s` said nothing of a tiny model's step)."""

from __future__ import annotations

import math

_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))  # largest first
DIGITS = 3  # significant digits shown


def format_seconds(seconds: float) -> str:
    """`12.3 s`, `4.56 ms`, `789 µs`, `1.20 ns`: three significant digits in the largest unit the value reaches (seconds
    from 1 s up, with as many digits as it has there: `1234 s`); `0 s` for zero; negative values with a sign."""
    if not math.isfinite(seconds):
        return f"{seconds} s"
    if seconds == 0:
        return "0 s"
    if seconds < 0:
        return "-" + format_seconds(-seconds)
    for scale, unit in _UNITS:
        value = seconds / scale
        if value < 1 and scale != _UNITS[-1][0]:
            continue
        decimals = max(0, DIGITS - 1 - math.floor(math.log10(value)))
        text = f"{value:.{decimals}f}"
        if float(text) >= 1000 and scale < 1:  # rounded up into the next unit: 999.96 µs is 1.00 ms
            return format_seconds(1000 * scale)
        return f"{text} {unit}"
    raise AssertionError("unreachable: the last unit takes every value")
