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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hetero.device import Device
from hetero.zero.norms import sum_of_squares

if TYPE_CHECKING:
    from hetero.zero.zero_chunk import ZeroChunk


def grad_to_host(
    device: Device, acc: torch.Tensor, target: torch.Tensor, *, first: bool, ready: Any = None
) -> torch.Tensor:
    """Put `target` (this micro-batch's reduced gradient, device memory, fp32) into `acc` (the host gradient chunk):
    replacing what is there when `first` (nothing accumulated since the update), else adding to it. `ready`: a
    compute marker at which `target` was complete, if one was taken then (else one is taken now). Returns the
    accumulated gradient's float64 sum of squares, a device scalar."""
    if not first:
        target.add_(device.to_device(acc))
        ready = None  # the sum is work queued now
    sq = sum_of_squares(target)
    device.copy(acc, target, after=ready if ready is not None else device.compute_marker())
    return sq


def chunk_sum_of_squares(zc: ZeroChunk, grad: torch.Tensor) -> torch.Tensor:
    """The float64 sum of squares of `grad`, a chunk's whole reduced gradient (`zc.grad_view()`): the one taken on the
    device on the gradient's way to the host if there is one (consumed), else computed where the gradient is."""
    sq, zc.grad_sq = zc.grad_sq, None
    return sum_of_squares(grad) if sq is None else sq
