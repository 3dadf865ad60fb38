"""A real torchrun launch: hetero.initialize joins the process group from the launcher's environment."""

import os
import subprocess
import sys

import pytest
import torch

try:
    from tests import parity
    from tests.dist import cpu_ranks_env, free_port, torchrun_failure
except ImportError:
    import parity  # type: ignore[no-redef]
    from dist import cpu_ranks_env, free_port, torchrun_failure  # type: ignore[no-redef]

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(240)
def test_torchrun_two_ranks_stage3_matches_plain_pytorch(tmp_path):
    out = tmp_path / "result.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(HERE, "torchrun_train.py"),
        str(out),
        "3",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=cpu_ranks_env(env))
    assert proc.returncode == 0, torchrun_failure(proc)
    result = torch.load(out, weights_only=True)
    result["state"] = {k: v.float() for k, v in result["state"].items()}
    parity.check(result, steps=4, rows=4)
