"""The NVMe tier when the disk misbehaves under a run: full in the middle of it, the swap directory deleted, a file
system turned read-only, a swap file changed by someone else, swap directories that a killed process left behind
([Note: swap directories left by a killed process] in hetero/memory/swap_file.py), and a disk that fails on one rank
of several ([Note: a rank's failure told to the others] in hetero/comm/watch.py)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hetero.errors import NvmeCorruptError, NvmeError
from hetero.memory import Tier, swap_file
from hetero.memory.nvme import NvmeStore
from hetero.memory.swap_file import ORPHAN_AGE_S, PREFIX

try:
    from tests import parity
    from tests.dist import ONE_RANK_FAULTS, ranks_apart, run_distributed
    from tests.test_manager import _bits, _filled_chunk
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    from dist import ONE_RANK_FAULTS, ranks_apart, run_distributed  # type: ignore[no-redef]
    from test_manager import _bits, _filled_chunk  # type: ignore[no-redef]

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _swap_dirs(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(PREFIX))


def _full(monkeypatch) -> None:
    """Every file system reports no free space from now on (what a full disk says to statvfs)."""
    for name in ("statvfs", "fstatvfs"):
        real = getattr(os, name)

        def empty(arg, real=real):
            st = list(real(arg))
            st[3] = st[4] = 0  # f_bfree, f_bavail
            return os.statvfs_result(st)

        monkeypatch.setattr(os, name, empty)


def test_a_full_disk_does_not_refuse_space_the_file_already_reserved(tmp_path, monkeypatch):
    """Each growth of a preallocated swap file reserves ahead; writes into that reservation need no free space. They
    were refused as soon as something else filled the disk, so a run failed with space in its own file."""
    with NvmeStore(tmp_path, block_bytes=MIB) as s:
        for key in range(5):
            s.write(key, torch.ones(MIB // 4)).result()
        if s.file_bytes < s.used_bytes + MIB:
            pytest.skip(f"no preallocation ahead on {tmp_path}'s file system")
        _full(monkeypatch)
        t = torch.arange(MIB // 4, dtype=torch.float32)
        s.write(5, t).result()  # inside the reservation
        out = torch.empty_like(t)
        s.read(5, out).result()
        assert torch.equal(out, t)


def test_a_deleted_swap_directory_leaves_the_run_going(tmp_path):
    """The open file outlives its deleted directory (a /tmp cleaner, a user's rm -rf): what was stored stays readable
    and the file still grows. Growing it asked its directory's free space and raised FileNotFoundError."""
    with NvmeStore(tmp_path, block_bytes=MIB) as s:
        a = torch.randn(MIB // 4)
        s.write(0, a).result()
        shutil.rmtree(s.directory)
        b = torch.randn(3 * MIB)  # beyond any reservation: the file must grow
        s.write(1, b).result()
        for key, want in ((0, a), (1, b)):
            out = torch.empty_like(want)
            s.read(key, out).result()
            assert torch.equal(out, want)
    assert _swap_dirs(tmp_path) == []


def test_a_read_only_file_system_says_so_and_what_to_do(tmp_path, monkeypatch):
    with NvmeStore(tmp_path, direct=False) as s:

        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(os, "pwrite", read_only)
        with pytest.raises(NvmeError, match="became read-only.*dmesg.*writable drive") as info:
            s.write(0, torch.ones(1000)).result(timeout=10)
        assert s.path in str(info.value)


def test_a_corrupt_swap_file_names_the_chunk_and_the_file(make_manager):
    """The store speaks of keys; the manager's error names the chunk and the tensors in it, the file, and that the
    values are lost."""
    m = make_manager(nvme=True)
    c, s, bits = _filled_chunk(m, tier=Tier.NVME)
    keep, ks, kbits = _filled_chunk(m, tier=Tier.NVME)
    path = m.storage.store.path
    with open(path, "r+b") as f:  # the first chunk's slot is the file's first
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 0xFF]))
    with pytest.raises(NvmeCorruptError) as info:
        m.access(c, Tier.HOST)
    msg = str(info.value)
    assert c.describe() in msg and s.name in msg and path in msg and "checksum mismatch" in msg
    assert "restart from the last checkpoint" in msg
    assert c.tier is Tier.NVME  # no half-read chunk passes as valid
    m.access(keep, Tier.HOST)  # another chunk is intact
    assert torch.equal(_bits(keep, ks), kbits)


