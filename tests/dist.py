"""Harness for multi-process tests on gloo/CPU, shared by the whole test suite.

``run_distributed(fn, world_size, ...)`` starts one process per rank, joins them into a process group through
``hetero.comm.init_from_env`` (so the real launcher path is what tests exercise), runs ``fn(rank, world_size,
*args, **kwargs)`` on each and returns the ranks' return values in rank order. A rank costs a fork and its test
module's import ([Note: ranks forked from a server]); a test still checks many things in one call rather than
starting ranks per check.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import subprocess
import time
import traceback
from collections.abc import Callable
from typing import Any

from tests import hf_float64

hf_float64.install()  # in the fork server and in spawned ranks: [Note: float64 references keep their loss in float64]

# [Note: ranks forked from a server]
# A spawned rank imports torch, hetero and its test module afresh: 3.5-4 CPU-seconds each on this project's 2-core
# VMs, for each of the suite's hundreds of ranks. Ranks are forked instead from multiprocessing's fork server, a
# single-threaded process that imported torch, hetero and transformers once (`_PRELOAD`): the suite took 911 s there
# against 1257 s spawned. Fork from the test process itself would copy its torch threads and state; the server has
# neither. What a fork does not give as spawn did: the test process's environment at the time (the server's is its
# own, from its start), so each rank is handed the environment and applies it before anything reads it.
# HETERO_TEST_START=spawn restores spawn.
_START_METHOD = os.environ.get("HETERO_TEST_START", "forkserver")
# transformers 5 imports its models lazily: the first model class a rank touched cost it 3-4 CPU-seconds of imports
# (modeling_utils and what it pulls in) after the fork, so the models the tests build are preloaded too.
_HF_MODELS = [f"transformers.models.{m}.modeling_{m}" for m in ("llama", "gpt2", "mistral", "qwen2", "bert")]
_PRELOAD = ["torch", "torch.distributed", "hetero", "transformers", *_HF_MODELS, "tests.dist"]
_REPORT_GRACE_S = 1.0  # after one rank fails, how long to wait for others' errors (they often explain it)
_EXIT_GRACE_S = 5.0  # after all ranks reported, how long they get to leave before they are killed


class DistributedTestError(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""

    def __init__(self, message: str, *, errors: dict[int, str], results: dict[int, Any]) -> None:
        super().__init__(message)
        self.errors = errors  # rank -> traceback text
        self.results = results  # rank -> return value, for ranks that finished


class DistributedTimeoutError(TimeoutError):
    """The run exceeded its timeout; ``running`` are the ranks that had not finished."""

    def __init__(self, message: str, *, running: list[int], results: dict[int, Any], errors: dict[int, str]):
        super().__init__(message)
        self.running = running
        self.results = results  # rank -> return value, for ranks that finished in time
        self.errors = errors


# [Note: tests no one rank can stand for]
# Under HETERO_TESTS_ONE_RANK ([Note: a multi-rank test as one rank]) a test marked `ranks_apart(why)` is skipped
# (tests/conftest.py): its ranks are meant to differ, or it needs them to. What a GPU run as one rank then reports as
# failed is the GPU's, not the layout's. `HETERO_TESTS_ONE_RANK=gloo pytest tests` on the CPU must pass whole; a new
# test that fails there gets the mark with its reason, or a guard around the part that needs several ranks
# (`one_rank()`): the thirty-second session's run found the estimator's ZeroDivisionError that way.
NEEDS_DEGREES = "tensor or pipeline parallel: the layout needs as many ranks as its degrees"
ONE_RANK_FAULTS = "one rank fails, hangs, dies or runs late: another must see it"
RANKS_DIFFER = "ranks are given different data, budgets or layers on purpose"
OWN_BATCHES = "the reference is built from each rank's own batch"
ONLY_SEVERAL = "asserts what only several ranks do (collectives, shards, gathers, reductions)"


def ranks_apart(why: str) -> Any:
    """Mark a multi-rank test that one rank cannot stand for, saying why (one of the reasons above)."""
    import pytest

    return pytest.mark.ranks_apart(why)


def one_rank() -> bool:
    """Whether multi-rank tests run as one rank (HETERO_TESTS_ONE_RANK)."""
    return bool(os.environ.get("HETERO_TESTS_ONE_RANK"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_ranks_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for ranks launched as processes (torchrun, srun-style) that this suite runs on gloo and the CPU: with the
    GPUs hidden, also on a GPU machine, where the launcher's ranks would otherwise pick NCCL and share one GPU."""
    return {**env, "CUDA_VISIBLE_DEVICES": ""}


