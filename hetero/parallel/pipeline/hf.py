"""Hugging Face causal LMs as pipeline units: embeddings, each decoder layer, final norm and head.

[Note: pipelining a Hugging Face decoder]
A Hugging Face causal LM does not run its children in order: `LlamaForCausalLM`'s top-level children are the base
model and the head, and the base model computes, once per forward, what every layer takes besides the hidden
states (position ids, the rotary embeddings, the causal mask). The pipeline cuts it instead into the units of a
decoder, each a small wrapper that calls the model's own modules:
 - "embeddings": the token embedding (GPT-2: plus the position embedding, then dropout; Gemma's scales by
   sqrt(hidden) inside its own module), from input ids;
 - one unit per decoder layer, named by the layer's FQN ("model.layers.3"), which computes the layer's other
   arguments from its input as the base model does (the base model's own rotary module and Hugging Face's
   `create_causal_mask`, or `create_sliding_window_causal_mask` for a sliding layer, so the attention
   implementation picks the mask it expects: none for SDPA's causal kernel, an additive one for eager attention),
   cached per shape and batch: the layers of a stage share them;
 - "head": final norm, LM head (Gemma 2 and 3: the final logits soft-capped) and, given labels, the model's own
   `loss_function` (per instance, so a tensor layout's vocabulary-parallel loss replaces it as it does in the
   whole model).
Which masks and rotary tables a family's layers take is its `Family` row: one causal mask (Llama, Gemma, GPT-2), a
sliding-window mask for every layer when the config has a window (Mistral, Phi-3), or each layer the mask of its
`config.layer_types` entry (Qwen2, Qwen3, Gemma 2, Gemma 3; Gemma 3 also a rotary table per layer type).
A bare base model (`LlamaModel`, `GPT2Model`: a reward or embedding model trained with a loss_fn) is cut the same
way, its last unit "norm" the final norm alone, returning the last hidden states as its forward does. Cut by its
top-level children it ran them in registration order, which is not its forward (Llama's rotary module last, GPT-2's
position embedding given the token embeddings), and failed deep in a layer ('cannot unpack non-iterable
NoneType').
The wrappers are not registered in the model: parameter names and `state_dict` keys stay the model's. Each unit
owns the model's modules it runs (`parts`), which the splitter removes from the ranks that do not keep the unit.
An embedding tied to the head (GPT-2) is then held by the first and last stages, each under its own name there
(`transformer.wte.weight`, `lm_head.weight`): see [Note: parameters tied across stages] in tied.py.

[Note: a padded batch through the stages]
The inputs are token ids, or a padded batch as a dict: `input_ids`, `attention_mask` ([batch, sequence], 1 keep, 0
padding) and optionally `position_ids`, as the model takes them. Every layer needs its micro-batch's mask and
positions, which are the same on every stage; only the activations travel between stages. Every rank calls
`train_batch` / `eval_batch` with the batch and splits it into the same micro-batches, so each stage reads them from
its own copy: the stage's chunk is bound to its micro-batch (`bind`) before its units run. A stage whose copy
differs (ids alone on a later stage while the first has a mask: its layers would attend to the padding, a silently
other loss) is caught at the first activation it receives: each carries in its header a digest of the mask and
positions the sender used (`side_digest`), which the receiver compares with its own ([Note: transfers] in
runtime.py). Without a dict nothing changes: the digest is 0, and a later stage may be given no inputs.

[Note: a split sequence through the stages]
Under a sequence split (Megatron-SP, Ulysses, ring: the same plan's region) the activations a stage receives inside
the region are this rank's 1/t of the sequence, [batch, seq/t, hidden], while the layers' attention needs masks and
rotary tables of the whole sequence: Megatron-SP gathers attention's input before the projections, Ulysses and ring
slice the whole tables and mask to the rank's positions. A layer unit built them from its input's length, so every
sequence split was refused with a pipeline of these models. Now a layer unit whose input is inside the region
(`split_sequence`) builds them for t times its input's length, from the micro-batch's whole mask and positions,
which every rank of the group holds (t is the group's size; ring's zig-zag too keeps 1/t per rank). The engine cuts
the model before the layout, and the stage holding `sequence_scatter` is gone from the others, so setup.py tells each
stage's units from the whole model's plan (`region_at`); the estimator lays the whole model out before cutting it,
and its units read the region's marks on the modules (`_split_by_marks`). Llama's first decoder layer holds the
scatter itself: its unit's input is whole, the layer's own pre-hook cuts it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hetero.errors import ConfigError
from hetero.parallel.sequence import region_mark


@dataclass(frozen=True)
class Family:
    """What hf.py reproduces of a family's base-model forward."""

    embeds: tuple[str, ...] = ("embed_tokens",)  # the base model's modules the embeddings unit owns
    layers: str = "layers"  # its ModuleList of decoder layers
    norm: str = "norm"  # its final norm
    rotary: str = "shared"  # "shared": one table for every layer; "by_type": one per layer type; "none": GPT-2
    masks: str = "causal"  # "causal"; "window": sliding for every layer when config.sliding_window; "by_type"
    softcap: bool = False  # the causal LM soft-caps its logits by config.final_logit_softcapping


