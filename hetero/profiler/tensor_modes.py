"""The tensor-parallel modes and sequence-parallel forms, as their papers describe one rank's share: a small table
the estimator and the planner read, and that implementations of the modes can be checked against.

For a tensor group of degree t, each mode gives the share of a planned layer's parameters one rank holds, the share of
its activations, and the bytes each rank moves per linear layer, forward and backward, with ring collectives, in
units of the layer's activation (the Colossal-AI papers' tables: Optimus 2D, Tesseract 2.5D, 3D; Megatron for 1D).
Sequence forms split the sequence over the same group: Megatron's inside 1D tensor parallelism (weights sharded),
Ulysses' and ring attention's with the weights whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorMode:
    """How one rank of a tensor group of degree t shares a linear layer, per the papers' tables."""

    name: str
    check: Callable[[int], str | None]  # None if the degree suits the mode, else why not
    param_degree: Callable[[int], int]  # the 1D degree giving the same share of the planned layers' parameters
    activation_share: Callable[[int], float]  # share of a layer's activations one rank holds
    comm: Callable[[int], float]  # bytes each rank moves per linear layer, in units of the layer's activation
    reference: str


def _root(t: int, k: int) -> int | None:
    q = round(t ** (1 / k))
    return next((c for c in (q - 1, q, q + 1) if c >= 2 and c**k == t), None)


def q_and_depth(t: int) -> tuple[int, int] | None:
    """(q, d) with q^2 d = t, q >= 2, d >= 2 the smallest such depth (2.5D)."""
    for d in range(2, t + 1):
        if t % d == 0 and (q := _root(t // d, 2)) is not None:
            return q, d
    return None


TENSOR_MODES: dict[str, TensorMode] = {
    "1d": TensorMode(
        "1d",
        lambda t: None,
        lambda t: t,
        lambda t: (10 + 24 / t) / 34,  # Korthikanti et al.: sbh (10 + 24 / t) of a block's 34 sbh (fused attention)
        lambda t: 2 * (t - 1) / t,
        "Megatron-LM (Shoeybi et al. 2019): 1/t of the weights, an all-reduce forward and backward",
    ),
    "2d": TensorMode(
        "2d",
        lambda t: None if _root(t, 2) else f"2d needs a square tensor degree (4, 9, 16, ...), got {t}",
        lambda t: t,
        lambda t: 1 / t,
        lambda t: 6 * (_root(t, 2) - 1) / _root(t, 2),  # type: ignore[operator]
        "Optimus (Xu et al. 2021), SUMMA on q x q: 1/q^2 of weights and activations, 6(q-1)/q",
    ),
    "2.5d": TensorMode(
        "2.5d",
        lambda t: None if q_and_depth(t) else f"2.5d needs a degree q^2 x d with q, d >= 2 (8, 16, 18, ...), got {t}",
        lambda t: q_and_depth(t)[0] ** 2,  # type: ignore[index]
        lambda t: 1 / t,
        lambda t: 3 * (q_and_depth(t)[0] - 1) * (q_and_depth(t)[1] + 1) / (q_and_depth(t)[1] * q_and_depth(t)[0]),  # type: ignore[index]
        "Tesseract (Wang et al. 2021): 1/q^2 of weights, 1/(d q^2) of activations, 3(q-1)(d+1)/(d q)",
    ),
    "3d": TensorMode(
        "3d",
        lambda t: None if _root(t, 3) else f"3d needs a cubic tensor degree (8, 27, 64, ...), got {t}",
        lambda t: t,
        lambda t: 1 / t,
        lambda t: 6 * (_root(t, 3) - 1) / t,  # type: ignore[operator]
        "3D tensor parallelism (Bian et al. 2021): 1/q^3 of weights and activations, 6(q-1)/q^3",
    ),
}

# Sequence forms over the tensor group: (weights sharded by the 1D plan, activation share, comm per layer / act).
SEQUENCE_FORMS: dict[str, tuple[bool, Callable[[int], float], Callable[[int], float], str]] = {
    "megatron": (True, lambda t: 1 / t, lambda t: 2 * (t - 1) / t, "Korthikanti et al. 2022: all-gather + RS"),
    "ulysses": (False, lambda t: 1 / t, lambda t: 4 * (t - 1) / t / t, "DeepSpeed-Ulysses: 4 all-to-alls of 1/t"),
    "ring": (False, lambda t: 1 / t, lambda t: 2 * (t - 1) / t, "Ring attention: k and v passed around the ring"),
}