def test_a_truncated_swap_file_names_the_chunk(make_manager):
    m = make_manager(nvme=True)
    c, _, _ = _filled_chunk(m, tier=Tier.NVME)
    os.truncate(m.storage.store.path, 0)
    with pytest.raises(NvmeCorruptError, match=r"moving chunk \d+ \[param.*truncated.*restart from the last"):
        m.access(c, Tier.HOST)


_KILLED = """
import os, signal, sys, torch
from hetero.memory.nvme import NvmeStore
s = NvmeStore(sys.argv[1], block_bytes=1 << 20)
s.write(0, torch.ones(1 << 20)).result()
print(s.directory, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_store(parent) -> str:
    """The directory of a store whose process was SIGKILLed (no close, no finalizer), aged past the grace period."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED), str(parent)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    directory = proc.stdout.strip()
    assert os.path.getsize(os.path.join(directory, "swap")) >= 4 << 20
    old = time.time() - 2 * ORPHAN_AGE_S
    os.utime(directory, (old, old))
    return directory


def test_a_killed_process_leaves_nothing_behind_the_next_store(tmp_path):
    """SIGKILL runs no cleanup: each killed run left its swap file, and a crash loop filled the disk. The next store
    in the same directory removes what no live store holds, and nothing a live one holds, however old."""
    live = NvmeStore(tmp_path)
    try:
        t = torch.randn(1000)
        live.write(0, t).result()
        old = time.time() - 2 * ORPHAN_AGE_S
        os.utime(live.directory, (old, old))
        dead = [_killed_store(tmp_path) for _ in range(2)]
        young = os.path.join(tmp_path, PREFIX + "being-made")  # a store just made, its file not locked yet
        os.mkdir(young)
        with NvmeStore(tmp_path) as fresh:
            assert _swap_dirs(tmp_path) == sorted(os.path.basename(d) for d in (live.directory, fresh.directory, young))
        assert not any(os.path.exists(d) for d in dead)
        out = torch.empty_like(t)
        live.read(0, out).result()
        assert torch.equal(out, t)
    finally:
        live.close()


def test_on_a_shared_file_system_a_store_removes_only_its_own_machines_orphans(tmp_path, monkeypatch):
    """An nvme_dir on NFS mounted nolock (Lustre localflock, BeeGFS by default) shared by two machines: a lock stays on
    the machine that took it, so the other machine's live store looked unlocked from here and its directory was
    removed under it. A store here removes only the orphans named for this machine; the rest wait for their own."""
    old = time.time() - 2 * ORPHAN_AGE_S
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    live = NvmeStore(tmp_path)  # node a's, in use
    try:
        t = torch.randn(1000)
        live.write(0, t).result()
        os.utime(live.directory, (old, old))
        monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
        # Node b's view: the file system is a network one, and node a's lock does not reach it.
        monkeypatch.setattr(swap_file, "shared_file_system", lambda path: "nfs", raising=False)
        monkeypatch.setattr(swap_file.fcntl, "flock", lambda fd, op: None)
        dead = [
            os.path.join(tmp_path, f"{PREFIX}{name}") for name in ("node_b-k1lled00", "node_bb-k1lled00", "0ld0name")
        ]
        for d in dead:
            os.mkdir(d)
            open(os.path.join(d, "swap"), "wb").close()
            os.utime(d, (old, old))
        with NvmeStore(tmp_path) as fresh:
            out = torch.empty_like(t)
            live.read(0, out).result()
            assert torch.equal(out, t) and os.path.isfile(live.path), "node a's live swap file was removed"
            assert os.path.basename(fresh.directory).startswith(f"{PREFIX}node_b-")
            kept = sorted(os.path.basename(d) for d in (live.directory, fresh.directory, *dead[1:]))
            assert _swap_dirs(tmp_path) == kept  # node b's orphan went; another machine's and an unnamed one stay
    finally:
        live.close()


