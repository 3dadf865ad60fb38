"""The three tiers and the exact byte accounting of each."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field


class Tier(enum.IntEnum):
    """Where a chunk lives. Lower is faster; eviction moves a chunk to the next higher value."""

    DEVICE = 0  # the compute device (cuda:N, or the CPU when there is no GPU)
    HOST = 1  # host memory: pinned with CUDA, pageable without
    NVME = 2  # swap files under the user's nvme_dir

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def below(self) -> Tier | None:
        """The tier a chunk evicted from here goes to; None for the last tier."""
        return Tier(self + 1) if self < Tier.NVME else None

    @classmethod
    def parse(cls, value: str | Tier) -> Tier:
        if isinstance(value, Tier):
            return value
        try:
            return cls[value.upper()]
        except KeyError:
            raise ValueError(f"unknown tier {value!r}; choose 'device', 'host' or 'nvme'") from None


@dataclass
class TierLedger:
    """Bytes held on one tier against its budget. Every allocation hetero makes on the tier passes through here."""

    tier: Tier
    budget: int  # bytes hetero may hold on this tier
    # A budget that is a target (automatic placement): how far a request the chunks in use leave no room for may raise
    # it ([Note: automatic placement]); None: the budget is a limit
    ceiling: int | None = None
    current: int = 0  # bytes held now by chunk payloads and buffers in use
    cached: int = 0  # bytes held by free buffers kept for reuse (host pool); counted against the budget too
    peak: int = 0  # highest current + cached ever reached
    observers: list[Callable[[Tier, int], None]] = field(default_factory=list)  # told (tier, used) at every change

    @property
    def used(self) -> int:
        return self.current + self.cached

    @property
    def free(self) -> int:
        return self.budget - self.used

    def take(self, nbytes: int) -> None:
        """Account nbytes newly held. The caller has made room first; exceeding the budget is a bug."""
        if self.used + nbytes > self.budget:
            raise AssertionError(
                f"{self.tier.label} ledger overrun: {self.used} + {nbytes} > budget {self.budget} "
                "(the caller must make room first)"
            )
        self.current += nbytes
        self.peak = max(self.peak, self.used)
        self._changed()

    def give(self, nbytes: int) -> None:
        if nbytes > self.current:
            raise AssertionError(f"{self.tier.label} ledger underrun: giving {nbytes} of {self.current}")
        self.current -= nbytes
        self._changed()

    def to_cache(self, nbytes: int) -> None:
        """A buffer in use becomes a cached free buffer: still held, no longer by a chunk."""
        if nbytes > self.current:
            raise AssertionError(f"{self.tier.label} ledger underrun: caching {nbytes} of {self.current}")
        self.current -= nbytes
        self.cached += nbytes
        self._changed()

    def from_cache(self, nbytes: int) -> None:
        self.cached -= nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.used)
        self._changed()

    def drop_cache(self, nbytes: int) -> None:
        self.cached -= nbytes
        self._changed()

    def _changed(self) -> None:
        for fn in self.observers:
            fn(self.tier, self.used)

    def reset_peak(self) -> None:
        self.peak = self.used
