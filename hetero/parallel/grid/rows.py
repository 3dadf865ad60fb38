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

3D computes attention in the `alt` layout, whose rows are another part of the batch than `main`'s: rank (a, b, c)
embeds rows a q + c (`main`) and attends over rows a q + b (`alt`). A mask is read by attention alone (transformers
builds the 4-D mask from it and the activations' row count, and passes it to each attention), and position ids by
attention alone in a rotary model (the cos and sin tables), so in 3D the mask and the positions are cut to `alt`'s
rows and everything attention is given is on its rows without a word exchanged; the ids and token types are cut to
`main`'s. The one reader of positions in `main` is a position embedding (GPT-2's, style ``embedding``): told by
`ROWS_ON_ALT` for the call, it moves its ids back to `main`'s rows before its lookup (`main_rows` in layers.py).
Cutting the mask to `main`'s rows and moving what attention receives instead failed on the data: transformers
builds no 4-D mask for rows without padding (sdpa), so ranks whose rows were unpadded had nothing to exchange while
their peers did. A model whose code reads the mask or positions elsewhere in `main` would get `alt`'s rows there.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from hetero.parallel.grid.layers import IDS_CUT, ROWS_ON_ALT, check_rows, own_rows
from hetero.parallel.grid.mesh import Grid

ROW_INPUTS = ("attention_mask", "position_ids")  # whole-batch inputs that activations of b/B rows meet
CUT_ALONG = ("input_ids", "token_type_ids")  # cut with them (the vocabulary embedding gathers them back)


def _rows(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] > 1


def _cut(t: Any, name: str, grid: Grid) -> Any:
    if not _rows(t):
        return t
    if grid.mode == "3d" and name in ROW_INPUTS:  # read by attention, on alt's rows ([Note: row inputs under a grid])
        check_rows(t, grid, f"the {name}")
        return t.chunk(grid.batch_parts, 0)[grid.alt.batch.rank]
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
    tokens: list[Any] = []  # the context tokens of the calls in progress (a forward may nest in another)

    def get(args: list, kwargs: dict, name: str) -> Any:
        return kwargs[name] if name in kwargs else args[where[name]] if where[name] < len(args) else None

    def pre(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = list(args)
        tokens.append(())  # first: `post` runs (and pops) even when this hook raises
        whole = [get(args, kwargs, n).shape[0] for n in ROW_INPUTS if n in where and _rows(get(args, kwargs, n))]
        if not whole:
            return tuple(args), kwargs
        for name, i in where.items():
            if name in kwargs:
                kwargs[name] = _cut(kwargs[name], name, grid)
            elif i < len(args):
                args[i] = _cut(args[i], name, grid)
        alt = (ROWS_ON_ALT.set((grid, whole[0] // grid.batch_parts)),) if grid.mode == "3d" else ()
        tokens[-1] = (IDS_CUT.set(grid), *alt)
        return tuple(args), kwargs

    def post(*_: Any) -> None:
        for token in reversed(tokens.pop() if tokens else ()):
            token.var.reset(token)

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, always_call=True)
