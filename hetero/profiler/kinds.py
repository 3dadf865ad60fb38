"""What each chunk holds on each tier now, by kind: the profile's by-kind samples and its peaks' holders."""

from __future__ import annotations

from typing import Any

from hetero.memory import ChunkState, Tier


def holds(chunk: Any, tier: Tier) -> bool:
    """Whether a chunk's bytes count on a tier's ledger now: resident there, reserved there by a move, or (NVMe) a
    swap copy."""
    if tier is Tier.NVME and chunk.on_nvme:
        return True
    if chunk.state is ChunkState.EMPTY:
        return False
    if chunk.tier == tier and tier is not Tier.NVME:
        return True
    return chunk.move is not None and chunk.move.dst == tier and tier is not Tier.NVME


def by_kind(manager: Any) -> dict[str, dict[str, int]]:
    """Bytes per tier per chunk kind now (what `holds` counts, in one pass), plus the pools' cached buffers and
    whatever else the ledger holds (buffers being allocated, staging). Runs at every sample: kept to plain lookups."""
    per_tier: tuple[dict[str, int], ...] = ({}, {}, {})  # indexed by Tier value
    nvme = per_tier[Tier.NVME]
    empty, nvme_tier = ChunkState.EMPTY, Tier.NVME
    for c in manager.chunks:
        n = c.capacity * c.dtype.itemsize
        k = c.kind
        if c.on_nvme:
            nvme[k] = nvme.get(k, 0) + n
        if c.state is empty:
            continue
        t = c.tier
        if t is not None and t is not nvme_tier:
            d = per_tier[t]
            d[k] = d.get(k, 0) + n
        move = c.move
        if move is not None and move.dst is not nvme_tier:
            d = per_tier[move.dst]
            d[k] = d.get(k, 0) + n
    out = {}
    for tier, ledger in manager.ledgers.items():
        d = per_tier[tier]
        if ledger.cached:
            d["cached"] = ledger.cached
        rest = ledger.current + ledger.cached - sum(d.values())
        if rest > 0:
            d["staging"] = rest
        out[_LABELS[tier]] = d
    return out


_LABELS = {t: t.label for t in Tier}
