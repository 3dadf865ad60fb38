"""Named hook points with any number of subscribers: how the profiler and automatic placement follow the engine and
the chunk manager without replacing their methods or reading their private state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Events:
    """Hook points declared up front; `subscribe` returns the function that unsubscribes."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._subscribers: dict[str, list[Callable[..., Any]]] = {n: [] for n in names}

    def subscribe(self, name: str, fn: Callable[..., Any]) -> Callable[[], None]:
        if name not in self._subscribers:
            raise ValueError(f"no hook point {name!r}; the hook points are {sorted(self._subscribers)}")
        self._subscribers[name].append(fn)
        return lambda: self._subscribers[name].remove(fn)

    def emit(self, name: str, *args: Any) -> None:
        for fn in self._subscribers[name]:
            fn(*args)

    def has(self, name: str) -> bool:
        """Whether anyone listens (to skip building what only a subscriber would read)."""
        return bool(self._subscribers[name])
