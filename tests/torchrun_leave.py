"""Launched by tests under torchrun: a script that ends with hetero's groups still referenced, as a training script's
module-level engine is, on one core shared with a busy process (see test_torchrun.py's leaving test)."""

import os
import sys

import torch

import hetero.comm

cpu = int(sys.argv[1])
os.sched_setaffinity(0, {cpu})  # both ranks and the busy process on one core: a gloo worker is often preempted
torch.set_num_threads(1)
COMM = hetero.comm.init_from_env()  # referenced until the interpreter's own teardown
# "user": the script also holds the group itself, which hetero cannot make it let go of
USER_GROUP = torch.distributed.group.WORLD if sys.argv[2:] == ["user"] else None
for _ in range(300):
    # A fresh tensor each time, dropped as soon as the collective returns: gloo's worker thread may then hold the
    # last reference to it, and dropping that reference needs the interpreter.
    t = torch.ones(64)
    COMM.all_reduce(t)
    assert t[0].item() == COMM.size
print("done", COMM.rank, flush=True)
