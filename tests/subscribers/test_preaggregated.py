"""Pre-aggregated histograms and KvflowMeterProvider: same data as the SDK, seen by every reader."""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    InMemoryMetricReader,
    MetricReader,
    MetricsData,
    ScopeMetrics,
)

from kvflow.subscribers import (
    HistogramStore,
    KvflowMeterProvider,
    L0LifecycleSubscriber,
    kvflow_resource,
    make_meter_provider,
)
from kvflow.subscribers.buckets import BLOCK_SECONDS
from kvflow.subscribers.testing import MetricsCapture
from tests.support.event_script import EventScript

L0_HISTOGRAMS = (
    "kvflow.l0.block_lifetime",
    "kvflow.l0.block_idle_before_evict",
    "kvflow.l0.block_reuse_gap",
)
A, B, C = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


def histograms(data: MetricsData | None) -> dict[str, Any]:
    """Histogram metrics by name from a collection, with each metric's scope name."""
    assert data is not None
    return {
        m.name: (sm.scope.name, m)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if isinstance(m.data, Histogram)
    }


def point_key(point: Any) -> tuple[Any, ...]:
    """Everything a histogram point exports except its timestamps."""
    return (
        tuple(sorted(dict(point.attributes).items())),
        point.count,
        point.sum,
        tuple(point.bucket_counts),
        tuple(point.explicit_bounds),
        point.min,
        point.max,
    )


def sdk_points(values: Sequence[tuple[float, dict[str, str]]]) -> list[Any]:
    """The SDK's own histogram points for the same values, buckets and attributes."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    histogram = provider.get_meter("ref").create_histogram(
        "h", unit="s", explicit_bucket_boundaries_advisory=BLOCK_SECONDS
    )
    for value, attributes in values:
        histogram.record(value, attributes)
    (metric,) = [m for rm in reader.get_metrics_data().resource_metrics  # type: ignore[union-attr]
                 for sm in rm.scope_metrics for m in sm.metrics]  # fmt: skip
    provider.shutdown()
    return list(metric.data.data_points)


def test_store_maths_match_the_sdk_histogram() -> None:
    """Buckets (boundary values included), count, sum, min and max equal the SDK's, per series."""
    rng = random.Random(4)
    gpu0 = {"instance_id": "gpu0", "model_name": "m"}
    gpu1 = {"instance_id": "gpu1", "model_name": "m"}
    values: list[tuple[float, dict[str, str]]] = []
    for _ in range(3000):
        value = rng.choice(
            [rng.choice(BLOCK_SECONDS), 0.0, rng.expovariate(0.05), rng.uniform(0, 200_000)]
        )
        # a fresh dict with the other key order must land in the same series
        attributes = rng.choice([gpu0, gpu1, {"model_name": "m", "instance_id": "gpu1"}])
        values.append((value, attributes))
    bad = [-1.0, math.nan, math.inf, -math.inf]

    store = HistogramStore("test")
    histogram = store.histogram("h", unit="s", description="", boundaries=BLOCK_SECONDS)
    for value, attributes in values:
        histogram.record(value, attributes)
    for value in bad:
        histogram.record(value, gpu0)

    (scope,) = store.produce()
    (metric,) = scope.metrics
    ours = sorted(map(point_key, metric.data.data_points))
    assert ours == sorted(map(point_key, sdk_points(values)))
    assert len(ours) == 2
    assert histogram.ignored == len(bad)
    assert metric.data.aggregation_temporality is AggregationTemporality.CUMULATIVE


def test_store_rejects_bad_boundaries_and_is_empty_before_values() -> None:
    store = HistogramStore("test")
    with pytest.raises(ValueError, match="increasing"):
        store.histogram("h", unit="s", description="", boundaries=(1.0, 1.0))
    with pytest.raises(ValueError, match="finite"):
        store.histogram("h", unit="s", description="", boundaries=(1.0, math.inf))
    store.histogram("h", unit="s", description="", boundaries=(1.0,))
    assert store.produce() == []


def narrative(sub: L0LifecycleSubscriber) -> None:
    """Each L0 rule of docs/METRICS.md on two instances, then evictions released and active."""
    s = EventScript()
    for inst, offset in (("gpu0", 0.0), ("gpu1", 0.25)):
        at = offset
        s.allocate(at, ("a", [10, 11], A + B), block_size=4, instance_id=inst)
        s.allocate(at + 2, ("b", [10], A), block_size=4, instance_id=inst)
        s.end_session(at + 3, "a")
        s.end_session(at + 5, "b")
        s.allocate(at + 8, ("c", [10], A), block_size=4, instance_id=inst)
        s.end_session(at + 9, "c")
        s.allocate(at + 15, ("d", [10, 11], C + A), block_size=4, instance_id=inst)
        s.allocate(at + 20.004, ("e", [12], B), block_size=4, instance_id=inst)
        s.allocate(at + 40, ("f", [12, 10], A + B), block_size=4, instance_id=inst)
        s.end_session(at + 41, "d")
    sub.on_events(s.events)


