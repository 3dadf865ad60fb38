"""Hugging Face `generate` on a model whose every forward gathers its parameters from the other ranks.

[Note: generating in step]
At stage 3 each forward gathers the parameters of each block from the data-parallel ranks, so every rank must run as
many forwards as the others. `generate` runs one forward per new token until every sequence of this rank's own batch
has ended (its EOS token, a stop string): ranks given other prompts end at other lengths, and the first to end leaves
the others waiting in a gather, which fails after comm_timeout (ten minutes by default) naming a rank that is alive
and well. transformers' remedy is `synced_gpus=True`: a rank whose sequences ended runs forwards on, their outputs
dropped, until an all-reduce over the default group says every rank has ended. `generate` turns it on by itself under
DeepSpeed ZeRO-3 and FSDP, recognised by flags of theirs that hetero does not set (a global DeepSpeed config; an FSDP
marker that torch.compile and torch's FSDP read too). So where the model's forward gathers across ranks, hetero
gives each generating module of the model (a class whose `generate` takes `synced_gpus`: the model itself, or the
model inside a PEFT wrapper, whose `generate` calls it) an instance `generate` whose `synced_gpus` defaults to True;
passing `synced_gpus` still decides. Only where hetero's ranks are the whole job: that all-reduce runs over the
default group, and a process outside hetero's group would not join it. Removed when the engine closes. Stages 0-2
gather nothing in forward, and a tensor-parallel group's ranks agree on each batch and end together.

Under a pipeline (parallel.pipeline > 1) a rank holds its stage's layers only, the others' set to None, and
`generate` runs the whole model on each rank: it failed inside the model ("'NoneType' object is not callable"). Under
a sequence split (parallel.sequence) each decode step's one new token cannot be cut into the split's parts: it failed
at the first step, advising to pad the sequence, which generate's caller cannot do. There the generating modules get
a `generate` that says so and what to do instead (`hetero.models.generate_greedy`, through eval_batch).

[Note: one prompt and one stream per tensor group]
The ranks of a tensor-parallel group (1D, Megatron-SP, the grid modes) run one model on one batch; `generate` runs the
model directly, not through `engine(...)`, so no batch agreement ([Note: a batch agreed over the model-parallel
group] in hetero/parallel/agree.py) saw its prompts. Ranks given other prompts (a loader sharded by global rank
instead of data-parallel rank) computed every token from a mix of both with no error, and so did ranks that sample
(`do_sample`) from streams seeded apart (`torch.manual_seed(seed + rank)`): each drew another token from the same
whole logits, and from then on each fed its own sequence. So there each generating module's `generate` first agrees
over the group on its arguments and, where it samples, on a digest of the random streams it draws from (the CPU's
and the compute device's): one small exchange per call. The logits are whole and the same on every rank, so a group
that agrees at the start picks the same tokens throughout. They are the plain model's tokens for the same seed, at
every tensor degree, greedy or sampled (temperature, top-k, top-p), up to the rounding of the sums' other order: a
forward of the model in eval mode draws nothing from the shared stream the sampler draws from, as the plain model's
([Note: dropout under tensor parallelism] in hetero/parallel/tp_rng.py; each forward used to move it, and a seeded
sampling run drew other tokens than the plain one's). A model left in training mode drops other elements than the
plain model (each rank draws its part's masks from its own stream), so its tokens differ, alike on every rank.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hetero.errors import HeteroError


def keep_ranks_generating(
    model: nn.Module,
    *,
    synced: bool,
    agree: Callable[[Any, str], None] | None = None,
    device_rng: Callable[[], torch.Tensor | None] = lambda: None,
) -> Callable[[], None]:
    """Give each generating module of `model` a `generate` with `synced_gpus` True by default where `synced`
    ([Note: generating in step]) and, with `agree` (a tensor group's batch agreement), one that agrees on its
    arguments and random streams first ([Note: one prompt and one stream per tensor group]); `device_rng`: the
    compute device's generator state (None on the CPU). Returns what undoes it."""
    changed = [m for m in model.modules() if _takes_synced_gpus(type(m))]
    for m in changed:
        m.generate = types.MethodType(functools.partial(_generate_in_step, synced, agree, device_rng), m)

    def undo() -> None:
        for m in changed:
            m.__dict__.pop("generate", None)

    return undo


def refuse_generating(model: nn.Module, *, pipeline: bool, sequence_parts: int) -> Callable[[], None]:
    """Give each generating module of `model`, cut into pipeline stages or run with its sequence split over
    `sequence_parts` parts, a `generate` that raises a clear error ([Note: generating in step]); returns what undoes
    it."""
    if pipeline:
        why = (
            "parallel.pipeline > 1: this rank holds only its pipeline stage's layers (the others' are None here), and "
            "generate runs the whole model on one rank"
        )
    else:
        why = (
            f"a sequence split (parallel.sequence) cuts every sequence into {sequence_parts} equal parts, and each "
            "step of generate feeds one new token (the cache holds the rest) or a sequence one longer than the last"
        )
    changed = [m for m in model.modules() if callable(getattr(type(m), "generate", None))]
    for m in changed:
        m.generate = types.MethodType(functools.partial(_refused, why), m)

    def undo() -> None:
        for m in changed:
            m.__dict__.pop("generate", None)

    return undo


def _refused(why: str, self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    raise HeteroError(
        f"{type(self).__name__}.generate with {why}. Decode greedily with hetero.models.generate_greedy(engine, "
        "input_ids, max_new_tokens=..., block_size=...) on every rank (a block_size the split divides: it pads every "
        "step to that length, through engine.eval_batch, which gives every rank its batch's whole logits), or take "
        "the weights (engine.full_state_dict() on every rank) into a model of its own and generate there"
    )


def _takes_synced_gpus(cls: type) -> bool:
    generate = getattr(cls, "generate", None)
    if not callable(generate):
        return False
    try:
        return "synced_gpus" in inspect.signature(generate).parameters
    except (TypeError, ValueError):  # a builtin or an extension's method: no signature to read
        return False


def _generate_in_step(
    synced: bool,
    agree: Callable[[Any, str], None] | None,
    device_rng: Callable[[], torch.Tensor | None],
    self: nn.Module,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """The class's `generate`, every rank running forwards until all have ended unless `synced_gpus` is given, the
    tensor group agreed on what it generates from."""
    if agree is not None:
        where = f"{type(self).__name__}.generate"
        streams = _streams(self, kwargs, device_rng)  # the key names what to do: the error shows it beside the values
        agree({"args": args, "kwargs": kwargs, "random streams (sampling: seed these ranks alike)": streams}, where)
    if synced and kwargs.get("synced_gpus") is None:
        kwargs["synced_gpus"] = True
    return type(self).generate(self, *args, **kwargs)


def _streams(model: nn.Module, kwargs: dict[str, Any], device_rng: Callable[[], torch.Tensor | None]) -> int:
    """A digest of the random streams a sampling `generate` draws from; 0 where it draws none (greedy, beam)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    sampling = kwargs.get("do_sample", getattr(config, "do_sample", False))
    if not sampling:
        return 0
    digest = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=8)
    on_device = device_rng()
    if on_device is not None:
        digest.update(on_device.cpu().numpy().tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True)
