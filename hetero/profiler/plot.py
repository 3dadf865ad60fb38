"""The profile's timeline as a PNG: per tier, memory stacked by chunk kind over the recording, the exact ledger
total on top, optimizer steps as dashed lines and chunk moves as ticks (arriving above the axis, leaving below);
below them the process's RSS beside what the ledgers in host memory held.

matplotlib is imported here only, and only when a profile is written (an optional dependency: hetero[profile]).
It draws on a bare Figure with the Agg canvas, so it never touches pyplot's global state or a display.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from hetero.profiler.rss import host_tiers, value_at

_MIB = 1 << 20
_ORDER = ("param", "param_shard", "grad", "grad_full", "optim", "cached", "staging")


def timeline_png(prof: Any, path: Path) -> None:
    tiers = list(prof.series)
    panels = len(tiers) + (1 if prof.rss_series else 0)
    fig = Figure(figsize=(12, 2.6 * panels), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    if prof.rss_series:
        _rss_panel(prof, axes[-1])
    kinds_seen = {k for _, s in prof.samples for d in s.values() for k in d}
    kinds = [k for k in _ORDER if k in kinds_seen] + sorted(kinds_seen - set(_ORDER))
    times = [t for t, _ in prof.samples]
    for ax, tier in zip(axes, tiers):
        # The kinds this tier held, each in its colour on every panel (a legend of every kind listed absent ones)
        held = [k for k in kinds if any(s[tier].get(k, 0) for _, s in prof.samples)]
        if times and held:
            stacks = [[s[tier].get(k, 0) / _MIB for _, s in prof.samples] for k in held]
            colours = [f"C{kinds.index(k) % 10}" for k in held]
            ax.stackplot(times, stacks, labels=held, colors=colours, step="post", alpha=0.8)
        series = prof.series[tier]
        if series:
            ax.plot(
                [t for t, _ in series],
                [u / _MIB for _, u in series],
                drawstyle="steps-post",
                color="black",
                linewidth=0.8,
                label="ledger total",
            )
        if tier == "device" and prof.activation_series:
            acts = prof.activation_series
            ax.plot(
                [t for t, _ in acts],
                [n / _MIB for _, n in acts],
                drawstyle="steps-post",
                color="tab:blue",
                linewidth=0.8,
                linestyle="--",
                label="activations (saved for backward)",
            )
        peak = prof.peaks[tier]
        if peak.bytes:
            ax.axhline(peak.bytes / _MIB, color="red", linewidth=0.6, linestyle=":", label="peak")
        top = max([u for _, u in series] + [n for _, n in prof.activation_series if tier == "device"] + [1]) / _MIB
        arrive = [m.end for m in prof.moves if m.dst == tier]
        leave = [m.start for m in prof.moves if m.src == tier]
        if arrive:
            ax.plot(arrive, [top * 1.04] * len(arrive), "|", color="tab:green", markersize=6, label="move in")
        if leave:
            ax.plot(leave, [-top * 0.04] * len(leave), "|", color="tab:red", markersize=6, label="move out")
        _step_lines(ax, prof)
        ax.set_ylabel(f"{tier} (MiB)")
        ax.set_ylim(-top * 0.08, top * 1.1)
        _legend(ax)
    axes[-1].set_xlabel("seconds since the profile began (dashed: optimizer steps)")
    fig.suptitle("hetero memory timeline")
    fig.savefig(path)


def _rss_panel(prof: Any, ax: Any) -> None:
    """The process's RSS beside what hetero's ledgers in host memory held ([Note: what the ledgers do not see])."""
    times = [t for t, _ in prof.rss_series]
    ax.plot(times, [n / _MIB for _, n in prof.rss_series], color="black", linewidth=0.9, label="process RSS")
    tiers = host_tiers(prof)
    held = [sum(value_at(prof.series[tier], t) for tier in tiers) / _MIB for t in times]
    label = f"{' + '.join(tiers)} ledgers"
    ax.plot(times, held, drawstyle="steps-post", color="tab:purple", linewidth=0.8, label=label)
    _step_lines(ax, prof)
    ax.set_ylabel("process (MiB)")
    ax.set_ylim(0, max(n for _, n in prof.rss_series) / _MIB * 1.1)
    _legend(ax)


def _step_lines(ax: Any, prof: Any) -> None:
    """The optimizer steps, as dashed lines."""
    for t, _ in prof.steps:
        ax.axvline(t, color="grey", linestyle="--", linewidth=0.7)


def _legend(ax: Any) -> None:
    """The panel's legend beside it, right of the plot: drawn inside, it covered the recording's first moments (the
    series and the moves' ticks there), whatever corner it took."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0, fontsize=7)
