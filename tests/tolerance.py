"""How close is close enough: hetero against plain PyTorch, with the tolerance derived from the arithmetic.

[Note: tolerances from the arithmetic]
A training run in fp32 is not the exact result of its math: every sum is rounded, and different summation orders
(chunked reductions, all-reduces over ranks, fused kernels) give different, equally valid roundings. So the
reference is the same run in float64, which is exact to within ~1e-16, and the scale of fp32's own error is measured,
not guessed: it is how far plain PyTorch in fp32 lands from the float64 run. hetero in fp32 is the same computation
with other summation orders; its error is of the same nature and size. A check passes when hetero's distance to the
float64 run is within `FACTOR` times plain fp32's distance, plus a floor of a few units of fp32 rounding for
tensors where plain fp32 happens to land almost exactly. Distances are norms over whole tensors, so one element
that Adam amplified (a gradient near zero, whose sign rounding decides) does not decide alone. A loss is one number,
so its scale is plain fp32's largest distance over the run relative to the loss: a single step can land on the exact
loss by chance.

Low precision (bf16, fp16) is checked the same way, against plain PyTorch in that precision, on the weight deltas
(final minus initial weights: what training changed) rather than the weights, whose initial values dominate. The
data must be learnable, so that the deltas are large against the rounding noise; `assert_learns` checks that the
bound is well below the deltas themselves, so a model that never updates cannot pass.
"""

from __future__ import annotations

import math

import torch

FACTOR = 8.0  # hetero may be this many times as far from float64 as plain PyTorch in the same precision
EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _bound(plain: float, scale: float, eps: float) -> float:
    return FACTOR * plain + 4 * eps * scale


def assert_losses(got: list[float], exact: list[float], plain: list[float], *, dtype: torch.dtype) -> None:
    """Per step: |got - exact| within FACTOR x plain fp32's distance (+ a few ulps of the loss). Plain's distance at a
    step is one sample of the run's rounding: it can land on the exact loss by chance (on one H100, one ulp at a step
    where hetero, summing in another valid order, was 24 ulps off). So the scale is plain's largest distance over the
    run relative to the loss, applied to each step's loss; never less than its own distance at that step."""
    eps = EPS[dtype]
    assert len(got) == len(exact) == len(plain), (len(got), len(exact), len(plain))
    scale = max((abs(p - e) / abs(e) for p, e in zip(plain, exact) if e != 0), default=0.0)
    for i, (g, e, p) in enumerate(zip(got, exact, plain)):
        bound = _bound(max(abs(p - e), scale * abs(e)), abs(e), eps)
        assert abs(g - e) <= bound, f"step {i}: loss {g!r} is {abs(g - e):.3g} from exact {e!r}; bound {bound:.3g}"


def assert_weights(
    got: dict[str, torch.Tensor],
    exact: dict[str, torch.Tensor],
    plain: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    initial: dict[str, torch.Tensor] | None = None,
) -> None:
    """Per tensor: ||got - exact|| within FACTOR x ||plain - exact|| (+ a few ulps of the tensor's norm). With
    `initial`, the deltas (final minus initial) are compared instead, and they must be learnable (see the note)."""
    eps = EPS[dtype]
    for name, e in exact.items():
        e = e.double().cpu()
        g, p = got[name].double().cpu(), plain[name].double().cpu()
        if initial is not None:
            start = initial[name].double().cpu()
            e, g, p = e - start, g - start, p - start
        ours, theirs = float((g - e).norm()), float((p - e).norm())
        bound = _bound(theirs, float(e.norm()), eps)
        assert ours <= bound, f"{name}: {ours:.3g} from exact, plain PyTorch {theirs:.3g}; bound {bound:.3g}"


def assert_learns(
    exact: dict[str, torch.Tensor], plain: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]
) -> None:
    """The run changed the weights far more than low precision's own error: a check on the deltas means something.
    Over the whole model, the exact delta must be at least twice the bound a check allows, so a run that never
    updated (its error: the whole delta) fails it."""
    delta = math.sqrt(sum(float((exact[k].double().cpu() - initial[k].double().cpu()).norm()) ** 2 for k in exact))
    noise = math.sqrt(sum(float((plain[k].double().cpu() - exact[k].double().cpu()).norm()) ** 2 for k in exact))
    assert delta >= 2 * FACTOR * noise, f"the data is not learnable enough: delta {delta:.3g}, noise {noise:.3g}"


def assert_near_plain(
    got: dict[str, torch.Tensor], exact: dict[str, torch.Tensor], plain: dict[str, torch.Tensor], *, rel: float
) -> None:
    """Each tensor within `rel` of its norm from plain fp32's, on top of fp32's own noise on it: a parameter whose
    exact gradient is zero (a key bias) gets Adam's lr-sized step from rounding, and plain fp32 is as far off."""
    for name, value in plain.items():
        noise = FACTOR * float((value.double().cpu() - exact[name].double().cpu()).norm())
        err, size = float((got[name].double().cpu() - value.double().cpu()).norm()), float(value.double().cpu().norm())
        assert err <= rel * size + noise, f"{name}: {err:.3g} from plain fp32 (norm {size:.3g}, noise {noise:.3g})"