# A rank ended by SIGTERM, with a store made on the main thread and one on another, and two children forked from it
# (one ended by SIGTERM, one exiting normally) before: each child inherits the handler and the stores' finalizers.
_TERMINATED = """
import json, os, signal, sys, threading, time, torch
from hetero.memory.nvme import NvmeStore
s = NvmeStore(sys.argv[1], block_bytes=1 << 20)
t = torch.arange(1 << 18, dtype=torch.float32)
s.write(0, t).result()
other = []
threading.Thread(target=lambda: other.append(NvmeStore(sys.argv[1], block_bytes=1 << 20))).start()
time.sleep(0.5)
children = []
for end in ("term", "exit"):
    pid = os.fork()
    if pid == 0:
        if end == "term":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        sys.exit(0)  # runs the finalizers it inherited
    children.append(os.waitpid(pid, 0)[1])
out = torch.empty_like(t)
s.read(0, out).result()
dirs = [s.directory, other[0].directory]
there = all(os.path.isfile(os.path.join(d, "swap")) for d in dirs)
print(json.dumps({"dirs": dirs, "children": children, "kept": torch.equal(out, t) and there}))
sys.stdout.flush()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
"""

# A program with a SIGTERM handler of its own (one that saves a checkpoint on preemption): it runs, the store stays.
_CHAINED = """
import json, os, signal, sys, torch
from hetero.memory.nvme import NvmeStore
got = []
mine = lambda signum, frame: got.append(signum)
signal.signal(signal.SIGTERM, mine)
s = NvmeStore(sys.argv[1], block_bytes=1 << 20)
t = torch.arange(1 << 18, dtype=torch.float32)
s.write(0, t).result()
os.kill(os.getpid(), signal.SIGTERM)
out = torch.empty_like(t)
s.read(0, out).result()
there = os.path.isdir(s.directory)
s.close()
back = signal.getsignal(signal.SIGTERM) is mine
print(json.dumps({"got": got, "kept": torch.equal(out, t), "dir": there, "mine_back": back}))
"""


def _script(code: str, parent) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(parent)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""},
    )


def test_a_rank_ended_by_sigterm_removes_its_swap_directories(tmp_path):
    """SIGTERM (a scheduler's, torchrun's once another rank failed) ended the process with no cleanup: its swap file
    stayed until the next store in nvme_dir, a minute later at the earliest. Now it removes this process's swap
    directories, the one made off the main thread too, and the process still dies of SIGTERM; a child forked from it
    removes none of them, whether SIGTERM or a normal exit ends it (its inherited finalizer deleted the parent's live
    directory: [Note: swap directories removed on SIGTERM])."""
    proc = _script(_TERMINATED, tmp_path)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr[-3000:])
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["kept"], "a forked child's end removed the parent's live swap file"
    term, exit_ = out["children"]
    assert os.WIFSIGNALED(term) and os.WTERMSIG(term) == signal.SIGTERM and os.WEXITSTATUS(exit_) == 0
    assert all(os.path.isabs(d) and d.startswith(str(tmp_path)) for d in out["dirs"])
    assert _swap_dirs(tmp_path) == []


def test_sigterm_runs_the_programs_own_handler_and_keeps_the_store(tmp_path):
    """A handler installed before the store (to checkpoint on preemption) runs, and the process lives on with its
    swap file; the last store's close puts that handler back."""
    proc = _script(_CHAINED, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"got": [signal.SIGTERM], "kept": True, "dir": True, "mine_back": True}
    assert _swap_dirs(tmp_path) == []


