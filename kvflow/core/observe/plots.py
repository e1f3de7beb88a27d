"""The PNG figures of `kvflow report`, drawn with matplotlib's Agg backend (no display).

`lifecycle_figure` draws the three L0 block-age histograms as the server aggregated
them (bucket counts over their explicit bounds, percentiles marked);
`timeline_figure` draws throughput, request rates, hit rates (prefix, and blend once
a blend lookup ran) and tier usage over the recorded interval, one point per pair of
consecutive snapshots.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window

import matplotlib.pyplot as plt

from kvflow.core.observe import units
from kvflow.core.observe.snapshot import OPS, Rates, Snapshot

L0_TITLES = {
    "lifetime": "Block lifetime (allocation to eviction)",
    "idle_before_evict": "Idle before evict (release to eviction)",
    "reuse_gap": "Reuse gap (between accesses of the same contents)",
}
_QUANTILE_COLOURS = {"p50_s": "tab:green", "p90_s": "tab:orange", "p99_s": "tab:red"}


def _bucket_labels(bounds: Sequence[float]) -> list[str]:
    labels = [f"<= {units.seconds(b)}" for b in bounds]
    return [*labels, f"> {units.seconds(bounds[-1])}"] if bounds else ["all"]


def lifecycle_figure(l0: dict[str, Any], path: Path, sample_rate: float) -> Path:
    """One bar chart per L0 histogram (values per bucket), p50/p90/p99 as vertical lines."""
    fig, axes = plt.subplots(3, 1, figsize=(11, 10), constrained_layout=True)
    fig.suptitle(f"GPU block lifecycle (L0, sample rate {sample_rate:g}, since server start)")
    for ax, (name, title) in zip(axes, L0_TITLES.items(), strict=True):
        hist = l0.get(name)
        ax.set_title(title, loc="left")
        if not hist or not hist.get("count"):
            ax.text(0.5, 0.5, "no values yet", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            continue
        bounds, counts = hist["bounds_s"], hist["bucket_counts"]
        positions = range(len(counts))
        ax.bar(positions, counts, color="tab:blue", edgecolor="navy")
        ax.set_xticks(list(positions), _bucket_labels(bounds), rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("blocks")
        for key, colour in _QUANTILE_COLOURS.items():
            value = hist.get(key)
            if value is not None:
                ax.axvline(
                    _position(value, bounds),
                    color=colour,
                    linestyle="--",
                    label=f"{key[:-2]} {units.seconds(value)}",
                )
        ax.legend(loc="upper right", title=f"{hist['count']} values")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _position(value: float, bounds: Sequence[float]) -> float:
    """Where `value` falls on the bar chart's bucket axis (interpolated within its bucket)."""
    lower = 0.0
    for i, upper in enumerate(bounds):
        if value <= upper:
            return i - 0.5 + (value - lower) / (upper - lower)
        lower = upper
    return len(bounds)


def timeline_figure(snaps: Sequence[Snapshot], path: Path) -> Path:
    """GB/s per direction, requests/s, token hit rates (prefix and blend) and tier usage
    over the interval."""
    rates = [Rates.between(a, b) for a, b in pairwise(snaps)]
    t = [b.at_s - snaps[0].at_s for b in snaps[1:]]
    fig, (gb, req, hit, use) = plt.subplots(
        4, 1, figsize=(11, 12), sharex=True, constrained_layout=True
    )
    fig.suptitle(
        f"kvflow {snaps[-1].endpoint}: {len(snaps)} samples over {t[-1] if t else 0:.0f} s"
    )
    _throughput(gb, t, rates)
    _requests(req, t, rates)
    _hit_rates(hit, t, rates, snaps[1:])
    for name in snaps[-1].tiers:
        use.plot(
            t,
            [100 * s.tiers[name].fraction if name in s.tiers else 0.0 for s in snaps[1:]],
            label=name,
        )
    use.set_ylim(0, 105)
    use.set_ylabel("% of capacity")
    use.set_title("Tier usage", loc="left")
    use.set_xlabel("seconds since the first sample")
    for ax in (gb, req, hit, use):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _throughput(ax: Any, t: list[float], rates: list[Rates]) -> None:
    """GB/s of stores and retrieves (blend retrieves once any moved bytes), and each L2
    tier's writes and reads."""
    ax.plot(t, [r.gb_s("store") for r in rates], label="store (GPU -> L1)", color="tab:blue")
    ax.plot(t, [r.gb_s("retrieve") for r in rates], label="retrieve (L1 -> GPU)", color="tab:red")
    blended = [r.gb_s("blend_retrieve") for r in rates]
    if any(blended):
        ax.plot(t, blended, label="blend retrieve (L1 -> GPU)", color="tab:brown")
    for name in sorted({n for r in rates for n in r.tier_gb_s if n != "l1"}):
        for i, (direction, colour) in enumerate((("write", "tab:purple"), ("read", "tab:olive"))):
            ax.plot(
                t,
                [r.tier_gb_s.get(name, (0.0, 0.0))[i] for r in rates],
                linestyle=":",
                label=f"{name} {direction}",
                color=colour,
            )
    ax.set_ylabel("GB/s")
    ax.set_title("Throughput", loc="left")


def _requests(ax: Any, t: list[float], rates: list[Rates]) -> None:
    """Requests/s per operation (blend ones once any ran) and errors/s of all of them."""
    colours = {"store": "tab:blue", "retrieve": "tab:red", "lookup": "tab:green",
               "blend_lookup": "tab:cyan", "blend_retrieve": "tab:brown"}  # fmt: skip
    for op, colour in colours.items():
        values = [r.per_s[f"{op}.requests"] for r in rates]
        if not op.startswith("blend") or any(values):
            ax.plot(t, values, label=op, color=colour)
    ax.plot(
        t,
        [sum(r.per_s[f"{op}.errors"] for op in OPS) for r in rates],
        label="errors",
        color="black",
        linestyle="--",
    )
    ax.set_ylabel("requests/s")
    ax.set_title("Requests", loc="left")


def _hit_rates(ax: Any, t: list[float], rates: list[Rates], snaps: Sequence[Snapshot]) -> None:
    """The prefix hit rate per interval and since start; the blend hit rate beside it
    once a blend lookup ran."""
    for op, label, colour in (
        ("lookup", "prefix", "tab:orange"),
        ("blend_lookup", "blend", "tab:cyan"),
    ):
        interval = [r.hit_rates[op] for r in rates]
        if op != "lookup" and not any(s.hit_rate(op) is not None for s in snaps):
            continue
        ax.plot(
            t,
            [100 * v if v is not None else float("nan") for v in interval],
            marker="o",
            color=colour,
            label=f"{label}, interval",
        )
        ax.plot(
            t,
            [100 * (s.hit_rate(op) or 0.0) for s in snaps],
            color=colour,
            linestyle="--",
            alpha=0.6,
            label=f"{label}, since start",
        )
    ax.set_ylim(0, 105)
    ax.set_ylabel("% of requested tokens")
    ax.set_title("Token hit rate (blend: tokens found past the prefix)", loc="left")
