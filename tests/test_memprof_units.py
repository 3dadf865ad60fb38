"""Durations printed for people (hetero/profiler/durations.py): a tiny model's predicted step in `--recommend` reads
`378 µs`, not `0.000 s`; the estimator's and planner's numbers are not changed, only how they are printed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from hetero.profiler.durations import format_seconds

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0 s"),
        (1234.5, "1234 s"),
        (12.345, "12.3 s"),
        (1.0, "1.00 s"),
        (0.9996, "1.00 s"),  # rounded up into the next unit
        (0.5, "500 ms"),
        (0.0123, "12.3 ms"),
        (0.000789, "789 µs"),
        (0.00099996, "1.00 ms"),
        (4.2e-6, "4.20 µs"),
        (1.2e-9, "1.20 ns"),
        (-0.002, "-2.00 ms"),
    ],
)
def test_format_seconds(seconds, text):
    assert format_seconds(seconds) == text


def _estimate_main():
    spec = importlib.util.spec_from_file_location("estimate_tool", ROOT / "tools" / "estimate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.timeout(300)
def test_recommend_prints_a_tiny_models_step_in_its_own_unit(capsys):
    machine = ["--device-memory", "80GiB", "--host-memory", "1TiB", "--nvme-space", "4TiB"]
    assert _estimate_main()(["--params", "1e5", "--recommend", "--world-size", "2", "--top", "3", *machine]) == 0
    out = capsys.readouterr().out
    steps = re.findall(r"^\s+\d+\.\s+(\S+ \S+)\s", out, flags=re.M)
    assert len(steps) == 3, out
    for step in steps:  # a step of this model takes well under a millisecond on an H100 node
        assert re.fullmatch(r"\d+(\.\d+)? µs", step), step
    assert "0.000 s" not in out
    terms = [line for line in out.splitlines() if line.startswith("       device ")]
    assert terms and all("e-0" not in line for line in terms)  # the cost model's terms too: `compute 293 µs`
    assert re.search(r"compute \d+(\.\d+)? µs", terms[0]), terms[0]
