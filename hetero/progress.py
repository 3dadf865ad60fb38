"""Progress bars for hetero's long work: lazy initialisation, weight streaming, checkpoint save, load, consolidate
and verify.

A bar is shown only where someone watches: on rank 0, when standard error is a terminal, with the config's
`progress` true and the environment variable HETERO_PROGRESS not "0" / "false" / "off" / "no". HETERO_PROGRESS=1
shows bars even when standard error is not a terminal (a notebook, a test). The other ranks stay quiet.

[Note: progress in a log]
Where standard error is a file (a batch job's log, CI, `nohup`), a bar's redraws would fill it with carriage
returns, so none is drawn; but work that runs for minutes there said nothing at all until it ended: the planner
ranking a 70B model's layouts (`tools/estimate.py --recommend`, several minutes on a laptop), a large model's lazy
initialisation or checkpoint. Rank 0 (config and environment as above) writes one plain line every `LOG_EVERY_S`
seconds of such work instead (done / total, the share, the time taken and an estimate of what is left), and one
when it ends if it wrote any: work shorter than that, every test's included, writes nothing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

_ENV = "HETERO_PROGRESS"
_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")
LOG_EVERY_S = 30.0  # [Note: progress in a log]


def enabled(*, rank: int = 0, config: bool = True) -> bool:
    """Whether this process shows progress bars."""
    env = os.environ.get(_ENV, "").strip().lower()
    if rank != 0 or not config or env in _OFF:
        return False
    if env in _ON:
        return True
    stream = sys.stderr
    return bool(getattr(stream, "isatty", None)) and stream.isatty()


def logged(*, rank: int = 0, config: bool = True) -> bool:
    """Whether this process writes progress as log lines: where it would draw bars but standard error is no
    terminal ([Note: progress in a log])."""
    env = os.environ.get(_ENV, "").strip().lower()
    return rank == 0 and config and env not in _OFF and not enabled(rank=rank, config=config)


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _amount(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:g}"
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or suffix == "TiB":
            return f"{n:.0f} {suffix}" if suffix == "B" else f"{n:.1f} {suffix}"
        n /= 1024
    return str(n)


class _Lines:
    """A bar for a log: a line every LOG_EVERY_S seconds of work, and one at its end if any ([Note: progress in a
    log])."""

    def __init__(self, total: float | None, desc: str, unit: str) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0.0
        self.postfix = ""
        self.start = self.last = time.monotonic()
        self.wrote = False

    def _line(self, now: float, end: bool = False) -> str:
        took = now - self.start
        unit = {"B": "", "it": "", "el": " elements"}.get(self.unit, f" {self.unit}s")
        done = _amount(self.n, self.unit)
        if self.total:
            share = min(self.n / self.total, 1.0)
            done += f"/{_amount(self.total, self.unit)}{unit} ({share:.0%})"
            left = took * (1 - share) / share if 0 < share < 1 and not end else None
        else:
            done += unit
            left = None
        tail = f", about {_duration(left)} left" if left is not None else ""
        more = f" [{self.postfix}]" if self.postfix else ""
        when = f"done in {_duration(took)}" if end else f"{_duration(took)} so far"
        return f"{self.desc}: {done}{more}, {when}{tail}"

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= LOG_EVERY_S:
            self.last = now
            self.wrote = True
            print(self._line(now), file=sys.stderr, flush=True)

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def close(self) -> None:
        if self.wrote:
            self.wrote = False
            print(self._line(time.monotonic(), end=True), file=sys.stderr, flush=True)

    def __enter__(self) -> _Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    """A tqdm bar (bytes scaled to KB/MB/GB with unit="B"), log lines, or a quiet stand-in (see the module
    docstring)."""
    if not enabled(rank=rank, config=config):
        return _Lines(total, desc, unit) if logged(rank=rank, config=config) else _Quiet()
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
