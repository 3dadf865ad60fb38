"""Which layers can compute on a weight split into tiles, and so which parameters may be split: see [Note: computing
on tiles] in `tiling.py`."""

from __future__ import annotations

import sys

from torch import nn


def _conv1d_class() -> type | None:
    """transformers' Conv1D, if transformers is loaded (a model holding one has imported it)."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return getattr(utils, "Conv1D", None)


def layer_kind(module: nn.Module) -> str | None:
    """Which tiled computation a module gets, or None. Its class must be one of the three layers, or a subclass that
    overrides `forward` (as Hugging Face's scaled and positional embeddings do: their `super().forward` then computes
    on the tiles); a subclass that does not (MultiheadAttention's out_proj, whose parent reads its weight itself)
    is left whole."""
    cls = type(module)
    for base, kind in bases():
        if isinstance(module, base) and (cls is base or cls.forward is not base.forward):
            if kind == "embedding" and (module.max_norm is not None or module.scale_grad_by_freq or module.sparse):
                return None  # these change the weight in forward, or its gradient's meaning
            return kind
    return None


def bases() -> list[tuple[type, str]]:
    out = [(nn.Linear, "linear"), (nn.Embedding, "embedding")]
    conv = _conv1d_class()
    if conv is not None:
        out.append((conv, "conv1d"))
    return out


def tile_rows(model: nn.Module) -> dict[int, int]:
    """Parameters that may be split into tiles: id -> elements per dim-0 row. A parameter qualifies when every module
    holding it is a tileable layer (see [Note: computing on tiles]) holding it as `weight`."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(p), []).append((module, name))
            params[id(p)] = p
    out: dict[int, int] = {}
    for key, held in holders.items():
        p = params[key]
        if p.dim() != 2 or getattr(p, "_hetero_tp", None) is not None or _users_hooks(p):
            continue
        if all(name == "weight" and layer_kind(m) is not None for m, name in held):
            out[key] = p.shape[1]
    return out


def _users_hooks(p: nn.Parameter) -> bool:
    """Whether a gradient hook other than hetero's own sequence-parallel one is registered on `p`: a hook sees the
    whole gradient, which a tiled weight never has ([Note: hooks on tiled gradients] in `tiling.py`), so such a
    weight stays whole."""
    ours = 1 if getattr(p, "_hetero_sp_reduced", False) else 0
    return len(p._backward_hooks or {}) > ours or bool(p._post_accumulate_grad_hooks)
