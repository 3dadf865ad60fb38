"""What the estimate CLI refuses and how it says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_an_nvme_dir_that_is_a_file_is_refused(tmp_path):
    # Its free space was read from the drive it sits on and the estimate said the layout fits; the engine refuses it.
    swap = tmp_path / "swap"
    swap.write_text("")
    tool = str(ROOT / "tools" / "estimate.py")
    cmd = [sys.executable, tool, "--params", "1e6", "--offload-optimizer", "nvme", "--nvme-dir", str(swap)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "is a file, not a directory; give a directory" in proc.stderr, proc.stderr
    cmd[-1] = str(tmp_path)
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=120).returncode == 0


def test_ranks_per_node_below_one_is_refused_by_the_function_too():
    # The CLI refused --ranks-per-node 0; hetero.estimate itself divided by it later (ZeroDivisionError).
    import hetero
    from hetero.errors import ConfigError

    with pytest.raises(ConfigError, match="ranks_per_node"):
        hetero.estimate(1_000_000, {"zero_stage": 3}, world_size=2, ranks_per_node=0, machine=False)
    assert hetero.estimate(1_000_000, {"zero_stage": 3}, world_size=2, ranks_per_node=1, machine=False).n_params
