"""Collective communication for hetero: the only module that touches ``torch.distributed``.

A :class:`Comm` wraps one process group. A world of size 1 needs no group at all: then every operation is a
no-op or a local copy and no ``torch.distributed`` function is called, so single-process training works with
``torch.distributed`` uninitialised (or even unavailable).

Ranks given to and returned by a :class:`Comm` are ranks *within its group*; they are translated to the global
ranks ``torch.distributed`` wants where it wants them, so code written against a subgroup reads the same as
code written against the world.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import re
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hetero.errors import CommError, RankTimeoutError
from hetero.launch import adopt_launcher_env

logger = logging.getLogger("hetero.comm")

_OPS = ("sum", "avg", "max", "min")
# The timeout given at init_from_env, reused for groups made by Comm.split so they fail as fast as the world.
_group_timeout: datetime.timedelta | None = None


class Handle(Protocol):
    """What isend / irecv return: wait() blocks until the transfer is done."""

    def wait(self) -> Any: ...


class _CopyBack:
    """Handle of a transfer through a temporary contiguous buffer; a receive copies it out on wait()."""

    def __init__(self, work: Any, buf: torch.Tensor, dest: torch.Tensor | None) -> None:
        self._work, self._buf, self._dest = work, buf, dest  # dest None: only keep buf alive (a send)

    def wait(self) -> bool:
        self._work.wait()
        if self._dest is not None:
            self._dest.copy_(self._buf)
        return True


class _AllOf:
    """One handle for several works that complete together (a coalesced group of point-to-point operations)."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        return True


class _Done:
    """Handle of an operation that already finished."""

    def wait(self) -> bool:
        return True


class _ThenDivide:
    """Handle of an asynchronous sum that becomes a mean on wait() (backends without a native AVG)."""

    def __init__(self, work: Any, out: torch.Tensor, divisor: int | None) -> None:
        self._work, self._out, self._divisor = work, out, divisor

    def wait(self) -> bool:
        self._work.wait()
        if self._divisor is not None:
            self._out.div_(self._divisor)
        return True


def _check_op(op: str, t: torch.Tensor | None = None) -> str:
    if op not in _OPS:
        raise ValueError(f"unknown reduce op {op!r}: expected one of {', '.join(_OPS)}")
    if op == "avg" and t is not None and not (t.is_floating_point() or t.is_complex()):
        raise ValueError(f"op 'avg' needs a floating point tensor, got {t.dtype} (use 'sum', then divide)")
    return op


def _reduce_op(op: str) -> Any:
    return {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.AVG,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }[op]


def _unsupported(err: BaseException) -> bool:
    """Whether a collective failed because the backend lacks it (raised before any communication)."""
    text = str(err).lower()
    return isinstance(err, NotImplementedError) or any(
        s in text for s in ("does not support", "not supported", "not implemented", "unsupported")
    )


