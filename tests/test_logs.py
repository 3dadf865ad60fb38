"""hetero's log lines once per job: rank 0 speaks, other ranks only for themselves ([Note: one rank speaks] in
hetero/logs.py)."""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from hetero import logs
from hetero.errors import ConfigError

try:
    from tests.dist import ONLY_SEVERAL, ranks_apart, run_distributed
except ImportError:  # run from tests/
    from dist import ONLY_SEVERAL, ranks_apart, run_distributed  # type: ignore[no-redef]

HETERO = Path(__file__).resolve().parent.parent / "hetero"
SHARED = "every rank says this alike"
OWN = "this rank's own disk is full"
ERROR = "this rank failed"


class _Lines(logging.Handler):
    """What a user's handler on the root logger prints, one string a record (as `logging.basicConfig` would)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Lines]:
    handler = _Lines()
    root = logging.getLogger()
    root.addHandler(handler)
    monkeypatch.setattr(logs, "_world_rank", None)  # restored after: the test process is rank 0
    monkeypatch.delenv(logs.ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    level = root.level
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.setLevel(level)
        root.removeHandler(handler)


def _say(log: logging.Logger) -> None:
    log.warning(SHARED)
    log.warning(OWN, extra={logs.ALL_RANKS: True})
    log.error(ERROR)


def test_rank_0_says_everything_unprefixed(lines):
    logs.set_world_rank(0)
    _say(logging.getLogger("hetero.memory"))
    assert lines.lines == [f"WARNING {SHARED}", f"WARNING {OWN}", f"ERROR {ERROR}"]


def test_another_rank_says_only_its_own_lines_and_errors_with_its_rank(lines, monkeypatch):
    logs.set_world_rank(1)
    _say(logging.getLogger("hetero.memory.nvme"))
    _say(logging.getLogger("hetero"))  # the package's own logger too
    assert lines.lines == [f"WARNING [rank 1] {OWN}", f"ERROR [rank 1] {ERROR}"] * 2
    lines.lines.clear()
    logging.getLogger("hetero.zero").info("%d chunks", 3)  # formatting arguments still apply after the prefix
    monkeypatch.setenv(logs.ENV, "all")
    logging.getLogger("hetero.zero").info("%d chunks", 3)
    assert lines.lines == ["INFO [rank 1] 3 chunks"]


@pytest.mark.parametrize(
    ("value", "shown"), [("all", True), ("ALL", True), ("0,1", True), ("1", True), ("0-3", True), ("2-3, 5", False)]
)
def test_the_variable_shows_the_ranks_it_names(lines, monkeypatch, value, shown):
    monkeypatch.setenv(logs.ENV, value)
    logs.set_world_rank(1)
    logging.getLogger("hetero.parallel").warning(SHARED)
    assert lines.lines == ([f"WARNING [rank 1] {SHARED}"] if shown else [])


def test_rank_0_left_out_of_the_list_is_quiet_but_for_its_own_lines(lines, monkeypatch):
    monkeypatch.setenv(logs.ENV, "1")
    logs.set_world_rank(0)
    _say(logging.getLogger("hetero.comm"))
    assert lines.lines == [f"WARNING {OWN}", f"ERROR {ERROR}"]


def test_before_the_group_the_launchers_rank_decides(lines, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    _say(logging.getLogger("hetero.config"))
    assert lines.lines == [f"WARNING [rank 3] {OWN}", f"ERROR [rank 3] {ERROR}"]
    lines.lines.clear()
    logs.set_world_rank(0)  # the group's word over the environment's
    logging.getLogger("hetero.config").warning(SHARED)
    assert lines.lines == [f"WARNING {SHARED}"]


def test_a_record_filtered_twice_is_prefixed_once(lines):
    logs.set_world_rank(2)
    record = logging.LogRecord("hetero.zero", logging.ERROR, __file__, 1, ERROR, None, None)
    assert logs.FILTER.filter(record) and logs.FILTER.filter(record)
    assert record.getMessage() == f"[rank 2] {ERROR}"


@pytest.mark.parametrize("value", ["yes", "1,x", "3-1", "-1", "0,,1"])
def test_a_malformed_variable_is_refused_at_the_worlds_setup_and_hides_nothing_after(lines, monkeypatch, value):
    monkeypatch.setenv(logs.ENV, value)
    with pytest.raises(ConfigError, match=f"{logs.ENV}=.*'all'.*ranges separated by commas"):
        logs.set_world_rank(1)
    monkeypatch.setattr(logs, "_world_rank", 1)
    logging.getLogger("hetero.engine").warning(SHARED)
    assert lines.lines == [f"WARNING [rank 1] {SHARED}"]


def test_every_logger_of_hetero_holds_the_filter():
    """A logger's filters see only its own records: each of hetero's loggers needs the filter, those of modules
    imported lazily too (their loggers are made at hetero's import)."""
    names = set()
    for path in HETERO.rglob("*.py"):
        names.update(re.findall(r"getLogger\(\s*[\"'](hetero(?:\.\w+)*)[\"']\s*\)", path.read_text()))
    assert "hetero.comm" in names and len(names) > 5  # the search finds them
    missing = sorted(n for n in names if logs.FILTER not in logging.getLogger(n).filters)
    assert not missing, f"loggers without the rank filter: {missing}; add them to hetero.logs.LOGGERS"


class _FailingMover:
    def synchronize(self) -> None:
        raise OSError(28, "No space left on device")


def _two_ranks(rank: int, world: int) -> dict[str, list[str]]:
    from hetero.memory.prefetch import Prefetcher

    # torchrun's RANK no longer says who speaks once the group is joined: the Comm does.
    os.environ["RANK"] = "0"
    handler = _Lines()
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    log = logging.getLogger("hetero.memory")
    out = {}
    for mode in ("", "all"):
        os.environ[logs.ENV] = mode
        handler.lines.clear()
        _say(log)
        # A call site marked as this rank's own: a failed move of its partial step.
        Prefetcher(None, _FailingMover(), {}, None, Counter(), depth=0).end_partial()  # type: ignore[arg-type]
        out[mode or "default"] = list(handler.lines)
    return out


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(120)
def test_two_ranks_say_shared_lines_once_and_their_own_each():
    ranks = run_distributed(_two_ranks, 2, timeout=90)
    failed = "WARNING {}ending a partial step: a move in flight failed ([Errno 28] No space left on device)"
    said = [*ranks[0]["default"], *ranks[1]["default"]]
    assert said.count(f"WARNING {SHARED}") == 1 and not any(SHARED in line for line in ranks[1]["default"])
    assert ranks[0]["default"][:3] == [f"WARNING {SHARED}", f"WARNING {OWN}", f"ERROR {ERROR}"]
    assert ranks[1]["default"][:2] == [f"WARNING [rank 1] {OWN}", f"ERROR [rank 1] {ERROR}"]
    for r, prefix in ((0, ""), (1, "[rank 1] ")):
        assert ranks[r]["default"][-1].startswith(failed.format(prefix)), ranks[r]["default"]
    assert ranks[1]["all"][:3] == [f"WARNING [rank 1] {SHARED}", f"WARNING [rank 1] {OWN}", f"ERROR [rank 1] {ERROR}"]
    assert ranks[0]["all"] == ranks[0]["default"]
