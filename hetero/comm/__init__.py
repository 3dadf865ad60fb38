"""Communication: the only package of hetero that touches ``torch.distributed``.

`group.py` wraps one process group (`Comm`: collectives, point-to-point, subgroups, NCCL's rules, timeouts),
`launch.py` joins the job from the launcher's environment, `watch.py` names the ranks behind a timeout, and
`handles.py` holds what asynchronous operations return.
"""

from hetero.comm.group import Comm, Rules
from hetero.comm.handles import Handle
from hetero.comm.launch import DEFAULT_TIMEOUT_S, init_from_env, local_rank

__all__ = ["DEFAULT_TIMEOUT_S", "Comm", "Handle", "Rules", "init_from_env", "local_rank"]
