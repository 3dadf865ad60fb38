"""Communication: the only package of hetero that touches ``torch.distributed``.

`group.py` wraps one process group (`Comm`: its control group, waits with timeouts, subgroups), with its
collectives in `collectives.py` (large CPU ones within a host by cross-memory reads, `cma.py`) and its point-to-point
transfers in `p2p.py`; `rules.py` says how a group behaves
(NCCL's rule on data tensors, timeouts), `launch.py` joins the job from the launcher's environment (`launchers.py`:
SLURM's or MPI's tasks without torchrun), `watch.py` names the ranks behind a timeout, `patience.py` waits for ranks
still at long local work (a checkpoint's writes and reads) and names those that stopped, and `handles.py` holds what
asynchronous operations return.
"""

from hetero.comm.group import Comm
from hetero.comm.handles import Handle
from hetero.comm.launch import DEFAULT_TIMEOUT_S, init_from_env, local_rank
from hetero.comm.rules import Rules, collective_failed

__all__ = ["DEFAULT_TIMEOUT_S", "Comm", "Handle", "Rules", "collective_failed", "init_from_env", "local_rank"]
