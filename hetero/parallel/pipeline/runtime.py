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

Known limit (NCCL): a rank's sends and receives to one peer share a stream there, and a send larger than NCCL's
buffer waits for its receive to be posted; 1F1B's steady state ("send my output, then receive a gradient" on one
rank, the mirror image on its neighbour) can then stall. torch.distributed.pipelining batches each such send with the
next receive, which needs the receiver to know shapes before the header arrives (static shapes); that is not done
here yet, and nothing in this repository's CI runs NCCL. gloo progresses sends in the background and is safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hetero.comm import Comm, Handle
from hetero.errors import HeteroError
from hetero.parallel.pipeline.schedule import Action, build
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
        for a in self.actions:
            start = time.perf_counter()
            s = self._stage(a.chunk)
            key = (a.chunk, a.microbatch)
            if a.kind == "F":
                if s == 0:
                    x = inputs[a.microbatch]
                else:
                    x = self._recv(a.microbatch, s, kind=0, src=(s - 1) % self.p)
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
                    sends.append(self._send(y.detach(), a.microbatch, s + 1, kind=0, dst=(s + 1) % self.p))
                saved[key] = (x, y)
                stats.peak_in_flight = max(stats.peak_in_flight, len(saved))
                stats.peak_saved_bytes = max(stats.peak_saved_bytes, sum(alive.values()))
                after_forward()
            else:
                x, y = saved.pop(key)
                if s == self.last_stage:
                    torch.autograd.backward(y * loss_scale)
                else:
                    g = self._recv(a.microbatch, s, kind=1, src=(s + 1) % self.p)
                    torch.autograd.backward(y, g)
                alive.pop(key, None)
                if s > 0:
                    gx = x.grad if x.grad is not None else torch.zeros_like(x)
                    sends.append(self._send(gx, a.microbatch, s - 1, kind=1, dst=(s - 1) % self.p))
                del x, y
                after_backward()
            if self.measure:
                stats.actions.append((repr(a), start - t0, time.perf_counter() - t0))
        for handle, _ in sends:
            handle.wait()
        stats.wall_s = time.perf_counter() - t0
        return total

    # ---- transfers ------------------------------------------------------------------------------------------
    def _tag(self, kind: int, microbatch: int, stage: int) -> int:
        return (microbatch * (self.last_stage + 1) + stage) * 2 + kind

    def _send(self, t: torch.Tensor, microbatch: int, stage: int, *, kind: int, dst: int) -> tuple[Handle, Any]:
        if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
            raise PipelineError(f"cannot pass a {t.dtype} tensor of {t.dim()} dims between stages")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[:4] = torch.tensor([microbatch, stage, _DTYPES.index(t.dtype), t.dim()])
        header[4 : 4 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        tag = self._tag(kind, microbatch, stage)
        # On the device the header travels from host memory only on backends that read it there (gloo);
        # NCCL needs it on the GPU too.
        header = header.to(t.device)
        payload = t.contiguous()
        h1 = self.pp.isend(header, dst, tag=tag)
        h2 = self.pp.isend(payload, dst, tag=tag)
        return _Both(h1, h2), (header, payload)  # the tensors must outlive the transfers

    def _recv(self, microbatch: int, stage: int, *, kind: int, src: int) -> torch.Tensor:
        tag = self._tag(kind, microbatch, stage)
        device = self.device
        header = torch.empty(_HEADER, dtype=torch.int64, device=device)
        t0 = time.perf_counter()
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
