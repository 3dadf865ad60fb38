"""Megatron sequence parallelism (Korthikanti et al., 2022): the parts of a layer outside the tensor-parallel
matmuls (norms, dropout, residual adds) work on 1/t of the sequence instead of a replica of all of it.

[Note: the sequence-parallel region]
The residual stream between ``sequence_scatter`` (on the module where the layers begin: hetero GPT's and GPT-2's
embedding dropout, Llama's first decoder layer) and ``sequence_gather`` (on the final norm) holds [batch, seq/t,
hidden] on each rank. Inside it, a column-parallel layer all-gathers its input along the sequence (backward:
reduce-scatter) and a row-parallel layer reduce-scatters its output (backward: all-gather), which moves the same
bytes as the two all-reduces they replace. Attention sees the whole sequence: the ``heads`` style gathers the
attention module's input before its forward reads the sequence length. The embedding stays replicated (its
all-reduce is unchanged) because Hugging Face models derive position ids and masks from its output's length.
A parameter used inside the region (a norm's weight, a row-parallel bias) sees only this rank's positions, so its
gradient is a part of the whole: a hook all-reduces it over the tensor group before it is accumulated, and nothing
outside this package needs to know. Dropout inside the region draws from a stream of each rank's own, as Megatron's
per-rank generator (tp_rng.py, [Note: dropout under tensor parallelism]): ranks seeded alike drew the same mask
for their different positions. Under a pipeline, a stage after the one holding ``sequence_scatter`` enters the
region at its first unit (`region_at`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hetero.comm import Comm
from hetero.errors import ConfigError
from hetero.parallel.tp_ops import gather_seq_exact, scatter_seq

SEQ_DIM = 1  # activations are [batch, seq, hidden], as in Hugging Face and hetero's GPT


def replace_first_input(
    name: str, args: tuple, kwargs: dict, fn: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[tuple, dict]:
    """Apply ``fn`` to a module call's hidden states: its first positional argument, else ``hidden_states=``."""
    if args and isinstance(args[0], torch.Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    for key in ("hidden_states", "x", "input"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return args, {**kwargs, key: fn(kwargs[key])}
    raise ConfigError(
        f"{name} was called without a tensor as its first argument or as hidden_states=: the tensor-parallel plan "
        "cannot find its hidden states; give this style to a module whose forward takes them first"
    )


def mark_region(module: nn.Module, role: str, parts: int) -> None:
    """Mark the module where a split region begins (`role` "scatter": its input is cut in `parts`) or ends
    ("gather"), for whoever runs a laid-out model in pieces (a pipeline's units made after the layout, as the
    estimator's: [Note: a split sequence through the stages] in pipeline/hf.py)."""
    module._hetero_seq_region = (role, parts)


def region_mark(module: nn.Module) -> tuple[str, int] | None:
    """`mark_region`'s (role, parts) of this module, None where no region begins or ends."""
    return getattr(module, "_hetero_seq_region", None)


def add_sequence_scatter(module: nn.Module, name: str, comm: Comm) -> None:
    """Enter the region: the module's hidden-states input is cut to this rank's part of the sequence."""
    mark_region(module, "scatter", comm.size)

    def pre_hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return replace_first_input(name, args, kwargs, lambda x: scatter_seq(x, comm, SEQ_DIM))

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)


def add_output_map(module: nn.Module, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """`fn` applied to the module's output (a tensor, or the first element of a tuple), by a forward hook."""

    def hook(_: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return fn(output)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (fn(output[0]), *output[1:])
        raise ConfigError(f"{name} returned {type(output).__name__}: sequence_gather needs a tensor (or tuple) output")

    module.register_forward_hook(hook)


def add_sequence_gather(module: nn.Module, name: str, comm: Comm) -> None:
    """Leave the region: the module's output is gathered into the whole sequence on every rank."""
    mark_region(module, "gather", comm.size)
    add_output_map(module, name, lambda x: gather_seq_exact(x, comm, SEQ_DIM))


def all_reduce_grads(params: list[nn.Parameter], comm: Comm) -> None:
    """Sum these parameters' gradients over the tensor group as autograd computes them (before accumulation),
    so every rank accumulates the gradient of the whole sequence."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(out)
        return out

    for p in params:
        if p.requires_grad and not getattr(p, "_hetero_sp_reduced", False):
            p.register_hook(hook)
            p._hetero_sp_reduced = True  # a tied or shared parameter is reduced once, not once per module
            p._hetero_grad_comm = comm  # a tiled weight's tiles bypass the hook ([Note: hooks on tiled gradients])


def region_at(units: Sequence[Sequence[str]], plan: Mapping[str, str], start: int) -> bool:
    """Whether pipeline unit `start` (an index into the whole model's `units`, in order, each given by the model's
    FQNs it runs) takes its input inside the region: a unit before it holds ``sequence_scatter`` (`plan`: the whole
    model's), and none before it ``sequence_gather``. A Hugging Face unit runs modules under other names than its
    own ("embeddings" runs GPT-2's `transformer.drop`), so it is found by what it runs."""

    def holders(style: str) -> list[int]:
        names = [n for n, s in plan.items() if style in s.split("+")]
        return [i for i, u in enumerate(units) if any(n == f or n.startswith(f"{f}.") for n in names for f in u)]

    scatter, gather = holders("sequence_scatter"), holders("sequence_gather")
    return bool(scatter) and min(scatter) < start and all(start <= g for g in gather)
