"""Random numbers under tensor parallelism: one stream shared by the tensor group outside the sharded region, one
stream per rank inside it.

[Note: dropout under tensor parallelism]
Ranks of a tensor group are seeded alike (the model must be built identically on each) and draw the same random
numbers as long as they draw the same shapes, which they do. Outside the sharded region that is what a model needs:
a dropout on a replicated tensor (the embeddings', the residual stream's after a row-parallel layer) must drop the
same elements on every rank, or the replicas stop being one model. Inside it, each rank holds a different part
(its heads' attention probabilities, its features of the MLP, under Megatron-SP its positions of the residual stream)
and the same stream gave every rank the same mask for its part: head j of rank 0 and head j of rank 1 dropped the
same positions, a correlation the unsharded model does not have (Megatron-LM keeps a second, per-rank generator for
this). `RegionRng` swaps the default generators (the CPU's, and the device's of the tensor that enters) for a
per-rank state on entering the region and back on leaving it. The per-rank state is seeded from a number read off
the shared CPU stream's state on entering (a hash of it), mixed with the rank; the shared CPU stream moves on to a
state hashed from the same bytes, so:
- the shared streams move alike on every rank, and replicas stay bit-identical;
- what the region draws is a function of the shared stream's state at the entry, which `torch.utils.checkpoint`
  saves and restores, so a recomputation in backward draws the same masks (no state of hetero's to save with it);
- a run is reproducible from the seed, and a checkpoint's saved RNG states cover it.
Without sequence parallelism the region runs from a column-parallel layer's input (or its `heads` /
`parallel_input` parent's) to the row-parallel layer's input; under Megatron-SP from `sequence_scatter` to
`sequence_gather`, since everything between holds a part of the sequence (so under Ulysses and ring too, over the
sequence group: seq_split.py). A forward that raises inside the region
leaves it at its module's exit or, at the latest, at the model's next forward. Under a pipeline a stage runs its
units, never the model: a stage whose input is inside the sequence-parallel region (after the one holding
`sequence_scatter`) enters it at its first unit, and every stage leaves it, if open, when its last unit returns
(`bracket`); the stage holding `sequence_scatter` used to leave the shared stream swapped for its rank's after its
forward, so what the program drew after a step differed between the tensor ranks.

[Note: dropout under a grid]
A grid (2D, 2.5D, 3D: grid/mesh.py) cuts every activation of the forward two ways: each tensor rank holds another
(batch part, hidden part) block of the residual stream (`main`), of what lies between a column- and a row-parallel
layer (`alt` in 3D) and of the attention probabilities (its rows, its heads); no two ranks hold the same block, the
2.5D depth layers included (they cut the batch first). Only the weights are replicated, and dropout draws nothing for
them. So the whole forward is the region, over the tensor group: entered at the model's call (under a pipeline, at
each stage's first unit) and left at its return; each rank draws its blocks' masks from its own stream, and what
follows the forward (a sampled token, the next batch's shuffle) draws the shared one again.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from hetero.comm import Comm
from hetero.device import Device

_MIX = 0x9E3779B97F4A7C15  # an odd constant (2^64 / golden ratio): rank r's seed is far from rank r+1's
_SEEDS = 1 << 63


def shared_draw() -> int:
    """A number read off the shared CPU stream, which moves on. No tensor operation: the draw is host-side work
    under any dispatch mode (the stand-in's, a compile) and never waits for a device."""
    digest = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=16).digest()
    torch.default_generator.manual_seed(int.from_bytes(digest[8:], "little") % _SEEDS)
    return int.from_bytes(digest[:8], "little") % _SEEDS


def rank_seed(shared: int, rank: int) -> int:
    """The seed of `rank`'s stream in a region entered when the shared CPU stream gave `shared`."""
    return (shared + (rank + 1) * _MIX) % _SEEDS


class RegionRng:
    """The default generators of one tensor rank, swapped for its own stream while inside the sharded region."""

    def __init__(self, comm: Comm) -> None:
        self.rank, self.size = comm.rank, comm.size
        self._outside: tuple[torch.Tensor, Device | None, torch.Tensor | None] | None = None  # shared states, inside
        self._devices: dict[torch.device, Device] = {}  # the device each region's tensors were on (CUDA only)

    @property
    def inside(self) -> bool:
        return self._outside is not None

    # Run eagerly under torch.compile: traced, the draw's bytes became a guard and every call recompiled.
    @torch.compiler.disable
    def enter_at(self, x: torch.Tensor) -> torch.Tensor:
        """Switch to this rank's stream, with `x` (returned) the first tensor of the region; once: a second entry
        before leaving is the same region's (q, k and v entering one by one). One rank is the plain model."""
        self.enter(x.device)
        return x

    @torch.compiler.disable
    def enter(self, device: torch.device | None) -> None:
        """`enter_at` for a tensor on `device` (None: the CPU's generator alone)."""
        if self._outside is not None or self.size == 1:
            return
        seed = rank_seed(shared_draw(), self.rank)
        dev = None if device is None else self._device(device)
        self._outside = (torch.get_rng_state(), dev, None if dev is None else dev.rng_state())
        set_streams(seed, dev)

    @torch.compiler.disable
    def leave(self, *_: Any) -> None:
        """Back to the shared streams, where they were on entering (moved on by the entry's draw). Any arguments
        (a module hook's) are ignored."""
        if self._outside is None:
            return
        cpu, dev, dev_state = self._outside
        self._outside = None
        torch.set_rng_state(cpu)
        if dev is not None:
            dev.set_rng_state(dev_state)

    def _device(self, device: torch.device) -> Device | None:
        if device.type != "cuda":  # the CPU's generator is swapped anyway; meta tensors draw nothing
            return None
        if device not in self._devices:
            self._devices[device] = Device(device)
        return self._devices[device]


def set_streams(seed: int, device: Device | None = None) -> None:
    """Seed the CPU's default generator and `device`'s with `seed`: a rank's stream inside the region (tests
    reproduce a rank's masks with it)."""
    torch.default_generator.manual_seed(seed)
    if device is not None:
        device.set_rng_state(torch.Generator(device=device.torch_device).manual_seed(seed).get_state())


def bracket(first: nn.Module, last: nn.Module, rng: RegionRng, *, enter: bool = True) -> None:
    """Run from `first`'s call to `last`'s return on this rank's stream (the device's of `first`'s first tensor
    input too), and back to the shared one when `last` returns or raises; `enter` False: only the way back, for a
    region some module inside opens. A model (first = last = the model) or a pipeline stage's run of units."""
    if enter:

        def pre_hook(_: nn.Module, args: tuple, kwargs: dict) -> None:
            x = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
            rng.enter(None if x is None else x.device)

        first.register_forward_pre_hook(pre_hook, with_kwargs=True)
    last.register_forward_hook(rng.leave, always_call=True)
