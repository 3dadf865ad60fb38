"""Launchers other than torchrun: join the job from SLURM's (or MPI's) environment, never train alone silently.

[Note: launchers]
torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; `hetero.comm.init_from_env` reads those.
`srun python train.py` (and `mpirun`) start one process per task without them: each would see WORLD_SIZE unset,
train as a world of its own on the first GPU, and write the same checkpoint as every other task. So when WORLD_SIZE
is unset, `adopt_launcher_env` looks for a launcher that started several tasks. SLURM's SLURM_PROCID, SLURM_NTASKS
and SLURM_LOCALID (OpenMPI's OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK, likewise) become RANK, WORLD_SIZE and
LOCAL_RANK, and the rendezvous is MASTER_ADDR:MASTER_PORT, which the job script sets (the first node of the
allocation, any free port): without them every task stops with an error that says how to set them. One task
(SLURM_NTASKS=1, e.g. `sbatch` running torchrun itself) is left alone.
The batch script itself is no task of a step: `sbatch --ntasks=4` runs it once, on the first node, with SLURM_NTASKS=4
and SLURM_PROCID=0 but none of the SLURM_STEP_* variables that `srun` sets for each task it starts. `python train.py`
there, without `srun`, became rank 0 of 4 and waited out the whole join timeout (ten minutes by default) for ranks
that nobody started; so it stops at once, saying to start the tasks with `srun` (or torchrun, or WORLD_SIZE=1 to
train as one process on purpose). `salloc`'s shell looks the same, and is told the same.
"""

from __future__ import annotations

import logging
import os

from hetero.errors import CommError

log = logging.getLogger("hetero.comm")

# launcher -> (rank, world size, local rank) variables
LAUNCHERS = {
    "SLURM": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    "OpenMPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
}
# Set by srun for each task of a step, and never in the batch script's (or salloc's) own shell.
_SLURM_STEP_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID", "SLURM_STEPID")
_SCRIPT_HINT = {
    "SLURM": 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) MASTER_PORT=29500',
    "OpenMPI": "mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500 ...",
}


def adopt_launcher_env(environ: dict[str, str] | None = None) -> str | None:
    """With WORLD_SIZE unset, set RANK, WORLD_SIZE and LOCAL_RANK from a launcher that started several tasks (see
    [Note: launchers]); returns its name, or None when there is none (or a single task). Raises CommError when the
    rendezvous address is missing."""
    env = os.environ if environ is None else environ
    if env.get("WORLD_SIZE", "").strip():
        return None
    for name, (rank_var, size_var, local_var) in LAUNCHERS.items():
        size_raw = env.get(size_var, "").strip()
        if not size_raw:
            continue
        try:
            size, rank = int(size_raw), int(env.get(rank_var, ""))
            local = int(env.get(local_var, "0") or 0)
        except ValueError:
            raise CommError(
                f"{name} launched this process but {rank_var}={env.get(rank_var)!r}, {size_var}={size_raw!r}, "
                f"{local_var}={env.get(local_var)!r} are not all integers"
            ) from None
        if size <= 1:
            return None
        if name == "SLURM" and not any(env.get(v, "").strip() for v in _SLURM_STEP_VARS):
            raise CommError(
                f"SLURM allotted {size} tasks ({size_var}={size}), but this process is the job's batch script (or "
                f"salloc's shell), not a task started by srun ({', '.join(_SLURM_STEP_VARS)} are not set): it would "
                f"wait for {size - 1} ranks that nobody starts. Start the tasks with `srun python ...` in the job "
                "script (with MASTER_ADDR and MASTER_PORT exported), or run torchrun under srun, one per node; to "
                "train as one process on purpose, set WORLD_SIZE=1"
            )
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not env.get(v, "").strip()]
        if missing:
            raise CommError(
                f"{name} started {size} tasks ({size_var}={size}) without torchrun, and {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set: each task would train alone. Set the rendezvous in "
                f"the job script ({_SCRIPT_HINT[name]}), or start torchrun once per node"
            )
        env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = str(rank), str(size), str(local)
        log.info("joining from %s: rank %d of %d (local rank %d)", name, rank, size, local)
        return name
    return None