def test_a_budget_given_counts_the_space_a_killed_run_left(tmp_path, monkeypatch):
    """A run killed outright (SIGKILL, or a launcher's SIGTERM once another rank failed) leaves its preallocated swap
    file, which the next store removes. But a given nvme_budget was checked against the free space before that: the
    restart failed with 'nvme_budget is more than the free space', the killed run's own file filling the disk."""
    from hetero.device import make_device
    from hetero.errors import ConfigError
    from hetero.memory.budgets import check_budgets

    dead = _killed_store(tmp_path)

    def held() -> int:  # bytes the files under tmp_path take on disk
        return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(tmp_path) for f in fs)

    disk = held() + 2 * MIB  # a disk holding only the killed run's file and 2 MiB free beside it
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(disk, held(), disk - held()))
    with pytest.raises(ConfigError, match="more than"):  # more than the whole disk: still refused
        check_budgets(
            make_device("cpu"), device_budget=None, host_budget=None, nvme_dir=str(tmp_path), nvme_budget=2 * disk
        )
    check_budgets(
        make_device("cpu"), device_budget=None, host_budget=None, nvme_dir=str(tmp_path), nvme_budget=disk - MIB
    )
    assert not os.path.exists(dead)


COMM_TIMEOUT = 120.0  # the ranks waiting for the failed one must stop long before this
STOPS_WITHIN_S = 10.0  # a look every POLL_S (1 s), with room for a loaded machine


def _digest(root: str) -> dict[str, int]:
    """Every file under a checkpoint root, with its size and modification time."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(d, f))
            out[os.path.relpath(os.path.join(d, f), root)] = (st.st_size, st.st_mtime_ns)
    return out


def _one_disk_fails(rank: int, world: int, root: str) -> dict:
    import hetero
    from hetero.errors import NvmeSpaceError, RankFailedError
    from hetero.memory import swap_blocks

    nvme = os.path.join(root, f"nvme{rank}")
    os.makedirs(nvme)
    model = parity.build()
    config = {
        "zero_stage": 3,
        "chunk_size": parity.CHUNK,
        "offload": {"optimizer": "nvme"},
        "memory": {"nvme_dir": nvme},
        "comm_timeout": COMM_TIMEOUT,
    }
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    ckpt = os.path.join(root, "ckpt")
    out: dict = {}

    def step(x, y):
        engine.backward(engine(x, labels=y).loss)
        engine.step()

    data = parity.batches(3, 4)
    step(*(t[rank * 2 : rank * 2 + 2] for t in data[0]))
    engine.save_checkpoint(ckpt)
    saved = _digest(ckpt)
    if rank == 1:  # only this rank's disk fills up, in the middle of the next update's write-backs
        real = swap_blocks.write_full

        def full(*args, **kwargs):
            out.setdefault("failed_at", time.time())
            raise OSError(errno.ENOSPC, "No space left on device")

        swap_blocks.write_full = full
    try:
        for x, y in data[1:]:
            step(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2])
    except (NvmeSpaceError, RankFailedError) as e:
        out.update(raised_at=time.time(), error=e, message=str(e))
    if rank == 1:
        swap_blocks.write_full = real
        # Alive, its process and connections open, until rank 0 is done: a rank that exits is seen by its closed
        # connection instead, which is not what this test is about.
        flag = os.path.join(root, "rank0-done")
        deadline = time.monotonic() + COMM_TIMEOUT
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)
        return {k: (type(v).__name__ if k == "error" else v) for k, v in out.items()}
    try:
        t0 = time.monotonic()
        engine.save_checkpoint(ckpt)  # a save after the failure: refused at once, the saved checkpoint untouched
    except RankFailedError as e:
        out.update(save_error=str(e), save_seconds=time.monotonic() - t0)
    out["saved_intact"] = _digest(ckpt).items() >= saved.items()
    open(os.path.join(root, "rank0-done"), "w").close()
    error = out.pop("error", None)
    out.update(type=type(error).__name__, failed_rank=getattr(error, "failed_rank", None))
    out["cause"] = getattr(error, "cause", None)
    return out


@ranks_apart(ONE_RANK_FAULTS)
def test_a_full_disk_on_one_rank_stops_every_rank_at_once_with_its_cause(tmp_path):
    """Rank 1's NVMe disk fills up in an update; rank 1 raises NvmeSpaceError. Rank 0 was already waiting in a
    collective of the update for rank 1: it waited comm_timeout (ten minutes by default), then said that rank 1 did
    not arrive, never why. Now rank 1 posts its error and rank 0 stops within seconds with RankFailedError, naming
    rank 1 and the full disk; a save attempted after it is refused at once, and the checkpoint saved before stands."""
    r0, r1 = run_distributed(_one_disk_fails, 2, str(tmp_path), timeout=COMM_TIMEOUT * 0.75)
    assert r1["error"] == "NvmeSpaceError" and "No space left on device" in r1["message"]
    assert r0["type"] == "RankFailedError", r0
    assert r0["failed_rank"] == 1 and r0["cause"].startswith("NvmeSpaceError: ") and "nvme1" in r0["cause"]
    msg = r0["message"]
    assert "global rank 1 failed with NvmeSpaceError" in msg and "No space left on device" in msg, msg
    assert "is full (" in msg and "resume from the last checkpoint" in msg, msg
    waited = r0["raised_at"] - r1["failed_at"]
    assert waited < STOPS_WITHIN_S, f"rank 0 stopped {waited:.1f} s after rank 1's disk failed"
    assert "global rank 1" in r0["save_error"] and r0["save_seconds"] < STOPS_WITHIN_S, r0
    assert r0["saved_intact"]


class _Work:
    """A backend's work that completes `after` seconds from its making (never, for None), or fails at once with
    `error`: its wait(timeout) raises "Operation timed out!" after `timeout` as torch's does."""

    def __init__(self, after: float | None = None, error: str | None = None) -> None:
        self.end = None if after is None else time.monotonic() + after
        self.error = error

    def wait(self, timeout=None) -> bool:
        if self.error is not None:
            raise RuntimeError(self.error)
        s = timeout.total_seconds()
        left = float("inf") if self.end is None else self.end - time.monotonic()
        time.sleep(max(0.0, min(s, left)))
        if left > s:
            raise RuntimeError("Operation timed out!")
        return True


