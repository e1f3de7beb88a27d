"""`kvflow report`: record a server for an interval, then write PNG plots and summary.md.

It samples the status request every `--sample-s` for `--interval-s` seconds, then
writes into `--out`: `l0_lifecycle.png` (the L0 block lifetime, idle-before-evict
and reuse-gap histograms), `timeline.png` (GB/s, requests/s, prefix and blend hit
rates and tier usage over the interval) and `summary.md` (the interval's measured totals, rates
and percentiles, linking both figures). What an operator attaches to a ticket.
Ctrl-C ends the recording early; the report covers the samples taken until then.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

from kvflow.core.observe import units
from kvflow.core.observe.connect import add_connection_args, connect, parse_args, seconds_in
from kvflow.core.observe.snapshot import GB, LOOKUPS, OPS, QUEUED_OPS, Rates, Snapshot
from kvflow.core.server.client import KVFlowClient

LIFECYCLE_PNG = "l0_lifecycle.png"
TIMELINE_PNG = "timeline.png"
SUMMARY_MD = "summary.md"


def record(
    client: KVFlowClient, interval_s: float, sample_s: float, *, log: bool = True
) -> list[Snapshot]:
    """Snapshots every `sample_s` for `interval_s` seconds (the first at once, at least two).

    Ctrl-C (SIGINT) ends the recording early: the samples taken so far are returned (a
    sample under way is dropped); with fewer than two, KeyboardInterrupt propagates."""
    snaps = [Snapshot.of(client.status())]
    start = time.monotonic()
    n = 1
    try:
        while True:
            next_at = start + n * sample_s
            if next_at > start + interval_s and len(snaps) >= 2:
                break
            time.sleep(max(next_at - time.monotonic(), 0.0))
            snaps.append(Snapshot.of(client.status()))
            n += 1
            if log:
                print(f"\rkvflow report: {len(snaps)} samples", end="", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        if len(snaps) < 2:
            raise
    if log:
        print(file=sys.stderr)
    return snaps


def summary(snaps: Sequence[Snapshot]) -> str:
    """The markdown summary of a recording: what happened between its first and last sample."""
    first, last = snaps[0], snaps[-1]
    whole = Rates.between(first, last)
    delta = {k: last.totals[k] - first.totals.get(k, 0.0) for k in last.totals}
    lines = [
        "# kvflow report",
        "",
        f"Server `{last.endpoint}`, up {units.uptime(last.uptime_s)}; "
        f"{len(snaps)} samples over {whole.seconds:.1f} s; "
        f"{last.instances} instances (models: {', '.join(last.models) or 'none'}).",
        *_operations(snaps, whole, delta),
        *_effectiveness(last, whole, delta),
        *_capacity(first, last),
        *_lifecycle(snaps, delta),
        "",
        f"![L0 lifecycle]({LIFECYCLE_PNG})",
        "",
        f"![timeline]({TIMELINE_PNG})",
        "",
    ]
    return "\n".join(lines)


def _operations(snaps: Sequence[Snapshot], whole: Rates, delta: dict[str, float]) -> list[str]:
    """The operations table: requests, errors, tokens and GB moved over the interval, and
    for stores and retrieves of GPU caches the mean host time until their copies were
    queued (`-` for CPU caches)."""
    steps = [Rates.between(a, b) for a, b in pairwise(snaps)]
    lines = [
        "",
        "## Operations over the interval",
        "",
        "| op | requests | errors | req/s | tokens | GB moved | mean GB/s | peak GB/s | host/op |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for op in OPS:
        looks = op in LOOKUPS
        tokens = delta[f"{op}.requested_tokens" if looks else f"{op}.tokens"]
        moved = "" if looks else f"{delta[f'{op}.bytes'] / GB:.4g}"
        mean = "" if looks else f"{whole.gb_s(op):.4g}"
        peak = "" if looks else f"{max((r.gb_s(op) for r in steps), default=0.0):.4g}"
        host = units.seconds(whole.queued_s(op)) if op in QUEUED_OPS else ""
        lines.append(
            f"| {op} | {delta[f'{op}.requests']:.0f} | {delta[f'{op}.errors']:.0f} | "
            f"{whole.per_s[f'{op}.requests']:.4g} | {tokens:.0f} | {moved} | {mean} | {peak}"
            f" | {host} |"
        )
    return lines


def _effectiveness(last: Snapshot, whole: Rates, delta: dict[str, float]) -> list[str]:
    """The prefix hit rate and, next to it, the blend hit rate: over the interval, since
    start, and per tier since start."""
    lines = ["", "## Cache effectiveness", ""]
    for op, label, tokens in (
        ("lookup", "token hit rate (prefix)", "tokens"),
        ("blend_lookup", "blend hit rate", "blend-lookup tokens found past the prefix"),
    ):
        lines.append(
            f"- {label} over the interval: **{units.percent(whole.hit_rates[op])}** "
            f"({delta[f'{op}.hit_tokens']:.0f} of {delta[f'{op}.requested_tokens']:.0f} "
            f"{tokens}); since start: {units.percent(last.hit_rate(op))}"
        )
        asked = last.totals[f"{op}.requested_tokens"]
        for tier_name, hits in sorted(last.tier_hits(op).items()):
            lines.append(
                f"  - {tier_name} (since start): {units.percent(hits / asked if asked else None)}"
            )
    return lines


def _capacity(first: Snapshot, last: Snapshot) -> list[str]:
    """Each tier's fill at the end and its evictions over the interval."""
    lines = [
        "",
        "## Capacity at the end",
        "",
        "| tier | used | capacity | usage | objects | evictions in interval |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, tier in last.tiers.items():
        evicted = tier.evicted_chunks - (
            first.tiers[name].evicted_chunks if name in first.tiers else 0.0
        )
        lines.append(
            f"| {name} | {units.size(tier.usage_bytes)} | {units.size(tier.capacity_bytes)} | "
            f"{units.percent(tier.fraction)} | {tier.objects:.0f} | {evicted:.0f} |"
        )
    return lines


def _lifecycle(snaps: Sequence[Snapshot], delta: dict[str, float]) -> list[str]:
    """The event pipeline's drops and lag, and the L0 block-age percentiles."""
    first, last = snaps[0], snaps[-1]
    dropped = last.bus["dropped"] - first.bus["dropped"]
    lines = [
        "",
        "## Event pipeline",
        "",
        f"- events dropped in the interval: {dropped:.0f} (since start {last.bus['dropped']:.0f}); "
        f"max queue depth seen {max(s.bus['queue_depth'] for s in snaps):.0f} of "
        f"{last.bus['capacity']:.0f}; max lag {units.seconds(max(s.bus['lag_s'] for s in snaps))}",
        "",
        f"## GPU block lifecycle (L0, sample rate {last.l0_sample_rate:g}, since start)",
        "",
        "| | values | p50 | p90 | p99 | max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, label in (
        ("lifetime", "block lifetime"),
        ("idle_before_evict", "idle before evict"),
        ("reuse_gap", "reuse gap"),
    ):
        hist = last.l0.get(name) or {}
        lines.append(
            f"| {label} | {hist.get('count', 0)} | "
            + " | ".join(
                units.seconds(last.l0_quantile(name, q)) for q in ("p50_s", "p90_s", "p99_s")
            )
            + f" | {units.seconds(hist.get('max_s'))} |"
        )
    lines.append(
        f"\nBlock reports in the interval: {delta['l0.allocation_records']:.0f} records, "
        f"{delta['l0.allocated_blocks']:.0f} blocks."
    )
    return lines


def write_report(snaps: Sequence[Snapshot], out: Path) -> list[Path]:
    """Write the two figures and the summary into `out` (created if missing)."""
    from kvflow.core.observe import plots  # matplotlib loads only when a report is written

    out.mkdir(parents=True, exist_ok=True)
    last = snaps[-1]
    written = [
        plots.lifecycle_figure(last.l0, out / LIFECYCLE_PNG, last.l0_sample_rate),
        plots.timeline_figure(snaps, out / TIMELINE_PNG),
    ]
    (out / SUMMARY_MD).write_text(summary(snaps))
    return [*written, out / SUMMARY_MD]


_seconds = seconds_in(0.1, 86400)


def parser(prog: str = "kvflow report") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_connection_args(p, _seconds)
    p.add_argument("--out", type=Path, required=True, help="directory for the PNGs and summary.md")
    p.add_argument(
        "--interval-s",
        type=_seconds,
        default=60.0,
        help="how long to record (Ctrl-C ends it sooner)",
    )
    p.add_argument("--sample-s", type=_seconds, default=1.0, help="seconds between samples")
    return p


def main(name: str, argv: list[str]) -> int:
    """Entry point of `kvflow report`: 1 when the server does not answer."""
    args = parse_args(parser(f"kvflow {name}"), argv)
    # SIGINT is how a recording ends early, also for a report started where SIGINT is
    # ignored (a background job of a script inherits SIG_IGN, and Python keeps it)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with connect(args) as client:
            snaps = record(client, args.interval_s, min(args.sample_s, args.interval_s))
    except KeyboardInterrupt:
        print("\nkvflow report: interrupted before two samples, nothing written", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"kvflow report: {args.endpoint} does not answer: {exc}", file=sys.stderr)
        return 1
    for path in write_report(snaps, args.out):
        print(path)
    return 0
