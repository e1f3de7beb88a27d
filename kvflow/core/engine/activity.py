"""Running totals of the engine's work for its status: what `kvflow top` and `kvflow report` read.

The metric subscribers hand their data to OpenTelemetry readers only (a Prometheus
scrape, an OTLP push), so a status request could not see operation counts, bytes,
hit tokens or evictions. `ActivityTally` is a small non-blocking subscriber on the
engine's bus that keeps those totals from the same events (blend lookups and
retrieves included, once one has ended); clients turn two snapshots into rates.
`l0_summary` reads the L0 lifecycle subscriber's pre-aggregated histograms (no
reader of its own) into counts, buckets and percentiles. Both are exact totals
since the engine started, as the metrics are.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kvflow.events import Event, EventType
from kvflow.subscribers.buckets import OP_SECONDS
from kvflow.subscribers.preaggregated import HistogramStore

_ET = EventType
#: START type -> the operation whose in-flight count it raises (its END lowers it)
_STARTS = {
    _ET.STORE_START: "store",
    _ET.RETRIEVE_START: "retrieve",
    _ET.LOOKUP_START: "lookup",
    _ET.BLEND_LOOKUP_START: "blend_lookup",
    _ET.BLEND_RETRIEVE_START: "blend_retrieve",
    _ET.L2_STORE_START: "l2_store",
    _ET.L2_LOAD_START: "l2_load",
    _ET.PREFETCH_START: "prefetch",
}
_ENDS = {
    _ET.STORE_END: "store",
    _ET.RETRIEVE_END: "retrieve",
    _ET.LOOKUP_END: "lookup",
    _ET.BLEND_LOOKUP_END: "blend_lookup",
    _ET.BLEND_RETRIEVE_END: "blend_retrieve",
    _ET.L2_STORE_END: "l2_store",
    _ET.L2_LOAD_END: "l2_load",
    _ET.PREFETCH_END: "prefetch",
}
#: operations whose requests, errors and tokens are totalled (`ops` of the snapshot); the
#: blend ones appear once one has ended
_TOTALLED = ("store", "retrieve", "lookup", "blend_lookup", "blend_retrieve")
#: lookup operation -> its END attrs of the tokens asked for, found, and found per tier
_LOOKUPS = {
    "lookup": ("requested_tokens", "hit_tokens", "hit_tokens_by_tier"),
    "blend_lookup": ("tokens", "blend_hit_tokens", "blend_hit_tokens_by_tier"),
}
_L1 = {_ET.L1_WRITE: "written", _ET.L1_READ: "read", _ET.L1_EVICT: "evicted"}
#: the L0 histograms `l0_summary` reports, by their short name
L0_HISTOGRAMS = {
    "kvflow.l0.block_lifetime": "lifetime",
    "kvflow.l0.block_idle_before_evict": "idle_before_evict",
    "kvflow.l0.block_reuse_gap": "reuse_gap",
}
QUANTILES = (0.5, 0.9, 0.99)


def _int(value: Any) -> int:
    """An attr read as a count: ints (not bools) as they are, anything else 0."""
    return value if type(value) is int and value >= 0 else 0


def _failed(attrs: Mapping[str, Any]) -> bool:
    return attrs.get("ok") is False or attrs.get("error") is not None


class ActivityTally:
    """Totals of operations, tokens, bytes, hits, evictions and block reports, by event.

    Runs inline on the bus dispatcher (`blocking = False`): a few dictionary
    additions per event under a lock. `snapshot()` copies them for a status reply.
    """

    name = "activity"
    blocking = False
    event_types: frozenset[EventType] | None = frozenset(
        {*_STARTS, *_ENDS, *_L1, _ET.L2_EVICT, _ET.BLOCK_ALLOCATION, _ET.LAYER_WAIT}
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: dict[str, Counter[str]] = {op: Counter() for op in _TOTALLED[:3]}
        self._started: Counter[str] = Counter()
        self._ended: Counter[str] = Counter()
        #: lookup operation -> tokens found per tier (the slowest each hit chunk needed)
        self._hit_by_tier: dict[str, Counter[str]] = {"lookup": Counter()}
        self._l1: Counter[str] = Counter()
        self._l2: dict[str, Counter[str]] = {}
        self._l0: Counter[str] = Counter()
        #: layer waits of layerwise retrieves, counted in OP_SECONDS buckets
        self._wait_counts = [0] * (len(OP_SECONDS) + 1)
        self._waits: Counter[str] = Counter()
        self._wait_max = self._wait_sum = 0.0

    def on_events(self, events: Sequence[Event]) -> None:
        """Add each event of the batch to the totals."""
        with self._lock:
            for ev in events:
                self._add(ev)

    def _add(self, ev: Event) -> None:
        etype, attrs = ev.type, ev.attrs
        op = _STARTS.get(etype)
        if op is not None:
            self._started[op] += 1
            return
        op = _ENDS.get(etype)
        if op is not None:
            self._ended[op] += 1
            self._add_end(op, attrs)
            return
        kind = _L1.get(etype)
        if kind is not None:
            self._l1[f"{kind}_chunks"] += _int(attrs.get("chunks"))
            self._l1[f"{kind}_bytes"] += _int(attrs.get("bytes"))
        elif etype is _ET.L2_EVICT:
            tier = self._tier(attrs)
            tier["evicted_chunks"] += _int(attrs.get("chunks"))
            tier["evicted_bytes"] += _int(attrs.get("bytes"))
        elif etype is _ET.LAYER_WAIT:
            self._add_waits(attrs)
        elif etype is _ET.BLOCK_ALLOCATION:
            records = attrs.get("records")
            if isinstance(records, Sequence):
                self._l0["allocation_records"] += len(records)
                self._l0["allocated_blocks"] += sum(
                    len(r[1]) for r in records if isinstance(r, Sequence) and len(r) == 3
                )

    def _add_end(self, op: str, attrs: Mapping[str, Any]) -> None:
        """An END: the operation's request, token and byte totals (L2 calls per tier)."""
        failed = _failed(attrs)
        if op in _TOTALLED:
            totals = self._ops.get(op)
            if totals is None:
                totals = self._ops[op] = Counter()
            totals["requests"] += 1
            totals["errors"] += failed
            if op in _LOOKUPS:
                self._add_hits(op, totals, attrs)
            else:
                totals["tokens"] += _int(attrs.get("tokens"))
                totals["bytes"] += _int(attrs.get("bytes"))
                queued = attrs.get("queued_ns")  # its copies ran on a GPU stream
                if isinstance(queued, int) and queued >= 0:
                    totals["queued_ops"] += 1
                    totals["queued_ns"] += queued
        elif op == "l2_store":
            tier = self._tier(attrs)
            tier["store_requests"] += 1
            tier["store_errors"] += failed
            tier["stored_bytes"] += _int(attrs.get("stored_bytes"))
            tier["store_failed_chunks"] += _int(attrs.get("failed_chunks"))
        elif op == "l2_load":
            tier = self._tier(attrs)
            tier["load_requests"] += 1
            tier["load_errors"] += failed
            tier["loaded_bytes"] += _int(attrs.get("loaded_bytes"))
            tier["load_failed_chunks"] += _int(attrs.get("failed_chunks"))

    def _add_hits(self, op: str, totals: Counter[str], attrs: Mapping[str, Any]) -> None:
        """A lookup's or blend lookup's tokens asked for and found, and those per tier (a
        producer that gives no split: all from L1)."""
        requested_key, hit_key, by_tier_key = _LOOKUPS[op]
        totals["requested_tokens"] += _int(attrs.get(requested_key))
        hit = _int(attrs.get(hit_key))
        totals["hit_tokens"] += hit
        tiers = self._hit_by_tier.get(op)
        if tiers is None:
            tiers = self._hit_by_tier[op] = Counter()
        by_tier = attrs.get(by_tier_key)
        if isinstance(by_tier, Mapping):
            for tier, n in by_tier.items():
                tiers[str(tier)] += _int(n)
        elif hit:
            tiers["l1"] += hit

    def _add_waits(self, attrs: Mapping[str, Any]) -> None:
        waits = attrs.get("waits_s")
        if not isinstance(waits, Sequence):
            return
        self._waits["reports"] += 1
        self._waits["stalled_layers"] += _int(attrs.get("stalled_layers"))
        for wait in waits:
            if isinstance(wait, (int, float)) and 0 <= wait < math.inf:
                self._wait_counts[bisect.bisect_left(OP_SECONDS, wait)] += 1
                self._waits["layers"] += 1
                self._wait_sum += wait
                self._wait_max = max(self._wait_max, wait)

    def _layer_waits(self) -> dict[str, Any]:
        """The layer-wait totals and quantiles, empty before the first report (call with
        the lock held)."""
        if not self._waits:
            return {}
        out: dict[str, Any] = dict(self._waits)
        out["sum_s"], out["max_s"] = self._wait_sum, self._wait_max
        for q in QUANTILES:
            value = quantile(q, OP_SECONDS, self._wait_counts)
            out[f"p{round(q * 100)}_s"] = None if value is None else min(value, self._wait_max)
        return out

    def _tier(self, attrs: Mapping[str, Any]) -> Counter[str]:
        name = str(attrs.get("tier"))
        tier = self._l2.get(name)
        if tier is None:
            tier = self._l2[name] = Counter()
        return tier

    def snapshot(self) -> dict[str, Any]:
        """The totals as plain JSON-able dicts (in-flight = STARTs without their END yet).

        `ops` has store, retrieve and lookup totals, and blend_lookup and blend_retrieve
        ones once such an op has ended; each lookup kind has its `hit_tokens_by_tier`; a
        store or retrieve whose END carried `queued_ns` (copies on a GPU stream) adds it
        to `queued_ns`, counted in `queued_ops`."""
        with self._lock:
            ops: dict[str, dict[str, Any]] = {op: dict(t) for op, t in self._ops.items()}
            inflight = {op: max(n - self._ended[op], 0) for op, n in self._started.items()}
            for op, tiers in self._hit_by_tier.items():
                ops[op]["hit_tokens_by_tier"] = dict(tiers)
            l1 = dict(self._l1)
            l2 = {name: dict(totals) for name, totals in self._l2.items()}
            l0 = dict(self._l0)
            layer_waits = self._layer_waits()
        return {
            "ops": ops, "inflight": inflight, "l1": l1, "l2": l2, "l0": l0,
            "layer_waits": layer_waits,
        }  # fmt: skip

    def shutdown(self) -> None:
        """Nothing to release."""


