"""Picklable objects through a group's tensor collectives, so that their waits are the group's own.

`torch.distributed`'s object collectives wait as long as the process group was created to wait: a `Comm` made
`with_timeout(comm_timeout)` over a group that `init_process_group` created with its default (30 minutes on gloo)
would hang there for half an hour where every other collective gives up after `comm_timeout` and names the missing
rank. So an object travels as its pickled bytes in two tensor collectives of the control group (its size, then its
bytes padded to the largest), each bounded by the group's timeout like any other ([Note: naming the rank that did
not arrive] in watch.py). Pickle trusts the sender, as torch's own object collectives do: the ranks of one job.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hetero.comm.group import Comm


def _pack(obj: object) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def _unpack(data: torch.Tensor) -> object:
    return pickle.loads(data.numpy().tobytes())


def broadcast(ctl: Comm, obj: object, src: int) -> object:
    """Group rank `src`'s `obj` on every rank of the (host-side) group `ctl`."""
    data = _pack(obj) if ctl.rank == src else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
    ctl.broadcast(size, src, what="an object's size (broadcast_object)")
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    ctl.broadcast(data, src, what=f"an object of {data.numel()} bytes (broadcast_object)")
    return obj if ctl.rank == src else _unpack(data)


def all_gather(ctl: Comm, obj: object) -> list[object]:
    """Every rank's `obj` of the (host-side) group `ctl`, in group rank order."""
    data = _pack(obj)
    sizes = torch.empty(ctl.size, dtype=torch.int64)
    ctl.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), what="objects' sizes (all_gather_object)")
    width = int(sizes.max().item())
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: data.numel()] = data
    out = torch.empty(ctl.size * width, dtype=torch.uint8)
    ctl.all_gather(out, mine, what=f"objects of up to {width} bytes (all_gather_object)")
    parts = [out[r * width : r * width + n] for r, n in enumerate(sizes.tolist())]
    return [_unpack(part) for part in parts]  # this rank's too: a copy, as from torch's all_gather_object
