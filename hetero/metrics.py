"""`engine.metrics()` and the optional tensorboard / wandb sink (config section "log").

The engine tells its `Monitor` about each backward (the loss), each micro-batch (its tokens, when given) and each
real update; `metrics()` reads the rest from the engine (loss scale, gradient norm, counters) and its chunk manager
(per-tier memory, bytes moved between tiers). With a sink configured, rank 0 writes the scalar metrics after every
`log.every`-th update; other ranks write nothing. Throughput is measured between consecutive updates on this rank:
tokens of the update's micro-batches over the wall time since the previous update (or since the first micro-batch).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from hetero.errors import ConfigError

if TYPE_CHECKING:
    from hetero.engine import Engine

log = logging.getLogger("hetero.metrics")


class Monitor:
    def __init__(self, engine: Engine) -> None:
        self._engine_ref = weakref.ref(engine)  # the engine owns its monitor: no cycle that delays freeing it
        self._losses: list[torch.Tensor] = []  # detached losses of the micro-batches since the last update
        self._tokens = 0  # tokens of the micro-batches since the last update
        self._given_tokens = False  # step() has been given token counts
        self._since: float | None = None  # when the current update's accumulation began (or the last update ended)
        # Mean loss over the last update's micro-batches, this rank: kept where the losses are until read. Read at every
        # update, a loss on a GPU made the host wait for the whole step's work there before the next forward.
        self._last_loss: torch.Tensor | float | None = None
        self.tokens_per_s: float | None = None  # over the last update, this rank
        self.update_seconds: float | None = None  # wall time of the last update's accumulation and step
        self._sinks = _open_sinks(engine)

    def loss(self, loss: torch.Tensor) -> None:
        if self._since is None:
            self._since = time.perf_counter()
        self._losses.append(loss.detach())

    def micro_batch(self, tokens: int | None) -> None:
        if self._since is None:
            self._since = time.perf_counter()
        if tokens is not None:
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
                raise ValueError(f"engine.step(tokens=...): expected a non-negative int, got {tokens!r}")
            self._tokens += tokens
            self._given_tokens = True

    def update(self) -> None:
        now = time.perf_counter()
        if self._since is not None:
            self.update_seconds = now - self._since
            if self._given_tokens and self.update_seconds > 0:
                self.tokens_per_s = self._tokens / self.update_seconds
        if self._losses:
            self._last_loss = torch.stack([x.float() for x in self._losses]).mean()
        self._losses.clear()
        self._tokens = 0
        self._since = now
        e = self._engine_ref()
        if self._sinks and e.global_steps % e.config.log.every == 0:
            values = _scalars(self.metrics())
            for sink in self._sinks:
                sink.write(values, e.global_steps)

    @property
    def last_loss(self) -> float | None:
        if isinstance(self._last_loss, torch.Tensor):
            self._last_loss = float(self._last_loss)  # the host waits for the device here, when someone asks
        return self._last_loss

    def metrics(self) -> dict[str, Any]:
        e = self._engine_ref()
        stats = e.manager.memory_stats()
        groups = e.optimizer.param_groups if e.optimizer is not None else []
        return {
            "step": e.global_steps,
            "micro_step": e.micro_steps,
            "loss": self.last_loss,
            "loss_scale": e.scaler.scale if e.scaler is not None else 1.0,
            "last_grad_norm": e.last_grad_norm,
            "skipped_steps": e.skipped_steps,
            "lr": [float(g["lr"]) for g in groups],
            "tokens_per_s": self.tokens_per_s,
            "update_seconds": self.update_seconds,
            "memory": {
                t: {"current": stats[t]["current"], "peak": stats[t]["peak"]} for t in ("device", "host", "nvme")
            },
            "moved": dict(stats["moved"]),
        }

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []


def _scalars(m: dict[str, Any]) -> dict[str, float]:
    """The metrics as flat scalar names for a sink (None values left out)."""
    out: dict[str, float] = {}
    for key in ("loss", "loss_scale", "last_grad_norm", "skipped_steps", "tokens_per_s", "update_seconds"):
        if m[key] is not None:
            out[f"train/{key}"] = float(m[key])
    for i, lr in enumerate(m["lr"]):
        out[f"train/lr{'' if i == 0 else f'_group{i}'}"] = lr
    for tier, v in m["memory"].items():
        out[f"memory/{tier}_current_bytes"] = float(v["current"])
        out[f"memory/{tier}_peak_bytes"] = float(v["peak"])
    for pair, n in m["moved"].items():
        out[f"moved/{pair.replace('->', '_to_')}_bytes"] = float(n)
    return out


# ---- sinks ---------------------------------------------------------------------------------------------------
class _TensorBoard:
    def __init__(self, directory: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                f"log.tensorboard = {directory!r}: torch.utils.tensorboard needs the tensorboard package: pip install "
                "'hetero[tensorboard]' (or remove log.tensorboard)"
            ) from None
        self._w = SummaryWriter(log_dir=directory)

    def write(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class _Wandb:
    def __init__(self, project: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                f"log.wandb = {project!r}: needs the wandb package: pip install wandb (or remove log.wandb)"
            ) from None
        self._wandb = wandb
        self._run = wandb.run if wandb.run is not None else wandb.init(project=project, config=config)

    def write(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        pass  # the run belongs to the script (wandb.finish at exit); several engines may share it


def _open_sinks(engine: Engine) -> list[Any]:
    cfg = engine.config.log
    mesh = getattr(engine, "mesh", None)
    if (mesh.world if mesh is not None else engine.comm).rank != 0:
        return []
    sinks: list[Any] = []
    if cfg.tensorboard is not None:
        sinks.append(_TensorBoard(cfg.tensorboard))
    if cfg.wandb is not None:
        sinks.append(_Wandb(cfg.wandb, engine.config.to_dict()))
    return sinks
