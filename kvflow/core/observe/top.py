"""`kvflow top`: a live terminal view of one server, refreshed every second; `q` quits.

Each tick asks the server for its status (the existing request: no new port) and
shows the rates since the previous tick: requests, token hit rates (prefix and blend,
overall and per tier), GB/s per direction and per tier, L1/L2 usage bars and
evictions, in-flight operations, the event bus (queue depth, lag, drops) and the L0
block lifetime, idle-before-evict and reuse-gap percentiles. `render` is a pure function of two
snapshots, so the view is testable without a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvflow.core.observe import units
from kvflow.core.observe.connect import add_connection_args, connect, parse_args, seconds_in
from kvflow.core.observe.snapshot import LOOKUPS, OPS, QUEUED_OPS, Rates, Snapshot

_INFLIGHT = (
    "store", "retrieve", "lookup", "blend_lookup", "blend_retrieve", "prefetch", "l2_store",
    "l2_load",
)  # fmt: skip
#: the hit-rate table's sections: lookup kind -> its label
_HIT_KINDS = {"lookup": "prefix", "blend_lookup": "blend"}
_L0 = (
    ("lifetime", "block lifetime"),
    ("idle_before_evict", "idle before evict"),
    ("reuse_gap", "reuse gap"),
)


def _header(snap: Snapshot, interval_s: float) -> Text:
    models = ", ".join(snap.models) if snap.models else "none"
    text = Text()
    text.append("kvflow top", style="bold")
    text.append(f"  {snap.endpoint}  up {units.uptime(snap.uptime_s)}")
    text.append(f"  instances {snap.instances} (models: {models})")
    text.append(f"  every {interval_s:g} s  ")
    text.append("q quits", style="reverse")
    if not snap.observed:
        text.append("\nobservability is off on this server: no totals", style="bold red")
    return text


def _requests(rates: Rates | None) -> Table:
    """Per operation: rates, GB/s moved and, for stores and retrieves of GPU caches, the
    host's part of each (START until its copies were queued; `-` for CPU caches)."""
    table = Table(title="Requests", box=box.SIMPLE, title_justify="left", expand=False)
    for column in ("op", "req/s", "errors/s", "tokens/s", "GB/s", "host/op"):
        table.add_column(column, justify="left" if column == "op" else "right")
    for op in OPS:
        if rates is None:
            table.add_row(op, "…", "…", "…", "…", "…" if op in QUEUED_OPS else "")
            continue
        tokens = rates.per_s[f"{op}.requested_tokens" if op in LOOKUPS else f"{op}.tokens"]
        moved = "" if op in LOOKUPS else units.gb_s(rates.gb_s(op))
        table.add_row(
            op,
            units.rate(rates.per_s[f"{op}.requests"]),
            units.rate(rates.per_s[f"{op}.errors"]),
            units.rate(tokens),
            moved,
            units.seconds(rates.queued_s(op)) if op in QUEUED_OPS else "",
        )
    return table


def _hits(snap: Snapshot, rates: Rates | None) -> Table:
    """Prefix hit rate (tokens found from token 0 / tokens looked up) and, next to it,
    blend hit rate (tokens found past the prefix / blend lookups' tokens), each overall
    and per tier (the slowest tier each hit chunk needed)."""
    table = Table(title="Token hit rate", box=box.SIMPLE, title_justify="left")
    table.add_column("", justify="left")
    table.add_column("last interval", justify="right")
    table.add_column("since start", justify="right")
    for op, label in _HIT_KINDS.items():
        interval = rates.hit_rates[op] if rates is not None else None
        table.add_row(
            f"{label}, all tiers", units.percent(interval), units.percent(snap.hit_rate(op))
        )
        asked = snap.totals[f"{op}.requested_tokens"]
        for tier, hits in sorted(snap.tier_hits(op).items()):
            table.add_row(f"  {tier}", "", units.percent(hits / asked if asked else None))
    table.caption = "blend: hits past the prefix / blend-lookup tokens"
    table.caption_justify = "left"
    return table


def _usage(snap: Snapshot, rates: Rates | None) -> Table:
    table = Table(title="Capacity and bandwidth", box=box.SIMPLE, title_justify="left")
    for column in ("tier", "usage", "", "used / capacity", "objects", "evict/s", "write", "read"):
        table.add_column(column, justify="left" if column in ("tier", "usage") else "right")
    for name, tier in snap.tiers.items():
        write, read = rates.tier_gb_s.get(name, (0.0, 0.0)) if rates else (0.0, 0.0)
        table.add_row(
            name,
            units.bar(tier.fraction),
            units.percent(tier.fraction),
            f"{units.size(tier.usage_bytes)} / {units.size(tier.capacity_bytes)}",
            f"{tier.objects:.0f}",
            units.rate(rates.tier_evictions_s.get(name, 0.0)) if rates else "…",
            units.gb_s(write) if rates else "…",
            units.gb_s(read) if rates else "…",
        )
    return table


