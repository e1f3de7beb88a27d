"""Metrics and spans reach real collectors: a Prometheus server and OTLP receivers."""

from __future__ import annotations

import shutil

import pytest

from kvflow.core.config import ObservabilityConfig
from kvflow.events import EventBus, EventType, now_ns
from kvflow.subscribers import build_subscribers
from kvflow.subscribers.buckets import OP_SECONDS
from kvflow.subscribers.testing import EventScript, OTLPReceiver, PrometheusServer, free_port

STORE = {"instance_id": "gpu0", "model_name": "llama"}


def publish_workload(bus: EventBus) -> EventScript:
    """A request that looks up, retrieves, stores (once failing) and ends."""
    s = EventScript(base_ns=now_ns())
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
    for event in s.events:
        assert bus.publish(event)
    return s


@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="the Debian package prometheus is not installed (`make pytest` installs it)",
)
def test_prometheus_scrapes_kvflow_metrics() -> None:
    """A real Prometheus scrapes the kvflow endpoint; metrics read back through its query API."""
    port = free_port()
    bus = EventBus()
    config = ObservabilityConfig(prometheus_port=port, logging_enabled=False)
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
        (up,) = prometheus.query('up{job="kvflow"}')
        assert up["value"][1] == "1"
    finally:
        prometheus.close()
        assert pipeline.shutdown(5.0), pipeline.errors


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
