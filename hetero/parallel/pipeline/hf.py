"""Hugging Face causal LMs as pipeline units: embeddings, each decoder layer, final norm and head.

[Note: pipelining a Hugging Face decoder]
A Hugging Face causal LM does not run its children in order: `LlamaForCausalLM`'s top-level children are the base
model and the head, and the base model computes, once per forward, what every layer takes besides the hidden
states (position ids, the rotary embeddings, the causal mask). The pipeline cuts it instead into the units of a
decoder, each a small wrapper that calls the model's own modules:
 - "embeddings": the token embedding (GPT-2: plus the position embedding, then dropout), from input ids;
 - one unit per decoder layer, named by the layer's FQN ("model.layers.3"), which computes the layer's other
   arguments from its input as the base model does (the base model's own rotary module and Hugging Face's
   `create_causal_mask`, so the attention implementation picks the mask it expects: none for SDPA's causal kernel,
   an additive one for eager attention), cached per shape: the layers of a stage share them;
 - "head": final norm, LM head and, given labels, the model's own `loss_function` (per instance, so a tensor
   layout's vocabulary-parallel loss replaces it as it does in the whole model).
A bare base model (`LlamaModel`, `GPT2Model`: a reward or embedding model trained with a loss_fn) is cut the same
way, its last unit "norm" the final norm alone, returning the last hidden states as its forward does. Cut by its
top-level children it ran them in registration order, which is not its forward (Llama's rotary module last, GPT-2's
position embedding given the token embeddings), and failed deep in a layer ('cannot unpack non-iterable
NoneType').
The wrappers are not registered in the model: parameter names and `state_dict` keys stay the model's. Each unit
owns the model's modules it runs (`parts`), which the splitter removes from the ranks that do not keep the unit.
An embedding tied to the head (GPT-2) is then held by the first and last stages, each under its own name there
(`transformer.wte.weight`, `lm_head.weight`): see [Note: parameters tied across stages] in tied.py.
Only the families whose base-model forward is reproduced here are accepted (Llama, GPT-2); the inputs are token
ids without padding or attention masks, as the pipeline passes them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hetero.errors import ConfigError

FAMILIES = {"LlamaModel": "llama", "GPT2Model": "gpt2"}  # base-model class -> the forward reproduced below


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
    names = {id(m): n for n, m in model.named_modules()}
    bare = base is model  # a base model alone: no head, its output the last hidden states
    head = None if bare else model.get_output_embeddings()
    if not bare and (head is None or id(head) not in names):
        raise ConfigError(f"parallel.pipeline: {type(model).__name__} has no output embeddings (LM head) to pipeline")
    prefix = f"{names[id(base)]}." if names[id(base)] else ""
    ctx = _Context(model, base, family)
    if family == "llama":
        embeds = {"embed_tokens": base.embed_tokens}
        layers, norm = base.layers, ("norm", base.norm)
    else:
        embeds = {"wte": base.wte, "wpe": base.wpe, "drop": base.drop}
        layers, norm = base.h, ("ln_f", base.ln_f)
    first = Embeddings(ctx, embeds, [f"{prefix}{n}" for n, m in embeds.items() if _has_state(m)])
    units: list[tuple[str, nn.Module]] = [("embeddings", first)]
    lname = names[id(layers)]
    units += [(f"{lname}.{i}", Layer(ctx, layer, f"{lname}.{i}")) for i, layer in layers.named_children()]
    if bare:
        return units + [("norm", Head(ctx, norm[1], None, [f"{prefix}{norm[0]}"]))]
    return units + [("head", Head(ctx, norm[1], head, [f"{prefix}{norm[0]}", names[id(head)]]))]


def _has_state(m: nn.Module) -> bool:
    return any(True for _ in m.parameters()) or any(True for _ in m.buffers())


class _Context:
    """What the layers take besides the hidden states, computed as the base model does, once per input shape."""

    def __init__(self, model: nn.Module, base: nn.Module, family: str) -> None:
        self.config = model.config
        self.family = family
        self.model = model  # its loss_function (a tensor layout replaces it per instance)
        self.rotary = getattr(base, "rotary_emb", None)  # Llama: the base model's rotary embedding (buffers only)
        self._key: tuple | None = None
        self._value: dict[str, Any] = {}

    def of(self, x: torch.Tensor) -> dict[str, Any]:
        key = (tuple(x.shape[:2]), x.dtype, x.device)
        if key != self._key:  # position ids, mask and rotary tables need no gradient: shared by micro-batches
            with torch.no_grad():
                pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
                value: dict[str, Any] = {"attention_mask": causal_mask(self.config, x, pos)}
                if self.family == "llama":
                    value.update(position_ids=pos, position_embeddings=self.rotary(x, pos))
            self._key, self._value = key, value
        return self._value


def causal_mask(config: Any, x: torch.Tensor, pos: torch.Tensor) -> Any:
    """Hugging Face's causal mask for hidden states `x` (no padding, no cache), across its signatures (4.5x
    named the embeddings `input_embeds` and took `cache_position`; 5.2x renamed `past_key_values` `cache`)."""
    from transformers.masking_utils import create_causal_mask

    params = inspect.signature(create_causal_mask).parameters
    kw: dict[str, Any] = {"config": config, "attention_mask": None, "position_ids": pos}
    kw["cache" if "cache" in params else "past_key_values"] = None
    kw["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = x
    if "cache_position" in params:
        kw["cache_position"] = pos[0]
    return create_causal_mask(**kw)


class _Unit(nn.Module):
    """A unit: the model's modules it runs are its children (parameters, `.to`), the context is not."""

    def __init__(self, ctx: _Context, parts: list[str]) -> None:
        super().__init__()
        object.__setattr__(self, "ctx", ctx)  # shared by the model's units; not a submodule
        self.parts = parts  # the model's FQNs of the modules this unit owns: removed where it is not kept


class Embeddings(_Unit):
    def __init__(self, ctx: _Context, modules: dict[str, nn.Module], parts: list[str]) -> None:
        super().__init__(ctx, parts)
        for name, m in modules.items():
            self.add_module(name, m)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor):
            # A padded batch as a tokenizer gives it: the mask could not reach the later stages' layers anyway.
            keys = f" (keys {', '.join(map(str, input_ids))})" if isinstance(input_ids, dict) else ""
            raise ConfigError(
                f"a pipelined {type(self.ctx.model).__name__} takes its inputs as one tensor of token ids, got "
                f"{type(input_ids).__name__}{keys}: attention masks, position or token type ids are not passed "
                "between stages. Pass input_ids; pad on the right with labels -100 at the padding (causal attention "
                "never looks ahead, so the loss is the one the mask would give)"
            )
        if self.ctx.family == "llama":
            return self.embed_tokens(input_ids)
        pos = torch.arange(input_ids.shape[-1], device=input_ids.device).unsqueeze(0)
        x = self.wte(input_ids)
        return self.drop(x + self.wpe(pos).to(x.device))


class Layer(_Unit):
    def __init__(self, ctx: _Context, layer: nn.Module, name: str) -> None:
        super().__init__(ctx, [name])
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x, **self.ctx.of(x))
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
        if labels is None:
            return logits
        loss = self.ctx.model.loss_function(logits, labels, vocab_size=self.ctx.config.vocab_size)
        return HeadOutput(loss=loss, logits=logits)
