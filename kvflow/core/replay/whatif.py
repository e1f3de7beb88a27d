"""`kvflow whatif DIR --l1-size-gb 1,2,4`: the L1 hit rate a recorded run would have had.

Reads the log's lookups, stores and retrieves (trace.py), simulates L1 as LRU at
every size in one pass (lru.py; `--sample-rate R` for the sampled mode) and prints
a table; with `--out DIR` also writes whatif.csv and the miss-ratio curve
whatif.png. "Hit tokens" are what a lookup counts as L1 hits: the tokens of the
consecutive chunks, from chunk 0, that L1 holds on every rank of the world.

`--l2-size-gb Y[,Y...]` adds an LRU L2 tier behind L1 (tiered.py; exact mode only):
hit tokens are then the prefix in L1 or L2, split by the tier each chunk counted for,
as LOOKUP_END's `hit_tokens_by_tier` does.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvflow.core.replay.lru import Distances, aligned, effective_capacity, simulate
from kvflow.core.replay.tiered import simulate_tiers
from kvflow.core.replay.trace import Trace, read_trace
from kvflow.core.replay.usage import Parser, UsageError
from kvflow.subscribers.eventlog_read import EventLogError, LogReader

GIB = 1 << 30


@dataclass(frozen=True)
class Row:
    """One L1 size's outcome."""

    size_gb: float
    objects: int  # chunk objects (one rank's chunk) that fit
    hit_tokens: float
    hit_rate: float  # hit tokens / requested tokens
    l2_size_gb: float = 0.0  # 0: no L2
    l2_hit_tokens: float = 0.0  # of hit_tokens, those of chunks found only in L2

    @property
    def l1_hit_tokens(self) -> float:
        """Hit tokens of chunks every rank had in L1."""
        return self.hit_tokens - self.l2_hit_tokens


