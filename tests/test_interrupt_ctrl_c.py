"""[Note: an interrupted rank] in hetero/comm/interrupt.py: SIGINT on one rank of a torchrun job, inside a forward,
ends that rank with KeyboardInterrupt (status 130, first), and the other rank says that rank 1 was interrupted, not
that the ranks ran different collectives; neither waits in the exit barrier, and no rank aborts in gloo's teardown."""

from __future__ import annotations

import os
import re
import time

import pytest

try:
    from tests.dist import ONE_RANK_FAULTS, ranks_apart, run_torchrun, torchrun_failure
except ImportError:  # tests/ itself on sys.path
    from dist import ONE_RANK_FAULTS, ranks_apart, run_torchrun, torchrun_failure  # type: ignore[no-redef]

TESTS = os.path.dirname(os.path.abspath(__file__))
LEFT_S = 25.0  # signal to the launcher's end: both ranks' teardown on a loaded 2-core machine, not a 30 s barrier

# Rank 1 sends itself SIGINT as its second layer's forward begins at step 3, while rank 0 is in its collectives.
JOB = f"""
import os, signal, sys, time
sys.path.insert(0, {TESTS!r}); sys.path.insert(0, os.path.dirname({TESTS!r}))
import torch
import parity
import hetero
from hetero.errors import CommError

marker = sys.argv[1]
torch.set_num_threads(1)
model = parity.build()
engine = hetero.initialize(model, parity.make_optimizer(model), {{"zero_stage": 3, "chunk_size": parity.CHUNK}})
rank, steps = engine.data_parallel_rank, [0]

def interrupt(module, args):
    if rank == 1 and steps[0] == 3:
        with open(marker, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGINT)

model.layers[1].register_forward_pre_hook(interrupt)
x, y = parity.batches(1, 4)[0]
try:
    while True:
        engine.backward(engine(x[2 * rank : 2 * rank + 2], labels=y[2 * rank : 2 * rank + 2]).loss)
        engine.step()
        steps[0] += 1
except KeyboardInterrupt:
    print(f"rank {{rank}}: interrupted (Ctrl-C)", file=sys.stderr)
    sys.exit(130)
except CommError as e:
    print(f"rank {{rank}}: {{type(e).__name__}}: {{e}}", file=sys.stderr)
    sys.exit(2)
"""


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(240)
def test_ctrl_c_on_one_rank_ends_it_with_130_and_the_other_says_it_was_interrupted(tmp_path):
    script, marker = tmp_path / "job.py", tmp_path / "interrupted_at"
    script.write_text(JOB)
    proc = run_torchrun([str(script), str(marker)], nproc=2, timeout=200)
    ended = time.time()
    failure = torchrun_failure(proc)
    assert proc.returncode != 0 and marker.exists(), failure
    assert "rank 1: interrupted (Ctrl-C)" in proc.stderr, failure
    told = re.search(r"rank 0: RankFailedError: .* global rank 1 was interrupted \(Ctrl-C\)", proc.stderr)
    assert told, failure
    assert "CollectiveMismatchError" not in proc.stderr and "terminate called" not in proc.stderr, failure
    # The interrupted rank left first, with its own status: torchrun names it as the failure's root cause.
    root = proc.stderr[proc.stderr.rfind("Root Cause") :]
    assert re.search(r"rank\s+: 1 .*\n\s+exitcode\s+: 130", root), root
    assert ended - float(marker.read_text()) < LEFT_S, ended - float(marker.read_text())
