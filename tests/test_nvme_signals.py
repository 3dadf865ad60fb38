"""The NVMe tier's swap directories when a scheduler ends the run: SIGTERM while the main thread is blocked in a C
call (a collective waiting on a peer), followed by SIGKILL after the grace period, and the next start in the same
nvme_dir right after a SIGKILL ([Note: swap directories removed on SIGTERM] in hetero/memory/swap_sigterm.py,
[Note: swap directories left by a killed process] in hetero/memory/swap_file.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hetero.memory import swap_file
from hetero.memory.nvme import NvmeStore
from hetero.memory.swap_file import ORPHAN_AGE_S, PREFIX

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE_S = 5.0  # a scheduler's grace between SIGTERM and SIGKILL (Slurm's and Kubernetes' 30 s, scaled down)
BLOCK_S = 20 * GRACE_S  # how long the main thread stays in its C call: well past the grace, so SIGKILL ends it
START_S = 120.0  # the child's import of torch and its first store, on a loaded 2-core machine


def _swap_dirs(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(PREFIX))


def _start(code: str, parent, *args: str) -> tuple[subprocess.Popen, str]:
    """A child running `code`; returns it and the first line it prints (its swap directory), once printed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), str(parent), *args],
        stdin=subprocess.PIPE,  # a child waiting on it lives until killed
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""},
    )
    ready, _, _ = select.select([proc.stdout], [], [], START_S)
    if not ready:
        proc.kill()
        raise AssertionError(f"the child printed nothing within {START_S} s: {proc.communicate()[1][-3000:]}")
    line = proc.stdout.readline().strip()
    if not line:
        proc.wait(timeout=START_S)
        raise AssertionError(f"the child ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
    return proc, line


# A rank whose main thread waits in C++ for a peer that never comes: on a c10d store key (what a rendezvous and a
# gloo group's setup wait on) or on a future (what a collective's work object is). Signals do not interrupt either
# wait, so Python's handler runs only when it returns, after BLOCK_S, so that a child the test failed to kill still
# ends. The directory is printed once the script's frame is on the line of its wait, and a margin later (the few
# bytecodes from there into the C call take microseconds): a SIGTERM sent before reached the interpreter in time.
_BLOCKED = """
import datetime, sys, threading, time, torch
import torch.distributed as dist
from hetero.memory.nvme import NvmeStore
s = NvmeStore(sys.argv[1], block_bytes=1 << 20)
s.write(0, torch.arange(1 << 20, dtype=torch.float32)).result()
block_s = float(sys.argv[2])
main = threading.main_thread().ident
def at(line):
    f = sys._current_frames()[main]
    while f.f_back is not None:  # the script's frame is the outermost
        f = f.f_back
    return f.f_lineno == line
def ready(line):
    while not at(line):
        time.sleep(0.01)
    time.sleep(0.5)
    print(s.directory, flush=True)
def blocked(line):
    threading.Thread(target=ready, args=(line,), daemon=True).start()
if sys.argv[3] == "store":
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    blocked(sys._getframe().f_lineno + 2)
    try:
        store.wait(["peer"], datetime.timedelta(seconds=block_s))
    except dist.DistStoreError:
        pass
else:
    peer = torch.futures.Future()
    threading.Timer(block_s, lambda: peer.set_result(None)).start()
    blocked(sys._getframe().f_lineno + 1)
    peer.wait()
"""


@pytest.mark.parametrize("wait", ["store", "future"])
def test_sigterm_ends_a_rank_blocked_in_a_c_call_at_once_and_removes_its_swap_directory(tmp_path, wait):
    """Python runs a SIGTERM handler only on the main thread, between bytecodes: a rank blocked in a collective ran
    it only once the collective returned, after the scheduler's SIGKILL, which left the swap file (tens of GB on a
    real run). A watcher thread learns of the signal at once, removes the directory, and ends the process of SIGTERM
    as the default action would have without hetero's handler: at once, not at the scheduler's SIGKILL."""
    proc, directory = _start(_BLOCKED, tmp_path, str(BLOCK_S), wait)
    try:
        assert os.path.isfile(os.path.join(directory, "swap"))
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=GRACE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The main thread was blocked for BLOCK_S: only the watcher can have ended it within the grace, of SIGTERM.
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr.read()[-3000:])
    assert _swap_dirs(tmp_path) == [], "the swap directory outlived a SIGTERM"