FAMILIES = {  # base-model class -> the forward reproduced here
    "LlamaModel": Family(),
    "GemmaModel": Family(),  # the sqrt(hidden) scale is in its embedding module
    "MistralModel": Family(masks="window"),
    "Phi3Model": Family(masks="window"),
    "Qwen2Model": Family(masks="by_type"),
    "Qwen3Model": Family(masks="by_type"),
    "Gemma2Model": Family(masks="by_type", softcap=True),
    "Gemma3TextModel": Family(masks="by_type", rotary="by_type", softcap=True),
    "GPT2Model": Family(embeds=("wte", "wpe", "drop"), layers="h", norm="ln_f", rotary="none"),
}
GEMMAS = ("GemmaModel", "Gemma2Model", "Gemma3TextModel")
SIDE = ("attention_mask", "position_ids")  # what a padded batch brings besides the ids: every layer reads them


@dataclass
class HeadOutput:
    """What the head unit returns given labels: the model's loss and the logits."""

    loss: torch.Tensor
    logits: torch.Tensor


def is_hf_decoder(model: nn.Module) -> bool:
    """A Hugging Face model with a base model distinct from itself (a causal LM around a decoder), or a bare base
    model of a family reproduced here."""
    base = getattr(model, "base_model", None)
    if not hasattr(model, "config") or not isinstance(base, nn.Module):
        return False
    return base is not model or type(model).__name__ in FAMILIES


def hf_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's pipeline units ([Note: pipelining a Hugging Face decoder]); a clear error for another family."""
    base = model.base_model
    family = FAMILIES.get(type(base).__name__)
    if family is None:
        raise ConfigError(
            f"parallel.pipeline: {type(model).__name__} (base {type(base).__name__}) is not a Hugging Face decoder "
            f"hetero can pipeline (supported: {', '.join(FAMILIES)}); pipeline a model whose forward runs its "
            "top-level children in order (an nn.Sequential, or a module like hetero.models.gpt_pipe.GPTPipe)"
        )
    _check_family(model, base)
    names = {id(m): n for n, m in model.named_modules()}
    bare = base is model  # a base model alone: no head, its output the last hidden states
    head = None if bare else model.get_output_embeddings()
    if not bare and (head is None or id(head) not in names):
        raise ConfigError(f"parallel.pipeline: {type(model).__name__} has no output embeddings (LM head) to pipeline")
    prefix = f"{names[id(base)]}." if names[id(base)] else ""
    ctx = _Context(model, base, family)
    embeds = {n: getattr(base, n) for n in family.embeds}
    layers, norm = getattr(base, family.layers), getattr(base, family.norm)
    first = Embeddings(ctx, embeds, [f"{prefix}{n}" for n, m in embeds.items() if _has_state(m)])
    first.runs = [f"{prefix}{n}" for n in embeds]  # GPT-2's dropout too, which holds its sequence_scatter
    units: list[tuple[str, nn.Module]] = [("embeddings", first)]
    lname = names[id(layers)]
    units += [(f"{lname}.{i}", Layer(ctx, layer, f"{lname}.{i}", int(i))) for i, layer in layers.named_children()]
    last = Head(ctx, norm, head, [f"{prefix}{family.norm}"] + ([] if bare else [names[id(head)]]))
    units.append(("norm" if bare else "head", last))
    _split_by_marks(units)
    return units


