"""Spawning a benchmark's ranks on this machine: each runs `target(rank, world, port, args, queue)` and puts its
results on the queue; the caller gets the messages, or a clear error when a rank dies or the time runs out."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(
    target: Callable[..., None], world: int, args: Any, *, name: str, timeout: float, messages: int | None = None
) -> list[Any]:
    """Run `world` ranks of `target` and return the first `messages` (default: one per rank) it puts on the queue."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, args, q), daemon=True) for r in range(world)]
    for pr in procs:
        pr.start()
    wanted = world if messages is None else messages
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < wanted:
        if time.monotonic() > deadline or not any(pr.is_alive() for pr in procs) and q.empty():
            raise RuntimeError(f"{name}: a rank died or ran past {timeout:.0f} s; try a smaller setting")
        try:
            got.append(q.get(timeout=1))
        except queue.Empty:
            continue
    for pr in procs:
        pr.join(60)
    return got
