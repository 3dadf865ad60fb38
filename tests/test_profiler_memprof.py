"""tools/memprof.py around a script that fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_a_script_failing_before_its_engine_leaves_no_empty_folder(tmp_path):
    # The folder is made (and checked writable) before the script runs; a script that made no engine left it empty
    # when it raised (a bad nvme_dir refused by initialize, say), where one that ended normally had it removed.
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('bad arguments')\n")
    out = tmp_path / "prof"
    cmd = [sys.executable, str(ROOT / "tools" / "memprof.py"), "--out", str(out), "--", "python", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "bad arguments" in proc.stderr, proc.stderr
    assert not out.exists()


@pytest.mark.timeout(60)
def test_help_names_both_ways_to_give_the_command():
    # It runs `-- python -m package.module` as python -m would; --help named a script only.
    cmd = [sys.executable, str(ROOT / "tools" / "memprof.py"), "--help"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "-- python (SCRIPT | -m MODULE) [ARGS...]" in proc.stdout, proc.stdout
    assert "python -m mypackage.train" in proc.stdout
