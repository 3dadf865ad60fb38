"""Collectives of a `Comm`: reductions, gathers, broadcasts, all-to-all, barriers (a mixin of `group.Comm`).

Every blocking one is started asynchronously and waited for with the group's timeout (`Comm._run`); every one on
data checks NCCL's rule first (`Comm._check_data`). See [Note: data and control groups] in `group.py`.
"""

from __future__ import annotations

import datetime
import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hetero import standin
from hetero.comm import cma, objects
from hetero.comm.handles import Done, Handle, LateGather, ThenDivide, Timed
from hetero.errors import RankTimeoutError

logger = logging.getLogger("hetero.comm")

_OPS = ("sum", "avg", "max", "min")


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


class Collectives:
    """The collectives of `Comm` (see `group.py` for the group itself)."""

    def _reduce_contiguous(self, t: torch.Tensor, op: str, what: str | None = None) -> None:
        what = what or f"all_reduce of {t.numel()} {t.dtype} elements"
        if self._cma_run(cma.start(self, "all_reduce", what, t, op=op), what):
            return
        if op == "avg" and self._backend != "nccl":
            # Only NCCL is trusted with a native AVG (gloo lacks it in many torch versions): sum, divide.
            self._run(what, dist.all_reduce, t, op=dist.ReduceOp.SUM)
            t.div_(self.size)
        else:
            self._run(what, dist.all_reduce, t, op=_reduce_op(op))

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """Reduce ``t`` across the group, in place: "sum" | "avg" | "max" | "min"."""
        _check_op(op, t)
        if self._local:
            return
        self._check_data("all_reduce", t)
        with torch.no_grad():
            if t.is_contiguous():
                self._reduce_contiguous(t, op)
            else:
                buf = t.contiguous()
                self._reduce_contiguous(buf, op)
                t.copy_(buf)

    def all_reduce_async(self, t: torch.Tensor, op: str = "sum", *, what: str | None = None) -> Handle:
        """Start an all-reduce of the contiguous ``t`` in place and return at once; ``wait()`` completes it (and
        divides, for "avg" off NCCL). Collectives run in the order issued, so ranks issuing the same sequence stay
        matched. Size 1: already done."""
        _check_op(op, t)
        if self._local:
            return Done()
        if not t.is_contiguous():
            raise ValueError("all_reduce_async needs a contiguous tensor (it reduces in place)")
        label = f"all_reduce of {what or f'{t.numel()} {t.dtype} elements'}"
        self._check_data(label, t)
        work = cma.start(self, "all_reduce", label, t, op=op)
        if work is not None:
            return Timed(work, self._wait, label, self.guarded())
        native_op = op if (op != "avg" or self._backend == "nccl") else "sum"
        with torch.no_grad():
            work = dist.all_reduce(t, op=_reduce_op(native_op), group=self.group, async_op=True)
        return ThenDivide(Timed(work, self._wait, label, self.guarded()), t, self.size if native_op != op else None)

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
        self._check_data("all_reduce_bucketed", *tensors)
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

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum", *, what: str | None = None) -> None:
        """Reduce ``inp`` across the group; rank r gets its flat elements [r*n, (r+1)*n) in ``out``.

        ``n`` is ``out``'s numel; ``out`` is filled in its logical (row-major) order. ``what`` names the data in
        errors (e.g. "gradients of chunk 3").
        """
        _check_op(op, inp)
        self._check_pair(out, inp, big=inp, small=out, what="reduce_scatter: inp")
        what = f"reduce_scatter of {what or f'{inp.numel()} {inp.dtype} elements'}"
        with torch.no_grad():
            if self._local:
                if out.data_ptr() != inp.data_ptr() or out.numel() != inp.numel():  # else in place: nothing to do
                    out.copy_(inp.reshape(out.shape))
                return
            self._check_data(what, out, inp)
            n = out.numel()
            src = inp.reshape(-1).contiguous()
            if self._backend != "nccl" and _overlap(src, out):
                # In place (out is our shard of inp) is what ZeRO does; only NCCL documents it as safe.
                src = src.clone()
            dst = out if out.is_contiguous() else _contiguous_like(out)
            if self._cma_run(cma.start(self, "reduce_scatter", what, dst.view(-1), src, op=op), what):
                if dst is not out:
                    out.copy_(dst)
                return
            native_op = op if (op != "avg" or self._backend == "nccl") else "sum"
            if self._native_rs is not False and _native_rs_op_ok(self._backend, native_op):
                fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
                try:
                    self._run(what, fn, dst.view(-1), src, op=_reduce_op(native_op))
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
            self._reduce_contiguous(buf, op, what)
            out.copy_(buf[self.rank * n : (self.rank + 1) * n].view(out.shape))

    def reduce_scatter_async(
        self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum", *, what: str | None = None
    ) -> Handle:
        """Start a reduce-scatter and return at once; ``wait()`` completes it. Collectives still run in the order
        they are issued, so ranks issuing the same sequence stay matched. Falls back to the blocking path (a handle
        that is already done) for size 1, a backend without the native operation, or overlapping or
        non-contiguous tensors."""
        _check_op(op, inp)
        self._check_pair(out, inp, big=inp, small=out, what="reduce_scatter: inp")
        simple = out.is_contiguous() and inp.is_contiguous() and not _overlap(out, inp)
        rs_op = op if (op != "avg" or self._backend == "nccl") else "sum"
        if self._local or self._native_rs is False or not simple or not _native_rs_op_ok(self._backend, rs_op):
            self.reduce_scatter(out, inp, op, what=what)
            return Done()
        label = f"reduce_scatter of {what or f'{inp.numel()} {inp.dtype} elements'}"
        self._check_data(label, out, inp)
        work = cma.start(self, "reduce_scatter", label, out.view(-1), inp.view(-1), op=op)
        if work is not None:
            return Timed(work, self._wait, label, self.guarded())
        native_op = op if (op != "avg" or self._backend == "nccl") else "sum"
        try:
            with torch.no_grad():
                fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # newer name first
                work = fn(out.view(-1), inp.view(-1), op=_reduce_op(native_op), group=self.group, async_op=True)
            self._native_rs = True
        except (RuntimeError, NotImplementedError) as err:
            if self._native_rs or not _unsupported(err):
                raise
            self._native_rs = False
            self.reduce_scatter(out, inp, op, what=what)
            return Done()
        return ThenDivide(Timed(work, self._wait, label, self.guarded()), out, self.size if native_op != op else None)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, what: str | None = None) -> None:
        """Gather every rank's ``inp`` into ``out``; rank r's lands at flat elements [r*n, (r+1)*n).

        ``n`` is ``inp``'s numel; ``out`` is filled in its logical (row-major) order. ``what`` names the data in
        errors (e.g. "parameters of chunk 3").
        """
        self._check_pair(out, inp, big=out, small=inp, what="all_gather: out")
        what = f"all_gather of {what or f'{inp.numel()} {inp.dtype} elements'}"
        with torch.no_grad():
            if self._local:
                out.copy_(inp.reshape(out.shape))
                return
            self._check_data(what, out, inp)
            src = inp.reshape(-1).contiguous()
            dst = out if out.is_contiguous() else _contiguous_like(out)
            if self._backend != "nccl" and _overlap(src, dst):
                # In place (inp is our shard of out) is what ZeRO does; only NCCL documents it as safe.
                src = src.clone()
            flat = dst.view(-1)
            done = self._cma_run(cma.start(self, "all_gather", what, flat, src), what)
            if not done and self._native_ag is not False:
                fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                try:
                    self._run(what, fn, flat, src)
                    self._native_ag = done = True
                except (RuntimeError, NotImplementedError) as err:
                    if self._native_ag or not _unsupported(err):
                        raise
                    logger.debug("%s lacks all_gather_into_tensor (%s): using all_gather", self._backend, err)
                    self._native_ag = False
            if not done:
                self._run(what, dist.all_gather, list(flat.split(src.numel())), src)
            if dst is not out:
                out.copy_(dst)

    def all_gather_async(self, out: torch.Tensor, inp: torch.Tensor, *, what: str | None = None) -> Handle:
        """Start `all_gather` and return at once; ``out`` holds the result only after ``wait()``, and ``inp`` must
        stay unchanged until then. Collectives run in the order they are issued, so ranks issuing the same sequence
        stay matched. Falls back to the blocking path (a handle already done) for size 1, a backend without the
        native operation, or overlapping or non-contiguous tensors. Under the stand-in ([Note: the CPU stand-in])
        ``out`` reads NaN until ``wait()``, and a change to ``inp`` in between fails there, as either would give
        wrong values on a GPU."""
        self._check_pair(out, inp, big=out, small=inp, what="all_gather: out")
        simple = out.is_contiguous() and inp.is_contiguous() and not _overlap(out, inp)
        if self._local or self._native_ag is False or not simple:
            self.all_gather(out, inp, what=what)
            return Done()
        label = f"all_gather of {what or f'{inp.numel()} {inp.dtype} elements'}"
        self._check_data(label, out, inp)
        work = cma.start(self, "all_gather", label, out.view(-1), inp.view(-1))
        if work is not None:
            return Timed(work, self._wait, label, self.guarded())
        strict = standin.active()
        dst = torch.empty_like(out) if strict else out
        try:
            with torch.no_grad():
                fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer name first
                work = fn(dst.view(-1), inp.view(-1), group=self.group, async_op=True)
            self._native_ag = True
        except (RuntimeError, NotImplementedError) as err:
            if self._native_ag or not _unsupported(err):
                raise
            self._native_ag = False
            self.all_gather(out, inp, what=what)
            return Done()
        if strict:
            standin.poison(out)
            return LateGather(Timed(work, self._wait, label, self.guarded()), out, dst, inp, label)
        return Timed(work, self._wait, label, self.guarded())

    def _cma_run(self, work: cma.Work | None, what: str) -> bool:
        """Wait for an operation the cross-memory transport took (as `_run` does); False where it took none."""
        if work is None:
            return False
        self.verify_checks()
        self._wait(work, what)
        return True

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

    def broadcast(self, t: torch.Tensor, src: int, *, what: str | None = None) -> None:
        """Copy group rank ``src``'s ``t`` into every rank's ``t``, in place."""
        self._check_peer(src, "src", allow_self=True)
        if self._local:
            return
        self._check_data("broadcast", t)
        with torch.no_grad():
            buf = t if t.is_contiguous() else t.contiguous()
            label = f"broadcast of {what or f'{t.numel()} {t.dtype} elements'}"
            self._run(label, dist.broadcast, buf, src=self._global_ranks[src])
            if buf is not t:
                t.copy_(buf)

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Return group rank ``src``'s picklable ``obj`` on every rank (through the control group, bounded by its
        timeout: `objects.py`)."""
        self._check_peer(src, "src", allow_self=True)
        if self._local:
            return obj
        self.verify_checks()
        return objects.broadcast(self.control, obj, src)

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's picklable ``obj``, in group rank order (through the control group, bounded by its timeout)."""
        if self._local:
            return [obj]
        self.verify_checks()
        return objects.all_gather(self.control, obj)

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
        self._check_data("all_to_all", t)
        with torch.no_grad():
            parts = torch.stack(t.detach().chunk(self.size, scatter_dim)).contiguous()
            out = torch.empty_like(parts)
            self._run(f"all_to_all of {t.numel()} {t.dtype} elements", dist.all_to_all_single, out, parts)
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
        self.refuse_if_failed("barrier")
        if self.control is not self:  # a barrier moves no data: the control group's
            self.control.barrier(timeout)
            return
        if timeout is None:
            self._run("barrier", dist.barrier)
            return
        td = datetime.timedelta(seconds=timeout)
        self.verify_checks()
        try:
            if self._backend == "gloo" and hasattr(dist, "monitored_barrier"):
                dist.monitored_barrier(group=self.group, timeout=td, wait_all_ranks=True)
            else:
                work = dist.barrier(group=self.group, async_op=True)
                if work is not None and work.wait(timeout=td) is False:
                    raise RuntimeError(f"barrier not completed within {timeout} s")
        except RuntimeError as err:
            raise self.failed_wait("barrier", self._timeout_error(err, timeout)) from err

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
