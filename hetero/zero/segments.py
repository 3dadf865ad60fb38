"""Which runs of a chunk's optimizer shard an update steps, and each parameter's step count.

[Note: parameters without a gradient]
PyTorch's optimizers skip a parameter whose .grad is None: no weight decay, no moment decay, no step
count. A flat update would do all three to a parameter that a step did not use (a skipped branch), so the
update runs on runs of parameters that did get a gradient (on any rank: `used` is all-reduced), and each
parameter keeps its own step count for Adam's bias correction. In the common case, every parameter used and
all counts equal, that is one run: the whole shard in one fused call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hetero.zero.zero_chunk import ZeroChunk


def update_segments(zc: ZeroChunk, used: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, steps taken) runs of the chunk's optimizer shard to update (`used`: which parameters got a
    gradient on any rank), then count the step of each used parameter."""
    lo, hi = zc.kept_range()
    runs: list[tuple[int, int, int]] = []
    flags = used.tolist()  # one call, not a tensor index per parameter
    for i, info in enumerate(zc.spec.params):
        a, b = max(info.offset, lo), min(info.offset + info.numel, hi)
        if not flags[i]:
            continue
        if a < b:
            if runs and runs[-1][1] == a - lo and runs[-1][2] == zc.param_steps[i]:
                runs[-1] = (runs[-1][0], b - lo, runs[-1][2])
            else:
                runs.append((a - lo, b - lo, zc.param_steps[i]))
        zc.param_steps[i] += 1
    return runs


def uncount_step(zc: ZeroChunk, used: torch.Tensor) -> None:
    """Take back the step `update_segments` counted for each used parameter: an fp16 update the kernels skipped
    ([Note: the overflow check on the device] in overflow.py)."""
    for i, flag in enumerate(used.tolist()):
        if flag:
            zc.param_steps[i] -= 1