def _pipeline(snap: Snapshot) -> Text:
    inflight = "  ".join(f"{op} {snap.inflight.get(op, 0):.0f}" for op in _INFLIGHT)
    bus = snap.bus
    text = Text()
    text.append("In flight  ", style="bold")
    text.append(inflight + "\n")
    text.append("Event bus  ", style="bold")
    text.append(
        f"queue {bus['queue_depth']:.0f} / {bus['capacity']:.0f}  "
        f"lag {units.seconds(bus['lag_s'])}  "
    )
    text.append(f"dropped {bus['dropped']:.0f}", style="bold red" if bus["dropped"] else "")
    text.append(f"  subscriber errors {bus['subscriber_errors']:.0f}")
    waits = snap.layer_waits
    if waits.get("layers"):  # layerwise retrieves reported: were their copies ahead?
        stalled = waits.get("stalled_layers", 0)
        text.append("\nLayer waits  ", style="bold")
        text.append(f"{waits['layers']:.0f} layers, ")
        text.append(f"{stalled:.0f} stalled", style="bold yellow" if stalled else "")
        text.append(
            f"  p50 {units.seconds(waits.get('p50_s'))}  p99 {units.seconds(waits.get('p99_s'))}"
            f"  max {units.seconds(waits.get('max_s'))}"
        )
    writes = snap.l2_writes
    if writes:  # L2 configured: how often stores waited for it, and what it lost
        text.append("\nL2 writes  ", style="bold")
        text.append(
            f"waited {writes['waits']:.0f} times, {units.seconds(writes['waited_s'])} in all  "
        )
        dropped = writes["dropped_chunks"]
        text.append(
            f"dropped {dropped:.0f} chunks in {writes['drop_bursts']:.0f} bursts",
            style="bold red" if dropped else "",
        )
    return text


def _l0(snap: Snapshot, rates: Rates | None) -> Table:
    title = f"GPU blocks (L0, sample rate {snap.l0_sample_rate:g})"
    table = Table(title=title, box=box.SIMPLE, title_justify="left")
    for column in ("", "p50", "p90", "p99", "values"):
        table.add_column(column, justify="left" if not column else "right")
    for name, label in _L0:
        count = (snap.l0.get(name) or {}).get("count", 0)
        table.add_row(
            label,
            *(units.seconds(snap.l0_quantile(name, q)) for q in ("p50_s", "p90_s", "p99_s")),
            str(count),
        )
    if rates is not None:
        table.caption = (
            f"allocations: {units.rate(rates.per_s['l0.allocation_records'])} records/s, "
            f"{units.rate(rates.per_s['l0.allocated_blocks'])} blocks/s"
        )
        table.caption_justify = "left"
    return table


def render(
    snap: Snapshot, rates: Rates | None, interval_s: float = 1.0, error: str | None = None
) -> RenderableType:
    """The whole view for the latest snapshot and the rates since the previous one."""
    parts: list[RenderableType] = [_header(snap, interval_s)]
    if error:
        parts.append(Text(f"status failed: {error} (showing the last answer)", style="bold red"))
    parts += [
        _requests(rates),
        _hits(snap, rates),
        _usage(snap, rates),
        _pipeline(snap),
        _l0(snap, rates),
    ]
    return Group(*parts)


@contextlib.contextmanager
def _keys() -> Iterator[int | None]:
    """stdin in cbreak mode (keys arrive unbuffered, unechoed) while the view runs; yields
    its fd, or None when stdin is not a terminal (then only Ctrl-C stops the view)."""
    if not sys.stdin.isatty():
        yield None
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _quit_pressed(fd: int | None, timeout: float) -> bool:
    """Wait up to `timeout` seconds for a key; True when it is q (or stdin closed)."""
    if fd is None:
        time.sleep(timeout)
        return False
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            data = os.read(fd, 64)
            if not data or b"q" in data.lower():
                return True
    return False


def run(args: argparse.Namespace, console: Console) -> int:
    """Show the view until q or Ctrl-C; 1 when the server never answers the first status."""
    endpoint, interval_s = args.endpoint, args.interval_s
    with connect(args) as client:
        try:
            prev = Snapshot.of(client.status())
        except Exception as exc:
            print(f"kvflow top: {endpoint} does not answer: {exc}", file=sys.stderr)
            return 1
        view = render(prev, None, interval_s)
        with _keys() as fd, Live(view, console=console, screen=True, auto_refresh=False) as live:
            live.refresh()
            try:
                while not _quit_pressed(fd, interval_s):
                    try:
                        snap = Snapshot.of(client.status())
                    except Exception as exc:
                        live.update(render(prev, None, interval_s, error=str(exc)), refresh=True)
                        continue
                    live.update(render(snap, Rates.between(prev, snap), interval_s), refresh=True)
                    prev = snap
            except KeyboardInterrupt:
                pass
    return 0


def once(args: argparse.Namespace, console: Console) -> int:
    """Print one view (rates over one interval) and exit: for scripts and logs."""
    endpoint, interval_s = args.endpoint, args.interval_s
    with connect(args) as client:
        try:
            first = Snapshot.of(client.status())
            time.sleep(interval_s)
            snap = Snapshot.of(client.status())
        except Exception as exc:
            print(f"kvflow top: {endpoint} does not answer: {exc}", file=sys.stderr)
            return 1
    console.print(render(snap, Rates.between(first, snap), interval_s))
    return 0


_positive = seconds_in(0.1, 3600)


def parser(prog: str = "kvflow top") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_connection_args(p, _positive)
    p.add_argument("--interval-s", type=_positive, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one view and exit")
    return p


def main(name: str, argv: list[str]) -> int:
    """Entry point of `kvflow top`."""
    args = parse_args(parser(f"kvflow {name}"), argv)
    console = Console()
    try:
        return once(args, console) if args.once else run(args, console)
    except ValueError as exc:  # a key file that is not one
        print(f"kvflow {name}: error: {exc}", file=sys.stderr)
        return 2
