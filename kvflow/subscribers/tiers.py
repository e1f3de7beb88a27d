"""The storage-tier metrics (kvflow.l2.*, kvflow.prefetch.*, kvflow.write_back.*).

`TierMetrics` owns these instruments for `MetricsSubscriber`, which pairs the
START/END events and hands each END (with its START's timestamp) here; counter
increments go into the subscriber's per-batch sums. Tier occupancy is observed
through the `tier_stats` callback when a reader collects.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation

from kvflow.events import Event, EventType
from kvflow.subscribers.batch import Adds, LabelSets, add
from kvflow.subscribers.buckets import GB_PER_S, OP_SECONDS

_ET = EventType
_NS = 1e-9
_T = ("tier",)
_TO = ("tier", "outcome")
_TRO = ("tier", "reason", "outcome")
_M = ("model_name",)
_MO = ("model_name", "outcome")
_MTO = ("model_name", "trigger", "outcome")
_R = ("reason",)

#: Returns each L2 tier's stats() by tier name: keys usage_bytes, capacity_bytes, objects, ...
TierStats = Callable[[], Mapping[str, Mapping[str, int]]]

#: START type -> the operation name (inflight instrument, kvflow.inflight.expired label).
OPERATIONS: Mapping[EventType, str] = {
    _ET.L2_STORE_START: "l2_store",
    _ET.L2_LOAD_START: "l2_load",
    _ET.PREFETCH_START: "prefetch",
}
#: operation -> the START attr its inflight gauge is labelled by.
INFLIGHT_LABEL: Mapping[str, tuple[str, ...]] = {"l2_store": _T, "l2_load": _T, "prefetch": _M}
_INFLIGHT = {"l2_store": "l2_stores", "l2_load": "l2_loads", "prefetch": "prefetches"}


class _Transfer:
    """The instruments of one L2 direction (store or load) and the END attrs they count."""

    __slots__ = ("bytes", "bytes_key", "chunks", "chunks_key", "duration", "failed", "requests",
                 "throughput")  # fmt: skip

    def __init__(self, meter: Any, direction: str, done: str) -> None:
        prefix = f"kvflow.l2.{direction}"
        self.chunks_key, self.bytes_key = f"{done}_chunks", f"{done}_bytes"
        self.requests = meter.create_counter(
            f"{prefix}.requests", unit="{request}", description=f"Finished L2 {direction} calls"
        )
        self.chunks = meter.create_counter(
            f"{prefix}.chunks", unit="{chunk}", description=f"Objects {done} by L2 {direction}s"
        )
        self.bytes = meter.create_counter(
            f"{prefix}.bytes", unit="By", description=f"Bytes {done} by L2 {direction}s"
        )
        self.failed = meter.create_counter(
            f"{prefix}.failed_chunks",
            unit="{chunk}",
            description=f"Objects an L2 {direction} failed to move",
        )
        self.duration = meter.create_histogram(
            f"{prefix}.duration",
            unit="s",
            description=f"L2 {direction} latency, START to END",
            explicit_bucket_boundaries_advisory=OP_SECONDS,
        )
        self.throughput = meter.create_histogram(
            f"{prefix}.throughput",
            unit="GBy/s",
            description=f"Bytes {done} / duration of successful L2 {direction}s, in 1e9 bytes/s",
            explicit_bucket_boundaries_advisory=GB_PER_S,
        )


class TierMetrics:
    """Records the L2, prefetch and write-back metrics of docs/METRICS.md."""

    def __init__(self, meter: Any, labels: LabelSets, tier_stats: TierStats | None) -> None:
        self._labels = labels
        self._tier_stats = tier_stats
        self._snapshot: Mapping[str, Mapping[str, int]] = {}
        self._snapshot_lock = threading.Lock()
        counter = meter.create_counter
        self._store = _Transfer(meter, "store", "stored")
        self._load = _Transfer(meter, "load", "loaded")
        self._evicted = (
            counter("kvflow.l2.evicted_chunks", unit="{chunk}", description="Objects L2 evicted"),
            counter("kvflow.l2.evicted_bytes", unit="By", description="Bytes L2 evicted"),
        )
        self._prefetch_requests = counter(
            "kvflow.prefetch.requests", unit="{request}", description="Finished prefetches"
        )
        self._prefetch_counts = tuple(
            (key, counter(f"kvflow.prefetch.{name}", unit="{chunk}", description=text))
            for key, name, text in (
                ("loaded_chunks", "chunks", "Objects prefetches loaded from L2"),
                ("written_back_chunks", "written_back_chunks", "Prefetched objects kept in L1"),
                ("discarded_chunks", "discarded_chunks", "Prefetched objects discarded"),
            )
        )
        self._prefetch_duration = meter.create_histogram(
            "kvflow.prefetch.duration",
            unit="s",
            description="prefetch latency, START to END",
            explicit_bucket_boundaries_advisory=OP_SECONDS,
        )
        self._kept = counter(
            "kvflow.write_back.kept_chunks",
            unit="{chunk}",
            description="Objects loaded from L2 kept in L1 (the contiguous prefix)",
        )
        self._discarded = counter(
            "kvflow.write_back.discarded_chunks",
            unit="{chunk}",
            description="Objects loaded from L2 discarded after a gap",
        )
        self.inflight = {
            op: meter.create_up_down_counter(
                f"kvflow.inflight.{plural}",
                unit="{operation}",
                description=f"{op} operations started and not yet finished",
            )
            for op, plural in _INFLIGHT.items()
        }
        if tier_stats is not None:
            for key, unit, text in (
                ("usage_bytes", "By", "L2 bytes in use, per tier"),
                ("capacity_bytes", "By", "L2 capacity, per tier"),
                ("objects", "{object}", "Objects held, per L2 tier"),
            ):
                meter.create_observable_gauge(
                    f"kvflow.l2.{key}", callbacks=[self._gauge(key)], unit=unit, description=text
                )

    # -- gauges ------------------------------------------------------------------------

    def _gauge(self, key: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        refresh = key == "usage_bytes"  # the first registered: the SDK calls it first

        def observe(options: CallbackOptions) -> Iterable[Observation]:
            found = []
            for tier, stats in self._stats(refresh).items():
                value = stats.get(key)
                if value is not None:
                    found.append(Observation(value, self._labels.get(_T, tier)))
            return found

        return observe

    def _stats(self, refresh: bool) -> Mapping[str, Mapping[str, int]]:
        """One tier_stats() snapshot per collection, shared by the three gauges."""
        assert self._tier_stats is not None
        with self._snapshot_lock:
            if refresh or not self._snapshot:
                self._snapshot = self._tier_stats()
            return self._snapshot

    # -- events ------------------------------------------------------------------------

    def on_end(self, ev: Event, start_ts: int | None, outcome: str, adds: Adds) -> None:
        """Count an L2_STORE_END, L2_LOAD_END or PREFETCH_END (timed when its START was seen)."""
        attrs = ev.attrs
        duration_ns = None if start_ts is None else max(ev.ts_ns - start_ts, 0)
        if ev.type is _ET.PREFETCH_END:
            model = attrs.get("model_name", "")
            labels = self._labels.get(_M, model)
            trigger = attrs.get("trigger", "")
            add(adds, self._prefetch_requests, self._labels.get(_MTO, model, trigger, outcome), 1)
            for key, instrument in self._prefetch_counts:
                add(adds, instrument, labels, attrs.get(key) or 0)
            if duration_ns is not None:
                with_outcome = self._labels.get(_MO, model, outcome)
                self._prefetch_duration.record(duration_ns * _NS, with_outcome)
            return
        tier = attrs.get("tier", "")
        labels = self._labels.get(_T, tier)
        if ev.type is _ET.L2_STORE_END:
            transfer = self._store
            timed = self._labels.get(_TO, tier, outcome)
        else:
            transfer = self._load
            timed = self._labels.get(_TRO, tier, attrs.get("reason", ""), outcome)
        add(adds, transfer.requests, timed, 1)
        add(adds, transfer.chunks, labels, attrs.get(transfer.chunks_key) or 0)
        nbytes = attrs.get(transfer.bytes_key) or 0
        add(adds, transfer.bytes, labels, nbytes)
        add(adds, transfer.failed, labels, attrs.get("failed_chunks") or 0)
        if duration_ns is None:
            return
        transfer.duration.record(duration_ns * _NS, timed)
        if outcome == "ok" and nbytes > 0 and duration_ns > 0:
            transfer.throughput.record(nbytes / duration_ns, labels)

    def on_event(self, ev: Event, adds: Adds) -> None:
        """Count an L2_EVICT or a WRITE_BACK."""
        attrs = ev.attrs
        if ev.type is _ET.L2_EVICT:
            labels = self._labels.get(_T, attrs.get("tier", ""))
            add(adds, self._evicted[0], labels, attrs.get("chunks") or 0)
            add(adds, self._evicted[1], labels, attrs.get("bytes") or 0)
        else:
            labels = self._labels.get(_R, attrs.get("reason", ""))
            add(adds, self._kept, labels, attrs.get("kept") or 0)
            add(adds, self._discarded, labels, attrs.get("discarded") or 0)


#: The single (unpaired) events TierMetrics.on_event counts.
TIER_EVENTS = frozenset({_ET.L2_EVICT, _ET.WRITE_BACK})
#: The END types TierMetrics.on_end counts.
TIER_ENDS = frozenset({_ET.L2_STORE_END, _ET.L2_LOAD_END, _ET.PREFETCH_END})
