"""A Hugging Face model's key/value cache, off in the forwards whose checkpointed blocks recompute.

[Note: no KV cache under recomputation]
A checkpointed block runs its forward twice, once in forward and once in backward. A decoder layer given a KV cache
appends its keys and values to it on each run: the recomputation appends them again (the cache of a training forward
held every layer's keys twice over, its memory doubled, and on transformers 4 the recomputed attention read keys twice
as long as those saved, and backward failed). A training forward has no use for a cache, so in a forward with autograd
(the one where hetero's checkpointed blocks recompute, `ActivationMemory._forward`) every model that holds a chosen
block and takes `use_cache` is called with `use_cache=False`, as transformers' own `gradient_checkpointing_enable`
does in training. The model's config is left as it is: an evaluation or `generate` (without autograd) keeps its cache,
and a `save_pretrained` writes the user's `use_cache`, not hetero's (setting `config.use_cache = False` for good, as
hetero did before, wrote `"use_cache": false` into every checkpoint's config.json and made evaluation forwards lose
their cache).
A `use_cache=True` given explicitly to such a forward is overridden with a warning, as transformers does.
A cache object given explicitly (`past_key_values=DynamicCache()`, transformers 5's `cache=`) reaches the blocks
whatever `use_cache` says, and each block wrote into it in forward and again in its recomputation (the cache of one
forward and backward held every layer's keys twice, and a recomputation attended over keys its forward never saw). So
in those forwards the chosen blocks themselves are called without it (`cache`, `past_key_values`, `past_key_value`,
`layer_past`, `cache_params` set to None), with a warning, as transformers' `GradientCheckpointingLayer` does: the
cache comes back as it was given (empty, where it was), exactly as under transformers' own gradient checkpointing.
Filling it once instead would need the recomputation to see the cache as it stood before its forward (a prefix cache
already holds keys), which no cache class offers. Blocks that only read a cache (transformers'
`_can_checkpoint_with_cache`) keep it, as there.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

log = logging.getLogger("hetero.activation")


def cache_off_when_recomputing(model: nn.Module, blocks: Iterable[str]) -> Callable[[], None]:
    """Turn the KV cache off in forwards with autograd of every module of `model` that holds one of `blocks` (qualified
    names) or is one, and takes `use_cache` with a config that has it ([Note: no KV cache under recomputation]); call
    it before the blocks' forwards are replaced (it reads their signatures). Returns what undoes it."""
    blocks = list(blocks)  # read twice
    parts = [name.split(".") for name in blocks]
    holding = {".".join(p[:i]) for p in parts for i in range(len(p) + 1)}  # the blocks and the modules above them
    warned = [False]  # an explicit use_cache=True overridden: warned once per model
    dropped = [False]  # an explicit cache object kept from the blocks: warned once per model
    handles, hooked = [], []
    for name, m in model.named_modules():
        if name not in holding or not hasattr(getattr(m, "config", None), "use_cache"):
            continue  # holds no block, or not a Hugging Face model: its `use_cache`, if any, is no switch we know
        index = _position(m, "use_cache")
        if index is None:
            continue
        hook = functools.partial(_cache_off, index, warned)
        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
        hooked.append(name)
    for name in blocks:
        if not any(h == "" or name == h or name.startswith(h + ".") for h in hooked):
            continue  # not inside a Hugging Face model whose cache we turn off: its cache arguments are its own
        block = model.get_submodule(name)
        if getattr(block, "_can_checkpoint_with_cache", False):
            continue  # it only reads the cache (transformers' flag): recomputing it reads the same keys
        where = {k: i for k in _CACHE_ARGS if (i := _position(block, k)) is not None}
        if where:
            hook = functools.partial(_no_cache_object, where, dropped)
            handles.append(block.register_forward_pre_hook(hook, with_kwargs=True))
    if handles:
        log.info("activation checkpointing: the KV cache is off in forwards with autograd (the config is unchanged)")
    return lambda: [h.remove() for h in handles]


# The names under which transformers' decoder layers take a KV cache object (5: cache, layer_past; 4: the others).
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past", "cache_params")


def _position(module: nn.Module, arg: str) -> int | None:
    """Where `module.forward` takes `arg`: its position (sys.maxsize where it can only be given by keyword), or None
    where it takes none."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature (a builtin) takes no `use_cache` we can see
        return None
    positional = True  # parameters before a *args can be given by position
    for i, p in enumerate(params):
        if p.name == arg:
            return i if positional and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else sys.maxsize
        positional = positional and p.kind is not inspect.Parameter.VAR_POSITIONAL
    return None


def _cache_off(
    index: int, warned: list[bool], module: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    if not torch.is_grad_enabled():
        return None  # nothing recomputes: evaluation and generate keep the cache
    if index < len(args):
        given, args = args[index], (*args[:index], False, *args[index + 1 :])
    else:
        given, kwargs = kwargs.get("use_cache"), {**kwargs, "use_cache": False}
    if given and not warned[0]:
        warned[0] = True
        log.warning(
            "activation checkpointing: %s was called with use_cache=True in a forward with autograd; running it with "
            "use_cache=False, since each recomputation of a checkpointed block would fill the cache again (call it "
            "under torch.no_grad() to get a cache)",
            type(module).__name__,
        )
    return args, kwargs


def _no_cache_object(
    where: dict[str, int], dropped: list[bool], module: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    if not torch.is_grad_enabled():
        return None  # nothing recomputes: evaluation and generate fill the cache
    given = []
    for name, index in where.items():
        if index < len(args):
            if args[index] is not None:
                given.append(name)
                args = (*args[:index], None, *args[index + 1 :])
        elif kwargs.get(name) is not None:
            given.append(name)
            kwargs = {**kwargs, name: None}
    if not given:
        return None
    if not dropped[0]:
        dropped[0] = True
        log.warning(
            "activation checkpointing: %s was given a KV cache (%s) in a forward with autograd; running it without, "
            "as transformers' gradient checkpointing does, since its recomputation would write the keys into the "
            "cache a second time: the cache comes back unfilled (call the model under torch.no_grad() to fill it)",
            type(module).__name__,
            ", ".join(given),
        )
    return args, kwargs