_KILLED = """
import sys, torch
from hetero.memory.nvme import NvmeStore
s = NvmeStore(sys.argv[1], block_bytes=1 << 20)
s.write(0, torch.arange(1 << 20, dtype=torch.float32)).result()
print(s.directory, flush=True)
sys.stdin.read()
"""


def test_the_next_start_right_after_a_sigkill_removes_the_killed_runs_swap_directory(tmp_path, caplog):
    """A restart right after a SIGKILL (torchrun's elastic restart, a crash loop) kept the killed run's swap file:
    only directories older than a minute were swept, so that a store being made (not yet locking its file) was
    not taken for an orphan; each restart added a swap file. A store is made under a name of its own and renamed
    once it locks its file, so an unlocked file under a store's name is an orphan at any age; one being made is
    not touched, nor a live one."""
    proc, dead = _start(_KILLED, tmp_path)
    proc.kill()
    proc.wait(timeout=START_S)
    on_disk = os.stat(os.path.join(dead, "swap")).st_blocks * 512
    assert on_disk >= 4 << 20  # the 4 MiB written, and what the file preallocated beyond
    # A store of another process caught between making its directory and locking its file: young, left alone.
    making = os.path.join(tmp_path, swap_file.making_prefix() + "x")
    os.mkdir(making)
    open(os.path.join(making, "swap"), "wb").close()
    with caplog.at_level(logging.WARNING, logger="hetero.memory.nvme"):
        live = NvmeStore(tmp_path)
    assert f"removed 1 swap directories ({on_disk / (1 << 20):.1f} MiB on disk)" in caplog.text
    assert os.path.basename(dead) in caplog.text
    try:
        t = torch.randn(1000)
        live.write(0, t).result()
        assert os.path.basename(live.directory).startswith(swap_file.dir_prefix())
        with NvmeStore(tmp_path) as fresh:
            kept = sorted(os.path.basename(d) for d in (live.directory, fresh.directory))
            assert _swap_dirs(tmp_path) == kept
        assert os.path.isdir(making)
        old = time.time() - 2 * ORPHAN_AGE_S
        os.utime(making, (old, old))  # one killed before it locked its file: swept once old
        with NvmeStore(tmp_path):
            assert not os.path.exists(making)
        out = torch.empty_like(t)
        live.read(0, out).result()
        assert torch.equal(out, t)
    finally:
        live.close()
    assert _swap_dirs(tmp_path) == []


# A program with a wakeup fd of its own (asyncio's event loop sets one): hetero keeps it, and puts nothing back
# over it when the store closes; a program without one has none again once its last store is closed.
_WAKEUP = """
import json, signal, socket, sys
from hetero.memory.nvme import NvmeStore
def current():
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
    return fd
r, w = socket.socketpair()
w.setblocking(False)
signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
with NvmeStore(sys.argv[1]):
    theirs_kept = current() == w.fileno()
theirs_after = current() == w.fileno()
signal.set_wakeup_fd(-1)
with NvmeStore(sys.argv[1]):
    ours = current() not in (-1, w.fileno())
print(json.dumps({"theirs_kept": theirs_kept, "theirs_after": theirs_after, "ours": ours, "none_after": current()}))
"""


def test_a_programs_own_wakeup_fd_is_kept(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_WAKEUP), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=START_S,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"theirs_kept": True, "theirs_after": True, "ours": True, "none_after": -1}
    assert _swap_dirs(tmp_path) == []


def test_a_directory_named_like_a_store_but_holding_other_things_is_not_swept(tmp_path):
    """A program's own directory that happens to start with the prefix (examples/train_gpt.py makes its nvme_dir as
    a `hetero-swap-` temporary directory, so a store whose nvme_dir is its parent saw it): it has no swap file of
    its own, so it was taken for a store killed before making one, and removed with the live store inside it."""
    theirs = os.path.join(tmp_path, PREFIX + "theirs")
    os.mkdir(theirs)
    with NvmeStore(theirs) as inside:
        old = time.time() - 2 * ORPHAN_AGE_S
        os.utime(theirs, (old, old))
        empty = os.path.join(tmp_path, PREFIX + "empty")  # one killed before it made its file: swept
        os.mkdir(empty)
        os.utime(empty, (old, old))
        with NvmeStore(tmp_path):
            assert os.path.isfile(inside.path) and not os.path.exists(empty)
