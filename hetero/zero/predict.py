"""The delayed update's forward on a prediction of the weights (`"delayed_param_update_prediction": true`).

[Note: predicting past the delay]
The delayed update ([Note: the delayed parameter update]) takes update t's gradient at θ_{t-2} and applies it to
θ_{t-1}. Adam is far less stable so: along a direction of curvature λ, with η the step an element takes (lr/√v̂),
the exact update with β1 = 0.9 stays stable up to ηλ = 2(1+β1)/(1-β1) = 38, the one-step-delayed one only up to
ηλ ≈ 1 (iterating the linear recurrences of both). Adaptive optimizers drive the preconditioned sharpness up to their
stability limit (Cohen et al., 2022, "Adaptive gradient methods at the edge of stability"), so the switch to the
delay throws every direction near that limit out of it. On examples/train_gpt.py (lr 3e-3) the loss rose from 2.67
to 3.0 within 20 updates of the switch and stalled near 2.1 over 1000 updates, where the exact update reaches 0.34;
plain PyTorch through the same algorithm does the same (benchmarks/delayed_update.py).

With this option the forward and backward of step t+1 run on a prediction of θ_t instead of θ_{t-1}. Adam's update t
is θ_t = θ_{t-1}(1 - lr·wd) - lr (β1 m_{t-1} + (1-β1) g_t) / (1-β1^k) / (√v̂_t + ε), and both of its parts are at
hand before update t steps:
  - the drift, β1 m_{t-1}: known while update t-1 steps, when m_{t-1} is in memory (states on NVMe are not, later):
    the pending values of update t-1 are θ_{t-1}(1 - lr·wd) minus the drift (`drift`, on the update's worker).
    lr and wd there are update t's, not update t-1's: update t-1 steps with the groups copied at its `step()`
    (ZeRO-Offload's update t-1 with lr_{t-1}), while the drift reads the groups as they are when its chunk steps,
    in the next forward, after the loop's scheduler set lr_t. Taken from update t-1, a LambdaLR that changed lr by
    16x at each update moved the loss of a 6-step run 1.5% off plain PyTorch's (tests/test_delayed.py). A learning
    rate changed later than that (after the next forward began) reaches the drift of the chunks that step after
    it only: the others' prediction is off by the change, never the master weights;
  - the fresh part, (1-β1) g_t: known at the boundary that prepares update t, where g_t is reduced and clipped: one
    axpy over this rank's shard before the values are written into the parameters (`fresh`).
√v̂ per element is not at hand at the boundary (it is on NVMe). Both parts divide by one scale per tensor, the mean
of √v̂ over the whole tensor (every rank sums its pieces while they step, the sums are added up on the control group
at the next boundary, `refresh`; the drift uses the scale of the update before), or by the least √v̂_t that Adam's
own update can have where that is larger: √(β2 v_{t-1}) for the drift (v_{t-1} is in memory beside it) and
√(1-β2)|g_t| for the fresh part (v_t = β2 v_{t-1} + (1-β2) g_t², bias corrections aside). The bound keeps an element
with a large v from moving further than Adam could move it: with the scale alone such elements overshoot, which
the example's long runs absorbed but an early switch did not (60 updates, delayed after 10: the 10 updates after the
switch averaged 3.767 against the exact 3.262, with the bound 3.185). Plain PyTorch on the example (300 updates,
mean loss of the last 20; exact 1.890, delayed 2.315): per-element √v̂ in both parts 1.863 (an ideal: at the
boundary v is on NVMe), the scale alone 1.851, per-element drift with a scaled fresh part 1.943, one scale for all
parameters 2.083, the bound on the drift alone 1.984, the scale with both bounds 1.837; over 1000 updates, both
bounds 0.326 against the exact 0.339. SGD needs no scale: its drift is lr·μ·buf (lr·μ²·buf with Nesterov) and its
fresh part lr(1-dampening)g (lr(1+μ(1-dampening))g), so without momentum the prediction is the update itself
(weight decay aside, which the prediction leaves out for SGD and coupled Adam).

The master weights and states go through the delayed sequence exactly; only where each gradient is taken moves, to
θ̂_{t-1}, the prediction of θ_{t-1}:  θ_t = θ_{t-1} - U(g(θ̂_{t-1})). What it costs:
  - the parameters hold predictions, so they cannot stand in for the master: it is kept in the optimizer chunk
    ([Note: the master follows the shard] does not apply; with states on NVMe 4 more bytes a parameter each way);
  - a few elementwise passes over the shard at the boundary (the fresh part and its bound) and beside each chunk's
    step (the drift and its bound), and an all-reduce of one float per tensor per update (over the ranks holding
    its shards, and over the tensor group, whose ranks hold slices of it: the scale is the whole tensor's).
Whatever applies the pending update outside a step (a checkpoint, a view, an fp16 step skipped) writes the exact
values from the master and forgets the scales (`reset`), so the update after it is predicted from scratch: a run
resumed from a checkpoint goes on as the one that saved it did.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from hetero.errors import ConfigError
from hetero.zero.grad_norm import zc_sharded
from hetero.zero.optim import Algorithm

if TYPE_CHECKING:
    from hetero.comm import Comm
    from hetero.zero.zero_chunk import ZeroChunk


class Prediction:
    """The per-tensor scales and the two parts of the prediction; see [Note: predicting past the delay]."""

    def __init__(self, algorithm: Algorithm, chunks: list[ZeroChunk], comm: Comm, tp: Comm | None = None) -> None:
        """`comm`: the group whose ranks hold the chunks' shards (ZeRO's); `tp`: the tensor-parallel group where there
        is one, whose ranks hold slices of a tensor: a tensor's scale is the mean over all of them."""
        if algorithm.name not in ("adam", "sgd"):
            raise ConfigError(
                f"delayed_param_update_prediction: predicts Adam, AdamW and SGD updates, not {algorithm.name!r}; use "
                "one of those, or set delayed_param_update_prediction false"
            )
        self.algorithm = algorithm
        self.comm = comm
        self.tp = tp
        self.sharded = zc_sharded(chunks)  # ranks hold disjoint pieces: their sums add up
        # Per chunk (id): (its entry, the entry's tensor in the per-tensor vectors, start, end in this rank's shard).
        # A weight tiled over several chunks ([Note: tiles] in hetero/memory/chunk_size.py) is one tensor: its tiles
        # share the index.
        self._pieces: dict[int, list[tuple[int, int, int, int]]] = {}
        index: dict[int, int] = {}
        numel: list[int] = []
        for zc in chunks:
            lo, hi = zc.kept_range()
            pieces = []
            for j, info in enumerate(zc.spec.params):
                t = index.setdefault(id(info.param), len(index))
                if t == len(numel):
                    numel.append(0)
                numel[t] += info.numel
                a, b = max(info.offset, lo), min(info.offset + info.numel, hi)
                if a < b:
                    pieces.append((j, t, a - lo, b - lo))
            self._pieces[id(zc)] = pieces
        # Over the tensor group, each tensor's sums and sizes add up alike: a slice, a block some ranks hold alike or
        # a tensor every rank holds whole counts as often in both, so the mean is the whole tensor's.
        self._numel = torch.tensor(numel, dtype=torch.float64)
        self._numel_summed = tp is None
        self._scale: list[float] | None = None  # per tensor: the mean of √v̂ after its last update (NaN: none yet)
        # The pending update's sums of √v̂ over this rank's pieces, and which tensors it stepped (1.0), in one
        # vector so that one collective adds both up.
        self._sums = torch.zeros(2, len(numel), dtype=torch.float64)
        self._drift_buf, self._fresh_buf = Scratch(), Scratch()  # the worker's and the driving thread's

    # ---- on the update's worker, beside a chunk's step ------------------------------------------------------
    def drift(
        self,
        zc: ZeroChunk,
        group: dict[str, Any],
        states: list[torch.Tensor],
        values: torch.Tensor,
        steps: list[int],
        used: list[int],
    ) -> None:
        """`values` (the chunk's new parameters, a copy of the master weights after its step) become the new weights
        minus the next update's drift; `steps` are the tensors' step counts after this update, `used` which ones
        stepped."""
        lr, wd = group["lr"], group["weight_decay"]
        for j, t, a, b in self._pieces[id(zc)]:
            if not used[j]:
                continue
            if self.algorithm.name == "sgd":
                mu = group["momentum"]
                if mu != 0:  # `values` holds the master's new values
                    values[a:b].add_(states[0][a:b], alpha=-lr * (mu * mu if group["nesterov"] else mu))
                continue
            beta1, beta2 = group["betas"]
            k = steps[j]
            scale = self._scale[t] if self._scale is not None else math.nan
            # The next update's √v̂ is at least q√v, q = √(β2 / (1-β2^(k+1))), whatever its gradient: dividing by
            # the larger of that bound and the scale keeps an element with a large v from moving further than Adam
            # could move it. max(q√v, scale) = q max(√v, scale / q): one clamp, with 1/q folded into the multiplier.
            q = math.sqrt(beta2 / (1.0 - beta2 ** (k + 1)))
            decay = 1.0 - lr * wd if self.algorithm.decouples(group) else 1.0
            roots = torch.zeros((), dtype=torch.float64)
            for s, e in _blocks(a, b):  # [Note: predicting in blocks]
                root = torch.sqrt(states[1][s:e], out=self._drift_buf.take(e - s, states[1]))
                roots += root.sum(dtype=torch.float64)
                if math.isnan(scale):
                    continue  # no scale yet (the first delayed update, or after a reset): no drift this time
                root.clamp_(min=(scale + group["eps"]) / q)
                out = values[s:e]  # holds the master's new values
                if decay != 1.0:
                    out.mul_(decay)
                out.addcdiv_(states[0][s:e], root, value=-lr * beta1 / (1.0 - beta1 ** (k + 1)) / q)
            self._sums[0, t] += roots / math.sqrt(1.0 - beta2**k)
            self._sums[1, t] = 1.0

    # ---- at the boundary, on the driving thread --------------------------------------------------------------
    def refresh(self) -> None:
        """The pending update has stepped every chunk on every rank: its sums become the per-tensor scales (the
        same on every rank). Collective on the control group (stages 1-3), at a boundary every rank reaches."""
        if self.algorithm.name != "adam":
            return
        sums = self._sums
        if self.sharded:
            self.comm.control.all_reduce(sums, op="sum")
        if self.tp is not None:
            self.tp.control.all_reduce(sums, op="sum")
            if not self._numel_summed:  # once, at the first boundary every rank reaches
                self.tp.control.all_reduce(self._numel, op="sum")
                self._numel_summed = True
        stepped = sums[1] > 0
        mean = sums[0] / self._numel
        old = torch.full_like(mean, math.nan) if self._scale is None else torch.tensor(self._scale, dtype=mean.dtype)
        self._scale = torch.where(stepped, mean, old).tolist()  # read per piece: floats, not tensor items
        sums.zero_()

    def reset(self) -> None:
        """The pending update was applied exactly (from outside a step): predict the next one from scratch."""
        self._scale = None
        self._sums.zero_()

    def fresh(
        self,
        zc: ZeroChunk,
        group: dict[str, Any],
        values: torch.Tensor,
        grad: torch.Tensor,
        coef: float | torch.Tensor,
    ) -> None:
        """Subtract the next update's fresh part from `values`: `grad` is its reduced gradient (this rank's part),
        `coef` its unscale-and-clip multiplier; the tensors' step counts are the ones before that update."""
        lr, sign = group["lr"], -1.0 if group.get("maximize", False) else 1.0
        for j, t, a, b in self._pieces[id(zc)]:
            g = grad[a:b] if not isinstance(coef, torch.Tensor) else grad[a:b] * coef
            mult = coef if not isinstance(coef, torch.Tensor) else 1.0  # what g still needs multiplying by
            if self.algorithm.name == "sgd":
                mu, damp = group["momentum"], group["dampening"]
                c = lr * ((1.0 + mu * (1.0 - damp)) if group["nesterov"] else (1.0 - damp if mu != 0 else 1.0))
                values[a:b].add_(g, alpha=-sign * c * mult)
                continue
            scale = self._scale[t] if self._scale is not None else math.nan
            if math.isnan(scale):
                continue
            (beta1, beta2), k = group["betas"], zc.param_steps[j] + 1  # the step this gradient's update is
            # Its √v̂ is at least √((1-β2) / (1-β2^k)) |g|, so |g| / √v̂ is at most r = √((1-β2^k) / (1-β2)): dividing
            # by the larger of that bound and the scale, as in `drift`, is clamping g to ±r·scale, then dividing.
            bound = math.sqrt((1.0 - beta2**k) / (1.0 - beta2)) * (scale + group["eps"]) / mult
            c = lr * (1.0 - beta1) / (1.0 - beta1**k) / (scale + group["eps"])
            for s, e in _blocks(0, b - a):  # [Note: predicting in blocks]
                clamped = torch.clamp(g[s:e], min=-bound, max=bound, out=self._fresh_buf.take(e - s, g))
                values[a + s : a + e].add_(clamped, alpha=-sign * c * mult)


