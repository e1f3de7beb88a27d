"""`kvflow whatif DIR --l1-size-gb 1,2,4`: the L1 hit rate a recorded run would have had.

Reads the log's lookups, stores and retrieves (trace.py), simulates L1 as LRU at
every size in one pass (lru.py; `--sample-rate R` for the sampled mode) and prints
a table; with `--out DIR` also writes whatif.csv and the miss-ratio curve
whatif.png. "Hit tokens" are what a lookup counts as L1 hits: the tokens of the
consecutive chunks, from chunk 0, that L1 holds on every rank of the world.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NoReturn

from kvflow.core.replay.lru import Distances, aligned, effective_capacity, simulate
from kvflow.core.replay.trace import Trace, read_trace
from kvflow.subscribers.eventlog_read import EventLogError, LogReader

GIB = 1 << 30


class UsageError(Exception):
    """A bad argument: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


@dataclass(frozen=True)
class Row:
    """One L1 size's outcome."""

    size_gb: float
    objects: int  # chunk objects (one rank's chunk) that fit
    hit_tokens: float
    hit_rate: float  # hit tokens / requested tokens


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


def _sizes(text: str) -> list[float]:
    try:
        sizes = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(
            f"--l1-size-gb must be sizes in GiB, comma-separated, got {text!r}"
        ) from None
    if not sizes or not all(math.isfinite(s) and s > 0 for s in sizes):
        raise UsageError(f"--l1-size-gb sizes must be finite and > 0, got {text!r}")
    return sorted(sizes)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvflow whatif",
        description="L1 hit rate at other capacities, simulated from a recorded event log"
        " (docs/EVENTLOG.md).",
    )
    p.add_argument("directory", metavar="DIR", help="the --event-log directory of a run")
    p.add_argument("--l1-size-gb", required=True, metavar="X[,X...]",
                   help="L1 sizes to simulate, GiB (2**30 bytes), comma-separated")  # fmt: skip
    p.add_argument("--chunk-size", type=int, metavar="N",
                   help="tokens per chunk (default: the log's; must match it)")  # fmt: skip
    p.add_argument("--sample-rate", type=float, metavar="R",
                   help="simulate only this share of keys (SHARDS, estimate stratified by key"
                        " popularity), e.g. 0.01; default exact")  # fmt: skip
    p.add_argument("--sample-seed", type=int, default=0, metavar="N", help="sampler seed")
    p.add_argument("--out", metavar="DIR", help="also write whatif.csv and whatif.png here")
    return p


def _table(rows: list[Row], trace: Trace, mode: str) -> list[str]:
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


def _pct(a: float, b: float) -> str:
    return f"{100 * a / b:.2f}%" if b else "n/a"


def write_outputs(out: Path, rows: list[Row], title: str) -> list[Path]:
    """whatif.csv and whatif.png (miss ratio against L1 size) in `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    csv = out / "whatif.csv"
    csv.write_text(
        "l1_size_gb,objects,hit_tokens,hit_rate,miss_ratio\n"
        + "".join(
            f"{r.size_gb:g},{r.objects},{r.hit_tokens:.0f},{r.hit_rate:.6f},{1 - r.hit_rate:.6f}\n"
            for r in rows
        )
    )
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r.size_gb for r in rows], [1 - r.hit_rate for r in rows], marker="o")
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
    rate = args.sample_rate
    if rate is not None and not (math.isfinite(rate) and 0 < rate <= 1):
        raise UsageError(f"--sample-rate must be a number in (0, 1], got {rate!r}")
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
    t1 = time.perf_counter()
    dist = simulate(trace, rate=rate or 1.0, seed=args.sample_seed)
    t2 = time.perf_counter()
    mode = "exact"
    if rate is not None:
        mode = f"sampled at {rate:g} (seed {args.sample_seed}; SHARDS, popularity-stratified)"
    mode += f"; read {t1 - t0:.2f} s, simulated {t2 - t1:.2f} s"
    rows = curve(trace, dist, sizes)
    out.write("\n".join(_table(rows, trace, mode)) + "\n")
    if args.out:
        paths = write_outputs(Path(args.out), rows, f"kvflow whatif: {args.directory} ({mode})")
        out.write("wrote " + ", ".join(str(p) for p in paths) + "\n")
    return 0


def main(command: str, argv: list[str]) -> int:
    """Entry point of `kvflow whatif` (see `kvflow whatif --help`)."""
    try:
        return run(argv, sys.stdout)
    except UsageError as exc:
        print(f"kvflow {command}: error: {exc}", file=sys.stderr)
        return 2