def test_l0_exports_the_same_histograms_through_either_provider() -> None:
    """make_meter_provider (pre-aggregated) and a plain provider export identical L0 histograms."""
    exported = []
    for kvflow_provider in (False, True):
        cap = MetricsCapture(kvflow_provider=kvflow_provider)
        narrative(L0LifecycleSubscriber(cap.provider, sample_rate=1.0, seed=0))
        found = histograms(cap.reader.get_metrics_data())
        exported.append(
            {
                name: (scope, metric.unit, metric.description,
                       metric.data.aggregation_temporality,
                       sorted(map(point_key, metric.data.data_points)))
                for name, (scope, metric) in found.items()
            }
        )  # fmt: skip
        assert cap.total("kvflow.l0.allocated_blocks", instance_id="gpu1") == 9
        cap.shutdown()
    plain, kvflow = exported
    assert set(kvflow) == set(L0_HISTOGRAMS)
    assert kvflow == plain
    lifetime_points = kvflow["kvflow.l0.block_lifetime"][4]
    assert [dict(p[0])["instance_id"] for p in lifetime_points] == ["gpu0", "gpu1"]
    assert all(p[1] > 1 for p in lifetime_points)


def test_l0_histograms_join_the_sdk_scope_under_the_kvflow_resource() -> None:
    """One ScopeMetrics for kvflow.l0 holds SDK counters and pre-aggregated histograms alike."""
    cap = MetricsCapture(kvflow_provider=True)
    narrative(L0LifecycleSubscriber(cap.provider, sample_rate=1.0, seed=0))
    data = cap.reader.get_metrics_data()
    assert data is not None
    (rm,) = data.resource_metrics
    assert rm.resource == kvflow_resource()
    (l0,) = [sm for sm in rm.scope_metrics if sm.scope.name == "kvflow.l0"]
    names = {m.name for m in l0.metrics}
    assert {"kvflow.l0.allocated_blocks", "kvflow.l0.tracked_blocks", *L0_HISTOGRAMS} <= names
    cap.shutdown()


def test_collection_is_cumulative_across_collects() -> None:
    """A second collection counts every value since the series began, from the same start time."""
    cap = MetricsCapture(kvflow_provider=True)
    sub = L0LifecycleSubscriber(cap.provider, sample_rate=1.0, seed=0)
    s = EventScript()
    s.allocate(0.0, ("a", [1], A), block_size=4)
    s.allocate(2.0, ("b", [1], B), block_size=4)
    sub.on_events(s.events)
    (first,) = cap.points("kvflow.l0.block_lifetime")
    s.events.clear()
    s.allocate(5.0, ("c", [1], C), block_size=4)
    sub.on_events(s.events)
    (second,) = cap.points("kvflow.l0.block_lifetime")
    assert (first.count, first.sum) == (1, 2.0)
    assert (second.count, second.sum, second.min, second.max) == (2, 5.0, 2.0, 3.0)
    assert second.start_time_unix_nano == first.start_time_unix_nano
    assert second.time_unix_nano >= first.time_unix_nano >= first.start_time_unix_nano
    cap.shutdown()


def test_concurrent_record_and_collect_stay_consistent() -> None:
    """While one thread records, every collection from another has count == sum(buckets)."""
    store = HistogramStore("test")
    histogram = store.histogram("h", unit="s", description="", boundaries=BLOCK_SECONDS)
    labels = {"instance_id": "gpu0", "model_name": "m"}
    n = 200_000
    done = threading.Event()

    def record() -> None:
        for i in range(n):
            histogram.record((i % 1000) * 0.01, labels)
        done.set()

    snapshots = []
    writer = threading.Thread(target=record)
    writer.start()
    while not done.is_set() or len(snapshots) < 2:
        for scope in store.produce():
            snapshots.extend(scope.metrics[0].data.data_points)
    writer.join()
    (last,) = store.produce()[0].metrics[0].data.data_points
    assert all(p.count == sum(p.bucket_counts) for p in snapshots)
    assert last.count == sum(last.bucket_counts) == n
    assert last.sum == pytest.approx(sum((i % 1000) * 0.01 for i in range(n)))


class _Producer:
    """A producer returning fixed scopes, or raising."""

    def __init__(self, scopes: list[ScopeMetrics] | None) -> None:
        self.scopes = scopes

    def produce(self) -> list[ScopeMetrics]:
        if self.scopes is None:
            raise RuntimeError("broken producer")
        return self.scopes


def test_provider_collects_producers_for_added_readers_and_survives_a_broken_one() -> None:
    """A producer alone makes a MetricsData; a reader added later sees it; a raising one is skipped."""
    provider = make_meter_provider([])
    reader = InMemoryMetricReader()
    provider.add_metric_reader(reader)
    assert reader.get_metrics_data() is None
    store = HistogramStore("kvflow.test")
    store.histogram("h", unit="s", description="d", boundaries=(1.0,)).record(0.5, {"k": "v"})
    provider.add_producer(_Producer(None))
    provider.add_producer(store)
    data = reader.get_metrics_data()
    assert data is not None
    (rm,) = data.resource_metrics
    assert rm.resource == kvflow_resource()
    ((scope, metric),) = histograms(data).values()
    assert scope == "kvflow.test"
    assert point_key(metric.data.data_points[0]) == (
        (("k", "v"),),
        1,
        0.5,
        (1, 0),
        (1.0,),
        0.5,
        0.5,
    )
    provider.shutdown()


def test_provider_refuses_an_sdk_without_its_collection_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An SDK lacking the private hook fails at construction, naming it, not at first export."""
    monkeypatch.delattr(MetricReader, "_set_collect_callback")
    with pytest.raises(RuntimeError, match="_set_collect_callback"):
        KvflowMeterProvider([InMemoryMetricReader()])
