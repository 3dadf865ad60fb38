"""A reduced gradient's way from device memory into a host-tier gradient chunk.

[Note: gradients to the host through pinned memory]
`acc.add_(target.to("cpu"))` lands the gradient in fresh pageable memory first: a synchronous copy the driver stages
page by page (1.8 GB/s on one H200: 1.24 s of a 551M-parameter Llama's 2.7 s step) before an add on the CPU. The host
chunk is pinned (`Device.empty_host`), so instead the sum is formed on the device (the earlier micro-batches' sum comes
up first) and copied down into the chunk at the bus's speed (50 GB/s there), off the compute stream. While the
gradient is on the device its sum of squares is taken there as well, for the update's reported norm: on the host that
is a float64 pass over every gradient on one core (`hetero/zero/norms.py`), 0.4 s of the same step. The update takes
it (`chunk_sum_of_squares`) only when nothing changed the gradient since: `zero_grad` clears it and every later
micro-batch replaces it.

The copy waits for a marker of when the reduced gradient was complete. A marker taken when the copy is asked for
(the reduction is completed a few chunks later in backward) also covers every backward kernel queued since: the host
would wait for the GPU to run dry once a chunk, and the GPU would then idle while the host queues the next layers. A
group of one "reduces" with a copy on the compute stream, so its marker is taken right then (`ZeroChunk.start_reduce`)
and the copy overlaps the backward kernels queued after it. (With NCCL the reduction ends on its own stream, and the
marker is taken after waiting for it.)

[Note: stage 0-1 gradients summed on the device]
Stages 0-1 accumulate each parameter's gradient into the chunk's full-size gradient buffer as it arrives. With that
buffer on the host, `acc.add_(grad.to("cpu"))` per parameter is a copy into pageable memory, which the host waits
for: on a GPU every parameter's gradient hook would wait for the whole queue of backward kernels before it (the
stand-in counts 19 such waits a step for the tiny test GPT, [Note: host waits]). So a chunk's gradients of one
micro-batch are summed into a device buffer (`HostSum`) and go down once, when the chunk has them all (or at the end
of backward), through pinned memory as the reduced gradients of stages 2-3 do. In the backward that reduces
([Note: reducing during backward at stages 0-1] in buckets.py) with a backend that reduces device memory only
(NCCL), that sum, with the earlier micro-batches' brought up into it, stays on the device for the reduction and goes
down once reduced: before, it went down, came up again for the collective and went down reduced, and the host waited
for the first copy (for the GPU to run every kernel queued before it) once a chunk.

[Note: a micro-batch's sum on the device goes down at its end]
A chunk's sum goes down early once all its parameters' gradients are in; the rest go down where its backward ends:
`engine.backward` flushes every chunk and clears the count of arrivals, and so does `train_batch` after each
micro-batch's backward (hetero/parallel/batches.py). It did neither: a chunk holding a parameter the batch never
used kept its sum on the device past the update, which stepped without it, and the sum went into the next batch's
gradient instead (under the stand-in, stage 1 with the optimizer on the host and two micro-batches: a loss of
0.52440 where plain PyTorch gave 0.68643 at the second step); and from the second micro-batch on, the count still
full from the first, every parameter's gradient sent the chunk's whole buffer down on its own. The CPU, one memory,
never sums on the side: only the stand-in and a GPU showed it. Dropped gradients (`zero_grad`) drop this sum too.

[Note: a chunk's sum flushed twice]
A tiled weight used twice (an embedding tied to the output head) gets its gradient in parts, one per use; the chunk
counts as complete at the first part, which flushes its sum, and the second part flushes again. Down to the host,
the second adds to the first. Kept on the device for the reduction (two ranks or more), the second sum replaced the
first, so the update stepped on the head's part alone (under the stand-in, stage 0 on two ranks: a loss of 4.67867
where plain PyTorch gave 4.63874 at the second step; tools/fuzz_parity.py found it). The second part now adds into
the kept sum, which the reduction takes once the last part is in (`_add_grad`'s `last`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hetero.zero.norms import sum_of_squares

if TYPE_CHECKING:
    from hetero.zero.zero_chunk import ZeroChunk


def grad_to_host(
    zc: ZeroChunk, target: torch.Tensor, *, first: bool, ready: Any = None, squares: bool = True
) -> torch.Tensor | None:
    """Put `target` (this micro-batch's reduced gradient, device memory, fp32) into the chunk's host gradient buffer:
    replacing what is there when `first` (nothing accumulated since the update), else adding to it. `ready`: a
    compute marker at which `target` was complete, if one was taken then (else one is taken now). The copy lands
    while the host goes on ([Note: copies the host does not wait for]). Returns the accumulated gradient's float64 sum
    of squares, a device scalar (squares False: None, not taken)."""
    device = zc.device
    # The first micro-batch's copy below writes the buffer whole: zeros first would be a pass over host memory for
    # nothing (52 ms of the 423 ms step of benchmarks/gpu_race.py's hetero_offload on one H100, in backward's hooks).
    acc = zc.grad_buffer(whole=first and zc.grad.capacity == target.numel())
    if not first:
        target.add_(device.to_device(acc))
        ready = None  # the sum is work queued now
    sq = sum_of_squares(target) if squares else None
    handle = device.copy_later(acc, target, after=ready if ready is not None else device.compute_marker())
    zc.manager.land_later(zc.grad, handle)
    return sq


def chunk_sum_of_squares(zc: ZeroChunk, grad: torch.Tensor) -> torch.Tensor:
    """The float64 sum of squares of `grad`, a chunk's whole reduced gradient (`zc.grad_view()`): the one taken on the
    device on the gradient's way to the host if there is one (consumed), else computed where the gradient is."""
    sq, zc.grad_sq = zc.grad_sq, None
    return sum_of_squares(grad) if sq is None else sq


class HostSum:
    """One chunk's gradients of the micro-batch, summed on the device on their way to its host gradient buffer
    (stages 0-1); see [Note: stage 0-1 gradients summed on the device]."""

    def __init__(self, zc: ZeroChunk) -> None:
        self.zc = zc
        self.buf: torch.Tensor | None = None  # device memory, the gradient buffer's size, while gradients arrive
        # Whether this backward reduces through device memory (`DenseReduce.keeps_sum`): the whole sum stays there.
        self.keep: Callable[[], bool] = lambda: False
        self.kept: torch.Tensor | None = None  # that sum, until the reduction takes it (`take`)

    def add(self, offset: int, flat: torch.Tensor) -> None:
        if self.buf is None:
            self.buf = self.zc.device.empty((self.zc.grad.capacity,), torch.float32).zero_()
        self.buf.narrow(0, offset, flat.numel()).add_(flat)

    def flush(self) -> None:
        """Add what arrived into the host buffer (replacing its zeros when nothing is accumulated there yet), or,
        where the backward reduces on the device, keep the whole sum there for that reduction: the reduced gradient
        then goes down once, not down, up and down again ([Note: stage 0-1 gradients summed on the device])."""
        if self.buf is None:
            return
        buf, self.buf = self.buf, None
        zc = self.zc
        if self.keep():
            if self.kept is not None:  # a part kept earlier in this backward: [Note: a chunk's sum flushed twice]
                self.kept.add_(buf)
                return
            if not zc.grad_is_zero:  # the earlier micro-batches' sum comes up first
                buf.add_(zc.device.to_device(zc.grad_buffer()))
                zc.manager.land_later(zc.grad, zc.device.compute_reached(), reads=True)
            self.kept = buf
        else:
            grad_to_host(zc, buf, first=zc.grad_is_zero, squares=False)  # before the reduction: no norm
        zc.grad_is_zero = False

    def take(self) -> torch.Tensor | None:
        """The sum kept on the device for the reduction, if any (once)."""
        kept, self.kept = self.kept, None
        return kept

    def drop(self) -> None:
        """The accumulation's gradients are dropped (`ZeroChunk.zero_grad`): so is the sum not gone down yet."""
        self.buf = self.kept = None
