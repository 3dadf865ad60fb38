"""A grid model's per-row inputs (attention masks, position ids) given for the whole batch, cut to this rank's rows.

[Note: row inputs under a grid]
A grid cuts the batch: the vocabulary embedding takes the whole ids and keeps this rank's rows (`own_rows`' order),
every activation after it holds b/B rows, and the loss takes the whole labels and keeps the same rows. An attention
mask or position ids for the whole batch ([b, s]: what `generate` passes, a padded batch's mask) would meet
activations of b/B rows inside the model, where transformers builds the causal mask and the rotary tables from them
(silently from the first b/B rows, where a mask's batch is read from the activations). So, on the way into the
module holding the grid head (a Hugging Face causal LM), a call that brings such an input has its ids, mask,
positions and token types cut to this rank's rows alike; the model's own code then sees one consistent batch of b/B
rows (GPT-2 reshapes the mask by the ids' batch), and the vocabulary embedding, told so through `IDS_CUT` for the
call, gathers the ids whole again (integers: a few bytes a token) before its lookup, which needs every row. A call
without such an input is left as it is: ids whole, nothing gathered. A one-row tensor ([1, s]) broadcasts and is
left whole.

3D computes attention in the `alt` layout, whose rows are another part of the batch than `main`'s, and which layout
reads a mask or the positions depends on the model (GPT-2 adds its position embedding in `main`, Llama's rotary
tables and every mask are used in attention): there the inputs are cut only when all their rows are equal (unpadded
prompts, as `generate` makes them), where any rows are the right ones, and a batch whose rows differ is refused.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from hetero.errors import ConfigError
from hetero.parallel.grid.layers import IDS_CUT, own_rows
from hetero.parallel.grid.mesh import Grid

ROW_INPUTS = ("attention_mask", "position_ids")  # whole-batch inputs that activations of b/B rows meet
CUT_ALONG = ("input_ids", "token_type_ids")  # cut with them (the vocabulary embedding gathers them back)


def _rows(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] > 1


def _cut(t: Any, name: str, grid: Grid) -> Any:
    if not _rows(t):
        return t
    if grid.mode == "3d" and name in ROW_INPUTS and not bool((t == t[:1]).all()):
        raise ConfigError(
            f"{name}: its rows differ (a padded batch), and tensor_mode '3d' computes attention on other rows than "
            "it embeds them, so no one cut of it fits both; pass rows of equal length without a mask, or use "
            "tensor_mode '2d' or '2.5d', which cut a padded batch's mask and positions with the batch"
        )
    return own_rows(t, grid, f"the {name}")


def cut_row_inputs(model: nn.Module, grid: Grid) -> None:
    """Cut `model`'s whole-batch row inputs to this rank's rows on every call that brings one ([Note: row inputs
    under a grid]); forward hooks, so the module and its names are unchanged."""
    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):  # no signature to read: nothing to cut by name
        return
    if not any(n in params for n in ROW_INPUTS):
        return
    where = {n: params.index(n) for n in ROW_INPUTS + CUT_ALONG if n in params}
    tokens: list[Any] = []  # IDS_CUT's tokens of the calls in progress (a forward may nest in another)

    def get(args: list, kwargs: dict, name: str) -> Any:
        return kwargs[name] if name in kwargs else args[where[name]] if where[name] < len(args) else None

    def pre(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = list(args)
        tokens.append(None)  # first: `post` runs (and pops) even when this hook raises
        if not any(_rows(get(args, kwargs, n)) for n in ROW_INPUTS if n in where):
            return tuple(args), kwargs
        for name, i in where.items():
            if name in kwargs:
                kwargs[name] = _cut(kwargs[name], name, grid)
            elif i < len(args):
                args[i] = _cut(args[i], name, grid)
        tokens[-1] = IDS_CUT.set(grid)
        return tuple(args), kwargs

    def post(*_: Any) -> None:
        token = tokens.pop() if tokens else None
        if token is not None:
            IDS_CUT.reset(token)

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, always_call=True)