def quantile(q: float, bounds: Sequence[float], counts: Sequence[int]) -> float | None:
    """The q-quantile of an explicit-bucket histogram, interpolated as Prometheus does.

    Linear within the bucket holding the rank; the first bucket starts at 0 and the
    overflow bucket reports its lower bound. None when the histogram is empty.
    """
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i >= len(bounds):
                return float(bounds[-1])
            lower = bounds[i - 1] if i > 0 else 0.0
            return float(lower + (bounds[i] - lower) * (rank - seen) / n)
        seen += n
    return float(bounds[-1])


def l0_summary(store: HistogramStore | None) -> dict[str, Any]:
    """Each L0 block-age histogram over all label sets: count, sum, min, max, p50/p90/p99, buckets.

    An empty dict without a store (metrics off, or a provider of the caller's own);
    a histogram with no values yet is absent.
    """
    if store is None:
        return {}
    out: dict[str, Any] = {}
    for scope in store.produce():
        for metric in scope.metrics:
            short = L0_HISTOGRAMS.get(metric.name)
            points = list(getattr(metric.data, "data_points", ()))
            if short is None or not points:
                continue
            bounds = [float(b) for b in points[0].explicit_bounds]
            counts = [0] * (len(bounds) + 1)
            for point in points:
                for i, n in enumerate(point.bucket_counts):
                    counts[i] += n
            entry: dict[str, Any] = {
                "count": sum(p.count for p in points),
                "sum_s": sum(p.sum for p in points),
                "min_s": min(p.min for p in points),
                "max_s": max(p.max for p in points),
                "bounds_s": bounds,
                "bucket_counts": counts,
            }
            for q in QUANTILES:
                value = quantile(q, bounds, counts)
                if value is not None:  # clamp the interpolation to what was seen
                    value = min(max(value, entry["min_s"]), entry["max_s"])
                entry[f"p{round(q * 100)}_s"] = value
            out[short] = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                          for k, v in entry.items()}  # fmt: skip
    return out