def _posted_by(store, rank: int, cause: str, origin: int | None = None) -> None:
    """What another process's `post_failure` leaves in the store."""
    from hetero.comm import watch

    n = store.add(watch._FAILED + "count", 1)
    store.set(
        f"{watch._FAILED}{n}", json.dumps({"rank": rank, "origin": rank if origin is None else origin, "cause": cause})
    )


def test_a_wait_ends_within_a_look_once_a_member_posts_its_failure_and_the_news_travels_on():
    from torch.distributed import HashStore

    from hetero.comm import watch
    from hetero.errors import RankFailedError

    store = HashStore()
    cause = "NvmeSpaceError: writing 4096 B of key 3 ... No space left on device"
    _posted_by(store, 1, cause)
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="global rank 1 failed with NvmeSpaceError: .*No space left") as info:
        watch.wait(_Work(), timeout_s=30.0, members=[0, 1], me=0, what="all_reduce", store=store)
    assert time.monotonic() - t0 < 3 * watch.POLL_S
    assert info.value.failed_rank == 1 and info.value.cause == cause
    assert "all_reduce on group [0, 1] on global rank 0" in str(info.value)
    t0 = time.monotonic()  # known now: the next wait on that group stops before it starts
    with pytest.raises(RankFailedError):
        watch.wait(_Work(), timeout_s=30.0, members=[0, 1], me=0, what="barrier", store=store)
    assert time.monotonic() - t0 < 0.5
    # Rank 0 posted that it stopped for rank 1: rank 2, which shares a group with rank 0 only, stops too, told why.
    with pytest.raises(RankFailedError, match=r"global rank 1 failed .*\(global rank\(s\) 0 stopped for it\)"):
        watch.wait(_Work(), timeout_s=30.0, members=[0, 2], me=2, what="recv", store=store)


