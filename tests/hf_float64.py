"""Hugging Face models in float64 compute their loss in float64: the tests' exact references are exact.

[Note: float64 references keep their loss in float64]
transformers' causal-LM loss (and its masked-LM and token-classification losses) upcasts with `logits.float()`
whatever the logits' dtype: meant for fp16/bf16 logits, it also casts float64 logits down, so a reference run of a
model `.to(torch.float64)` computed its loss and the loss's gradient in fp32 (5.24: the loss of a tiny Llama was
5e-8 from float64's cross entropy of its own logits, the logits' gradient 7e-8 relative). Every parity test measures
hetero's fp32 error against that reference ([Note: tolerances from the arithmetic] in tests/tolerance.py): the
reference carried fp32 rounding of its own, a floor under every distance measured from it.

So in the test processes a model's `loss_function` (the property every Hugging Face model calls its loss through)
hands those losses float64 logits whose `.float()` keeps float64 (`_Float64Logits`). Everything else is
transformers' own code: fp16/bf16 logits are upcast to fp32 as before, fp32 logits and every loss that
`loss_function` does not resolve to one of these (hetero's vocabulary-parallel losses, set on the model, a model's
own `CrossEntropyLoss` as in BERT) run exactly as before, bit for bit. `LOSS_MAPPING` itself is left alone:
transformers' Trainer asks it `is ForCausalLMLoss` to count the items of a shifted batch.

`install()` patches `PreTrainedModel` once `transformers.modeling_utils` is imported (at once if it is, else on its
import: it costs seconds, which a test session that never builds a Hugging Face model should not pay). conftest.py
installs it in the pytest process, tests/dist.py in every rank it starts: the fork server imports tests.dist after
the models it preloads, a spawned rank before or after its test module. No subprocess a test starts computes a float64
reference of a Hugging Face model. A transformers without this property or these losses is left as it is.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

import torch

_MODULE = "transformers.modeling_utils"
_UPCASTING = ("ForCausalLMLoss", "ForMaskedLMLoss", "ForTokenClassification")  # they call logits.float()


class _Float64Logits(torch.Tensor):
    """float64 logits whose `.float()` gives them back as a plain float64 tensor (a view, in the autograd graph)."""

    def float(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


def keep_float64(loss: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`loss` (one of transformers' upcasting losses, logits its first argument) with float64 logits kept so."""

    @functools.wraps(loss)
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "logits" in kwargs and kwargs["logits"].dtype == torch.float64:
            kwargs["logits"] = kwargs["logits"].as_subclass(_Float64Logits)
        elif args and args[0].dtype == torch.float64:
            args = (args[0].as_subclass(_Float64Logits), *args[1:])
        return loss(*args, **kwargs)

    return wrapped


def _patch(modeling_utils: Any) -> None:
    try:
        from transformers.loss import loss_utils
    except ImportError:
        return
    model = getattr(modeling_utils, "PreTrainedModel", None)
    prop = getattr(model, "loss_function", None)
    if not isinstance(prop, property) or prop.fget is None or getattr(prop.fget, "keeps_float64", False):
        return
    wrapped = {id(f): keep_float64(f) for name in _UPCASTING if (f := getattr(loss_utils, name, None)) is not None}
    get = prop.fget

    def loss_function(self: Any) -> Any:
        fn = get(self)
        return wrapped.get(id(fn), fn)

    loss_function.keeps_float64 = True  # type: ignore[attr-defined]
    model.loss_function = property(loss_function, prop.fset, prop.fdel, prop.__doc__)


class _OnImport(importlib.abc.MetaPathFinder):
    """Finds transformers.modeling_utils as the other finders do, and patches it once it has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _MODULE:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = getattr(spec.loader, "exec_module", None)
        if run is not None:

            def exec_module(module: Any) -> None:
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """[Note: float64 references keep their loss in float64]; idempotent."""
    if _MODULE in sys.modules:
        _patch(sys.modules[_MODULE])
    elif not any(isinstance(f, _OnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnImport())
