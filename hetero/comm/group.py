"""One process group: the collectives and point-to-point transfers hetero uses, with NCCL's rules and timeouts.

A :class:`Comm` wraps one process group. A world of size 1 needs no group at all: then every operation is a
no-op or a local copy and no ``torch.distributed`` function is called, so single-process training works with
``torch.distributed`` uninitialised (or even unavailable).

Ranks given to and returned by a :class:`Comm` are ranks *within its group*; they are translated to the global
ranks ``torch.distributed`` wants where it wants them, so code written against a subgroup reads the same as
code written against the world.

[Note: data and control groups]
NCCL moves device memory only. Bulk data (chunks, gradients, activations) goes through the group itself, on device
tensors; small host-side messages (flags, scalar sums, checksums, pickled objects, the collective schedule's
checks) go through `comm.control`, a gloo group over the same ranks, so they neither need a device copy nor a
device synchronisation. On gloo the control group is the group itself, except under the CPU stand-in
(`HETERO_STANDIN=1`), which makes it a separate group and holds the data group to NCCL's rule, so that a host
tensor sent through the data group fails on a CPU as it would on a GPU (see [Note: the CPU stand-in]).

Every blocking operation waits at most the group's timeout (`comm_timeout`); on expiry the error names the operation
and the ranks that did not arrive ([Note: naming the rank that did not arrive], `watch.py`). NCCL's data operations
stay asynchronous on the device: their timeout is NCCL's own watchdog, and each collective of the chunk protocol is
preceded by a check on the control group, which does time out with that error.
"""

from __future__ import annotations

import datetime
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from hetero import standin
from hetero.comm.handles import AllOf, CopyBack, Done, Handle, ThenDivide, Timed
from hetero.comm.watch import diagnose
from hetero.errors import CommError, RankTimeoutError

logger = logging.getLogger("hetero.comm")

_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class Rules:
    """How a group's operations behave; subgroups made by `split` inherit them."""

    timeout_s: float | None = None  # bound on every blocking operation; None: the process group's own timeout
    device_only: Callable[[torch.Tensor], str | None] | None = None  # why a data tensor is refused, or None
    separate_control: bool = False  # small host messages go through a gloo group of their own


def _cuda_only(t: torch.Tensor) -> str | None:
    return None if t.is_cuda else f"a {t.device.type} tensor: NCCL takes CUDA tensors only"


def rules_for(backend: str, timeout_s: float | None) -> Rules:
    """NCCL's rules for an NCCL group; under the stand-in, the same rules for gloo."""
    if backend == "nccl":
        return Rules(timeout_s=timeout_s, device_only=_cuda_only, separate_control=True)
    if standin.active():
        return Rules(timeout_s=timeout_s, device_only=standin.collective_rule, separate_control=True)
    return Rules(timeout_s=timeout_s)


# The control group made for each process group, so that wrapping the same group twice (Comm.world() again) does
# not make a second one: groups are made collectively and live as long as the job.
_CONTROL_OF: dict[Any, Any] = {}
# The rules init_from_env chose for the world, reused by Comm.world() and inherited by every split.
_WORLD_RULES: list[Rules] = [Rules()]


def _world_rules(backend: str) -> Rules:
    """The world's rules: those init_from_env chose, else the backend's own."""
    chosen = _WORLD_RULES[0]
    return rules_for(backend, chosen.timeout_s)


def set_world_rules(rules: Rules) -> None:
    """Called once by init_from_env: the rules (timeout, device rule) of the world it joined."""
    _WORLD_RULES[0] = rules


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


