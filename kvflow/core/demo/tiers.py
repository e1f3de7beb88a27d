"""The demo's tier side: the default L1 size, and the per-tier rows of its summary.

The default L1 is sized against the workload so that its shared prefixes age out of
L1 between uses: with an L2 disk tier they come back from disk (lookup hits on
disk, prefetches, write-back into L1); without one they are computed again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvflow.core.config import BACKLOG_SHARE
from kvflow.core.demo.tally import OpTotals, TierTrace
from kvflow.core.demo.workload import Footprint
from kvflow.events import EventType

#: the default L1 holds 1/L1_PART of the workload's distinct chunks, or more where
#: the write-through backlog (BACKLOG_SHARE of L1) could not take its largest request
L1_PART = 3


@dataclass(frozen=True)
class L1Sizing:
    """The L1 the demo runs with: its chunks, their bytes and what they were sized from."""

    chunks: int
    chunk_nbytes: int
    footprint: Footprint

    @property
    def nbytes(self) -> int:
        return self.chunks * self.chunk_nbytes

    def describe(self) -> str:
        fp = self.footprint
        return (
            f"{_size(self.nbytes)} = {self.chunks} chunks of {_size(self.chunk_nbytes)}: 1/"
            f"{L1_PART} of the workload's {fp.distinct_chunks} distinct chunks, at least "
            f"{_backlog_chunks(fp)} (then the write-through backlog, {BACKLOG_SHARE:.0%} of "
            f"L1, takes its largest request's {fp.largest_request_chunks} chunks)"
        )


def _backlog_chunks(footprint: Footprint) -> int:
    """The smallest L1, in chunks, whose write-through backlog takes the largest request
    whole: below it, a store after a large one would often skip L2 (a store failure)."""
    return math.ceil(footprint.largest_request_chunks / BACKLOG_SHARE)


def default_l1(footprint: Footprint, chunk_nbytes: int) -> L1Sizing:
    """An L1 of 1/`L1_PART` of the workload's distinct chunks, raised to what the
    write-through backlog needs: too small for every shared prefix to stay, large
    enough that the backlog bound seldom turns a store's chunks away from L2."""
    chunks = max(footprint.distinct_chunks // L1_PART, _backlog_chunks(footprint), 1)
    return L1Sizing(chunks, chunk_nbytes, footprint)


def _size(n: float) -> str:
    """Bytes in MiB below a GiB, else in GiB (the unit of the size flags)."""
    return f"{n / (1 << 20):.1f} MiB" if n < 1 << 30 else f"{n / (1 << 30):.2f} GiB"


@dataclass(frozen=True)
class TierRow:
    """One tier's line of the summary (L1 first, then the L2 tiers in order).

    `hit_*` are lookup hits whose slowest tier was this one; `stored`/`loaded` are
    chunks written into / read out of it; failures are failed ops for L1 (a store or
    retrieve raised) and failed chunks for an L2 tier.
    """

    name: str
    usage_bytes: int
    capacity_bytes: int
    objects: int
    evicted_chunks: int
    hit_chunks: int
    hit_tokens: int
    stored_chunks: int
    loaded_chunks: int
    store_failures: int
    load_failures: int


def tier_rows(
    status: dict[str, Any],
    trace: TierTrace,
    ops: dict[EventType, OpTotals],
    chunk_size: int,
) -> list[TierRow]:
    """L1's row from its stats and the events, then each L2 tier's from `status()["l2"]`."""
    hits = trace.hit_tokens_by_tier()
    l1 = status["l1"]
    rows = [
        TierRow(
            "l1", l1["usage_bytes"], l1["capacity_bytes"], l1["objects"], l1["evicted_chunks"],
            hits["l1"] // chunk_size, hits["l1"], trace.l1_chunks["written"],
            trace.l1_chunks["read"], ops[EventType.STORE_START].failed,
            ops[EventType.RETRIEVE_START].failed,
        )
    ]  # fmt: skip
    l2 = status["l2"] or {"tiers": {}}
    for name, t in l2["tiers"].items():
        rows.append(
            TierRow(
                name, t["usage_bytes"], t["capacity_bytes"], t["objects"], t["evicted_chunks"],
                t["hit_chunks"], hits[name], t["stored"], t["loaded"], t["store_failures"],
                t["load_failures"],
            )
        )  # fmt: skip
    return rows


def tier_table(rows: list[TierRow]) -> list[str]:
    """The rows as an aligned table with a header line."""
    head = ("tier", "usage of capacity", "objects", "evicted", "hit chunks", "hit tokens",
            "stored", "loaded", "failed store/load")  # fmt: skip
    cells = [head] + [
        (
            r.name,
            f"{_size(r.usage_bytes)} of {_size(r.capacity_bytes)}",
            f"{r.objects:,}",
            f"{r.evicted_chunks:,}",
            f"{r.hit_chunks:,}",
            f"{r.hit_tokens:,}",
            f"{r.stored_chunks:,}",
            f"{r.loaded_chunks:,}",
            f"{r.store_failures}/{r.load_failures} {'ops' if r.name == 'l1' else 'chunks'}",
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in cells]  # fmt: skip
