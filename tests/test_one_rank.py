"""[Note: tests no one rank can stand for] in tests/dist.py: as one rank, a marked test is skipped with its reason;
in a normal run it runs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKED = "tests/test_tiling.py::test_auto_chunk_size_is_agreed_by_ranks_with_different_budgets"


def _setup_only(one_rank: str | None) -> str:
    """The marked test's setup alone (no ranks started), in a fresh pytest: its report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "HETERO_TESTS_ONE_RANK"}
    if one_rank:
        env["HETERO_TESTS_ONE_RANK"] = one_rank
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist", "--setup-only"]
    out = subprocess.run([*cmd, MARKED], cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode in (0, 5), out.stdout + out.stderr  # 5: "no tests ran" (set up, not run)
    return out.stdout


@pytest.mark.timeout(120)
def test_a_marked_test_is_skipped_as_one_rank_saying_why():
    report = _setup_only("gloo")
    assert "1 skipped" in report and "one rank cannot stand for several: ranks are given" in report, report


@pytest.mark.timeout(120)
def test_a_marked_test_runs_in_a_normal_run():
    report = _setup_only(None)
    assert "skipped" not in report and "SETUP" in report, report
