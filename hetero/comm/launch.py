"""Joining the job's process group from the launcher's environment (torchrun's variables)."""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import socket
import threading
import time
from typing import Any

import torch.distributed as dist

from hetero.comm import interrupt, leaving
from hetero.comm.group import Comm
from hetero.comm.launchers import adopt_launcher_env
from hetero.comm.rules import rules_for, set_world_rules
from hetero.device import gpu_count, select_gpu
from hetero.errors import CommError

logger = logging.getLogger("hetero.comm")

DEFAULT_TIMEOUT_S = 600.0  # a collective that does not complete in 10 minutes is a hang, not a slow step

# [Note: the roll call at joining]
# torch's rendezvous trusts every process's RANK and WORLD_SIZE. A rank started twice (two terminals, a launch that
# gave two processes one RANK, a previous job still holding MASTER_PORT's store) joined or hung at random: one of the
# pair formed the group with the others, the other hung inside `init_process_group` past its timeout, or failed at its
# first collective blaming rank 0 as dead. Ranks whose WORLD_SIZE differed all joined "their" groups and met at the
# first collective, which timed out after `timeout_s` saying the ranks ran different collectives. So before the
# backend connects, each rank answers a roll call in the rendezvous store: rank 0 posts its WORLD_SIZE (the store's
# own), each rank claims its RANK with a token of its own process and compares the world size, and the last to arrive
# posts the outcome every rank waits for. A second claim of a rank or another world size posts a refusal instead, so
# that every rank still waiting raises the same CommError at once. Keys are per torchrun restart, and a process that
# joins again (after `destroy_process_group`) holds its claim already. Launch variables that every rank must share
# (`SHARED_ENV`: HETERO_CPU_TRANSPORT, which decides how a gloo group's CPU data moves) are posted with each claim:
# a rank launched with an invalid value refuses for every rank at once, and the last to arrive compares every rank's
# values and refuses, naming each rank's, where they differ (one rank on gloo beside peers on cross-memory attach
# made `Link.open` fall back to gloo for all without a word, and an invalid value raised on that rank alone after
# the backend joined, leaving its peers waiting at their first collective for the whole timeout).
# This process in its claims, made once: joining again, it holds its claim (a random tag: pids repeat in containers).
_ME = f"host {socket.gethostname()} pid {os.getpid()} ({os.urandom(4).hex()})"
_OK = "ok"
# Launch variables every rank must set alike: name -> (the value when unset, the valid values), read with the backend
# they matter for (`launch_settings`).
SHARED_ENV = {"HETERO_CPU_TRANSPORT": ("cma", ("cma", "gloo"))}
_STORE_GRACE_S = 5.0  # past the join timeout, for torch's own timeout error (raised at the timeout) to come first


def _env_int(name: str, *, required: bool) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        if required:
            raise CommError(
                f"environment variable {name} is not set; launch with torchrun (which sets RANK, WORLD_SIZE, "
                "LOCAL_RANK, MASTER_ADDR and MASTER_PORT) or set them yourself"
            )
        return None
    try:
        return int(raw)
    except ValueError:
        raise CommError(f"environment variable {name} = {raw!r} is not an integer") from None


def local_rank() -> int:
    """This process's rank on its node, from LOCAL_RANK (0 when unset)."""
    value = _env_int("LOCAL_RANK", required=False)
    if value is None:
        return 0
    if value < 0:
        raise CommError(f"environment variable LOCAL_RANK = {value} must be >= 0")
    return value