def _timed_out(err: BaseException) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def _peer_gone(err: BaseException) -> bool:
    text = str(err).lower()
    return any(s in text for s in ("connection closed", "connection reset", "broken pipe", "socket closed"))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share storage (conservatively: the same storage at all)."""
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


class Comm:
    """One process group, or a world of size 1 with no group at all (``group=None``)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, rules: Rules | None = None) -> None:
        self.group = group
        self._control: Comm | None = None  # see [Note: data and control groups]; None: this group itself
        # Probed on first use: whether the backend has the single-tensor reduce_scatter / all_gather.
        self._native_rs: bool | None = None
        self._native_ag: bool | None = None
        if group is None:
            self.rank, self.size = 0, 1
            self._global_ranks = [0]
            self._backend = "none"
            self.rules = Rules()
            return
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise CommError("this process is not a member of the process group it was given")
        self.size = dist.get_world_size(group)
        self._global_ranks = list(dist.get_process_group_ranks(group))
        self._backend = str(dist.get_backend(group))
        self.rules = rules if rules is not None else rules_for(self._backend, _WORLD_RULES[0].timeout_s)
        if self.rules.separate_control and self.size > 1:
            control = _CONTROL_OF.get(group)
            if control is None:
                # Made when the group is first wrapped, which every member does at the same point of the program.
                control = dist.new_group(
                    ranks=self._global_ranks,
                    backend="gloo",
                    timeout=self._timedelta(),
                    use_local_synchronization=self.size != dist.get_world_size(),
                )
                _CONTROL_OF[group] = control
            self._control = Comm(control, rules=Rules(timeout_s=self.rules.timeout_s))

    @classmethod
    def world(cls) -> Comm:
        """The default group, or a size-1 Comm when ``torch.distributed`` is not initialised."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.group.WORLD, rules=_world_rules(str(dist.get_backend())))
        return cls()

    @property
    def control(self) -> Comm:
        """The group for small host-side messages: see [Note: data and control groups]."""
        return self._control if self._control is not None else self

    @property
    def needs_device_tensors(self) -> bool:
        """Whether data collectives take device memory only (NCCL, or the stand-in)."""
        return self.rules.device_only is not None

    def with_timeout(self, timeout_s: float | None) -> Comm:
        """The same group (and control group), with every blocking operation bounded by `timeout_s` seconds."""
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s = {timeout_s} must be positive seconds (or None for the group's own)")
        other = object.__new__(Comm)
        other.__dict__.update(self.__dict__)
        other.rules = replace(self.rules, timeout_s=timeout_s)
        if self._control is not None:
            other._control = self._control.with_timeout(timeout_s)
        return other

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

    def _timedelta(self) -> datetime.timedelta | None:
        t = self.rules.timeout_s
        return None if t is None else datetime.timedelta(seconds=t)

    def _check_data(self, op: str, *tensors: torch.Tensor) -> None:
        """NCCL's rule (and the stand-in's): data operations take device memory only."""
        rule = self.rules.device_only
        if rule is None or self._local:
            return
        for t in tensors:
            why = rule(t)
            if why is not None:
                raise CommError(
                    f"{op} on group {self._global_ranks} was given {why} (shape {tuple(t.shape)}, {t.dtype}). "
                    "Put bulk data on the device first; send small host-side values through comm.control"
                )

    def _wait(self, work: Any, what: str) -> None:
        """Wait for a backend's work, bounded by the group's timeout; see [Note: naming the rank that did not
        arrive]. NCCL's work is left to the device stream (and NCCL's watchdog)."""
        if work is None:
            return
        timeout = self._timedelta()
        if timeout is None or self._backend == "nccl":
            work.wait()
            return
        try:
            ok = work.wait(timeout=timeout)
        except RuntimeError as err:
            if not (_timed_out(err) or _peer_gone(err)):
                raise
            raise self.timeout_error(what, err) from err
        if ok is False:
            raise self.timeout_error(what, RuntimeError("the wait gave up"))

    def timeout_error(self, what: str, err: BaseException) -> Exception:
        """The error for `what` not completing in time on this group, naming the ranks that did not arrive."""
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:
            store = None
        desc = f"{what} on group {self._global_ranks}"
        me = self._global_ranks[self.rank]
        timeout_s = self.rules.timeout_s or 0.0
        return diagnose(store, me=me, members=self._global_ranks, what=desc, timeout_s=timeout_s, err=err)

    def _run(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """A blocking operation: started asynchronously, then waited for with the group's timeout."""
        self._wait(fn(*args, group=self.group, async_op=True, **kwargs), what)

    def _check_peer(self, r: int, name: str, *, allow_self: bool) -> None:
        if not isinstance(r, int) or not 0 <= r < self.size:
            raise ValueError(f"{name} = {r!r} is not a rank of this group (size {self.size})")
        if not allow_self and r == self.rank:
            raise ValueError(f"{name} = {r} is this rank itself: point-to-point needs another rank")

    # ----------------------------------------------------------------------------------------- collectives
    def _reduce_contiguous(self, t: torch.Tensor, op: str, what: str | None = None) -> None:
        what = what or f"all_reduce of {t.numel()} {t.dtype} elements"
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
                out.copy_(inp.reshape(out.shape))
                return
            self._check_data(what, out, inp)
            n = out.numel()
            src = inp.reshape(-1).contiguous()
            if self._backend != "nccl" and _overlap(src, out):
                # In place (out is our shard of inp) is what ZeRO does; only NCCL documents it as safe.
                src = src.clone()
            native_op = op if (op != "avg" or self._backend == "nccl") else "sum"
            if self._native_rs is not False:
                dst = out if out.is_contiguous() else _contiguous_like(out)
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
        if self._local or self._native_rs is False or not simple:
            self.reduce_scatter(out, inp, op, what=what)
            return Done()
        label = f"reduce_scatter of {what or f'{inp.numel()} {inp.dtype} elements'}"
        self._check_data(label, out, inp)
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
        return ThenDivide(Timed(work, self._wait, label), out, self.size if native_op != op else None)

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
            done = False
            if self._native_ag is not False:
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
        self._check_data("broadcast", t)
        with torch.no_grad():
            buf = t if t.is_contiguous() else t.contiguous()
            self._run(f"broadcast of {t.numel()} {t.dtype} elements", dist.broadcast, buf, src=self._global_ranks[src])
            if buf is not t:
                t.copy_(buf)

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Return group rank ``src``'s picklable ``obj`` on every rank (through the control group)."""
        self._check_peer(src, "src", allow_self=True)
        if self._local:
            return obj
        ctl = self.control
        box = [obj if self.rank == src else None]
        try:
            dist.broadcast_object_list(box, src=self._global_ranks[src], group=ctl.group)
        except RuntimeError as err:
            if _timed_out(err):
                raise ctl.timeout_error("broadcast_object", err) from err
            raise
        return box[0]

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's picklable ``obj``, in group rank order."""
        if self._local:
            return [obj]
        ctl = self.control
        out: list[object] = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=ctl.group)
        except RuntimeError as err:
            if _timed_out(err):
                raise ctl.timeout_error("all_gather_object", err) from err
            raise
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
        if timeout is None:
            self.control._run("barrier", dist.barrier)
            return
        td = datetime.timedelta(seconds=timeout)
        try:
            ctl = self.control
            if ctl._backend == "gloo" and hasattr(dist, "monitored_barrier"):
                dist.monitored_barrier(group=ctl.group, timeout=td, wait_all_ranks=True)
            else:
                work = dist.barrier(group=ctl.group, async_op=True)
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
        self.isend(t, dst).wait()

    def recv(self, t: torch.Tensor, src: int) -> None:
        """Receive into ``t`` from group rank ``src`` (blocking)."""
        self.irecv(t, src).wait()

    def isend(self, t: torch.Tensor, dst: int, *, tag: int = 0) -> Handle:
        """Start sending ``t`` to group rank ``dst``; do not modify ``t`` before the handle's wait(). ``tag`` pairs it
        with the receive of the same tag (gloo matches by tag; NCCL ignores tags and matches in order)."""
        self._check_p2p(dst, "dst")
        self._check_data("send", t)
        buf = t.contiguous()
        work = dist.isend(buf, dst=self._global_ranks[dst], group=self.group, tag=tag)
        timed = Timed(work, self._wait, f"send of {t.numel()} {t.dtype} elements to group rank {dst}")
        # A contiguous copy must outlive the transfer: the handle holds it until wait().
        return timed if buf is t else CopyBack(timed, buf, None)

    def irecv(self, t: torch.Tensor, src: int, *, tag: int = 0) -> Handle:
        """Start receiving into ``t`` from group rank ``src``; ``t`` holds the data once wait() returns."""
        self._check_p2p(src, "src")
        self._check_data("recv", t)
        what = f"receive of {t.numel()} {t.dtype} elements from group rank {src}"
        if t.is_contiguous():
            return Timed(dist.irecv(t, src=self._global_ranks[src], group=self.group, tag=tag), self._wait, what)
        buf = _contiguous_like(t)
        work = dist.irecv(buf, src=self._global_ranks[src], group=self.group, tag=tag)
        return CopyBack(Timed(work, self._wait, what), buf, t)

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
            self._check_data(f"batch_p2p {kind}", t)
            fn = dist.isend if kind == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, t, self._global_ranks[peer], self.group, tag))
        if not p2p:
            return []
        what = f"point-to-point group of {len(p2p)} transfers with group ranks {sorted({op[2] for op in ops})}"
        works = [Timed(w, self._wait, what) for w in dist.batch_isend_irecv(p2p)]
        if len(works) == len(p2p):
            return works
        whole = AllOf(works)  # a coalesced group returns fewer handles than operations
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
        timeout = self._timedelta()
        control = self.rules.separate_control

        def make(part: list[int], local: bool) -> Any:
            pg = dist.new_group(ranks=part, timeout=timeout, use_local_synchronization=local)
            if control and len(part) > 1:  # its control group, made at once, in the same order on every rank
                ctl = dist.new_group(ranks=part, timeout=timeout, backend="gloo", use_local_synchronization=local)
                if me in part:
                    _CONTROL_OF[pg] = ctl
            return pg

        if self.size == dist.get_world_size():
            # new_group must be entered by every process of the job, for every new group, in the same order.
            for part in parts:
                pg = make(part, local=False)
                if me in part:
                    mine = pg
        else:
            # Processes outside this group will not call us: only members of each part synchronise (the parts
            # are disjoint, which is what local synchronisation needs to be deadlock-free).
            mine = make(parts[seen[self.rank]], local=True)
        logger.debug("split %s into %s", self._global_ranks, parts)
        return Comm(mine, rules=self.rules)

    new_subgroups = split