def test_waits_on_groups_without_a_failure_are_as_before():
    from torch.distributed import HashStore

    from hetero.comm import watch

    store = HashStore()
    _posted_by(store, 5, "NvmeError: not a member of these groups")
    assert watch.wait(_Work(after=1.5 * watch.POLL_S), timeout_s=30.0, members=[0, 1], me=0, what="x", store=store)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="Operation timed out"):  # the wait's own limit: the caller diagnoses
        watch.wait(_Work(), timeout_s=1.5 * watch.POLL_S, members=[0, 1], me=0, what="x", store=store)
    assert 1.4 * watch.POLL_S < time.monotonic() - t0 < 3 * watch.POLL_S
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):  # the work's own error, at once
        watch.wait(
            _Work(error="Connection closed by peer"), timeout_s=30.0, members=[0, 1], me=0, what="x", store=store
        )
    assert time.monotonic() - t0 < 0.5


def test_a_closed_connection_and_a_patient_meeting_name_the_failed_rank_and_its_cause():
    """A rank whose process ended after its failure closes its connections: the diagnosis names its error at once,
    where it waited ten seconds for posts, then said only that a peer closed its connection. A checkpoint's meeting
    stops on the post too, where it waited comm_timeout for a heartbeat that never came."""
    from types import SimpleNamespace

    from torch.distributed import HashStore

    from hetero.comm.patience import Meeting
    from hetero.comm.watch import diagnose
    from hetero.errors import RankFailedError

    store = HashStore()
    _posted_by(store, 1, "NvmeError: reading 8192 B of key 7 ... Input/output error")
    t0 = time.monotonic()
    err = diagnose(
        store, me=0, members=[0, 1], what="all_gather", timeout_s=60.0, err=RuntimeError("Connection closed")
    )
    assert isinstance(err, RankFailedError) and err.failed_rank == 1 and "Input/output error" in str(err)
    assert time.monotonic() - t0 < 1.0
    comm = SimpleNamespace(global_ranks=[0, 1], rank=0, size=2, rules=SimpleNamespace(timeout_s=30.0))
    t0 = time.monotonic()
    left = r"global rank 1 left .*Input/output error.*finish writing"
    with pytest.raises(RankFailedError, match=left) as info, Meeting(comm, "save", "writing a checkpoint", store=store):
        pass
    assert info.value.failed_rank == 1 and time.monotonic() - t0 < 10.0


_DIES = """
import os, sys, time, torch
from hetero.comm import init_from_env
comm = init_from_env(backend="gloo", timeout_s=60)
if comm.rank == 1:
    raise ValueError("a mistake on rank 1 alone")
t0 = time.monotonic()
try:
    comm.all_reduce(torch.ones(4))
except Exception as e:
    print(f"{time.monotonic() - t0:.2f} {type(e).__name__}: {e}", flush=True)
"""


@ranks_apart(ONE_RANK_FAULTS)
def test_a_rank_that_dies_of_an_exception_is_named_with_it(tmp_path):
    """Not only a disk: a rank whose script ends in an exception posts it as it exits. The other rank, waiting for
    it, said after ten seconds that a peer closed its connection; now it names the exception at once."""
    from tests.dist import cpu_ranks_env, free_port

    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.pop("HETERO_STANDIN", None)  # CPU ranks, whose all-reduce of a host tensor the stand-in refuses as NCCL would
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_DIES)],
            env=cpu_ranks_env({**env, "RANK": str(r), "LOCAL_RANK": str(r)}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    (out, err), (_, err1) = (p.communicate(timeout=100) for p in procs)
    assert procs[1].returncode != 0 and "a mistake on rank 1 alone" in err1
    seconds, _, message = out.strip().partition(" ")
    assert message.startswith("RankFailedError: "), out + err
    assert "global rank 1 failed with ValueError: a mistake on rank 1 alone" in message, message
    assert float(seconds) < 5.0, out