def _split_by_marks(units: list[tuple[str, nn.Module]]) -> None:
    """Units made of a model laid out already (the estimator's meta copy: it lays out the whole model, then cuts
    it) learn from the region's marks which of them take a slice of the sequence; the engine cuts first and tells
    its stages from the whole plan instead (setup.py). [Note: a split sequence through the stages]"""
    parts = 1
    for _, unit in units:
        split_sequence(unit, parts)
        for m in unit.modules():
            mark = region_mark(m)
            if mark is not None:
                parts = mark[1] if mark[0] == "scatter" else 1


def _check_family(model: nn.Module, base: nn.Module) -> None:
    """What a family's row does not reproduce is refused by name, before anything is cut."""
    name, config = type(base).__name__, model.config
    if name in GEMMAS and "Scaled" not in type(base.embed_tokens).__name__:
        raise ConfigError(
            f"parallel.pipeline: this transformers' {name} scales its embeddings by sqrt(hidden) in its forward, not "
            "in its embedding module; the pipeline's embeddings unit runs the module alone. Use a transformers whose "
            "Gemma embedding scales itself (GemmaTextScaledWordEmbedding)"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ConfigError(
            f"parallel.pipeline: {type(model).__name__} with use_bidirectional_attention is not pipelined (its "
            "masks are not the causal ones hetero builds per layer); pipeline it causal or without a pipeline"
        )


def _has_state(m: nn.Module) -> bool:
    return any(True for _ in m.parameters()) or any(True for _ in m.buffers())


def side_inputs(batch: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A micro-batch's attention mask and position ids (None where not given; both None for a tensor of ids)."""
    if not isinstance(batch, Mapping):
        return None, None
    mask, pos = (batch.get(k) for k in SIDE)
    return mask, pos


def side_digest(batch: Any) -> torch.Tensor | None:
    """An int64 digest of a micro-batch's mask and positions (their shapes and values, on their device), None
    without them; never raises: a malformed batch is refused by `bind`, under the pipeline's halting."""
    parts = []
    for i, t in enumerate(side_inputs(batch)):
        if not isinstance(t, torch.Tensor):
            continue
        flat = t.detach().reshape(-1).long()
        # Distinct pseudo-random weights per element: masks differing anywhere give different sums.
        w = (torch.arange(1, flat.numel() + 1, device=flat.device) * 2654435761) % 2147483629 + 1
        shape = sum((d + 1) * 1000003**k for k, d in enumerate(t.shape))
        parts.append((flat * w).sum() * (2 * i + 3) + shape)
    return torch.stack(parts).sum() if parts else None


def check_batch(batch: Mapping, model: nn.Module) -> None:
    """A padded batch's keys and shapes, checked: a ConfigError saying what to pass."""
    what = f"a pipelined {type(model).__name__}"
    extra = sorted(str(k) for k in batch if k not in ("input_ids", *SIDE))
    if extra:
        hint = " (pass labels as the second argument of train_batch / eval_batch)" if "labels" in extra else ""
        raise ConfigError(
            f"{what} takes a batch as token ids, or a dict of input_ids, attention_mask and optionally position_ids; "
            f"got keys {', '.join(extra)} besides{hint}: token type ids and embeddings are not passed between stages"
        )
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ConfigError(f"{what}: input_ids must be a [batch, sequence] tensor of token ids, got {_shape(ids)}")
    mask, pos = side_inputs(batch)
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape):
        raise ConfigError(
            f"{what}: attention_mask must be a [batch, sequence] tensor like input_ids {tuple(ids.shape)} (1 for a "
            f"token, 0 for padding), got {_shape(mask)}"
        )
    if pos is not None and (not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[1] != ids.shape[1]
                            or pos.shape[0] not in (1, ids.shape[0])):  # fmt: skip
        raise ConfigError(
            f"{what}: position_ids must be a [batch or 1, sequence] tensor for input_ids {tuple(ids.shape)}, got "
            f"{_shape(pos)}"
        )


def _shape(t: Any) -> str:
    return f"a tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


class _Context:
    """What the layers take besides the hidden states, computed as the base model does, once per input shape and
    micro-batch."""

    def __init__(self, model: nn.Module, base: nn.Module, family: Family) -> None:
        self.config = model.config
        self.family = family
        self.model = model  # its loss_function (a tensor layout replaces it per instance)
        self.rotary = getattr(base, "rotary_emb", None)  # the base model's rotary embedding (buffers only)
        self.side: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # the bound micro-batch's
        self._key: tuple | None = None
        self._value: dict[str, dict[str, Any]] = {}  # layer type -> the layer's keyword arguments

    def bind(self, batch: Any) -> None:
        """The micro-batch the next units run on ([Note: a padded batch through the stages])."""
        if isinstance(batch, Mapping):
            check_batch(batch, self.model)
        self.side = side_inputs(batch)

    def layer_type(self, index: int) -> str:
        if self.family.masks == "by_type":
            return self.config.layer_types[index]
        window = self.family.masks == "window" and getattr(self.config, "sliding_window", None) is not None
        return "sliding_attention" if window else "full_attention"

    def of(self, x: torch.Tensor, index: int, parts: int = 1) -> dict[str, Any]:
        """Layer `index`'s arguments besides `x`, whose sequence is one of `parts` equal slices of the micro-batch's
        ([Note: a split sequence through the stages])."""
        mask, pos = self.side
        if parts > 1:  # the whole sequence's shape, dtype and device: a view, nothing allocated
            x = x[:, :1].expand(x.shape[0], x.shape[1] * parts, *x.shape[2:])
        key = (tuple(x.shape[:2]), x.dtype, x.device, mask, pos)
        if self._key is None or not _same(key, self._key):  # shared by micro-batches without a mask
            if mask is not None and mask.shape[0] != x.shape[0]:
                raise ConfigError(
                    f"the attention mask has {mask.shape[0]} rows and the activations {x.shape[0]}: a grid tensor "
                    "mode (2d, 2.5d, 3d) cuts the batch's rows, and a padded batch through a pipeline is not cut "
                    "with them; pass the ids alone there, padded on the right with labels -100 at the padding"
                )
            self._key, self._value = key, {}
        kind = self.layer_type(index)
        if kind not in self._value:
            with torch.no_grad():  # position ids, masks and rotary tables need no gradient
                self._value[kind] = self._compute(x, mask, pos, kind)
        return self._value[kind]

    def _compute(self, x: torch.Tensor, mask: Any, pos: Any, kind: str) -> dict[str, Any]:
        if pos is None:
            pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        # On the meta device (the balancer counting FLOPs of a model built there) the mask's values do not matter, and
        # transformers looks for packed sequences in given positions with `.item()`, which meta tensors refuse.
        mask_pos = None if x.is_meta else pos
        value: dict[str, Any] = {
            "attention_mask": causal_mask(self.config, x, mask, mask_pos, sliding=kind != "full_attention")
        }
        if self.family.rotary == "none":
            return value
        if self.family.rotary == "by_type":
            tables = self.rotary(x, pos, kind)
        else:
            shared = next((v for v in self._value.values() if "position_embeddings" in v), None)
            tables = shared["position_embeddings"] if shared is not None else self.rotary(x, pos)
        return {**value, "position_ids": pos, "position_embeddings": tables}

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """GPT-2's position embedding's ids: the micro-batch's, else counted from 0."""
        pos = self.side[1]
        return pos if pos is not None else torch.arange(ids.shape[-1], device=ids.device).unsqueeze(0)


def _same(a: tuple, b: tuple) -> bool:
    """Keys equal: shapes and dtypes by value, the mask and positions by identity (a micro-batch's own tensors)."""
    return a[:3] == b[:3] and a[3] is b[3] and a[4] is b[4]


def causal_mask(config: Any, x: torch.Tensor, mask: Any, pos: torch.Tensor, *, sliding: bool = False) -> Any:
    """Hugging Face's causal mask (sliding: its sliding-window one) for hidden states `x` and a 2-D padding mask or
    None (no cache), across its signatures (4.5x named the embeddings `input_embeds` and took `cache_position`; 5.2x
    renamed `past_key_values` `cache`)."""
    from transformers import masking_utils

    fn = masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
    params = inspect.signature(fn).parameters
    kw: dict[str, Any] = {"config": config, "attention_mask": mask, "position_ids": pos}
    kw["cache" if "cache" in params else "past_key_values"] = None
    kw["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = x
    if "cache_position" in params:
        kw["cache_position"] = torch.arange(x.shape[1], device=x.device)
    return fn(**kw)


def split_sequence(unit: nn.Module, parts: int) -> None:
    """A decoder layer unit whose input holds one of `parts` slices of the sequence (inside a sequence split's
    region): its masks and rotary tables stay the whole sequence's ([Note: a split sequence through the stages]);
    another unit: nothing (the embeddings and head take their inputs whole, GPT-2's position ids from the ids)."""
    if isinstance(unit, Layer):
        unit.sequence_parts = parts


def owned(name: str, unit: nn.Module) -> list[str]:
    """The model's FQNs a pipeline unit runs: a Hugging Face unit's `runs`, another unit's own name."""
    return list(unit.runs) if isinstance(unit, _Unit) else [name]


def bind_microbatch(unit: nn.Module, batch: Any) -> None:
    """A Hugging Face unit: run the next units on this micro-batch's mask and positions ([Note: a padded batch
    through the stages]); another module: nothing."""
    if isinstance(unit, _Unit):
        unit.ctx.bind(batch)


def microbatch_digest(unit: nn.Module, batch: Any) -> torch.Tensor | None:
    """A Hugging Face unit: `side_digest` of the micro-batch; another module: None (nothing to compare)."""
    return side_digest(batch) if isinstance(unit, _Unit) else None


class _Unit(nn.Module):
    """A unit: the model's modules it runs are its children (parameters, `.to`), the context is not."""

    def __init__(self, ctx: _Context, parts: list[str]) -> None:
        super().__init__()
        object.__setattr__(self, "ctx", ctx)  # shared by the model's units; not a submodule
        self.parts = parts  # the model's FQNs of the modules this unit owns: removed where it is not kept
        self.runs = parts  # the model's FQNs of the modules it runs (besides `parts`, stateless ones): where plans sit


class Embeddings(_Unit):
    def __init__(self, ctx: _Context, modules: dict[str, nn.Module], parts: list[str]) -> None:
        super().__init__(ctx, parts)
        for name, m in modules.items():
            self.add_module(name, m)

    def forward(self, input_ids: torch.Tensor | Mapping[str, torch.Tensor]) -> torch.Tensor:
        if isinstance(input_ids, Mapping):
            self.ctx.bind(input_ids)
            input_ids = input_ids["input_ids"]
        elif isinstance(input_ids, torch.Tensor):
            self.ctx.bind(None)
        else:
            raise ConfigError(
                f"a pipelined {type(self.ctx.model).__name__} takes its inputs as a tensor of token ids, or a dict of "
                f"input_ids, attention_mask and optionally position_ids; got {type(input_ids).__name__}"
            )
        if self.ctx.family.rotary != "none":
            return self.embed_tokens(input_ids)
        x = self.wte(input_ids)
        return self.drop(x + self.wpe(self.ctx.positions(input_ids)).to(x.device))


class Layer(_Unit):
    def __init__(self, ctx: _Context, layer: nn.Module, name: str, index: int) -> None:
        super().__init__(ctx, [name])
        self.layer = layer
        self.index = index  # the layer's place in the model: its type (full or sliding attention)
        self.sequence_parts = 1  # its input holds 1/parts of the sequence: [Note: a split sequence through the stages]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x, **self.ctx.of(x, self.index, self.sequence_parts))
        return out[0] if isinstance(out, tuple) else out  # transformers 4 returned (hidden_states, ...)


class Head(_Unit):
    def __init__(self, ctx: _Context, norm: nn.Module, head: nn.Module | None, parts: list[str]) -> None:
        super().__init__(ctx, parts)
        self.norm, self.head = norm, head  # head None: a bare base model, whose output is the last hidden states

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor | HeadOutput:
        """The logits; with labels, the model's own loss too (labels as the model takes them: unshifted)."""
        if self.head is None:
            if labels is not None:
                raise ConfigError(
                    f"{type(self.ctx.model).__name__} has no head and computes no loss: pass loss_fn to train_batch "
                    "and eval_batch (it takes the last hidden states and the labels)"
                )
            return self.norm(x)
        logits = self.head(self.norm(x))
        cap = getattr(self.ctx.config, "final_logit_softcapping", None) if self.ctx.family.softcap else None
        if cap is not None:  # as Gemma 2 and 3's causal LM does it
            logits = torch.tanh(logits / cap) * cap
        if labels is None:
            return logits
        loss = self.ctx.model.loss_function(logits, labels, vocab_size=self.ctx.config.vocab_size)
        return HeadOutput(loss=loss, logits=logits)