def _native_rs_op_ok(backend: str, op: str) -> bool:
    """Whether the backend's tensor reduce-scatter honours `op`: gloo's in torch 2.4 sums whatever op it is given,
    so on gloo only "sum" takes the native path (min / max go through all_reduce)."""
    return backend != "gloo" or op == "sum"


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share storage (conservatively: the same storage at all)."""
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


class Comm:
    """One process group, or a world of size 1 with no group at all (``group=None``)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        if group is None:
            self.rank, self.size = 0, 1
            self._global_ranks = [0]
            self._backend = "none"
            return
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise CommError("this process is not a member of the process group it was given")
        self.size = dist.get_world_size(group)
        self._global_ranks = list(dist.get_process_group_ranks(group))
        self._backend = str(dist.get_backend(group))
        # Probed on first use: whether the backend has the single-tensor reduce_scatter / all_gather.
        self._native_rs: bool | None = None
        self._native_ag: bool | None = None

    @classmethod
    def world(cls) -> Comm:
        """The default group, or a size-1 Comm when ``torch.distributed`` is not initialised."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.group.WORLD)
        return cls()

    @property
    def backend(self) -> str:
        """The group's backend name ("gloo", "nccl", ...), or "none" for the group-less size-1 Comm."""
        return self._backend

    @property
    def global_ranks(self) -> list[int]:
        """Global rank of each group rank, in group rank order."""
        return list(self._global_ranks)

    def global_rank(self, group_rank: int) -> int:
        """The global rank of a rank of this group."""
        self._check_peer(group_rank, "group_rank", allow_self=True)
        return self._global_ranks[group_rank]

    def __repr__(self) -> str:
        ranks = self._global_ranks
        return f"Comm(rank={self.rank}, size={self.size}, backend={self._backend}, ranks={ranks})"

    @property
    def _local(self) -> bool:
        # A group of one has nothing to exchange: skip torch.distributed (and the group-less Comm has none).
        return self.size == 1

    def _check_peer(self, r: int, name: str, *, allow_self: bool) -> None:
        if not isinstance(r, int) or not 0 <= r < self.size:
            raise ValueError(f"{name} = {r!r} is not a rank of this group (size {self.size})")
        if not allow_self and r == self.rank:
            raise ValueError(f"{name} = {r} is this rank itself: point-to-point needs another rank")

    # ----------------------------------------------------------------------------------------- collectives
    def _reduce_contiguous(self, t: torch.Tensor, op: str) -> None:
        if op == "avg" and self._backend != "nccl":
            # Only NCCL is trusted with a native AVG (gloo lacks it in many torch versions): sum, divide.
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
            t.div_(self.size)
        else:
            dist.all_reduce(t, op=_reduce_op(op), group=self.group)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """Reduce ``t`` across the group, in place: "sum" | "avg" | "max" | "min"."""
        _check_op(op, t)
        if self._local:
            return
        with torch.no_grad():
            if t.is_contiguous():
                self._reduce_contiguous(t, op)
            else:
                buf = t.contiguous()
                self._reduce_contiguous(buf, op)
                t.copy_(buf)

    def all_reduce_bucketed(
        self, tensors: Sequence[torch.Tensor], op: str = "sum", bucket_bytes: int = 25 << 20
    ) -> None:
        """All-reduce many tensors in place with one collective per bucket of about ``bucket_bytes``.

        Tensors are flattened into buckets in order, one stream of buckets per (dtype, device) since a flat
        buffer has one dtype; a tensor larger than ``bucket_bytes`` is a bucket by itself. Every rank must
        pass tensors of the same shapes and dtypes in the same order, as for any collective.
        """
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes = {bucket_bytes} must be positive")
        for t in tensors:
            _check_op(op, t)
        _check_op(op)
        if self._local or not tensors:
            return
        buckets: list[list[torch.Tensor]] = []
        open_bucket: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
        for t in tensors:
            key = (t.dtype, t.device)
            nbytes = t.numel() * t.element_size()
            bucket, used = open_bucket.get(key, (None, 0))
            if bucket is None or used + nbytes > bucket_bytes:
                bucket, used = [], 0
                buckets.append(bucket)
            bucket.append(t)
            open_bucket[key] = (bucket, used + nbytes)
        with torch.no_grad():
            for bucket in buckets:
                if len(bucket) == 1 and bucket[0].is_contiguous():
                    self._reduce_contiguous(bucket[0], op)
                    continue
                flat = torch.cat([t.reshape(-1) for t in bucket])
                self._reduce_contiguous(flat, op)
                offset = 0
                for t in bucket:
                    t.copy_(flat[offset : offset + t.numel()].view(t.shape))
                    offset += t.numel()

    all_reduce_coalesced = all_reduce_bucketed

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum") -> None:
        """Reduce ``inp`` across the group; rank r gets its flat elements [r*n, (r+1)*n) in ``out``.

        ``n`` is ``out``'s numel; ``out`` is filled in its logical (row-major) order.
        """
        _check_op(op, inp)
        self._check_pair(out, inp, big=inp, small=out, what="reduce_scatter: inp")
        with torch.no_grad():
            if self._local:
                out.copy_(inp.reshape(out.shape))
                return
            n = out.numel()
            src = inp.reshape(-1).contiguous()
            if self._backend != "nccl" and _overlap(src, out):
                # In place (out is our shard of inp) is what ZeRO does; only NCCL documents it as safe.
                src = src.clone()
            native_op = op if (op != "avg" or self._backend == "nccl") else "sum"
            if self._native_rs is not False and _native_rs_op_ok(self._backend, native_op):
                dst = out if out.is_contiguous() else _contiguous_like(out)
                fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
                try:
                    fn(dst.view(-1), src, op=_reduce_op(native_op), group=self.group)
                    self._native_rs = True
                except (RuntimeError, NotImplementedError) as err:
                    if self._native_rs or not _unsupported(err):
                        raise
                    logger.debug("%s lacks reduce_scatter_tensor (%s): using all_reduce", self._backend, err)
                    self._native_rs = False
                else:
                    if native_op != op:
                        dst.div_(self.size)
                    if dst is not out:
                        out.copy_(dst)
                    return
            # Backends without a tensor reduce-scatter (gloo in older torch): all-reduce a copy of the whole
            # input and keep our slice. It moves size times the data, which is fine for CPU test groups.
            buf = src.clone()
            self._reduce_contiguous(buf, op)
            out.copy_(buf[self.rank * n : (self.rank + 1) * n].view(out.shape))

    def reduce_scatter_async(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum") -> Handle:
        """Start a reduce-scatter and return at once; ``wait()`` completes it. Collectives still run in the order
        they are issued, so ranks issuing the same sequence stay matched. Falls back to the blocking path (a handle
        that is already done) for size 1, a backend without the native operation, or overlapping or
        non-contiguous tensors."""
        _check_op(op, inp)
        self._check_pair(out, inp, big=inp, small=out, what="reduce_scatter: inp")
        simple = out.is_contiguous() and inp.is_contiguous() and not _overlap(out, inp)
        native_op = op if (op != "avg" or self._backend == "nccl") else "sum"
        if self._local or self._native_rs is False or not simple or not _native_rs_op_ok(self._backend, native_op):
            self.reduce_scatter(out, inp, op)
            return _Done()
        try:
            with torch.no_grad():
                fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # newer name first
                work = fn(out.view(-1), inp.view(-1), op=_reduce_op(native_op), group=self.group, async_op=True)
            self._native_rs = True
        except (RuntimeError, NotImplementedError) as err:
            if self._native_rs or not _unsupported(err):
                raise
            self._native_rs = False
            self.reduce_scatter(out, inp, op)
            return _Done()
        return _ThenDivide(work, out, self.size if native_op != op else None)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Gather every rank's ``inp`` into ``out``; rank r's lands at flat elements [r*n, (r+1)*n).

        ``n`` is ``inp``'s numel; ``out`` is filled in its logical (row-major) order.
        """
        self._check_pair(out, inp, big=out, small=inp, what="all_gather: out")
        with torch.no_grad():
            if self._local:
                out.copy_(inp.reshape(out.shape))
                return
            src = inp.reshape(-1).contiguous()
            dst = out if out.is_contiguous() else _contiguous_like(out)
            if self._backend != "nccl" and _overlap(src, dst):
                # In place (inp is our shard of out) is what ZeRO does; only NCCL documents it as safe.
                src = src.clone()
            flat = dst.view(-1)
            done = False
            if self._native_ag is not False:
                fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                try:
                    fn(flat, src, group=self.group)
                    self._native_ag = done = True
                except (RuntimeError, NotImplementedError) as err:
                    if self._native_ag or not _unsupported(err):
                        raise
                    logger.debug("%s lacks all_gather_into_tensor (%s): using all_gather", self._backend, err)
                    self._native_ag = False
            if not done:
                dist.all_gather(list(flat.split(src.numel())), src, group=self.group)
            if dst is not out:
                out.copy_(dst)

    def _check_pair(
        self, out: torch.Tensor, inp: torch.Tensor, *, big: torch.Tensor, small: torch.Tensor, what: str
    ) -> None:
        if out.dtype != inp.dtype or out.device != inp.device:
            raise ValueError(
                f"{what.split(':')[0]}: out is {out.dtype} on {out.device}, inp {inp.dtype} on {inp.device}"
            )
        if big.numel() != self.size * small.numel():
            raise ValueError(
                f"{what} has {big.numel()} elements; it must have group size ({self.size}) x {small.numel()}"
            )

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        """Copy group rank ``src``'s ``t`` into every rank's ``t``, in place."""
        self._check_peer(src, "src", allow_self=True)
        if self._local:
            return
        with torch.no_grad():
            buf = t if t.is_contiguous() else t.contiguous()
            dist.broadcast(buf, src=self._global_ranks[src], group=self.group)
            if buf is not t:
                t.copy_(buf)

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Return group rank ``src``'s picklable ``obj`` on every rank."""
        self._check_peer(src, "src", allow_self=True)
        if self._local:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=self._global_ranks[src], group=self.group)
        return box[0]

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's picklable ``obj``, in group rank order."""
        if self._local:
            return [obj]
        out: list[object] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    # Along-a-dimension collectives for tensor and sequence parallelism: out of place, every rank passes the same
    # shape. They move `dim` to the front, where the flat rank order of all_gather / reduce_scatter is the order
    # along `dim`.
    def all_gather_dim(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``t`` concatenated along ``dim`` in group rank order (a new contiguous tensor)."""
        if self._local:
            return t.detach().clone()
        front = t.detach().movedim(dim, 0).contiguous()
        out = front.new_empty((self.size * front.shape[0], *front.shape[1:]))
        self.all_gather(out, front)
        return out.movedim(0, dim).contiguous()

    def reduce_scatter_dim(self, t: torch.Tensor, dim: int, op: str = "sum") -> torch.Tensor:
        """``t`` reduced across ranks, then cut into ``size`` equal parts along ``dim``: rank r gets part r."""
        if t.shape[dim] % self.size:
            raise ValueError(
                f"reduce_scatter_dim: dimension {dim} of shape {tuple(t.shape)} does not divide by the group size "
                f"{self.size}"
            )
        if self._local:
            return t.detach().clone()
        front = t.detach().movedim(dim, 0).contiguous()
        out = front.new_empty((front.shape[0] // self.size, *front.shape[1:]))
        self.reduce_scatter(out, front, op)
        return out.movedim(0, dim).contiguous()

    def all_to_all_dim(self, t: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Cut ``t`` into ``size`` parts along ``scatter_dim``, send part j to rank j, and concatenate the parts
        received along ``gather_dim`` in group rank order (Ulysses' re-partition of heads and sequence)."""
        if t.shape[scatter_dim] % self.size:
            raise ValueError(
                f"all_to_all_dim: dimension {scatter_dim} of shape {tuple(t.shape)} does not divide by the group "
                f"size {self.size}"
            )
        if self._local:
            return t.detach().clone()
        with torch.no_grad():
            parts = torch.stack(t.detach().chunk(self.size, scatter_dim)).contiguous()
            out = torch.empty_like(parts)
            dist.all_to_all_single(out, parts, group=self.group)
            return torch.cat(list(out.unbind(0)), dim=gather_dim)

    def barrier(self, timeout: float | None = None) -> None:
        """Wait for every rank of the group; with ``timeout`` (s), raise RankTimeoutError instead of hanging.

        On gloo the timed barrier is ``monitored_barrier``: group rank 0 learns which ranks did not arrive and
        names them; the other ranks only learn that rank 0 gave up. After a timeout the group is unusable.
        """
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout = {timeout} must be positive seconds (or None for the group's own)")
        if self._local:
            return
        if timeout is None:
            dist.barrier(group=self.group)
            return
        td = datetime.timedelta(seconds=timeout)
        try:
            if self._backend == "gloo" and hasattr(dist, "monitored_barrier"):
                dist.monitored_barrier(group=self.group, timeout=td, wait_all_ranks=True)
            else:
                work = dist.barrier(group=self.group, async_op=True)
                if work is not None and work.wait(timeout=td) is False:
                    raise RuntimeError(f"barrier not completed within {timeout} s")
        except RuntimeError as err:
            raise self._timeout_error(err, timeout) from err

    def _timeout_error(self, err: BaseException, timeout: float) -> RankTimeoutError:
        me = self._global_ranks[self.rank]
        found = re.search(r"Ranks? ([\d,\s]+) failed to pass monitoredBarrier", str(err))
        if found:
            missing = [self._global_ranks[int(r)] for r in re.findall(r"\d+", found.group(1))]
            msg = (
                f"barrier timed out after {timeout} s on global rank {me}: global rank(s) "
                f"{', '.join(map(str, missing))} did not arrive. Check that those processes are alive (a "
                "crash or an out-of-memory kill shows in their logs or exit codes), are not stuck in a long "
                f"step, and run the same sequence of collectives as the others. ({err})"
            )
            return RankTimeoutError(msg, missing_ranks=missing, timeout_s=timeout)
        monitor = self._global_ranks[0]
        msg = (
            f"barrier failed after up to {timeout} s on global rank {me}: some rank of the group did not "
            f"arrive or died. Global rank {monitor} (the group's rank 0) names the missing ranks in its "
            f"error; check its logs, then those ranks' logs. ({err})"
        )
        return RankTimeoutError(msg, missing_ranks=None, timeout_s=timeout)

    # ------------------------------------------------------------------------------------- point-to-point
    def send(self, t: torch.Tensor, dst: int) -> None:
        """Send ``t`` to group rank ``dst`` (blocking)."""
        self._check_p2p(dst, "dst")
        dist.send(t.contiguous(), dst=self._global_ranks[dst], group=self.group)

    def recv(self, t: torch.Tensor, src: int) -> None:
        """Receive into ``t`` from group rank ``src`` (blocking)."""
        self._check_p2p(src, "src")
        buf = t if t.is_contiguous() else _contiguous_like(t)
        dist.recv(buf, src=self._global_ranks[src], group=self.group)
        if buf is not t:
            t.copy_(buf)

    def isend(self, t: torch.Tensor, dst: int, *, tag: int = 0) -> Handle:
        """Start sending ``t`` to group rank ``dst``; do not modify ``t`` before the handle's wait(). ``tag`` pairs it
        with the receive of the same tag (gloo matches by tag; NCCL ignores tags and matches in order)."""
        self._check_p2p(dst, "dst")
        buf = t.contiguous()
        work = dist.isend(buf, dst=self._global_ranks[dst], group=self.group, tag=tag)
        # A contiguous copy must outlive the transfer: the handle holds it until wait().
        return work if buf is t else _CopyBack(work, buf, None)

    def irecv(self, t: torch.Tensor, src: int, *, tag: int = 0) -> Handle:
        """Start receiving into ``t`` from group rank ``src``; ``t`` holds the data once wait() returns."""
        self._check_p2p(src, "src")
        if t.is_contiguous():
            return dist.irecv(t, src=self._global_ranks[src], group=self.group, tag=tag)
        buf = _contiguous_like(t)
        return _CopyBack(dist.irecv(buf, src=self._global_ranks[src], group=self.group, tag=tag), buf, t)

    def batch_p2p(self, ops: Sequence[tuple[str, torch.Tensor, int, int]]) -> list[Handle]:
        """Start sends and receives together: ``ops`` are ("send" | "recv", contiguous tensor, group rank, tag).

        NCCL runs them as one group, so a send and a receive between the same two ranks cannot wait on each other
        (each rank's point-to-point operations share one stream); other backends issue them one by one. Returns one
        handle per operation, in order (on NCCL each stands for the whole group, which completes as one)."""
        p2p = []
        for kind, t, peer, tag in ops:
            self._check_p2p(peer, "peer")
            if kind not in ("send", "recv") or not t.is_contiguous():
                raise ValueError(f"batch_p2p: expected ('send' | 'recv', a contiguous tensor, ...), got {kind!r}")
            fn = dist.isend if kind == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, t, self._global_ranks[peer], self.group, tag))
        if not p2p:
            return []
        works = list(dist.batch_isend_irecv(p2p))
        if len(works) == len(p2p):
            return works
        whole = _AllOf(works)  # a coalesced group returns fewer handles than operations
        return [whole] * len(p2p)

    def _check_p2p(self, peer: int, name: str) -> None:
        if self.size == 1:
            raise CommError(f"point-to-point {name} = {peer}: a group of size 1 has no other rank")
        self._check_peer(peer, name, allow_self=False)

    # ------------------------------------------------------------------------------------------ subgroups
    def split(self, ranks_list: Sequence[Sequence[int]]) -> Comm:
        """Partition this group; every rank of it calls with the same full partition and gets its own part.

        Ranks are ranks of this group. Within a part, group ranks follow ascending global rank (torch sorts).
        """
        seen: dict[int, int] = {}
        for gi, ranks in enumerate(ranks_list):
            if len(ranks) == 0:
                raise ValueError(f"ranks_list[{gi}] is empty: every part of the partition needs a rank")
            for r in ranks:
                self._check_peer(r, f"ranks_list[{gi}] member", allow_self=True)
                if r in seen:
                    raise ValueError(
                        f"rank {r} is in ranks_list[{seen[r]}] and ranks_list[{gi}]: parts must not overlap"
                    )
                seen[r] = gi
        if len(seen) != self.size:
            absent = sorted(set(range(self.size)) - set(seen))
            raise ValueError(f"ranks_list must cover every rank of the group; missing {absent}")
        if self.size == 1:
            return self
        parts = [sorted(self._global_ranks[r] for r in ranks) for ranks in ranks_list]
        me = self._global_ranks[self.rank]
        mine: dist.ProcessGroup | None = None
        if self.size == dist.get_world_size():
            # new_group must be entered by every process of the job, for every new group, in the same order.
            for part in parts:
                pg = dist.new_group(ranks=part, timeout=_group_timeout)
                if me in part:
                    mine = pg
        else:
            # Processes outside this group will not call us: only members of each part synchronise (the parts
            # are disjoint, which is what local synchronisation needs to be deadlock-free).
            part = parts[seen[self.rank]]
            mine = dist.new_group(ranks=part, timeout=_group_timeout, use_local_synchronization=True)
        logger.debug("split %s into %s", self._global_ranks, parts)
        return Comm(mine)

    new_subgroups = split


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


