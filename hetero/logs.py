"""hetero's log lines once per job, not once per rank: a filter on hetero's loggers that lets rank 0 speak.

[Note: one rank speaks]
Under `torchrun --nproc_per_node 8` every rank runs the same code, so a line the library logs (a config note, an
fp16 overflow, a pipeline balance) came out eight times. `RankFilter` passes every record on the job's rank 0 and,
on the other ranks, only what rank 0 cannot say for them: records at ERROR and above, and records marked as about
this rank alone (`log.warning(..., extra={"all_ranks": True})`: its own disk, its own failed move, a peer it waits
for). `HETERO_LOG_RANKS` shows more: `all`, or a list of world ranks (`0,3`, `4-7`); the lines of a rank other than 0
then begin with `[rank N] `, so interleaved lines say who spoke.

The rank is the world rank hetero/comm hands over once a process group is wrapped (`set_world_rank`), before that
the launcher's RANK (torchrun, or hetero/comm/launchers.py for SLURM / MPI); a process with neither is rank 0. The
filter reads a module variable and the environment at log time: no collective, no call into the group.

A logger's filters see only the records logged through that logger, not those its children pass up to their
parents' handlers, so the filter sits on `hetero` and on each of hetero's loggers (`LOGGERS`), made here if a lazily
imported module has not made it yet; tests/test_logs.py checks that every `getLogger("hetero...")` in hetero is one
of them.
"""

from __future__ import annotations

import logging
import os

from hetero.errors import ConfigError

ENV = "HETERO_LOG_RANKS"
# What a call passes as `extra` to mark a record as about this rank alone, shown on every rank.
ALL_RANKS = "all_ranks"
# Every logger hetero's modules use; tests/test_logs.py checks the sources against it.
LOGGERS = (
    "hetero",
    "hetero.activation",
    "hetero.checkpoint",
    "hetero.comm",
    "hetero.config",
    "hetero.engine",
    "hetero.integrations",
    "hetero.io.hugepages",
    "hetero.memory",
    "hetero.memory.chunk_size",
    "hetero.memory.lanes",
    "hetero.memory.nvme",
    "hetero.metrics",
    "hetero.parallel",
    "hetero.profiler",
    "hetero.zero",
)

_world_rank: int | None = None  # set once a process group is wrapped (hetero/comm); None: the launcher's RANK
_parsed: tuple[str, frozenset[int] | None] = ("", frozenset({0}))  # the last HETERO_LOG_RANKS read, and its ranks


def set_world_rank(rank: int | None) -> None:
    """This process's rank in the job, from hetero/comm once it knows it (None: back to the environment's RANK).
    Also where a malformed HETERO_LOG_RANKS is refused, once, rather than at a log call."""
    global _world_rank
    shown_ranks(os.environ.get(ENV, ""))
    _world_rank = rank


def world_rank() -> int:
    """The rank the filter speaks for: the one hetero/comm set, else RANK, else 0."""
    if _world_rank is not None:
        return _world_rank
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0  # a launcher's malformed RANK is init_from_env's error to raise, not a log call's


def shown_ranks(value: str) -> frozenset[int] | None:
    """The ranks whose every line is shown, from HETERO_LOG_RANKS's `value` (None: all of them)."""
    text = value.strip().lower()
    if not text:
        return frozenset({0})
    if text == "all":
        return None
    ranks: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            first, last = -1, -2
        if not 0 <= first <= last:
            raise ConfigError(
                f"{ENV}={value!r}: {part.strip()!r} is not a rank or a range of ranks; set it to 'all', or to world "
                "ranks and ranges separated by commas (eg '0,3' or '4-7'), or unset it to see rank 0's lines only"
            )
        ranks.update(range(first, last + 1))
    return frozenset(ranks)


def _shown() -> frozenset[int] | None:
    global _parsed
    value = os.environ.get(ENV, "")
    if value != _parsed[0]:
        try:
            _parsed = (value, shown_ranks(value))
        except ConfigError:
            _parsed = (value, None)  # refused at the world's setup; a log call shows every rank rather than hide any
    return _parsed[1]


class RankFilter(logging.Filter):
    """Pass a record on a shown rank (rank 0 by default), at ERROR and above, or marked `extra={"all_ranks": True}`;
    prefix `[rank N] ` to those a rank other than 0 passes. See [Note: one rank speaks]."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = world_rank()
        shown = _shown()
        if not (
            (shown is None or rank in shown) or record.levelno >= logging.ERROR or getattr(record, ALL_RANKS, False)
        ):
            return False
        if rank != 0 and not getattr(record, "hetero_rank_prefixed", False):
            record.msg = f"[rank {rank}] {record.msg}"  # getMessage formats str(msg) % args: the same with a prefix
            record.hetero_rank_prefixed = True  # a record handled twice (a queue's listener) is prefixed once
        return True


FILTER = RankFilter()


def install() -> None:
    """Put the filter on every logger of hetero (idempotent: a logger holds a filter once)."""
    for name in LOGGERS:
        logging.getLogger(name).addFilter(FILTER)


install()  # once per process, at hetero's import
