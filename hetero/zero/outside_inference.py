"""hetero's own work inside a forward that runs under `torch.inference_mode`.

[Note: hetero's memory under inference mode]
Under `torch.inference_mode` every tensor made is an inference tensor, and stays one: outside the mode it cannot be
updated in place nor saved for a backward. A view of another dtype (`buf.view(torch.float16)`) is one too, even of a
normal tensor. hetero makes and views its chunk buffers inside the user's forward (a gather at stage 3, a move up
from the host or NVMe, a buffer taken from or given back to a pool) and keeps them after it: a `model.generate` or an
evaluation under inference_mode left chunk memory that the next NVMe read into it (on a worker thread, which is never
in the mode) or the next training step refused to write: "Inplace update to inference tensor outside InferenceMode".
So hetero's work at the forward's points (its module hooks, a tile's gather and release, the delayed update's tick,
the engine's bookkeeping around the model's call) runs outside inference mode with grad mode off, as the caller's
is; the model's own compute stays in the caller's mode, and its outputs are inference tensors as without hetero.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def outside_inference_mode() -> Iterator[None]:
    """Leave inference mode, if on, for hetero's bookkeeping ([Note: hetero's memory under inference mode])."""
    if not torch.is_inference_mode_enabled():
        yield
        return
    # inference_mode(False) turns grad mode on: the caller's, inside inference mode, was off.
    with torch.inference_mode(False), torch.no_grad():
        yield


def in_normal_mode(fn: F) -> F:
    """`fn`, run outside inference mode ([Note: hetero's memory under inference mode])."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_inference_mode_enabled():  # a flag read: the hooks run per module and forward
            return fn(*args, **kwargs)
        with outside_inference_mode():
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def in_callers_mode(inference: bool) -> contextlib.AbstractContextManager:
    """Back into inference mode for the model's compute where the caller was in it (`inference`)."""
    return torch.inference_mode() if inference else contextlib.nullcontext()
