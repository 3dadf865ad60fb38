"""Launched by tests under torchrun: a script that ends with hetero's groups still referenced, as a training script's
module-level engine is, on one core shared with busy processes (see test_torchrun.py's leaving test)."""

import atexit
import os
import sys


def _workers_at_exit() -> None:
    # Registered before hetero is imported, so it runs after hetero's exit hook: by then every gloo worker thread of
    # hetero's groups must have been joined, the interpreter still running ([Note: letting the groups go]).
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    os.write(1, f"gloo workers at exit {os.environ['RANK']}: {names.count('pt_gloo_runloop')}\n".encode())


atexit.register(_workers_at_exit)

import torch  # noqa: E402

import hetero.comm  # noqa: E402

cpu = int(sys.argv[1])
os.sched_setaffinity(0, {cpu})  # both ranks and the busy processes on one core: a gloo worker is often preempted
torch.set_num_threads(1)
COMM = hetero.comm.init_from_env()  # referenced until the interpreter's own teardown
for _ in range(300):
    # A fresh tensor each time, dropped as soon as the collective returns: gloo's worker thread may then hold the
    # last reference to it, and dropping that reference needs the interpreter.
    t = torch.ones(64)
    COMM.control.all_reduce(t)  # a host tensor: the control group, a gloo group of its own under the stand-in
    assert t[0].item() == COMM.size
print("done", COMM.rank, flush=True)
