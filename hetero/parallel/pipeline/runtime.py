"""Execute a pipeline schedule: this rank's forwards and backwards, with activations and their gradients passed
point-to-point between neighbouring stages.

[Note: transfers]
Every transfer is a fixed-size header (micro-batch, destination virtual stage, dtype, shape) followed by the
payload, so the receiver can allocate without knowing the model; the header is checked, so a schedule whose ranks
disagree fails with a clear error instead of computing with the wrong tensor. Both carry a tag unique to the
(kind, micro-batch, virtual stage), so gloo pairs them even when activations and gradients share a link (the
interleaved schedule's ring); NCCL ignores tags and relies on the schedules' send and receive orders agreeing, which
`schedule.simulate` and the tests check. Sends are non-blocking and waited at the end of the batch (see
[Note: why these orders cannot deadlock] in schedule.py).

On NCCL a rank's transfers to one peer share a stream and a large send waits for its receive, so a send that the
schedule pairs with the next action's receive on the same link goes out with it as one group on both sides
([Note: paired transfers] in schedule.py); `schedule.check_rendezvous` proves GPipe and 1F1B deadlock-free under
that worst case. Known limit: the interleaved schedule's warm-up sends around the ring are not paired that way, so on
NCCL it could stall once activations outgrow NCCL's eager buffers: there `require_rendezvous` refuses it with a clear
error (use 1f1b or gpipe) instead of risking a hang; gloo progresses sends in the background and runs every schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hetero.comm import Comm, Handle
from hetero.errors import ConfigError, HeteroError
from hetero.parallel.pipeline.schedule import Action, build, check_rendezvous, paired
from hetero.parallel.pipeline.split import StageChunk

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_MAX_DIMS = 8
_HEADER = 4 + _MAX_DIMS  # micro-batch, virtual stage, dtype code, ndim, shape


class PipelineError(HeteroError, RuntimeError):
    """Stages disagree on what they exchange, or a stage produced something that cannot be passed on."""


@dataclass
class RunStats:
    """What one batch through the pipeline cost this rank (filled when the runtime measures)."""

    wall_s: float = 0.0  # the batch's schedule, first action to last
    wait_s: float = 0.0  # blocked in receives: the bubble, as this rank saw it
    peak_saved_bytes: int = 0  # activations saved for backward alive at once (parameters excluded)
    peak_in_flight: int = 0  # micro-batch chunks forwarded and not yet backwarded, at most at once
    actions: list[tuple[str, float, float]] = field(default_factory=list)  # (action, start, end) relative to start


def require_rendezvous(schedule: str, lists: list[list[Action]], virtual: int, backend: str) -> None:
    """On NCCL, refuse a schedule whose transfers could deadlock when sends wait for their receives (the known
    limit above) with an error that says what to use instead, rather than hang in the first batch."""
    if backend != "nccl":
        return  # gloo progresses sends in the background: every schedule runs
    try:
        check_rendezvous(lists, virtual)
    except RuntimeError as err:
        raise ConfigError(
            f"parallel.schedule: {schedule!r} with {len(lists)} stages, {virtual} virtual stages and these "
            "micro-batches can deadlock on NCCL (its warm-up sends are not paired with receives yet); use "
            '"1f1b" or "gpipe", which are proven deadlock-free there'
        ) from err


class PipelineRuntime:
    def __init__(
        self,
        chunks: list[StageChunk],
        pp: Comm,
        *,
        schedule: str,
        microbatches: int,
        virtual: int,
        device: torch.device,
    ) -> None:
        self.chunks = chunks  # this rank's model chunks; chunks[c] is virtual stage c * p + rank
        self.pp = pp
        self.p, self.v, self.m = pp.size, virtual, microbatches
        self.actions: list[Action] = build(schedule, self.p, microbatches, pp.rank, virtual)
        self.last_stage = self.p * self.v - 1
        lists = [build(schedule, self.p, microbatches, r, virtual) for r in range(self.p)]
        require_rendezvous(schedule, lists, virtual, pp.backend)
        self.paired = paired(lists, virtual)[pp.rank]  # actions whose send goes with the next receive
        self.device = device  # where received tensors are allocated
        # NCCL sets a group's communicator up at its first collective: make that one every rank takes part in.
        pp.barrier()
        self.measure = False  # fill `stats` (saved-tensor accounting costs a hook per saved tensor)
        self.stats = RunStats()

    def _stage(self, chunk: int) -> int:
        return chunk * self.p + self.pp.rank

    def run(
        self,
        inputs: list[Any],
        labels: list[Any],
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        loss_scale: float,
        after_forward: Callable[[], None],
        after_backward: Callable[[], None],
    ) -> torch.Tensor:
        """Run the batch's actions; return the sum of the micro-batches' losses (on the last stage, else 0).

        loss_scale multiplies each micro-batch's loss before its backward (1 / micro-batches, times a loss scale)."""
        saved: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}  # (chunk, micro-batch) -> (input, output)
        sends: list[tuple[Handle, torch.Tensor]] = []
        total = torch.zeros((), dtype=torch.float32)
        stats = self.stats = RunStats()
        alive: dict[tuple[int, int], int] = {}  # saved-for-backward bytes per (chunk, micro-batch), when measuring
        t0 = time.perf_counter()
        pending: tuple | None = None  # a send held for the next action's receive (schedule.paired)
        for i, a in enumerate(self.actions):
            start = time.perf_counter()
            s = self._stage(a.chunk)
            key = (a.chunk, a.microbatch)
            if a.kind == "F":
                if s == 0:
                    x = inputs[a.microbatch]
                else:
                    x = self._recv(a.microbatch, s, kind=0, src=(s - 1) % self.p, send=pending)
                    pending = None
                    if x.is_floating_point():
                        x.requires_grad_(True)
                last = s == self.last_stage
                with self._saving(alive, key):
                    y = self.chunks[a.chunk](x, labels[a.microbatch] if last and loss_fn is None else None)
                    if last:
                        y = loss_fn(y, labels[a.microbatch]) if loss_fn is not None else _loss_of(y)
                if last:
                    total += y.detach().float().cpu()
                else:
                    if not isinstance(y, torch.Tensor):
                        raise PipelineError(
                            f"virtual stage {s} returned {type(y).__name__}; a stage must return one tensor to pass "
                            "to the next (split the model where a single tensor flows between units)"
                        )
                    out = (y.detach(), a.microbatch, s + 1, 0, (s + 1) % self.p)
                    if i in self.paired:
                        pending = out
                    else:
                        sends.append(self._send(*out))
                saved[key] = (x, y)
                stats.peak_in_flight = max(stats.peak_in_flight, len(saved))
                stats.peak_saved_bytes = max(stats.peak_saved_bytes, sum(alive.values()))
                after_forward()
            else:
                x, y = saved.pop(key)
                if s == self.last_stage:
                    torch.autograd.backward(y * loss_scale)
                else:
                    g = self._recv(a.microbatch, s, kind=1, src=(s + 1) % self.p, send=pending)
                    pending = None
                    torch.autograd.backward(y, g)
                alive.pop(key, None)
                if s > 0:
                    gx = x.grad if x.grad is not None else torch.zeros_like(x)
                    out = (gx, a.microbatch, s - 1, 1, (s - 1) % self.p)
                    if i in self.paired:
                        pending = out
                    else:
                        sends.append(self._send(*out))
                del x, y
                after_backward()
            if self.measure:
                stats.actions.append((repr(a), start - t0, time.perf_counter() - t0))
        assert pending is None, "a paired send outlived the schedule"  # paired() never pairs the last action
        for handle, _ in sends:
            handle.wait()
        stats.wall_s = time.perf_counter() - t0
        return total

    # ---- transfers ------------------------------------------------------------------------------------------
    def _tag(self, kind: int, microbatch: int, stage: int) -> int:
        return (microbatch * (self.last_stage + 1) + stage) * 2 + kind

    def _message(self, t: torch.Tensor, microbatch: int, stage: int, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The header (on the payload's device: NCCL reads GPU memory only) and the contiguous payload."""
        if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
            raise PipelineError(f"cannot pass a {t.dtype} tensor of {t.dim()} dims between stages")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[:4] = torch.tensor([microbatch, stage, _DTYPES.index(t.dtype), t.dim()])
        header[4 : 4 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        return header.to(t.device), t.contiguous()

    def _send(self, t: torch.Tensor, microbatch: int, stage: int, kind: int, dst: int) -> tuple[Handle, Any]:
        header, payload = self._message(t, microbatch, stage, kind)
        tag = self._tag(kind, microbatch, stage)
        h1 = self.pp.isend(header, dst, tag=tag)
        h2 = self.pp.isend(payload, dst, tag=tag)
        return _Both(h1, h2), (header, payload)  # the tensors must outlive the transfers

    def _recv(self, microbatch: int, stage: int, *, kind: int, src: int, send: tuple | None = None) -> torch.Tensor:
        """Receive a message; with `send` (a paired send to the same peer), as two groups: both headers, then both
        payloads (see [Note: paired transfers] in schedule.py)."""
        tag = self._tag(kind, microbatch, stage)
        device = self.device
        header = torch.empty(_HEADER, dtype=torch.int64, device=device)
        t0 = time.perf_counter()
        out: list[tuple] = []
        if send is not None:
            t_out, mb_out, stage_out, kind_out, dst = send
            if dst != src:
                raise PipelineError(f"a paired send to rank {dst} cannot go with a receive from rank {src}")
            h_out, p_out = self._message(t_out, mb_out, stage_out, kind_out)
            tag_out = self._tag(kind_out, mb_out, stage_out)
            out = [("send", p_out, dst, tag_out)]
            _wait_all(self.pp.batch_p2p([("send", h_out, dst, tag_out), ("recv", header, src, tag)]))
        else:
            self.pp.irecv(header, src, tag=tag).wait()
        mb, st, code, ndim = (int(v) for v in header[:4].tolist())
        if (mb, st) != (microbatch, stage):
            what = ("activation", "gradient")[kind]
            raise PipelineError(
                f"pipeline rank {self.pp.rank} expected the {what} of micro-batch {microbatch} for virtual stage "
                f"{stage} and received micro-batch {mb} for stage {st}: the ranks run different schedules"
            )
        shape = [int(d) for d in header[4 : 4 + ndim].tolist()]
        t = torch.empty(shape, dtype=_DTYPES[code], device=device)
        if out:
            _wait_all(self.pp.batch_p2p([*out, ("recv", t, src, tag)]))
        else:
            self.pp.irecv(t, src, tag=tag).wait()
        self.stats.wait_s += time.perf_counter() - t0
        return t

    # ---- measuring ------------------------------------------------------------------------------------------
    def _saving(self, alive: dict, key: tuple[int, int]) -> Any:
        if not self.measure:
            return _Null()
        params = {p.untyped_storage().data_ptr() for c in self.chunks for _, u in c.units for p in u.parameters()}
        seen: set[int] = set()
        alive[key] = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in seen:
                seen.add(ptr)
                alive[key] += t.untyped_storage().nbytes()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


class _Both:
    def __init__(self, a: Handle, b: Handle) -> None:
        self.a, self.b = a, b

    def wait(self) -> bool:
        self.a.wait()
        self.b.wait()
        return True


def _wait_all(handles: list[Handle]) -> None:
    for h in handles:
        h.wait()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _loss_of(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None:
        raise PipelineError(
            "the last stage returned no .loss: with loss_fn=None its last unit is called with labels= and must "
            "return an object with a loss (Hugging Face style); otherwise pass loss_fn to train_batch"
        )
    return loss
