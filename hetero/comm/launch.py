"""Joining the job's process group from the launcher's environment (torchrun's variables)."""

from __future__ import annotations

import datetime
import logging
import os

import torch.distributed as dist

from hetero.comm import leaving
from hetero.comm.group import Comm
from hetero.comm.launchers import adopt_launcher_env
from hetero.comm.rules import rules_for, set_world_rules
from hetero.device import gpu_count, select_gpu
from hetero.errors import CommError

logger = logging.getLogger("hetero.comm")

DEFAULT_TIMEOUT_S = 600.0  # a collective that does not complete in 10 minutes is a hang, not a slow step


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
    try:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=td)
    except (RuntimeError, ValueError) as err:
        raise CommError(
            f"rank {rank} of {world_size} could not join the {backend} process group at "
            f"{os.environ['MASTER_ADDR']}:{port} within {timeout_s} s: {err}"
        ) from err
    set_world_rules(rules_for(backend, timeout_s))
    # The group we joined is ours to leave, at exit: [Note: leaving together], [Note: letting the groups go].
    leaving.joined()
    logger.info("joined %s process group: rank %d of %d (local rank %d)", backend, rank, world_size, lrank)
    return Comm.world()
