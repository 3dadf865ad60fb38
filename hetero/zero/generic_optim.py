"""Any elementwise torch optimizer, stepped on views of hetero's flat shards.

[Note: the generic update]
hetero's master weights and optimizer states are flat fp32 runs cut into shards wherever the chunk boundaries
fall, so an optimizer can step a shard only if its update of each element reads nothing but that element's
parameter, gradient and states (and per-parameter scalars such as the step count). Adam, AdamW and SGD are such,
and get torch's fused kernels on whole runs (hetero/zero/optim.py). Any other optimizer class runs its *own*
`step()` on a shadow instance whose param group holds one flat view per parameter piece of the shard: the view
writes into the master shard, `.grad` views the reduced gradient, and the state dict handed in views the chunk's
state buffers, so the class's own code (foreach or not, every hyperparameter of the user's param group) does the
arithmetic. A parameter's first step gets the state the class initialises its own way (Adagrad's
`initial_accumulator_value`, ...; in step(), or in the constructor of a throwaway instance), then copied into the
chunk. 0-d states other than "step" (NAdam's `mu_product`,
ASGD's `eta`, `mu`) are per parameter, kept here by (chunk, parameter) and saved in checkpoints by name.

Whether a class qualifies is probed once, on a small matrix, before anything is built: two steps on the whole
tensor must equal two steps on its flattened halves, and every state must have the parameter's shape or none. An
optimizer that factors its moments over rows and columns (Adafactor), orthogonalises the update (Muon), needs a
closure (LBFGS) or sparse gradients (SparseAdam) fails it, and the error says which of those it is.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hetero.errors import ConfigError

log = logging.getLogger("hetero.zero")

# Known classes that cannot step a flat shard, and why (the probe finds these too; the reason reads better).
_WHY_NOT = {
    "LBFGS": "it re-evaluates the loss through a closure several times per step and keeps a history of whole "
    "flattened gradients, which hetero's one backward per update cannot give it",
    "SparseAdam": "it needs sparse gradients; hetero's gradients are dense flat shards",
    "Adafactor": "it factors the second moment into row and column statistics of each matrix, so an element's "
    "update depends on the whole row and column, which a flat shard cut anywhere does not hold",
    "Muon": "it orthogonalises each matrix's update (Newton-Schulz iterations over the whole matrix), which a flat "
    "shard cut anywhere does not hold",
}
# What a refusal names instead: torch's elementwise optimizers, every one of which steps a flat shard.
_WORKS = "Elementwise optimizers work: Adam, AdamW, SGD, Adagrad, RMSprop, Adamax, NAdam, RAdam, ASGD, Rprop"
_PROBE_SHAPE = (4, 6)
_PROBE_CUT = 7  # the flat halves' boundary: not a row boundary, as a shard's is not


def _on_host(hyper: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters for a step on host tensors.

    [Note: capturable where the shard is]
    `capturable=True` asks for a step that a CUDA graph can capture (the step count and bias corrections kept as
    device tensors, no host reads). It changes where the arithmetic's scalars live, not the arithmetic, and torch
    refuses it for host tensors. The probe (small CPU tensors) and the step of a shard on the host (optimizer
    offload) run without it; a shard on the GPU keeps it, its step count beside the parameter. Found on one H100:
    the probe refused NAdam(capturable=True) outright."""
    return {**hyper, "capturable": False} if hyper.get("capturable") else hyper


