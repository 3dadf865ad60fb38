"""tools/fuzz_parity.py runs and reports: two cases (seed 4: stages 0-1, the optimizer on the host under the stand-in,
micro-batches and most model features), in this process's rank server. The fuzzer itself is not part of the suite
(its cases take minutes); this checks only that it still drives hetero and its reference, and agrees."""

from __future__ import annotations

import json

from tools import fuzz_parity


def test_two_cases_run_and_report(capsys, monkeypatch):
    monkeypatch.setenv("HETERO_STANDIN", "1")  # restored after: main() sets it for its ranks
    code = fuzz_parity.main(["--cases", "2", "--seed", "4", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["cases"] == 2 and report["standin"] is True, report
    assert report["agreed"] + report["refused"] == 2, report["failures"]
    assert code == 0
