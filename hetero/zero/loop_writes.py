"""Writes of the training loop into the parameters at stages 0-2 ([Note: the loop's writes into parameters]).

[Note: the loop's writes into parameters]
At stages 0-2 every parameter is a view of its chunk on every rank, readable and writable as in plain PyTorch; the
update, though, steps the fp32 master weights (apart from the parameters, on whichever tier the optimizer lives) and
writes the parameters from them. So a loop's own in-place write (magnitude pruning `p.mul_(mask)`, WGAN's weight
clipping `p.clamp_(-c, c)`, a max-norm constraint, under `torch.no_grad()`) lasted until the next update, which
brought the old values back from the masters (measured: pruning after every step, 0.026 off plain PyTorch's weights
after three steps, the pruned weights grown back). Such a write goes through the parameter and bumps its version
counter, as autograd sees it; the engine notes every parameter's version after it wrote them, and before the next
backward, update or `gathered_parameters` block (a read-only one would otherwise pass the writes over) the chunks
holding a parameter written since have their masters take every element whose value changed (`adopt_all`: the host
waits for the device once for every such chunk, not once each, which one H200 counted as 5 waits a step; as
`gathered_parameters(modify=True)` does, without its broadcast: each rank from its own values, as DDP leaves each
rank's edit to the rank; every rank making the same write, as such loops do, keeps them equal). A write through
`.data` bumps no version (autograd does not see it either): do it inside `with
engine.gathered_parameters(modify=True):`. With `delayed_param_update` the parameters may hold a prediction of the
pending update, not the masters' values, so a write is refused there, naming that block. At stage 3 the parameters
are released outside forward, and writing one raises: the same block is the way.
"""

from __future__ import annotations

import torch

from hetero.device import Device
from hetero.errors import HeteroError
from hetero.zero.views import adopt_all
from hetero.zero.zero_chunk import ZeroChunk


class LoopWrites:
    """The versions of the parameters of stage 0-2 trainable chunks, and their masters' catching up."""

    def __init__(self, chunks: list[ZeroChunk], device: Device, dtype: torch.dtype, *, delayed: bool) -> None:
        self.device, self.dtype, self.delayed = device, dtype, delayed
        self._params = [
            (zc, info.param, info.name)
            for zc in chunks
            if zc.stage < 3 and zc.optim is not None and not zc.spec.tile
            for info in zc.spec.params
            if not info.tiled
        ]
        self._versions: list[int] = []
        self.note()

    def note(self) -> None:
        """The parameters as the engine left them (after it wrote them, or adopted the loop's writes)."""
        self._versions = [p._version for _, p, _ in self._params]

    def adopt(self) -> None:
        """Before what reads the masters: the chunks of parameters written since `note` take the writes."""
        written: dict[int, ZeroChunk] = {}
        first = None
        for (zc, p, name), seen in zip(self._params, self._versions):
            if p._version != seen:
                written.setdefault(id(zc), zc)
                first = first or name
        if not written:
            return
        if self.delayed:
            raise HeteroError(
                f"parameter {first!r} was written in place outside hetero while delayed_param_update is on: the "
                "parameters may hold a prediction of the pending update rather than the master weights, and the "
                "write would be lost. Write inside `with engine.gathered_parameters(modify=True):`, which applies "
                "the pending update first"
            )
        adopt_all(list(written.values()), self.device, self.dtype)
        self.note()