def curve(trace: Trace, dist: Distances, sizes_gb: list[float]) -> list[Row]:
    """The hit tokens and rate at each size (GiB of L1, as --l1-size-gb)."""
    obj = aligned(trace.object_bytes() or 1)
    rows = []
    for gb in sizes_gb:
        cap = effective_capacity(int(gb * GIB), obj)
        hits = dist.hit_chunks(cap) * trace.chunk_size
        rate = hits / trace.requested_tokens if trace.requested_tokens else 0.0
        rows.append(Row(gb, cap // obj, hits, rate))
    return rows


def tiered_curve(trace: Trace, sizes_gb: list[float], l2_sizes_gb: list[float]) -> list[Row]:
    """Hit tokens and rate, split L1/L2, at each (L1 size, L2 size) pair (GiB; an L2
    of 0 is none): one exact simulation per pair (tiered.py)."""
    obj = aligned(trace.object_bytes() or 1)
    rows = []
    for gb in sizes_gb:
        cap = effective_capacity(int(gb * GIB), obj)
        for l2_gb in l2_sizes_gb:
            hits = simulate_tiers(trace, cap, int(l2_gb * GIB), int(gb * GIB))
            tokens = hits.chunks * trace.chunk_size
            rate = tokens / trace.requested_tokens if trace.requested_tokens else 0.0
            rows.append(Row(gb, cap // obj, tokens, rate, l2_gb, hits.l2_chunks * trace.chunk_size))
    return rows


def _sizes(text: str, flag: str = "--l1-size-gb", *, zero_ok: bool = False) -> list[float]:
    try:
        sizes = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} must be sizes in GiB, comma-separated, got {text!r}") from None
    if not sizes or not all(math.isfinite(s) and (s >= 0 if zero_ok else s > 0) for s in sizes):
        bound = ">= 0" if zero_ok else "> 0"
        raise UsageError(f"{flag} sizes must be finite and {bound}, got {text!r}")
    return sorted(set(sizes)) if zero_ok else sorted(sizes)


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="kvflow whatif",
        description="L1 hit rate at other capacities, simulated from a recorded event log"
        " (docs/EVENTLOG.md).",
    )
    p.add_argument("directory", metavar="DIR", help="the --event-log directory of a run")
    p.add_argument("--l1-size-gb", required=True, metavar="X[,X...]",
                   help="L1 sizes to simulate, GiB (2**30 bytes), comma-separated")  # fmt: skip
    p.add_argument("--l2-size-gb", metavar="Y[,Y...]",
                   help="also simulate an LRU L2 tier behind L1 of these sizes, GiB (0: none;"
                        " default: the run's disk tier size when the log records it, else"
                        " none); exact mode only")  # fmt: skip
    p.add_argument("--chunk-size", type=int, metavar="N",
                   help="tokens per chunk (default: the log's; must match it)")  # fmt: skip
    p.add_argument("--sample-rate", type=float, metavar="R",
                   help="simulate only this share of keys (SHARDS, estimate stratified by key"
                        " popularity), e.g. 0.01; default exact")  # fmt: skip
    p.add_argument("--sample-seed", type=int, default=0, metavar="N", help="sampler seed")
    p.add_argument("--out", metavar="DIR", help="also write whatif.csv and whatif.png here")
    return p


def _table(rows: list[Row], trace: Trace, mode: str, *, tiered: bool = False) -> list[str]:
    if tiered:
        return _tiered_table(rows, trace, mode)
    lines = [
        f"{trace.lookups} lookups, {trace.requested_tokens} tokens requested, chunk size "
        f"{trace.chunk_size}, object {aligned(trace.object_bytes() or 1)} bytes; {mode}",
        f"live run: {trace.live_l1_hit_tokens} L1 hit tokens "
        f"({_pct(trace.live_l1_hit_tokens, trace.requested_tokens)})",
        f"{'L1 GiB':>10}  {'objects':>10}  {'hit tokens':>14}  {'hit rate':>8}  {'miss ratio':>10}",
    ]
    for r in rows:
        lines.append(
            f"{r.size_gb:>10g}  {r.objects:>10}  {r.hit_tokens:>14.0f}  {r.hit_rate:>8.4f}  "
            f"{1 - r.hit_rate:>10.4f}"
        )
    return lines


def _tiered_table(rows: list[Row], trace: Trace, mode: str) -> list[str]:
    lines = [
        f"{trace.lookups} lookups, {trace.requested_tokens} tokens requested, chunk size "
        f"{trace.chunk_size}, object {aligned(trace.object_bytes() or 1)} bytes; {mode}; "
        "L2: an LRU tier behind L1 (docs/EVENTLOG.md)",
        f"live run: {trace.live_l1_hit_tokens} L1 hit tokens "
        f"({_pct(trace.live_l1_hit_tokens, trace.requested_tokens)})",
        f"{'L1 GiB':>10}  {'L2 GiB':>8}  {'objects':>10}  {'hit tokens':>14}  {'l1 tokens':>14}  "
        f"{'l2 tokens':>14}  {'hit rate':>8}  {'miss ratio':>10}",
    ]
    for r in rows:
        lines.append(
            f"{r.size_gb:>10g}  {r.l2_size_gb:>8g}  {r.objects:>10}  {r.hit_tokens:>14.0f}  "
            f"{r.l1_hit_tokens:>14.0f}  {r.l2_hit_tokens:>14.0f}  {r.hit_rate:>8.4f}  "
            f"{1 - r.hit_rate:>10.4f}"
        )
    return lines


def _pct(a: float, b: float) -> str:
    return f"{100 * a / b:.2f}%" if b else "n/a"


def write_outputs(out: Path, rows: list[Row], title: str, *, tiered: bool = False) -> list[Path]:
    """whatif.csv and whatif.png (miss ratio against L1 size; with L2, a line per L2
    size and the csv's l2 columns) in `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    csv = out / "whatif.csv"
    if tiered:
        csv.write_text(
            "l1_size_gb,l2_size_gb,objects,hit_tokens,l1_hit_tokens,l2_hit_tokens,hit_rate,"
            "miss_ratio\n"
            + "".join(
                f"{r.size_gb:g},{r.l2_size_gb:g},{r.objects},{r.hit_tokens:.0f},"
                f"{r.l1_hit_tokens:.0f},{r.l2_hit_tokens:.0f},{r.hit_rate:.6f},"
                f"{1 - r.hit_rate:.6f}\n"
                for r in rows
            )
        )
    else:
        csv.write_text(
            "l1_size_gb,objects,hit_tokens,hit_rate,miss_ratio\n"
            + "".join(
                f"{r.size_gb:g},{r.objects},{r.hit_tokens:.0f},{r.hit_rate:.6f},{1 - r.hit_rate:.6f}\n"
                for r in rows
            )
        )
    fig, ax = plt.subplots(figsize=(6, 4))
    for l2 in sorted({r.l2_size_gb for r in rows}):
        line = [r for r in rows if r.l2_size_gb == l2]
        label = f"L2 {l2:g} GiB" if tiered else None
        ax.plot([r.size_gb for r in line], [1 - r.hit_rate for r in line], marker="o", label=label)
    if tiered:
        ax.legend(fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("L1 size (GiB)")
    ax.set_ylabel("token miss ratio")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    png = out / "whatif.png"
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return [csv, png]


def run(argv: list[str], out: IO[str]) -> int:
    """Parse, read, simulate, print (and write); the exit status."""
    args = _parser().parse_args(argv)
    sizes = _sizes(args.l1_size_gb)
    l2_given = args.l2_size_gb is not None
    l2_sizes = _sizes(args.l2_size_gb, "--l2-size-gb", zero_ok=True) if l2_given else []
    rate = args.sample_rate
    if rate is not None and not (math.isfinite(rate) and 0 < rate <= 1):
        raise UsageError(f"--sample-rate must be a number in (0, 1], got {rate!r}")
    if rate is not None and any(l2_sizes):
        raise UsageError(
            "--sample-rate simulates L1 alone: --l2-size-gb needs the exact mode (leave out"
            " --sample-rate, or give --l2-size-gb 0)"
        )
    try:
        reader = LogReader.open(args.directory)
    except EventLogError as exc:
        print(f"kvflow whatif: error: {exc}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    trace = read_trace(reader)
    for problem in reader.problems:
        print(f"kvflow whatif: skipped: {problem}", file=sys.stderr)
    if trace.lookups == 0:
        print(f"kvflow whatif: error: {args.directory}: no lookups in the log", file=sys.stderr)
        return 1
    if args.chunk_size is not None and trace.chunk_size and args.chunk_size != trace.chunk_size:
        raise UsageError(
            f"--chunk-size {args.chunk_size} differs from the log's {trace.chunk_size}: chunk"
            " keys are hashes of whole chunks, so a log answers only for its own chunk size"
        )
    trace.chunk_size = trace.chunk_size or args.chunk_size or 0
    if not l2_given and rate is None:
        recorded = _recorded_l2_gb(reader)
        l2_sizes = [recorded] if recorded else []
    tiered = any(l2_sizes)
    t1 = time.perf_counter()
    if tiered:
        rows = tiered_curve(trace, sizes, l2_sizes)
    else:
        dist = simulate(trace, rate=rate or 1.0, seed=args.sample_seed)
    t2 = time.perf_counter()
    mode = "exact"
    if rate is not None:
        mode = f"sampled at {rate:g} (seed {args.sample_seed}; SHARDS, popularity-stratified)"
    mode += f"; read {t1 - t0:.2f} s, simulated {t2 - t1:.2f} s"
    if not tiered:
        rows = curve(trace, dist, sizes)
    out.write("\n".join(_table(rows, trace, mode, tiered=tiered)) + "\n")
    if args.out:
        title = f"kvflow whatif: {args.directory} ({mode})"
        paths = write_outputs(Path(args.out), rows, title, tiered=tiered)
        out.write("wrote " + ", ".join(str(p) for p in paths) + "\n")
    return 0


def _recorded_l2_gb(reader: LogReader) -> float:
    """The run's disk tier capacity (GiB) as its log's first header records it; 0 when
    it does not (no L2, or a log written before headers carried it)."""
    header = reader.first_header
    nbytes = getattr(header, "l2_disk_bytes", None) if header is not None else None
    return nbytes / GIB if nbytes else 0.0


def main(command: str, argv: list[str]) -> int:
    """Entry point of `kvflow whatif` (see `kvflow whatif --help`)."""
    try:
        return run(argv, sys.stdout)
    except UsageError as exc:
        print(f"kvflow {command}: error: {exc}", file=sys.stderr)
        return 2
