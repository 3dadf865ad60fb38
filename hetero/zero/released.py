"""Parameters whose values are not on this rank: reading one is a clear Python error, never a read of freed memory.

[Note: released parameters]
At stage 3 a parameter's `.data` views its chunk's gathered storage, which has zero bytes while the chunk is not
gathered (see [Note: transient chunks]). A kernel handed such a tensor reads past the end of its storage: the
process dies of a segmentation fault. So while a parameter is not in use (not between its unit's enter and exit, or
inside `engine.gathered_parameters()`), its class is swapped for a subclass of its own class whose
`__torch_function__` lets through what reads no values (shape, dtype, device, `requires_grad`, `.grad`, hooks...)
and turns every other operation into a `ReleasedParameterError` that names the parameter and the way to read it.
`isinstance(p, nn.Parameter)`, names, identity and `state_dict()` keys are unchanged; swapping a class is one
pointer write, so entering and leaving a unit costs nothing measurable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hetero.errors import ReleasedParameterError

_T = torch.Tensor
# Functions that read no values: metadata, autograd bookkeeping, and what hetero itself does to a parameter.
_HARMLESS = {
    f
    for f in (
        _T.shape.__get__,  # type: ignore[attr-defined]
        _T.dtype.__get__,  # type: ignore[attr-defined]
        _T.device.__get__,  # type: ignore[attr-defined]
        _T.layout.__get__,  # type: ignore[attr-defined]
        _T.ndim.__get__,  # type: ignore[attr-defined]
        _T.requires_grad.__get__,  # type: ignore[attr-defined]
        _T.requires_grad.__set__,  # type: ignore[attr-defined]
        _T.is_leaf.__get__,  # type: ignore[attr-defined]
        _T.grad.__get__,  # type: ignore[attr-defined]
        _T.grad.__set__,  # type: ignore[attr-defined]
        _T.grad_fn.__get__,  # type: ignore[attr-defined]
        _T.data.__set__,  # type: ignore[attr-defined]
        _T.is_meta.__get__,  # type: ignore[attr-defined]
        _T.is_cuda.__get__,  # type: ignore[attr-defined]
        _T.is_sparse.__get__,  # type: ignore[attr-defined]
        _T.size,
        _T.stride,
        _T.storage_offset,
        _T.is_contiguous,
        _T.untyped_storage,
        _T.data_ptr,
        _T.dim,
        _T.numel,
        _T.nelement,
        _T.element_size,
        _T.is_floating_point,
        _T.is_complex,
        _T.requires_grad_,
        _T.register_hook,
        _T.register_post_accumulate_grad_hook,
        _T.__hash__,
        _T.__len__,
        _T.__reduce_ex__,
    )
}
_CLASSES: dict[type, type] = {}  # a parameter class -> its released twin


class _Released:
    """Mixed into a parameter's class while it is released; see [Note: released parameters]."""

    _hetero_name: str

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        # A debugger, a log line or an error message printing a parameter between its uses: what it is, not an error.
        return f"Parameter {self._hetero_name!r} ({tuple(self.shape)}, {self.dtype}; released: not on this rank)"  # type: ignore[attr-defined]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _HARMLESS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        released = [a for a in _flat(args, kwargs) if isinstance(a, _Released)]
        readers = {id(r): r for r in (a.__dict__.get("_hetero_reader") for a in released)}
        if len(readers) == 1 and None not in readers.values():  # [Note: a parameter read outside its module]
            got = next(iter(readers.values()))(func, args, kwargs or {}, released)
            if got is not NotImplemented:
                return got
        names = [a._hetero_name for a in released]
        what = getattr(func, "__name__", repr(func))
        what = "reading an attribute of" if what in ("__get__", "__set__") else f"{what}() read"
        if any(a.__dict__.get("_hetero_tiled") for a in released):
            raise ReleasedParameterError(
                f"{what} parameter {names[0]!r}, which is split into tiles (a weight larger than a chunk: its "
                "layer computes on one tile at a time, [Note: computing on tiles]), so its values are never whole. "
                "Read it inside `with engine.gathered_parameters([...]):` (every rank enters it), use "
                "engine.full_state_dict(), or set the config's tiling to false (or a larger chunk_size)" + _SAVING
            )
        raise ReleasedParameterError(
            f"{what} parameter {names[0] if names else '?'!r}, whose full values are not on this rank: at "
            "zero_stage 3 each rank holds a shard of it between uses. Read it inside `with "
            "engine.gathered_parameters([...]):` (every rank enters it), or use engine.full_state_dict() for a "
            "copy of every weight" + _SAVING
        )


# Hugging Face's and PEFT's save_pretrained read every weight; both take the values instead (every rank calls it).
_SAVING = ". Saving a Hugging Face or PEFT model: model.save_pretrained(out, state_dict=engine.full_state_dict())"


def _flat(args: tuple, kwargs: dict | None) -> list[Any]:
    out: list[Any] = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def _twin(cls: type) -> type:
    twin = _CLASSES.get(cls)
    if twin is None:
        twin = type(f"Released{cls.__name__}", (_Released, cls), {"__module__": __name__})
        _CLASSES[cls] = twin
    return twin


def set_reader(params: Iterable[nn.Parameter], reader: Callable[..., Any] | None) -> None:
    """`reader(func, args, kwargs, params)` is asked first when an operation reads these parameters released: it
    returns the operation's result, or NotImplemented for the error ([Note: a parameter read outside its module]
    in hooks.py)."""
    for p in params:
        if reader is None:
            p.__dict__.pop("_hetero_reader", None)
        else:
            p.__dict__["_hetero_reader"] = reader


def release(params: Iterable[nn.Parameter], names: Iterable[str]) -> None:
    """Mark parameters released: operations that read their values raise `ReleasedParameterError`."""
    for p, name in zip(params, names):
        cls = type(p)
        if isinstance(p, _Released):
            continue
        p.__dict__["_hetero_name"] = name
        p.__class__ = _twin(cls)


def restore(params: Iterable[nn.Parameter]) -> None:
    """Give released parameters their own class back (their values are in place again)."""
    for p in params:
        if isinstance(p, _Released):
            p.__class__ = type(p).__mro__[2]


def is_released(p: torch.Tensor) -> bool:
    return isinstance(p, _Released)