def init_from_env(*, backend: str | None = None, timeout_s: float = 600) -> Comm:
    """Join the process group described by torchrun's environment variables and return the world Comm.

    If ``torch.distributed`` is already initialised, that group is used as is. WORLD_SIZE unset or 1 gives a
    size-1 Comm with no group, unless SLURM or MPI started several tasks: then their variables say where this
    process is (``hetero.launch``, [Note: launchers]). ``backend`` defaults to "nccl" with CUDA, else "gloo".
    ``timeout_s`` bounds every collective, so a dead or hung rank ends in an error instead of a hang.
    """
    global _group_timeout
    if timeout_s <= 0:
        raise ValueError(f"timeout_s = {timeout_s} must be positive")
    if dist.is_available() and dist.is_initialized():
        return Comm.world()
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
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise CommError("backend 'nccl' needs CUDA, which is not available; use backend='gloo'")
        if "LOCAL_RANK" not in os.environ:
            # Without it every rank would pick GPU 0; torchrun always sets it.
            raise CommError("environment variable LOCAL_RANK is not set; nccl needs it to pick a GPU")
        torch.cuda.set_device(lrank)
    td = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=td)
    except (RuntimeError, ValueError) as err:
        raise CommError(
            f"rank {rank} of {world_size} could not join the {backend} process group at "
            f"{os.environ['MASTER_ADDR']}:{port} within {timeout_s} s: {err}"
        ) from err
    _group_timeout = td
    # The group we joined is ours to leave: a process that exits with it alive leaves the backend's threads to be
    # torn down by static destructors, which can abort the process ("terminate called without an active exception")
    # after the training script has finished correctly.
    atexit.register(_leave_group)
    logger.info("joined %s process group: rank %d of %d (local rank %d)", backend, rank, world_size, lrank)
    return Comm.world()


def _leave_group() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
