"""Progress bars for hetero's long work: lazy initialisation, weight streaming, checkpoint save, load, consolidate
and verify.

A bar is shown only where someone watches: on rank 0, when standard error is a terminal, with the config's
`progress` true and the environment variable HETERO_PROGRESS not "0" / "false" / "off" / "no". Logs, CI and the
other ranks stay quiet. HETERO_PROGRESS=1 shows bars even when standard error is not a terminal (a notebook, a
test). Elsewhere `bar()` returns a stand-in with the same `update` / `close` that does nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_ENV = "HETERO_PROGRESS"
_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


def enabled(*, rank: int = 0, config: bool = True) -> bool:
    """Whether this process shows progress bars."""
    env = os.environ.get(_ENV, "").strip().lower()
    if rank != 0 or not config or env in _OFF:
        return False
    if env in _ON:
        return True
    stream = sys.stderr
    return bool(getattr(stream, "isatty", None)) and stream.isatty()


class _Quiet:
    """A bar that shows nothing."""

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def bar(total: float | None, desc: str, *, unit: str = "it", rank: int = 0, config: bool = True) -> Any:
    """A tqdm bar (bytes scaled to KB/MB/GB with unit="B"), or a quiet stand-in (see the module docstring)."""
    if not enabled(rank=rank, config=config):
        return _Quiet()
    from tqdm.auto import tqdm

    scale = unit == "B"
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=scale,
        unit_divisor=1024 if scale else 1000,
        leave=False,
        dynamic_ncols=True,
        file=sys.stderr,
    )
