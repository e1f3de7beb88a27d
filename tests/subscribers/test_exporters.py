"""Metrics and spans reach real collectors: a Prometheus server and OTLP receivers."""

from __future__ import annotations

import urllib.request

import pytest

from kvflow.core.config import ObservabilityConfig
from kvflow.events import EventBus, EventType, now_ns
from kvflow.subscribers import build_subscribers
from kvflow.subscribers.buckets import BLOCK_SECONDS, OP_SECONDS
from tests.support.collectors import OTLPReceiver, PrometheusServer, free_port
from tests.support.event_script import EventScript

STORE = {"instance_id": "gpu0", "model_name": "llama"}


def publish_workload(bus: EventBus) -> EventScript:
    """A request that looks up, retrieves, stores (once failing) and ends.

    Its GPU block is then evicted for another request's tokens (with L0 sampling
    at 1.0: one lifetime of 0.2 s and one idle time of 0.14 s).
    """
    s = EventScript(base_ns=now_ns())
    s.allocate(0.0, ("req-1", [7], [1, 2, 3, 4]), **STORE, block_size=4)
    s.op("lookup", 0.0, 0.001, "req-1", start_attrs={"model_name": "llama", "tokens": 512},
         model_name="llama", requested_tokens=512, hit_tokens=256)  # fmt: skip
    s.op("retrieve", 0.002, 0.004, "req-1", start_attrs={**STORE, "tokens": 256},
         **STORE, tokens=256, bytes=1 << 20)  # fmt: skip
    s.op("store", 0.01, 0.02, "req-1", start_attrs={**STORE, "tokens": 512},
         **STORE, tokens=512, bytes=1 << 21)  # fmt: skip
    s.op("store", 0.03, 0.04, "req-1", start_attrs=STORE, **STORE, tokens=0, bytes=0,
         ok=False, error="l1_full")  # fmt: skip
    s.add(EventType.L1_EVICT, 0.05, "req-1", chunks=2, bytes=4096)
    s.end_session(0.06, "req-1")
    s.allocate(0.2, ("req-2", [7], [5, 6, 7, 8]), **STORE, block_size=4)
    for event in s.events:
        assert bus.publish(event)
    return s


@pytest.mark.needs("prometheus", why="a real Prometheus scrapes kvflow's metrics endpoint")
def test_prometheus_scrapes_kvflow_metrics() -> None:
    """A real Prometheus scrapes the kvflow endpoint; metrics read back through its query API."""
    port = free_port()
    bus = EventBus()
    config = ObservabilityConfig(prometheus_port=port, logging_enabled=False, l0_sample_rate=1.0)
    pipeline = build_subscribers(config, bus=bus, l1_stats=lambda: {"usage_bytes": 4096,
                                 "capacity_bytes": 1 << 30, "objects": 2})  # fmt: skip
    bus.start()
    prometheus = PrometheusServer([f"127.0.0.1:{port}"])
    try:
        publish_workload(bus)
        assert bus.flush(5.0)
        prometheus.wait_ready()
        ok = prometheus.wait_for('kvflow_store_requests_total{outcome="ok"}')
        assert ok[0]["metric"]["instance_id"] == "gpu0"
        assert ok[0]["metric"]["model_name"] == "llama"
        assert float(ok[0]["value"][1]) == 1.0
        (failed,) = prometheus.query('kvflow_store_requests_total{outcome="error"}')
        assert float(failed["value"][1]) == 1.0
        (count,) = prometheus.query("sum(kvflow_store_duration_seconds_count)")
        assert float(count["value"][1]) == 2.0
        (usage,) = prometheus.query("kvflow_l1_usage_bytes")
        assert float(usage["value"][1]) == 4096
        (lifetime,) = prometheus.wait_for("kvflow_l0_block_lifetime_seconds_count")
        assert float(lifetime["value"][1]) == 1.0
        (le_01,) = prometheus.query('kvflow_l0_block_lifetime_seconds_bucket{le="0.1"}')
        (le_025,) = prometheus.query('kvflow_l0_block_lifetime_seconds_bucket{le="0.25"}')
        assert (float(le_01["value"][1]), float(le_025["value"][1])) == (0.0, 1.0)
        (up,) = prometheus.query('up{job="kvflow"}')
        assert up["value"][1] == "1"
    finally:
        prometheus.close()
        assert pipeline.shutdown(5.0), pipeline.errors