class GenericUpdate:
    """Steps one torch optimizer class on flat shards (see [Note: the generic update])."""

    def __init__(self, cls: type, state_names: tuple[str, ...], scalar_names: tuple[str, ...], tensor_step: bool):
        self.cls = cls
        self.state_names = state_names  # per-element states, kept in the optim chunk beside the master
        self.scalar_names = scalar_names  # 0-d per-parameter states other than "step"
        self.tensor_step = tensor_step  # the class keeps state["step"] as a tensor (torch's do) or a number
        self.scalars: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (chunk, param index) -> 0-d states
        self._shadows: dict[int, torch.optim.Optimizer] = {}  # param group index -> a shadow instance

    # ---- probing ----------------------------------------------------------------------------------------------
    @classmethod
    def probe(cls, optimizer: torch.optim.Optimizer) -> GenericUpdate:
        """Check that the user's optimizer is elementwise (raises ConfigError saying why not); learn its states."""
        kind = type(optimizer)
        name = kind.__name__
        if name in _WHY_NOT:
            raise ConfigError(f"optimizer {name} cannot run on hetero's flat shards: {_WHY_NOT[name]}. {_WORKS}")
        hyper = _on_host({k: v for k, v in optimizer.param_groups[0].items() if k != "params"})
        g = torch.Generator().manual_seed(0)
        value = torch.rand(_PROBE_SHAPE, generator=g) + 0.5
        grads = [torch.randn(_PROBE_SHAPE, generator=g) for _ in range(2)]
        try:
            whole = [value.clone()]
            shadow = _shadow(kind, whole, hyper)
            for grad in grads:
                whole[0].grad = grad.clone()
                shadow.step()
            state = shadow.state[whole[0]]
            flat = value.clone().reshape(-1)
            halves = [flat[:_PROBE_CUT], flat[_PROBE_CUT:]]
            split = _shadow(kind, halves, hyper)
            for grad in grads:
                for h, gr in zip(halves, (grad.reshape(-1)[:_PROBE_CUT], grad.reshape(-1)[_PROBE_CUT:])):
                    h.grad = gr.clone()
                split.step()
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(
                f"optimizer {name} cannot run on hetero's flat shards: stepping it on flattened pieces of a matrix "
                f"failed ({type(e).__name__}: {e}). hetero steps flat runs of elements cut anywhere, so the "
                f"optimizer must update each element from that element alone. {_WORKS}"
            ) from None
        flat_names, scalar_names = [], []
        for key, v in state.items():
            if key == "step":
                continue
            if not isinstance(v, torch.Tensor):
                raise ConfigError(
                    f"optimizer {name} keeps state {key!r} as a {type(v).__name__}; hetero keeps optimizer states "
                    f"as tensors in its chunks. {_WORKS}"
                )
            if v.shape == value.shape:
                flat_names.append(key)
            elif v.dim() == 0:
                scalar_names.append(key)
            else:
                raise ConfigError(
                    f"optimizer {name} cannot run on hetero's flat shards: its state {key!r} has shape "
                    f"{tuple(v.shape)} for a parameter of shape {tuple(value.shape)}, so it is not kept per element "
                    "(factored or blocked statistics mix the elements of a row, column or block, which a shard cut "
                    f"anywhere does not hold). {_WORKS}"
                )
        same = torch.allclose(whole[0].reshape(-1), flat, rtol=1e-5, atol=1e-7) and all(
            torch.allclose(state[k].reshape(-1), torch.cat([split.state[h][k] for h in halves]), rtol=1e-5, atol=1e-7)
            for k in flat_names
        )
        if not same:
            raise ConfigError(
                f"optimizer {name} cannot run on hetero's flat shards: its update of an element depends on other "
                "elements of the same tensor (two steps on a matrix differ from two steps on its flattened halves), "
                f"and hetero cuts tensors into shards anywhere. {_WORKS}"
            )
        tensor_step = isinstance(state.get("step"), torch.Tensor)
        log.info("optimizer %s steps through the generic path: states %s, scalars %s", name, flat_names, scalar_names)
        return cls(kind, tuple(flat_names), tuple(scalar_names), tensor_step)

    # ---- the update -------------------------------------------------------------------------------------------
    def update(
        self,
        zc: Any,
        used: torch.Tensor,
        group: dict[str, Any],
        master: torch.Tensor,
        grad: torch.Tensor,
        states: dict[str, torch.Tensor],
    ) -> None:
        """Step every used parameter piece of this rank's shard of chunk `zc`, in place (counts the step too)."""
        stage, rank, size = zc.stage, zc.comm.rank, zc.shard_numel
        lo = 0 if stage == 0 else rank * size
        hi = lo + (zc.spec.capacity if stage == 0 else size)
        steps_before = list(zc.param_steps)
        zc.update_segments(used)  # counts the step of every used parameter (and Adam's runs, unused here)
        hyper = {k: v for k, v in group.items() if k != "params"}
        if master.device.type == "cpu":
            hyper = _on_host(hyper)
        shadow = self._shadows.get(zc.spec.group)
        if shadow is None:
            shadow = self._shadows[zc.spec.group] = _shadow(self.cls, [], hyper)
        pieces: list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]] = []
        for i, info in enumerate(zc.spec.params):
            a, b = max(info.offset, lo), min(info.offset + info.numel, hi)
            if not used[i] or a >= b:
                continue
            p = master[a - lo : b - lo]
            p.grad = grad[a - lo : b - lo]
            views = {n: states[n][a - lo : b - lo] for n in self.state_names}
            if steps_before[i] == 0:
                # Some classes make a parameter's state in their constructor, not in step() (Adagrad in older torch):
                # a throwaway instance over this view gives it its first state either way.
                first = _shadow(self.cls, [p], hyper).state.get(p)
                if first:
                    shadow.state[p] = dict(first)
            else:
                st: dict[str, Any] = dict(views)
                st.update(self.scalars.get((zc.spec.index, i), {}))
                step = float(steps_before[i])
                # capturable=True (a GPU's graph-safe step) wants the count beside the parameter; else on the host.
                where = p.device if hyper.get("capturable") else None
                # torch.full: made from Python data on a GPU (torch.tensor) it would wait for the device.
                st["step"] = (
                    torch.full((), step, dtype=torch.float32, device=where) if self.tensor_step else steps_before[i]
                )
                shadow.state[p] = st
            pieces.append((i, p, views))
        if not pieces:
            return
        shadow.param_groups[0].update(hyper)
        shadow.param_groups[0]["params"] = [p for _, p, _ in pieces]
        try:
            shadow.step()
            for i, p, views in pieces:
                st = shadow.state[p]
                for n, view in views.items():
                    if st[n] is not view:  # first step (a fresh state), or a class that replaced the tensor
                        view.copy_(st[n])
                if self.scalar_names:
                    self.scalars[(zc.spec.index, i)] = {n: st[n].detach().clone() for n in self.scalar_names}
        finally:
            for _, p, _ in pieces:
                p.grad = None
            shadow.state.clear()
            shadow.param_groups[0]["params"] = []

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def scalars_by_name(self, chunks: list[Any], name_of: Any) -> dict[str, dict[str, list]]:
        """This rank's 0-d states by stored parameter name: {name: {state: [value, dtype]}}."""
        out: dict[str, dict[str, list]] = {}
        for zc in chunks:
            for i, info in enumerate(zc.spec.params):
                kept = self.scalars.get((zc.spec.index, i))
                if kept:
                    out[name_of(info)] = {k: [float(v), str(v.dtype).removeprefix("torch.")] for k, v in kept.items()}
        return out

    def load_scalars(self, chunks: list[Any], name_of: Any, saved: dict[str, dict[str, list]]) -> None:
        self.scalars.clear()
        for zc in chunks:
            for i, info in enumerate(zc.spec.params):
                entry = saved.get(name_of(info))
                if entry:
                    self.scalars[(zc.spec.index, i)] = {
                        k: torch.tensor(v, dtype=getattr(torch, dt)) for k, (v, dt) in entry.items()
                    }


def _shadow(kind: type, params: list[torch.Tensor], hyper: dict[str, Any]) -> torch.optim.Optimizer:
    """An instance of the user's optimizer class over `params` with the user's hyperparameters. torch's
    constructors refuse an empty parameter list, so the instance is made on a placeholder and then emptied."""
    placeholder = [torch.zeros(1)]
    try:
        opt = kind(params or placeholder, **{k: v for k, v in hyper.items() if _accepts(kind, k)})
    except TypeError:
        # A constructor that does not take every group key: build it as torch.optim.Optimizer itself would.
        opt = kind.__new__(kind)
        torch.optim.Optimizer.__init__(opt, params or placeholder, dict(hyper))
    opt.param_groups[0].update(hyper)
    if not params:
        opt.param_groups[0]["params"] = []
    return opt


def _accepts(kind: type, key: str) -> bool:
    import inspect

    try:
        sig = inspect.signature(kind.__init__)
    except (TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return True
    return key in sig.parameters