def init_from_env(*, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Comm:
    """Join the process group described by torchrun's environment variables and return the world Comm.

    If ``torch.distributed`` is already initialised, that group is used as is (with ``timeout_s`` bounding hetero's
    own waits). WORLD_SIZE unset or 1 gives a size-1 Comm with no group, unless SLURM or MPI started several tasks:
    then their variables say where this process is (`launchers.py`, [Note: launchers]). ``backend`` defaults to
    "nccl" with CUDA, else "gloo". ``timeout_s`` bounds every collective, so a dead or hung rank ends in an error
    naming it instead of a hang.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s = {timeout_s} must be positive")
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            interrupt.install(dist.get_rank())  # [Note: an interrupted rank]
        return Comm.world().with_timeout(timeout_s)
    adopt_launcher_env()  # srun / mpirun without torchrun: join their tasks, never train alone silently
    world_size = _env_int("WORLD_SIZE", required=False)
    if world_size is None or world_size == 1:
        return Comm()
    if world_size < 1:
        raise CommError(f"environment variable WORLD_SIZE = {world_size} must be >= 1")
    if not dist.is_available():
        raise CommError(f"WORLD_SIZE = {world_size} but this torch build has no torch.distributed")
    rank = _env_int("RANK", required=True)
    assert rank is not None
    if not 0 <= rank < world_size:
        raise CommError(f"environment variable RANK = {rank} must lie in [0, WORLD_SIZE = {world_size})")
    if not os.environ.get("MASTER_ADDR", "").strip():
        raise CommError("environment variable MASTER_ADDR is not set: it names rank 0's host (eg 127.0.0.1)")
    port = _env_int("MASTER_PORT", required=True)
    assert port is not None
    if not 0 < port < 65536:
        raise CommError(f"environment variable MASTER_PORT = {port} is not a TCP port (1-65535)")
    lrank = local_rank()
    if backend is None:
        backend = "nccl" if gpu_count() else "gloo"
    if backend == "nccl":
        if not gpu_count():
            raise CommError("backend 'nccl' needs CUDA, which is not available; use backend='gloo'")
        if "LOCAL_RANK" not in os.environ:
            # Without it every rank would pick GPU 0; torchrun always sets it.
            raise CommError("environment variable LOCAL_RANK is not set; nccl needs it to pick a GPU")
        select_gpu(lrank)
    td = datetime.timedelta(seconds=timeout_s)
    where = f"{os.environ['MASTER_ADDR']}:{port}"
    try:
        store = _rendezvous(rank, world_size, timeout_s, where)
        store.set_timeout(td)
        _roll_call(store, rank, world_size, timeout_s, where, settings=launch_settings(backend))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=td)
    except (RuntimeError, ValueError) as err:
        if isinstance(err, CommError):
            raise
        if "EADDRINUSE" in str(err) or os.strerror(errno.EADDRINUSE).lower() in str(err).lower():
            raise CommError(
                f"rank {rank} of {world_size} could not open the rendezvous at {where}: MASTER_PORT {port} is taken "
                "on this host (another job, or an earlier run still alive). Choose a free port, the same on every "
                f"rank ({err})"
            ) from err
        raise CommError(
            f"rank {rank} of {world_size} could not join the {backend} process group at {where} within "
            f"{timeout_s} s: {err}"
        ) from err
    set_world_rules(rules_for(backend, timeout_s))
    # The group we joined is ours to leave, at exit: [Note: leaving together], [Note: letting the groups go].
    leaving.joined()
    interrupt.install(rank)  # Ctrl-C on this rank stops it and tells the others: [Note: an interrupted rank]
    logger.info("joined %s process group: rank %d of %d (local rank %d)", backend, rank, world_size, lrank)
    return Comm.world()


def launch_settings(backend: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """This rank's values of the launch variables every rank must share (`SHARED_ENV`) that matter to `backend`:
    HETERO_CPU_TRANSPORT moves a gloo group's CPU data, and nothing of an NCCL group's."""
    env = os.environ if environ is None else environ
    if backend != "gloo":
        return {}
    return {name: env.get(name, "").strip().lower() or unset for name, (unset, _) in SHARED_ENV.items()}


# [Note: a port held by something else]
# A client of torch's TCPStore (every rank but 0, or every rank under torchrun's agent store) connects to
# MASTER_ADDR:MASTER_PORT, then waits for the store's answer to a ping with no bound at all (torch 2.13: a blocking
# `recv` in `TCPStore::ping`, whatever the store's timeout). A program that listens on the port and never speaks (a
# stale debugger, a web server's half-open socket, any listener) held the rank in `init_process_group` for ever. So the
# store is made in a thread of its own, and a join that outlives the join timeout (plus a grace, for torch's own timeout
# error to come first) is a CommError naming the port; the thread stays blocked in `recv`, a daemon that holds nothing
# of the job's, until the process ends.
def _rendezvous(rank: int, world_size: int, timeout_s: float, where: str) -> Any:
    """torch's env:// rendezvous store, or a CommError once it has taken longer than `timeout_s`: see
    [Note: a port held by something else]."""
    td = datetime.timedelta(seconds=timeout_s)
    box: dict[str, Any] = {}

    def make() -> None:
        try:
            box["store"] = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=td))[0]
        except Exception as err:  # handed to the joining thread, which raises it
            box["error"] = err

    thread = threading.Thread(target=make, name="hetero-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout_s + _STORE_GRACE_S)
    if thread.is_alive():
        raise CommError(
            f"rank {rank} of {world_size} reached {where}, but what listens there never answered as torch's store "
            f"within {timeout_s} s: MASTER_PORT is held by another program (not a torch store), or by a process that "
            "hangs. Choose a free MASTER_PORT, the same on every rank, or stop the program holding it (on "
            f"MASTER_ADDR's host, `ss -ltnp` shows it)"
        )
    if "error" in box:
        raise box["error"]
    return box["store"]


def _roll_call(
    store: Any,
    rank: int,
    world_size: int,
    timeout_s: float,
    where: str,
    me: str = _ME,
    settings: dict[str, str] | None = None,
) -> None:
    """Every rank's RANK claimed once, its WORLD_SIZE rank 0's and its `settings` (`launch_settings`) valid and
    every rank's, or a CommError on every rank still waiting: see [Note: the roll call at joining]. `me` names this
    process in the claim (its host, pid and a random tag)."""
    key = f"hetero/join/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    settings = settings or {}

    def refuse(why: str) -> CommError:
        store.compare_set(f"{key}/outcome", "", why)  # the first refusal wins; after "ok" only this rank stops
        if rank == 0:  # the store may live in this process: the others read the refusal before it goes
            _linger(store, f"{key}/read", world_size - 1, min(timeout_s, 5.0))
        return CommError(why)

    def text(value: bytes) -> str:
        return value.decode(errors="replace")

    if rank == 0:
        first = text(store.compare_set(f"{key}/world_size", "", str(world_size)))
        if first != str(world_size):
            raise refuse(
                f"rank 0 was started twice at {where}: one with WORLD_SIZE {first}, {me} with {world_size}. Stop "
                "the other job or choose another MASTER_PORT"
            )
    else:
        try:
            store.wait([f"{key}/world_size"])
        except RuntimeError as err:
            raise CommError(
                f"rank {rank} of {world_size} reached the rendezvous at {where}, but rank 0 did not join within "
                f"{timeout_s} s ({err})"
            ) from err
        first = text(store.get(f"{key}/world_size"))
        if first != str(world_size):
            raise refuse(
                f"the ranks disagree on the world size: rank 0 has WORLD_SIZE {first}, rank {rank} ({me}) has "
                f"{world_size}. Launch every rank with the same WORLD_SIZE (and RANKs 0 to WORLD_SIZE - 1)"
            )
    holder = text(store.compare_set(f"{key}/rank{rank}", "", me))
    if holder != me:
        raise refuse(
            f"rank {rank} was started twice at {where}: by {holder} and by {me}. Give every process its own RANK "
            "(torchrun does), and make sure no earlier job still uses this MASTER_ADDR:MASTER_PORT"
        )
    store.set(f"{key}/settings{rank}", json.dumps(settings, sort_keys=True))
    for name, value in settings.items():
        valid = SHARED_ENV[name][1]
        if value not in valid:
            raise refuse(
                f"{name}={value!r} on rank {rank} ({me}) is not one of {', '.join(map(repr, valid))}: launch every "
                f"rank with the same valid {name} (or none: {SHARED_ENV[name][0]!r})"
            )
    if store.add(f"{key}/arrived", 1) == world_size:
        every = [json.loads(text(store.get(f"{key}/settings{r}"))) for r in range(world_size)]
        differ = sorted({name for s in every for name in s if s.get(name) != every[0].get(name)})
        if differ:
            raise refuse(
                "the ranks were launched with different settings, which every rank must share: "
                + "; ".join(f"{name} is {_by_value([s.get(name, '(unset)') for s in every])}" for name in differ)
                + f". Launch every rank with the same {', '.join(differ)}"
            )
        store.compare_set(f"{key}/outcome", "", _OK)
    try:
        store.wait([f"{key}/outcome"])
    except RuntimeError as err:
        missing = [r for r in range(world_size) if not store.check([f"{key}/rank{r}"])]
        raise CommError(
            f"rank {rank} of {world_size}: rank(s) {_listed(missing)} did not join at {where} within {timeout_s} s. "
            f"Check that WORLD_SIZE ({world_size}) processes were started and that they reach this address ({err})"
        ) from err
    outcome = text(store.get(f"{key}/outcome"))
    if outcome != _OK:
        store.add(f"{key}/read", 1)  # rank 0 may be waiting for this before it leaves (`_linger`)
        raise CommError(f"rank {rank} of {world_size} cannot join: {outcome}")


def _linger(store: Any, key: str, count: int, limit_s: float) -> None:
    """Wait until `count` ranks have added to `key` or `limit_s` passed. Rank 0, refusing the launch, hosts the
    rendezvous store where no agent does: leaving at once reset the connections of ranks still to read why, who then
    raised "Connection reset by peer" instead of the refusal."""
    deadline = time.monotonic() + limit_s
    while store.add(key, 0) < count and time.monotonic() < deadline:
        time.sleep(0.02)


def _by_value(values: list[str]) -> str:
    """Each rank's value of one variable, grouped: "'gloo' on rank 1 and 'cma' on ranks 0, 2"."""
    ranks: dict[str, list[int]] = {}
    for r, value in enumerate(values):
        ranks.setdefault(value, []).append(r)
    return " and ".join(f"{v!r} on rank{'s' if len(rs) > 1 else ''} {_listed(rs)}" for v, rs in ranks.items())


def _listed(ranks: list[int], most: int = 16) -> str:
    shown = ", ".join(map(str, ranks[:most]))
    return shown + (f" and {len(ranks) - most} more" if len(ranks) > most else "")
