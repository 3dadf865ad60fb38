"""fp16's overflow check where every chunk steps on the device: the kernels skip an overflowed update themselves.

[Note: the overflow check on the device]
With fp16 an update first asks whether the gradient is finite: overflowed, it is skipped and the loss scale halves.
Asked on the host, the answer is a value read back from the device, and on a GPU the host then waits at the update's
start for the whole backward and the norm's all-reduce to run, with nothing queued behind them: the GPU idles while
the host queues the update, chunk by chunk, and the next forward (the one wait a step left in fp16, `gpu_waits.py`).
Where every chunk steps on the device with torch's fused Adam kernels, the answer need not reach the host first:

- the gradient's sum of squares stays on the device, all-reduced there; `found_inf` (1.0 where it is not finite)
  goes to every chunk's fused kernel, which then leaves the master, the moments and the step count as they were
  (torch's own `found_inf`, as GradScaler hands fused optimizers). The gradient's multiplier is the scale's
  reciprocal, a number the host has; with clipping it is computed on the device from the norm, in float64, with the
  host's operations in the host's order (the same bits as `prepare`'s);
- the flag is copied to host memory behind a marker recorded right after it is computed, before the first chunk's
  kernels are queued, and read when the update has queued them all (`Updater.finish`). The host may still block
  there, until the device has passed the check, but the device has the whole update queued behind it to run while
  the host goes on to the next forward: it does not run dry, as it did while the host queued the update after the
  read. (`tools/gpu_waits.py` on a GPU lists such a block apart from the waits, which leave the compute stream
  dry; the stand-in counts only those, and finds none.) Reading the flag any later would leave the LR
  scheduler's step, which the engine takes at `step()`, undecided there;
- the host's books are then settled as the host-side check keeps them, before `step()` returns: the scale backs off
  or grows, and an overflowed update is undone where it counted itself: `global_steps`, each used parameter's step
  count (`uncount_step`), the last norm; `skipped_steps` and `last_update_skipped` count it, so the LR scheduler does
  not step. Nothing is speculative past `step()`: the counters, the scale and the schedule are the host check's.

What the skipped update still does: its chunks stream through as an applied one's (a master written back unchanged
to the parameters, the gradient cleared), work the host-side check saves on a step that is rare once the scale has
settled. Other optimizers (SGD, the generic path), states stepped on the host, tensor and pipeline groups, and the
loop's own `clip_grad_norm_` (it read the norm already) keep the host-side check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hetero.device import Device
from hetero.zero.grad_norm import clip_coef_on_device

if TYPE_CHECKING:
    from hetero.zero.optim import Algorithm


def skips_itself(algorithm: Algorithm) -> bool:
    """Whether the algorithm's kernels take `found_inf` (torch's fused Adam and AdamW)."""
    return algorithm.name == "adam" and algorithm.generic is None


@dataclass
class Pending:
    """An update whose overflow flag the host has not read yet."""

    handle: Any  # `Device.copy_later`'s: the flag is in the check's host buffer once it has landed
    used_of: list[torch.Tensor]  # per chunk, the parameters whose step count the update advanced
    norm_before: float | torch.Tensor | None  # the last norm before this update's
    overflowed: bool | None = None  # read by `DeviceCheck.take`


class DeviceCheck:
    """The check of one engine's updates on the device; its flag's host buffer is reused update after update."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._flag: torch.Tensor | None = None
        self.pending: Pending | None = None

    def check(
        self,
        sq: torch.Tensor,
        *,
        inv_scale: float,
        clip_max: float | None,
        used_of: list[torch.Tensor],
        norm_before: float | torch.Tensor | None,
    ) -> tuple[float | torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the (scaled) gradient's sum of squares on the device, all-reduced: the gradient's multiplier, the
        kernels' `found_inf`, and the unscaled sum of squares (the norm's square, exact: the scale is a power of 2).
        Queues the flag's copy to the host; `take` hands it over once the update is queued, with what an overflow
        takes back (`used_of`, `norm_before`)."""
        found = (~torch.isfinite(sq)).to(torch.float32).reshape(1)
        if self._flag is None:
            # A whole page: pinned memory is registered page by page anyway
            self._flag = self.device.empty_host(4096)[:4].view(torch.float32)
        handle = self.device.copy_later(self._flag, found, after=self.device.compute_marker())
        self.pending = Pending(handle=handle, used_of=used_of, norm_before=norm_before)
        coef = inv_scale if clip_max is None else clip_coef_on_device(sq, clip_max, inv_scale)
        return coef, found.reshape(()), sq * (inv_scale * inv_scale)

    def take(self) -> Pending | None:
        """The pending update, its flag landed (the host waiting for the device to pass the check); None when none
        is pending."""
        pending = self.pending
        if pending is None:
            return None
        self.pending = None
        self.device.landed(pending.handle)
        assert self._flag is not None
        pending.overflowed = bool(self._flag[0] != 0)
        return pending

    def close(self) -> None:
        self.take()
        if self._flag is not None:
            self.device.free_host(self._flag.view(torch.uint8))
            self._flag = None
