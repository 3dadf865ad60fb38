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
A region inside which nothing drew (the model in eval mode, a dropout of p = 0) gives the shared CPU stream back as
it found it, the entry's draw undone: the plain model's forward then draws nothing, and neither does this one, so
what follows a forward draws what it draws without tensor parallelism. A sampling `generate` drew other tokens than
the plain model's with the same seed (every forward moved the shared stream once per region, and the sampler draws
from it); now it draws the same. Whether anything drew is read off this rank's own streams at the exit (their states
against those just seeded): ranks of a group draw the same shapes there, so they all decide alike and stay
bit-identical. The device's shared stream is always given back as it was (the entry's draw is the CPU's alone).
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
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from hetero.comm import Comm
from hetero.device import Device
from hetero.zero.hooks import outside_compile

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
        self._outside: _Outside | None = None  # the shared streams' states, while inside
        self._devices: dict[torch.device, Device] = {}  # the device each region's tensors were on (CUDA only)

    @property
    def inside(self) -> bool:
        return self._outside is not None

    # Run eagerly under torch.compile: traced, the draw's bytes became a guard and every call recompiled.
    # `outside_compile`, not `torch.compiler.disable` here: that imports torch._dynamo as the class is defined, which
    # doubled the time of `import hetero` for every command line (3.2 s CPU against 1.6 s, `import torch` 1.5 s).
    @outside_compile
    def enter_at(self, x: torch.Tensor) -> torch.Tensor:
        """Switch to this rank's stream, with `x` (returned) the first tensor of the region; once: a second entry
        before leaving is the same region's (q, k and v entering one by one). One rank is the plain model."""
        self.enter(x.device)
        return x

    @outside_compile
    def enter(self, device: torch.device | None) -> None:
        """`enter_at` for a tensor on `device` (None: the CPU's generator alone)."""
        if self._outside is not None or self.size == 1:
            return
        before = torch.get_rng_state()
        seed = rank_seed(shared_draw(), self.rank)
        dev = None if device is None else self._device(device)
        outside = (before, torch.get_rng_state(), dev, None if dev is None else dev.rng_state())
        set_streams(seed, dev)
        self._outside = _Outside(*outside, seeded=_states(dev))

    @outside_compile
    def leave(self, *_: Any) -> None:
        """Back to the shared streams, where they were on entering: moved on by the entry's draw where this rank's
        streams drew inside, as found where they drew nothing ([Note: dropout under tensor parallelism]). Any
        arguments (a module hook's) are ignored."""
        out = self._outside
        if out is None:
            return
        self._outside = None
        drew = _states(out.dev) != out.seeded
        torch.set_rng_state(out.moved if drew else out.before)
        if out.dev is not None:
            out.dev.set_rng_state(out.dev_state)

    def _device(self, device: torch.device) -> Device | None:
        if device.type != "cuda":  # the CPU's generator is swapped anyway; meta tensors draw nothing
            return None
        if device not in self._devices:
            self._devices[device] = Device(device)
        return self._devices[device]


@dataclass(frozen=True)
class _Outside:
    """The shared streams while a region runs on this rank's, and this rank's as they were seeded."""

    before: torch.Tensor  # the shared CPU state at the entry, before its draw
    moved: torch.Tensor  # the shared CPU state after the entry's draw
    dev: Device | None  # the device whose generator was swapped too (CUDA only)
    dev_state: torch.Tensor | None  # its shared state at the entry
    seeded: tuple[bytes, bytes]  # this rank's CPU and device states as seeded: unchanged at the exit, nothing drew


def _states(dev: Device | None) -> tuple[bytes, bytes]:
    """The bytes of the CPU's and `dev`'s generator states: host-side reads, no tensor operation (as shared_draw)."""
    on_device = b"" if dev is None else dev.rng_state().numpy().tobytes()
    return torch.get_rng_state().numpy().tobytes(), on_device


def set_streams(seed: int, device: Device | None = None) -> None:
    """Seed the CPU's default generator and `device`'s with `seed`: a rank's stream inside the region (tests
    reproduce a rank's masks with it)."""
    torch.default_generator.manual_seed(seed)
    if device is not None:
        device.set_rng_state(torch.Generator(device=device.torch_device).manual_seed(seed).get_state())


def inputs_device(args: tuple, kwargs: dict) -> torch.device | None:
    """The device whose generator a region entered with these inputs swaps: that of the first tensor on an
    accelerator, searched inside containers too (a batch given as a dict or a tuple), else the first tensor's; None
    without a tensor. The first top-level tensor alone missed a batch in a dict (the CUDA stream stayed shared: every
    rank drew the same masks for its blocks) and took a host tensor ahead of the device's (a CPU mask)."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    x = next((t for t in tensors if t.device.type not in ("cpu", "meta")), tensors[0] if tensors else None)
    return None if x is None else x.device


def bracket(first: nn.Module, last: nn.Module, rng: RegionRng, *, enter: bool = True) -> None:
    """Run from `first`'s call to `last`'s return on this rank's stream (the device's of `first`'s inputs too:
    `inputs_device`), and back to the shared one when `last` returns or raises; `enter` False: only the way back, for a
    region some module inside opens. A model (first = last = the model) or a pipeline stage's run of units."""
    if enter:

        def pre_hook(_: nn.Module, args: tuple, kwargs: dict) -> None:
            rng.enter(inputs_device(args, kwargs))

        first.register_forward_pre_hook(pre_hook, with_kwargs=True)
    last.register_forward_hook(rng.leave, always_call=True)
