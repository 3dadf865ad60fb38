"""Checkpoint names as transformers 5 converts them when it loads: renamed keys and experts fused into one tensor.

[Note: transformers' checkpoint conversions]
transformers 5 keeps checkpoints in their original layout and converts them in `from_pretrained`: Mixtral's
`block_sparse_moe.experts.E.w1/w3/w2.weight` (one tensor per expert) become `mlp.experts.gate_up_proj` [E, 2I, H] and
`mlp.experts.down_proj` [E, H, I], and `save_pretrained` converts back, so every Mixtral, Qwen2/3-MoE, OLMoE or
DeepSeek checkpoint is in the old layout. `weights=` matched the files' names as they are and refused them. Here the
model's own conversion list (transformers' `get_model_conversion_mapping`) names, for each file key, the model key it
feeds. Renames are served under the new name. The fusions hetero applies are the ones these families use: experts
stacked along dim 0 (`MergeModulelist(dim=0)`), then the stacked projections concatenated along dim 1
(`Concatenate(dim=1)`); the fused tensor's elements are then the file tensors' elements in the order (expert, then
projection), so a range of them (a rank's share, a tile's rows) is read from the few file tensors it covers, never the
whole fused tensor. Another operation leaves its keys as they are: the mismatch is reported by name.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import torch
from torch import nn

log = logging.getLogger("hetero.zero")


class Converted:
    """A weight source seen under the model's names: each converted name is the flattened concatenation of file
    tensors (one for a rename). Same reading interface as `WeightSource`."""

    def __init__(self, source: Any, parts: dict[str, tuple[list[str], tuple[int, ...]]]) -> None:
        self.source = source
        self.parts = parts  # model name -> (file keys in element order, its shape)
        used = {k for keys, _ in parts.values() for k in keys}
        self._keys = [k for k in source.keys() if k not in used] + list(parts)  # noqa: SIM118 (not a dict)

    def keys(self) -> list[str]:
        return self._keys

    def shape(self, key: str) -> tuple[int, ...]:
        return self.parts[key][1] if key in self.parts else self.source.shape(key)

    def read(self, key: str) -> torch.Tensor:
        if key not in self.parts:
            return self.source.read(key)
        shape = self.parts[key][1]
        return self.read_elements(key, 0, math.prod(shape)).reshape(shape)

    def read_elements(self, key: str, a: int, b: int, into: memoryview | None = None) -> torch.Tensor:
        if key not in self.parts:
            return self.source.read_elements(key, a, b, into)
        out, at = [], 0
        for k in self.parts[key][0]:
            n = math.prod(self.source.shape(k))
            lo, hi = max(a, at), min(b, at + n)
            if lo < hi:
                out.append(self.source.read_elements(k, lo - at, hi - at).reshape(-1))
            at += n
        got = out[0] if len(out) == 1 else torch.cat(out)
        return got if into is None else torch.frombuffer(into, dtype=torch.uint8).view(got.dtype).copy_(got)


def converted(source: Any, model: nn.Module) -> Any:
    """`source` under the names a Hugging Face model's `from_pretrained` gives its keys (see the note above); the
    source itself for other models, or where nothing needs converting."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # no transformers, or one before 5: names are as saved
        return source
    if not isinstance(model, PreTrainedModel):
        return source
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    own = set(model.state_dict())
    parts: dict[str, tuple[list[str], tuple[int, ...]]] = {}
    fused: dict[str, list[tuple[int, int, str]]] = {}  # model name -> (expert, projection, file key)
    how: dict[str, Any] = {}
    for k in source.keys():  # noqa: SIM118 (a weight source, not a dict)
        if k in own:
            continue  # saved under the model's own names (hetero's consolidation, an older transformers' save)
        target, pattern = rename_source_key(k, renamings, converters)
        if pattern is None:
            if target != k:
                parts[target] = ([k], source.shape(k))
            continue
        conv = next(c for c in converters if pattern in c.source_patterns)
        ops = [(type(o), getattr(o, "dim", None)) for o in conv.operations]
        hit = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), k)
        if ops not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]) or hit is None:
            log.warning("weights: %s needs transformers' conversion %s, which hetero does not apply", k, conv)
            continue
        fused.setdefault(target, []).append((int(hit.group(1)), conv.source_patterns.index(pattern), k))
        how[target] = conv
    for target, members in fused.items():
        members.sort()
        experts = sorted({e for e, _, _ in members})
        projections = len(how[target].source_patterns)
        if experts != list(range(len(experts))) or len(members) != len(experts) * projections:
            continue  # some experts or projections missing: left as they are, reported by name
        first = [source.shape(k) for e, _, k in members if e == 0]
        shape = (len(experts), sum(s[0] for s in first), *first[0][1:])
        parts[target] = ([k for _, _, k in members], shape)
    return Converted(source, parts) if parts else source
