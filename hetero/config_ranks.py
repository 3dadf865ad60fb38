"""One config for every rank: `agree_config` compares the keys every rank must share, once, as `initialize` starts.

[Note: one config for every rank]
Each rank builds its Config from what its own process was given (a file, a dict, the environment). A few keys are the
rank's own: its resources (memory budgets and nvme_dir; where its chunks live: offload; prefetch_depth;
activation_offload), its waits (comm_timeout, checkpoint_patience) and its outputs (log, progress). Ranks may set
those as they like: a rank's placement moves bytes only between its own tiers, and the collectives every rank runs
are the same whatever its tiers (tests/test_config_ranks.py trains with placements that differ). Every other key
shapes the collectives that all ranks run together, or the update that each replica computes. A rank given another
zero_stage, precision, chunk_size, grad_accumulation_steps or check_collectives ran other collectives than its peers:
gloo aborted the process ("Received data size doesn't match expected size"), or the ranks waited until comm_timeout
(ten minutes by default) and blamed an operation; one given another grad_clip_norm at stage 0 stepped its replica
with other gradients, and the replicas drifted apart without a word. So every rank's shared keys are gathered once,
over the engine's world, before the first process group is made from `parallel`, and a difference is one ConfigError
on every rank (each computes it from the same gathered list) naming the keys and each rank's value. A key added to
Config later is shared unless listed in PER_RANK: a refusal that names it beats a silent drift.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hetero.errors import ConfigError

if TYPE_CHECKING:
    from hetero.comm import Comm
    from hetero.config import Config

# Keys a rank may set for itself ([Note: one config for every rank]).
PER_RANK = (
    "memory",
    "offload",
    "prefetch_depth",
    "activation_offload",
    "comm_timeout",
    "checkpoint_patience",
    "log",
    "progress",
)
_SECTIONS = ("parallel", "loss_scale")  # shared sections, compared key by key so that an error names the key
_RANKS_SHOWN = 8  # ranks listed per value; the rest counted


def shared_keys(config: Config) -> dict[str, Any]:
    """The config's keys that every rank must share, flat ("parallel.tensor"), as plain values."""
    out: dict[str, Any] = {}
    for key, value in config.to_dict().items():
        if key in PER_RANK:
            continue
        if key in _SECTIONS:
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def agree_config(config: Config, world: Comm) -> None:
    """Raise the same ConfigError on every rank of `world` if the ranks were given configs that differ in a shared
    key. Every rank calls it, before any other collective over `world`."""
    if world.size == 1:
        return
    every: list[dict[str, Any]] = world.all_gather_object(shared_keys(config))  # type: ignore[assignment]
    differ = [key for key in every[0] if any(r.get(key) != every[0][key] for r in every)]
    differ += sorted({k for r in every for k in r} - set(every[0]))  # another hetero version on some rank
    if not differ:
        return
    lines = [f"{key} is {_by_value(key, every)}" for key in differ]
    raise ConfigError(
        "the ranks were given different configs; every rank must be given the same one, except for "
        f"{', '.join(PER_RANK)}, which are each rank's own. Differing: " + "; ".join(lines)
    )


def _by_value(key: str, every: list[dict[str, Any]]) -> str:
    """'2 on ranks 0, 2 and 3 on rank 1' for one key."""
    groups: dict[str, list[int]] = {}
    for rank, keys in enumerate(every):
        groups.setdefault(repr(keys.get(key, "(absent)")), []).append(rank)
    parts = []
    for value, ranks in groups.items():
        shown = ", ".join(map(str, ranks[:_RANKS_SHOWN]))
        more = f" and {len(ranks) - _RANKS_SHOWN} more" if len(ranks) > _RANKS_SHOWN else ""
        parts.append(f"{value} on rank{'s' if len(ranks) > 1 else ''} {shown}{more}")
    return " and ".join(parts)