# [Note: predicting in blocks]
# Each part of the prediction is a few elementwise passes over a tensor's piece of the shard. Written whole, each pass
# made a temporary the size of the piece (the fresh part's clamped gradient, the drift's √v): above the C heap's mmap
# threshold that is fresh memory every time, faulted in page by page. On one H200 the 551M Llama of
# benchmarks/gpu_race.py stepped 7.12 s with the prediction against 5.77 s without it, the fresh part on the training
# thread between backward and the next forward. In blocks through a buffer kept for the purpose, the same arithmetic
# element by element (the drift's float64 sum of √v in another order) took a clamp-and-add over 64M elements from
# 0.17 to 0.04 s on the 2-core development VM.
BLOCK = 1 << 20  # elements a pass takes at a time: 4 MiB of fp32 scratch


def _blocks(a: int, b: int) -> list[tuple[int, int]]:
    return [(s, min(b, s + BLOCK)) for s in range(a, b, BLOCK)]


class Scratch:
    """A buffer of BLOCK elements reused pass after pass, one per thread that uses it."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def take(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """`n` elements (at most BLOCK) of `like`'s dtype, in the same memory as `like` (a device's or the host's)."""
        if self.buf is None or self.buf.dtype != like.dtype or self.buf.device != like.device:
            self.buf = like.new_empty(BLOCK)
        return self.buf[:n]
