"""Models without memory for the estimator: from a Hugging Face config file, or from a bare parameter count.

Both are built on the meta device, so a 70B model costs nothing: the estimator needs only parameter shapes (for the
chunk layout) and a forward on meta tensors (for the activations).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetero.errors import ConfigError
from hetero.models.gpt import GPT, GPTConfig

GPT_VOCAB = 50304  # GPT-2's vocabulary padded to a multiple of 64
GPT_CONTEXT = 2048
HEAD_DIM = 128
ASPECT = 128  # hidden size per layer: GPT-3 6.7B (32 x 4096), 13B (40 x 5120) and 175B (96 x 12288) all have d = 128 L


def gpt_for_params(n_params: float) -> GPT:
    """A GPT-3-shaped model of about n_params parameters, on meta.

    [Note: shapes from a parameter count]
    A GPT block has 12 d^2 weights (4 d^2 attention, 8 d^2 MLP), so P = 12 L d^2 + (V + S) d. GPT-3's large models
    keep d = 128 L, so 12 L (128 L)^2 = 196608 L^3 ~ P gives L; d is then solved from the quadratic in d and
    rounded to a multiple of the head size (128). Activations follow from a meta forward of this model, so they
    are those of a standard pre-LayerNorm transformer with sequence length S and vocabulary V.
    """
    if not 1e5 <= n_params < math.inf:  # nan fails both; inf has no shape (it overflowed int() below)
        raise ConfigError(f"params: expected a finite parameter count of at least 1e5, got {n_params!r}")
    layers = max(2, round((n_params / (12 * ASPECT**2)) ** (1 / 3)))
    # 12 L d^2 + (V + S) d - P = 0
    a, b, c = 12 * layers, GPT_VOCAB + GPT_CONTEXT, -float(n_params)
    d = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
    head = HEAD_DIM if d >= 4 * HEAD_DIM else 64
    d = max(head, round(d / head) * head)
    cfg = GPTConfig(vocab_size=GPT_VOCAB, n_layer=layers, n_head=d // head, n_embd=d, block_size=GPT_CONTEXT)
    with torch.device("meta"):
        return GPT(cfg)


def hf_model_from_config(path: str | os.PathLike) -> nn.Module:
    """A Hugging Face causal LM built on meta from its config.json (a file, or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"hf config {str(p)!r} does not exist; give a config.json file or its directory")
    try:
        d: dict[str, Any] = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"hf config {str(p)!r} is not valid JSON: {e}") from None
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ConfigError("reading a Hugging Face config needs transformers: pip install transformers") from None
    model_type = d.pop("model_type", None)
    if model_type is None:
        raise ConfigError(f"hf config {str(p)!r} has no 'model_type' key; is it a Hugging Face config.json?")
    try:  # transformers' own errors list every model type it knows: hundreds of names, the point lost among them
        cfg = AutoConfig.for_model(model_type, **d)
    except ValueError:
        raise ConfigError(
            f"hf config {str(p)!r}: model_type {model_type!r} is not known to transformers {_version()}; check the "
            "spelling, or upgrade transformers if the model is newer than it"
        ) from None
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        raise ConfigError(
            f"hf config {str(p)!r}: model_type {model_type!r} has no causal language model in transformers "
            f"(AutoModelForCausalLM); the estimator builds one from the config: pass the model itself (on the meta "
            "device) to hetero.estimate instead"
        ) from None


def _version() -> str:
    import transformers

    return transformers.__version__


def default_seq_len(model: nn.Module, cap: int = GPT_CONTEXT) -> int:
    """The model's context length, capped (long-context models train mostly on shorter sequences)."""
    cfg = getattr(model, "config", None)
    for name in ("block_size", "max_position_embeddings", "n_positions", "n_ctx"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return min(v, cap)
    return min(1024, cap)


def as_model(obj: Any) -> nn.Module:
    """The model `hetero.estimate` / `hetero.plan` were given: a model, or one on meta from a count or a config."""
    if isinstance(obj, nn.Module):
        return obj
    if isinstance(obj, bool):
        raise ConfigError(f"model_or_param_count: expected a model, a parameter count or a config path, got {obj!r}")
    if isinstance(obj, (int, float)):
        return gpt_for_params(obj)
    if isinstance(obj, (str, os.PathLike)):
        return hf_model_from_config(obj)
    raise ConfigError(
        f"model_or_param_count: expected an nn.Module, a parameter count or a path to a Hugging Face config.json, "
        f"got {type(obj).__name__}"
    )


def as_optimizer(optimizer: torch.optim.Optimizer | str, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer instance given, or a named one over all the model's trainable parameters (one group)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    makers = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    if optimizer not in makers:
        raise ConfigError(f"optimizer: {optimizer!r} is not known; give an optimizer instance or one of {list(makers)}")
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = {"lr": 1e-3, "momentum": 0.9} if optimizer == "sgd" else {"lr": 1e-3}
    return makers[optimizer](params, **kwargs)
