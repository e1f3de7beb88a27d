"""Pre-aggregated explicit-bucket histograms, handed to OpenTelemetry readers at collection.

One SDK `Histogram.record` costs several microseconds (a Measurement object,
attribute cleaning and hashing, locks) and the SDK has no bulk record. A
`HistogramStore` adds a value with a bisect and a few additions under a lock,
and `KvflowMeterProvider` (providers.py) passes its contents to every reader as
the OpenTelemetry "MetricProducer" would: same data model, cumulative temporality.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from itertools import pairwise
from time import time_ns

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    ScopeMetrics,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

_INF = math.inf
#: identity-cache entries kept per histogram before it is cleared (callers reuse a few dicts)
_MAX_CACHED_ATTRIBUTES = 256


class _Series:
    """The cumulative aggregate of one attribute set since its first value."""

    __slots__ = ("attributes", "bucket_counts", "count", "max", "min", "start_ns", "sum")

    def __init__(self, attributes: dict[str, str], n_buckets: int) -> None:
        self.attributes = attributes
        self.start_ns = time_ns()
        self.bucket_counts = [0] * n_buckets
        self.count = 0
        self.sum: float = 0
        self.min = _INF
        self.max = -_INF


class PreaggregatedHistogram:
    """One histogram metric of a `HistogramStore`: a cumulative series per attribute set.

    Buckets follow the SDK: a value v lands in the first bucket whose upper
    boundary is >= v. Negative, NaN and infinite values are ignored, as the SDK
    ignores them, and counted in `ignored`.
    """

    def __init__(self, name: str, unit: str, description: str, boundaries: Sequence[float]) -> None:
        bounds = tuple(float(b) for b in boundaries)
        if not all(math.isfinite(b) for b in bounds) or any(
            lo >= hi for lo, hi in pairwise(bounds)
        ):
            raise ValueError(
                f"{name}: boundaries must be finite and increasing, got {boundaries!r}"
            )
        self.name = name
        self.unit = unit
        self.description = description
        self.boundaries = bounds
        self.ignored = 0
        self._lock = threading.Lock()
        self._series: dict[frozenset[tuple[str, str]], _Series] = {}
        # id(attributes) -> (attributes, series): the mapping is kept so its id stays unique
        self._by_identity: dict[int, tuple[Mapping[str, str], _Series]] = {}

    def record(self, value: float, attributes: Mapping[str, str]) -> None:
        """Add one value to the series of `attributes` (a mapping the caller no longer mutates)."""
        if not 0.0 <= value < _INF:
            with self._lock:
                self.ignored += 1
            return
        cached = self._by_identity.get(id(attributes))
        if cached is None or cached[0] is not attributes:
            cached = self._bind(attributes)
        series = cached[1]
        lock = self._lock
        lock.acquire()  # explicit acquire/release: 0.15 us less per value than `with`
        try:
            series.bucket_counts[bisect_left(self.boundaries, value)] += 1
            series.count += 1
            series.sum += value
            if value < series.min:
                series.min = value
            if value > series.max:
                series.max = value
        finally:
            lock.release()

    def _bind(self, attributes: Mapping[str, str]) -> tuple[Mapping[str, str], _Series]:
        """Find or create the series of an attribute set and cache it under the mapping's id."""
        key = frozenset(attributes.items())
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = _Series(dict(attributes), len(self.boundaries) + 1)
        if len(self._by_identity) >= _MAX_CACHED_ATTRIBUTES:
            self._by_identity.clear()
        entry = (attributes, series)
        self._by_identity[id(attributes)] = entry
        return entry

    def collect(self, time_unix_nano: int) -> Metric | None:
        """A snapshot of every series as an OpenTelemetry Metric (None before the first value)."""
        with self._lock:
            snapshot = [
                (s.attributes, s.start_ns, s.count, s.sum, tuple(s.bucket_counts), s.min, s.max)
                for s in self._series.values()
            ]
        if not snapshot:
            return None
        points = [
            HistogramDataPoint(
                attributes=attributes,
                start_time_unix_nano=start_ns,
                time_unix_nano=time_unix_nano,
                count=count,
                sum=total,
                bucket_counts=buckets,
                explicit_bounds=self.boundaries,
                min=low,
                max=high,
            )
            for attributes, start_ns, count, total, buckets, low, high in snapshot
        ]
        return Metric(
            name=self.name,
            description=self.description,
            unit=self.unit,
            data=Histogram(
                data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE
            ),
        )


class HistogramStore:
    """Pre-aggregated histograms of one instrumentation scope, a metric producer.

    Register it with `KvflowMeterProvider.add_producer`; every reader of that
    provider then collects its histograms beside the SDK's own instruments.
    """

    def __init__(self, scope_name: str) -> None:
        self.scope = InstrumentationScope(scope_name)
        self._histograms: list[PreaggregatedHistogram] = []

    def histogram(
        self, name: str, *, unit: str, description: str, boundaries: Sequence[float]
    ) -> PreaggregatedHistogram:
        """A new histogram of this scope (names are the caller's to keep unique)."""
        histogram = PreaggregatedHistogram(name, unit, description, boundaries)
        self._histograms = [*self._histograms, histogram]
        return histogram

    def produce(self) -> list[ScopeMetrics]:
        """The scope's histograms that hold values, collected now (empty list if none)."""
        now = time_ns()
        metrics = [m for h in self._histograms if (m := h.collect(now)) is not None]
        if not metrics:
            return []
        return [
            ScopeMetrics(scope=self.scope, metrics=metrics, schema_url=self.scope.schema_url or "")
        ]