def run_torchrun(
    script: list[str], *, nproc: int, timeout: float, env: dict[str, str] | None = None, cwd: Any = None
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=nproc script...` on gloo and the CPU (`cpu_ranks_env`), its output
    captured.

    [Note: torchrun in tests]
    `--standalone`: the launcher's store binds a port the OS picks as it binds, where `--master_port` with a port
    `free_port` found free a moment before could be taken by then (two tests at a time, `pytest -n 2`, open many).
    On a timeout the launcher and its ranks are all killed: the ranks run in sessions of their own, and killing the
    launcher alone left them waiting for its store for the rest of the run (the stand-in suite under `-n 2` found
    four of them still there a quarter of an hour later). Raises `subprocess.TimeoutExpired` as `subprocess.run`."""
    import sys

    import psutil

    launched = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # the launcher sets them for its ranks
    base = {k: v for k, v in (env or os.environ).items() if k not in launched}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script]
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=cpu_ranks_env(base), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            for p in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun_failure(proc: Any, keep: int = 6000) -> str:
    """What a failed torchrun printed, without the launcher's own report: its traceback and per-rank table take
    the last few thousand characters and push out the failing rank's message (an abort's "terminate called ...")."""
    err = proc.stderr
    cut = err.rfind('Traceback (most recent call last):\n  File "<frozen runpy>"')
    if cut > 0:
        err = err[:cut]
    return proc.stdout[-2000:] + "\n--- stderr before torchrun's report ---\n" + err[-keep:]


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: Any,
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the test process's environment when it started the ranks, not the fork server's
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    if backend == "gloo":
        # Ranks on gloo are CPU ranks, also on a GPU machine: several ranks cannot share one GPU as NCCL ranks, and
        # the engine would put its chunks on cuda:0 for a backend that is tested here as the CPU's. Set before CUDA
        # is first touched in this process (the fork server never touches it: it only imported torch)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import torch.distributed as dist

    from hetero.comm import init_from_env

    torch.set_num_threads(1)  # several ranks share 2 cores: intra-op threads would only fight
    ok = False
    try:
        init_from_env(backend=backend, timeout_s=pg_timeout)
        value = fn(rank, world_size, *args, **kwargs)
        payload = pickle.dumps(value)  # here, so an unpicklable result is this rank's error, not a lost one
        ok = True
    except BaseException:
        payload = traceback.format_exc().encode()
    results.put((rank, ok, payload))
    if ok and dist.is_initialized():
        # Rank 0 hosts the store: leaving before the others are done with it would break them. The result is
        # reported already, so a broken group (e.g. after a timeout test) is of no concern here.
        with contextlib.suppress(Exception):
            dist.barrier()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120,
    backend: str = "gloo",
    report_grace: float = _REPORT_GRACE_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return values by rank.

    ``fn`` must be a module-level function and its arguments and return value picklable. If a rank raises,
    this raises DistributedTestError with the tracebacks of the failing ranks. If the run exceeds
    ``timeout`` seconds, all processes are killed and DistributedTimeoutError (a TimeoutError) names the
    ranks still running; the values of ranks that did finish are on its ``results``. No process outlives the
    call.
    """
    if world_size < 1:
        raise ValueError(f"world_size = {world_size} must be >= 1")
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as err:
        raise TypeError(f"fn and its arguments must be picklable (fn module-level): {err}") from err
    one_rank = os.environ.get("HETERO_TESTS_ONE_RANK")
    if one_rank:
        # [Note: a multi-rank test as one rank]
        # On a machine with one GPU no test can put two NCCL ranks on it, and gloo ranks hide the GPU: the
        # multi-rank tests would never touch CUDA there. HETERO_TESTS_ONE_RANK=nccl runs each as a single rank on
        # that backend (cuda:0), `fn(0, 1, ...)`, whose result stands for every rank's. A worker slices its data by
        # rank and world size, so one rank trains on the whole batch, which is what the plain reference does; the
        # tests that compare ranks with each other, or kill one, are skipped there ([Note: tests no one rank can
        # stand for]). `gloo` gives the same layout on the CPU, where the whole suite passes so (tools/gpu_check.sh,
        # `onegpu`, runs it on the GPU).
        backend, copies, world_size = one_rank, world_size, 1
    else:
        copies = 1
    deadline = time.monotonic() + timeout
    for attempt in range(2):
        try:
            return _run_once(fn, world_size, args, kwargs, deadline, timeout, backend, report_grace) * copies
        except DistributedTestError as err:
            # The port was free when picked but another process may have taken it since: try once more.
            busy = any("address already in use" in tb.lower() for tb in err.errors.values())
            if attempt == 0 and busy and time.monotonic() < deadline:
                continue
            raise
    raise AssertionError("unreachable")


def _run_once(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    deadline: float,
    timeout: float,
    backend: str,
    report_grace: float,
) -> list[Any]:
    ctx = mp.get_context(_START_METHOD)
    if _START_METHOD == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: once a test session
    reports = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)  # _worker hides the GPUs from gloo ranks after applying it
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, backend, timeout, args, kwargs, reports, environ),
            name=f"hetero-test-rank{rank}",
            daemon=True,  # dies with the parent if the parent is killed outright
        )
        for rank in range(world_size)
    ]
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    silent_since: dict[int, float] = {}
    try:
        # A rank unpickles `fn`, importing its module, before `_worker` runs: a module that asks CUDA
        # anything at import (a skipif on the GPU count) would see the GPU there. Hidden in the environment the
        # ranks start with, gloo ranks never see it. A fork server started here (the first call's first start) has
        # it hidden too, and every rank forked from it.
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        if backend == "gloo":
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            for p in procs:
                p.start()
        finally:
            if hidden is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = hidden
        first_error_at: float | None = None
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            if first_error_at is not None and now - first_error_at > report_grace:
                break
            if now >= deadline:
                running = [r for r in range(world_size) if r not in results and r not in errors]
                raise DistributedTimeoutError(
                    f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size}) exceeded its "
                    f"timeout of {timeout} s; ranks still running: {running}"
                    + "".join(f"\n--- rank {r} raised:\n{tb}" for r, tb in sorted(errors.items())),
                    running=running,
                    results=results,
                    errors=errors,
                )
            try:
                rank, ok, payload = reports.get(timeout=min(0.1, deadline - now))
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if r in results or r in errors or p.is_alive():
                        continue
                    # Its report may still be in the pipe: a rank is lost only if silent a while after exit.
                    if now - silent_since.setdefault(r, now) > 1.0:
                        errors[r] = (
                            f"process exited with code {p.exitcode} without reporting (killed by a signal, "
                            "os._exit, or a crash in native code)"
                        )
                        first_error_at = first_error_at or now
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload.decode(errors="replace")
                first_error_at = first_error_at or time.monotonic()
        if errors:
            raise DistributedTestError(
                f"{len(errors)} of {world_size} ranks failed in {getattr(fn, '__name__', fn)}:"
                + "".join(f"\n--- rank {r} raised:\n{tb}" for r, tb in sorted(errors.items())),
                errors=errors,
                results=results,
            )
        return [results[r] for r in range(world_size)]
    finally:
        leave_by = time.monotonic() + (_EXIT_GRACE_S if len(results) == world_size else 0.0)
        for p in procs:
            if p.pid is not None:
                p.join(max(0.0, leave_by - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join(5)
        reports.close()
        reports.cancel_join_thread()
