"""Tensor-parallel plans: which module gets which style, as FQN glob patterns, and the built-in plans.

A pattern is a module's qualified name (``layers.0.attn.q_proj``) where ``*`` stands for any run of characters
inside one name component (``layers.*.attn.q_proj``) and ``?`` for one. A style may combine several with ``+``
(``norm+sequence_gather``). Modules no pattern names keep their parameters whole (replicated).

Styles:
- ``colwise``: ``nn.Linear`` or Hugging Face ``Conv1D`` with its output features sharded; ``colwise_qkv`` the same
  for a fused q/k/v projection holding all of q, then k, then v (each block sharded on its own, GPT-2's ``c_attn``;
  with fewer key/value heads, Phi-3-medium's ``qkv_proj``, k and v are narrower than q and cut by key/value heads).
  One holding each head's q, k and v side by side (GPT-NeoX's ``query_key_value``) is plain ``colwise``; which one a
  layer has is checked ([Note: fused q/k/v projections] in fused_qkv.py), as is that cuts chain: a ``colwise`` layer
  widening the hidden states, the ``rowwise`` one after it bringing them back ([Note: cuts that must chain]).
  ``colwise_gate_up``: the same for a fused gate/up projection holding all of gate, then all of up (Phi-3's
  ``gate_up_proj``, whose MLP chunks its output in two): each half sharded on its own. A plain ``colwise`` layer
  twice as wide as the ``rowwise`` layer after it in its MLP is refused ([Note: fused gate/up projections] in
  fused_mlp.py).
- ``rowwise``: input features sharded; the partial outputs are summed (all-reduce, or reduce-scatter along the
  sequence under sequence parallelism) before the bias is added.
- ``vocab``: ``nn.Embedding`` sharded by vocabulary range.
- ``vocab_head``: the LM head (``nn.Linear``) with logits left sharded by vocabulary; the model's own loss is
  replaced by the vocabulary-parallel cross entropy.
- ``parallel_input``: a module whose column-parallel children read its input (an MLP with gate and up projections):
  the input enters the tensor-parallel region once, in a pre-hook (f; under sequence parallelism the all-gather
  along the sequence), instead of once per child.
- ``heads``: an attention module; its head counts are divided by the degree (checked), and it is a
  ``parallel_input`` (under sequence parallelism attention must see the whole sequence). With fewer key/value heads
  than ranks (kv dividing the degree), each rank holds one whole key/value head instead: its ``colwise`` layers
  with kv x head_dim outputs (k and v projections) are cut by head, each head held by degree / kv ranks
  ([Note: key/value heads replicated over tensor ranks] in kv_replicas.py).
- ``norm``: a LayerNorm/RMSNorm inside the sequence-parallel region (its gradients are all-reduced under SP).
- ``head_norm``: a norm inside an attention module applied to each head on its own (Qwen3's and Gemma 3's q_norm and
  k_norm): whole on every rank but fed only this rank's heads, so its gradient is summed over the tensor group.
- ``embedding``: a position embedding (not cut by vocabulary). 1D leaves it whole; the grid modes (2D, 2.5D, 3D),
  which cut every activation along the hidden dimension, cut its columns (``grid/apply.py``).
- ``sequence_scatter`` / ``sequence_gather``: where the sequence-parallel region begins (the module's input is cut)
  and ends (its output is gathered). Both do nothing without sequence parallelism.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping

from torch import nn

from hetero.errors import ConfigError

STYLES = (
    "colwise",
    "colwise_qkv",
    "colwise_gate_up",
    "rowwise",
    "vocab",
    "vocab_head",
    "heads",
    "parallel_input",
    "norm",
    "head_norm",
    "embedding",
    "sequence_scatter",
    "sequence_gather",
)
COLUMN = ("colwise", "colwise_qkv", "colwise_gate_up")  # the styles that cut a layer's output features
FUSED_PARTS = {"colwise_qkv": 3, "colwise_gate_up": 2}  # blocks of the output each cut on its own (1: the whole)


def _gpt(prefix: str = "") -> dict[str, str]:
    """hetero.models.gpt.GPT."""
    p = prefix
    return {
        f"{p}embed": "vocab",
        f"{p}pos_embed": "embedding",
        f"{p}drop": "sequence_scatter",
        f"{p}layers.*.ln_?": "norm",
        f"{p}layers.*.attn": "heads",
        f"{p}layers.*.attn.?_proj": "colwise",  # q_proj, k_proj, v_proj (o_proj overridden below)
        f"{p}layers.*.attn.o_proj": "rowwise",
        f"{p}layers.*.mlp": "parallel_input",
        f"{p}layers.*.mlp.fc": "colwise",
        f"{p}layers.*.mlp.proj": "rowwise",
        f"{p}ln_f": "norm+sequence_gather",
        f"{p}lm_head": "vocab_head",
    }


def _gpt2(prefix: str, head: bool) -> dict[str, str]:
    """GPT-2 of transformers: Conv1D layers (weights stored [in, out]) and a fused q/k/v projection."""
    p = prefix
    plan = {
        f"{p}wte": "vocab",
        f"{p}wpe": "embedding",
        f"{p}drop": "sequence_scatter",
        f"{p}h.*.ln_?": "norm",
        f"{p}h.*.attn": "heads",
        f"{p}h.*.attn.c_attn": "colwise_qkv",
        f"{p}h.*.attn.c_proj": "rowwise",
        f"{p}h.*.mlp": "parallel_input",
        f"{p}h.*.mlp.c_fc": "colwise",
        f"{p}h.*.mlp.c_proj": "rowwise",
        f"{p}ln_f": "norm+sequence_gather",
    }
    if head:
        plan["lm_head"] = "vocab_head"
    return plan


def _llama(prefix: str, head: bool, head_norms: bool = False) -> dict[str, str]:
    """Llama of transformers (also the plan of its close relatives: grouped-query attention, RMSNorm, SwiGLU).
    ``head_norms``: its attention normalises q and k per head (Qwen3, Gemma 3)."""
    p = prefix
    plan = {
        f"{p}embed_tokens": "vocab",
        f"{p}layers.0": "sequence_scatter",
        # input_ and post_attention_layernorm, and Gemma's pre_ and post_feedforward_layernorm
        f"{p}layers.*.*_layernorm": "norm",
        f"{p}layers.*.self_attn": "heads",
        f"{p}layers.*.self_attn.q_proj": "colwise",
        f"{p}layers.*.self_attn.k_proj": "colwise",
        f"{p}layers.*.self_attn.v_proj": "colwise",
        f"{p}layers.*.self_attn.o_proj": "rowwise",
        f"{p}layers.*.mlp": "parallel_input",  # gate_proj and up_proj read the same input
        f"{p}layers.*.mlp.gate_proj": "colwise",
        f"{p}layers.*.mlp.up_proj": "colwise",
        f"{p}layers.*.mlp.down_proj": "rowwise",
        f"{p}norm": "norm+sequence_gather",
    }
    if head_norms:
        plan[f"{p}layers.*.self_attn.?_norm"] = "head_norm"
    if head:
        plan["lm_head"] = "vocab_head"
    return plan


def _phi3(prefix: str, head: bool) -> dict[str, str]:
    """Phi-3 of transformers (Phi-4 has its layout): Llama's with fused projections, qkv_proj holding all of q, then
    k, then v (k and v narrower with fewer key/value heads: Phi-3-medium, Phi-4), and gate_up_proj all of gate, then
    up, each cut by its blocks."""
    p = prefix
    plan = {
        f"{p}embed_tokens": "vocab",
        f"{p}layers.0": "sequence_scatter",
        f"{p}layers.*.*_layernorm": "norm",  # input_ and post_attention_layernorm
        f"{p}layers.*.self_attn": "heads",
        f"{p}layers.*.self_attn.qkv_proj": "colwise_qkv",
        f"{p}layers.*.self_attn.o_proj": "rowwise",
        f"{p}layers.*.mlp": "parallel_input",
        f"{p}layers.*.mlp.gate_up_proj": "colwise_gate_up",
        f"{p}layers.*.mlp.down_proj": "rowwise",
        f"{p}norm": "norm+sequence_gather",
    }
    if head:
        plan["lm_head"] = "vocab_head"
    return plan


# Known model families, recognised by what the model is (module names it must have), not by its class: a fine-tuned
# subclass, or a relative with the same layout (Mistral, Qwen2 are Llama's), gets the same plan. Tried in order.
# Later patterns of a plan override earlier ones for the modules both match.
BUILTIN_PLANS: list[tuple[str, tuple[str, ...], dict[str, str]]] = [
    ("hetero GPT", ("embed", "layers.*.attn.q_proj", "layers.*.mlp.fc", "lm_head"), _gpt()),
    ("GPT-2 with LM head", ("transformer.h.*.attn.c_attn", "lm_head"), _gpt2("transformer.", head=True)),
    ("GPT-2", ("h.*.attn.c_attn", "wte"), _gpt2("", head=False)),
    (
        "Llama-like with q/k norms and LM head",
        ("model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.q_norm", "model.embed_tokens", "lm_head"),
        _llama("model.", head=True, head_norms=True),
    ),
    (
        "Llama-like with q/k norms",
        ("layers.*.self_attn.q_proj", "layers.*.self_attn.q_norm", "embed_tokens"),
        _llama("", head=False, head_norms=True),
    ),
    (
        "Llama-like with LM head",
        ("model.layers.*.self_attn.q_proj", "model.embed_tokens", "lm_head"),
        _llama("model.", head=True),
    ),
    ("Llama-like", ("layers.*.self_attn.q_proj", "embed_tokens"), _llama("", head=False)),
    (
        "Phi-3 with LM head",
        ("model.layers.*.self_attn.qkv_proj", "model.layers.*.mlp.gate_up_proj", "model.embed_tokens", "lm_head"),
        _phi3("model.", head=True),
    ),
    ("Phi-3", ("layers.*.self_attn.qkv_proj", "layers.*.mlp.gate_up_proj", "embed_tokens"), _phi3("", head=False)),
]


def auto_plan(model: nn.Module) -> dict[str, str]:
    """The built-in plan of the first known family whose module names the model has; a ConfigError otherwise."""
    names = [n for n, _ in model.named_modules() if n]
    for _, signature, plan in BUILTIN_PLANS:
        if all(any(_compile(p).match(n) for n in names) for p in signature):
            return plan
    families = "; ".join(f"{family} ({', '.join(sig)})" for family, sig, _ in BUILTIN_PLANS)
    raise ConfigError(
        f"tensor_plan = 'auto' recognises no known layout in {type(model).__name__}; the families it knows, by the "
        f"module names they have: {families}. Give your own plan instead: a mapping of module patterns to styles, as "
        "parallel.tensor_plan (or apply_tensor_parallel's plan), e.g. {'model.layers.*.self_attn.q_proj': 'colwise', "
        "...}; the styles are listed in hetero/parallel/plans.py"
    )


def _compile(pattern: str) -> re.Pattern[str]:
    out = "".join("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c) for c in pattern)
    return re.compile(out + r"\Z")


def check_style(style: object, where: str) -> list[str]:
    """The parts of a style string, each checked; a ConfigError names an unknown one and the closest known."""
    if not isinstance(style, str) or not style:
        raise ConfigError(f"{where}: a style must be a non-empty string, got {style!r}; known: {', '.join(STYLES)}")
    parts = style.split("+")
    for part in parts:
        if part not in STYLES:
            close = difflib.get_close_matches(part, STYLES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown tensor-parallel style {part!r}{hint}; known: {', '.join(STYLES)}")
    return parts


def resolve_plan(model: nn.Module, plan: Mapping[str, str] | str, *, strict: bool = True) -> dict[str, str]:
    """The concrete plan: every module FQN a pattern matches -> its style (``"auto"``: the model's built-in plan).

    Patterns are applied in order and a later one overrides an earlier one on the modules both match, so a broad
    pattern can be refined. A pattern that matches no module is an error (a typo would otherwise silently leave
    layers whole) unless ``strict`` is False (a pipeline stage holds only some of the modules a plan names); a
    style that does not exist always is.
    """
    if isinstance(plan, str):
        if plan != "auto":
            raise ConfigError(f"tensor_plan = {plan!r}: expected 'auto' or a mapping of module patterns to styles")
        plan = auto_plan(model)
    if not isinstance(plan, Mapping):
        raise ConfigError(f"tensor_plan must be 'auto' or a mapping of module patterns to styles, got {plan!r}")
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        check_style(style, f"tensor_plan[{pattern!r}]")
        regex = _compile(str(pattern))
        hits = [n for n in names if regex.match(n)]
        if not hits and strict:
            close = difflib.get_close_matches(str(pattern), names, n=3)
            hint = f"; closest module names: {', '.join(close)}" if close else ""
            raise ConfigError(
                f"tensor_plan pattern {pattern!r} matches no module of {type(model).__name__}{hint}. Patterns are "
                "module names where * stands for one name component (layers.*.attn.q_proj)"
            )
        for n in hits:
            out[n] = style
    return out
