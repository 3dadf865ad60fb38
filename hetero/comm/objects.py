"""Picklable objects through a group's tensor collectives, so that their waits are the group's own.

`torch.distributed`'s object collectives wait as long as the process group was created to wait: a `Comm` made
`with_timeout(comm_timeout)` over a group that `init_process_group` created with its default (30 minutes on gloo)
would hang there for half an hour where every other collective gives up after `comm_timeout` and names the missing
rank. So an object travels as its pickled bytes in two tensor collectives of the control group (its size, then its
bytes padded to the largest), each bounded by the group's timeout like any other ([Note: naming the rank that did
not arrive] in watch.py). Pickle trusts the sender, as torch's own object collectives do: the ranks of one job.

[Note: an object that cannot be pickled]
A rank whose object fails to pickle (a lambda, an open file, a lock) still takes part in both collectives: its size
goes negative and its bytes carry the pickling error's text, so every rank raises the same `CommError` naming it.
Raising on that rank alone left its peers inside the size collective, where its next object call met them: rank 0
of an all-gather returned its first object beside rank 1's second, and no rank raised at all.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING

import torch

from hetero.errors import CommError

if TYPE_CHECKING:
    from hetero.comm.group import Comm


def _pack(obj: object) -> tuple[torch.Tensor, int, BaseException | None]:
    """The bytes to send, their signed size (negative: the text of a pickling error) and that error."""
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as err:  # pickle raises TypeError, AttributeError, PicklingError, RecursionError, ...
        text = f"{type(err).__name__}: {err}".encode(errors="replace")
        return torch.frombuffer(bytearray(text), dtype=torch.uint8), -len(text), err
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), len(data), None


def _unpack(data: torch.Tensor) -> object:
    return pickle.loads(data.numpy().tobytes())


def _refuse(op: str, bad: dict[int, str], own: BaseException | None) -> CommError:
    ranks = ", ".join(map(str, bad))
    why = "; ".join(f"rank {r}: {text}" for r, text in bad.items())
    err = CommError(
        f"{op}: the object of group rank(s) {ranks} could not be pickled ({why}). Pass picklable objects (no "
        "lambdas, locks, open files or generators); every rank of the group raises this"
    )
    if own is not None:
        err.__cause__ = own
    return err


def broadcast(ctl: Comm, obj: object, src: int) -> object:
    """Group rank `src`'s `obj` on every rank of the (host-side) group `ctl`."""
    data, signed, own = _pack(obj) if ctl.rank == src else (None, 0, None)
    size = torch.tensor([signed], dtype=torch.int64)
    ctl.broadcast(size, src, what="an object's size (broadcast_object)")
    n = abs(int(size.item()))
    if data is None:
        data = torch.empty(n, dtype=torch.uint8)
    ctl.broadcast(data, src, what=f"an object of {n} bytes (broadcast_object)")
    if int(size.item()) < 0:  # see [Note: an object that cannot be pickled]
        raise _refuse("broadcast_object", {src: data.numpy().tobytes().decode(errors="replace")}, own)
    return obj if ctl.rank == src else _unpack(data)


def all_gather(ctl: Comm, obj: object) -> list[object]:
    """Every rank's `obj` of the (host-side) group `ctl`, in group rank order."""
    data, signed, own = _pack(obj)
    sizes = torch.empty(ctl.size, dtype=torch.int64)
    ctl.all_gather(sizes, torch.tensor([signed], dtype=torch.int64), what="objects' sizes (all_gather_object)")
    width = int(sizes.abs().max().item())
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: data.numel()] = data
    out = torch.empty(ctl.size * width, dtype=torch.uint8)
    ctl.all_gather(out, mine, what=f"objects of up to {width} bytes (all_gather_object)")
    parts = [out[r * width : r * width + abs(n)] for r, n in enumerate(sizes.tolist())]
    bad = {r: parts[r].numpy().tobytes().decode(errors="replace") for r, n in enumerate(sizes.tolist()) if n < 0}
    if bad:  # see [Note: an object that cannot be pickled]
        raise _refuse("all_gather_object", bad, own)
    return [_unpack(part) for part in parts]  # this rank's too: a copy, as from torch's all_gather_object