def test_prometheus_endpoint_serves_l0_histograms() -> None:
    """The scrape text carries the pre-aggregated L0 histograms beside the SDK's metrics."""
    bus = EventBus()
    config = ObservabilityConfig(
        prometheus_port=free_port(), logging_enabled=False, l0_sample_rate=1.0
    )
    pipeline = build_subscribers(config, bus=bus)
    bus.start()
    try:
        publish_workload(bus)
        assert bus.flush(5.0)
        assert pipeline.prometheus is not None
        with urllib.request.urlopen(pipeline.prometheus.url, timeout=5.0) as reply:
            text = reply.read().decode()
    finally:
        assert pipeline.shutdown(5.0), pipeline.errors
    labels = 'instance_id="gpu0",model_name="llama"'
    assert "# TYPE kvflow_l0_block_lifetime_seconds histogram" in text
    assert (
        'kvflow_l0_block_lifetime_seconds_bucket{instance_id="gpu0",le="0.1",model_name="llama"} 0.0'
        in text
    )
    assert (
        'kvflow_l0_block_lifetime_seconds_bucket{instance_id="gpu0",le="0.25",model_name="llama"} 1.0'
        in text
    )
    assert f"kvflow_l0_block_lifetime_seconds_count{{{labels}}} 1.0" in text
    assert f"kvflow_l0_block_idle_before_evict_seconds_sum{{{labels}}} 0.14" in text
    assert f"kvflow_l0_allocated_blocks_total{{{labels}}} 2.0" in text
    assert "kvflow_store_duration_seconds_count" in text


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_otlp_push_of_metrics_and_spans(protocol: str) -> None:
    """The real OTLP exporters deliver kvflow's metrics and spans to a collector on shutdown."""
    receiver = OTLPReceiver(protocol)
    bus = EventBus()
    config = ObservabilityConfig(
        otlp_endpoint=receiver.endpoint,
        otlp_protocol=protocol,
        tracing_enabled=True,
        prometheus_port=0,
        logging_enabled=False,
        export_interval_s=60.0,  # nothing is pushed before shutdown's final export
        l0_sample_rate=1.0,
    )
    pipeline = build_subscribers(config, bus=bus)
    bus.start()
    try:
        publish_workload(bus)
        assert pipeline.shutdown(10.0), pipeline.errors
        metrics = {m.name: m for m in receiver.metrics()}
        assert {"kvflow.store.requests", "kvflow.store.duration", "kvflow.retrieve.throughput",
                "kvflow.lookup.hit_tokens", "kvflow.l1.evicted_chunks",
                "kvflow.bus.published"} <= set(metrics)  # fmt: skip
        requests = metrics["kvflow.store.requests"].sum.data_points
        assert sorted(p.as_int for p in requests) == [1, 1]
        duration = metrics["kvflow.store.duration"]
        assert duration.unit == "s"
        assert tuple(duration.histogram.data_points[0].explicit_bounds) == OP_SECONDS
        assert {"service.name": "kvflow"}.items() <= receiver.resources()[0].items()
        lifetime = metrics["kvflow.l0.block_lifetime"]
        assert lifetime.unit == "s"
        assert lifetime.histogram.aggregation_temporality == 2  # CUMULATIVE
        (point,) = lifetime.histogram.data_points
        assert tuple(point.explicit_bounds) == BLOCK_SECONDS
        assert (point.count, point.min, point.max) == (1, 0.2, 0.2)
        assert {kv.key: kv.value.string_value for kv in point.attributes} == STORE

        spans = {sp.name: sp for sp in receiver.spans()}
        assert {"kvflow.request", "kvflow.lookup", "kvflow.retrieve", "kvflow.store"} <= set(spans)
        root = spans["kvflow.request"]
        store_spans = [sp for sp in receiver.spans() if sp.name == "kvflow.store"]
        assert all(sp.parent_span_id == root.span_id for sp in store_spans)
        assert [sp.status.code for sp in store_spans].count(2) == 1  # STATUS_CODE_ERROR
        retrieve = spans["kvflow.retrieve"]
        assert retrieve.end_time_unix_nano - retrieve.start_time_unix_nano == 2_000_000
    finally:
        receiver.close()
