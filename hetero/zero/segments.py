"""Which runs of a chunk's optimizer shard an update steps, and each parameter's step count.

[Note: parameters without a gradient]
PyTorch's optimizers skip a parameter whose .grad is None: no weight decay, no moment decay, no step
count. A flat update would do all three to a parameter that a step did not use (a skipped branch), so the
update runs on runs of parameters that did get a gradient (on any rank: `used` is all-reduced), and each
parameter keeps its own step count for Adam's bias correction. In the common case, every parameter used and
all counts equal, that is one run: the whole shard in one fused call.

[Note: zero gradients kept]
`optimizer.zero_grad(set_to_none=False)` leaves a zero tensor in each .grad that exists, so torch steps a parameter
that once had a gradient at every later update, used or not (Adam's moments decay and move it, weight decay shrinks
it, its step count advances), until a `zero_grad()` that sets them to None. hetero's loop calls the same: after
`engine.optimizer.zero_grad(set_to_none=False)` each chunk keeps `kept_grads`, the parameters any rank stepped since
then, and steps them again with a zero gradient (the buffer holds zeros where no gradient came). The flags are
or-ed into `used` before its all-reduce, so every rank steps the same parameters whatever its own loop called.
Whatever the loop's last zeroing, each update adds what it stepped to `kept_grads` (a set_to_none zeroing empties
it): torch's `.grad` exists for what got a gradient since then, so a loop zeroing after its step
(`step(); zero_grad(set_to_none=False)`, the order of most loops) keeps the first update's gradients as zeros too.
Recorded only once the loop zeroed that way, they were lost: the parameters not used at the next update were
skipped (measured: a block frozen for two steps, the loss 0.0093 off plain PyTorch's at the fourth step). The
optimizer object the user built and handed to `initialize` passes its `zero_grad`'s `set_to_none` here too
(`zero_mode`), dropping no gradient ([Note: the optimizer handed over]).
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


def flags_to_step(zc: ZeroChunk) -> torch.Tensor:
    """This rank's parameters to step, before the all-reduce: those that got a gradient, and where the loop zeroes
    with `set_to_none=False`, those whose zero gradient it keeps ([Note: zero gradients kept])."""
    return zc.used | zc.kept_grads if zc.keeps_zero_grads else zc.used.clone()


def remember_stepped(zc: ZeroChunk, used: torch.Tensor) -> None:
    """`used` (agreed over the ranks) stepped: torch's `.grad` of each now exists, and stays (as zeros) until a
    set_to_none zeroing; while the loop keeps zero gradients, they step next time."""
    zc.kept_grads |= used


def zero_mode(chunks: list[ZeroChunk], set_to_none: bool) -> None:
    """The loop's choice of torch's zero_grad semantics, no gradient dropped: False keeps what steps as zeros."""
    for zc in chunks:
        zc.keeps_zero_grads = not set_to_none
        if set_to_none:
            zc.kept_grads.zero_()
