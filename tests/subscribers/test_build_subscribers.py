"""build_subscribers / ObservabilityPipeline: what each config builds, and clean shutdown."""

from __future__ import annotations

import io
import logging
import socket
import time
import urllib.request
from dataclasses import dataclass

import pytest

from kvflow.core.config import ObservabilityConfig
from kvflow.events import EventBus
from kvflow.subscribers import L0LifecycleSubscriber, build_subscribers
from kvflow.subscribers.testing import MetricsCapture, SpanCapture
from tests.support.collectors import free_port
from tests.support.event_script import EventScript

STORE = {"instance_id": "gpu0", "model_name": "llama"}


def names(pipeline: object) -> set[str]:
    return {s.name for s in pipeline.subscribers}  # type: ignore[attr-defined]


def port_is_free(port: int) -> bool:
    """Nothing listens on the port (connections left in TIME_WAIT do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_defaults_serve_prometheus_on_loopback_and_release_the_port() -> None:
    """Default config: metrics, L0 and logging subscribers on the bus, /metrics on 127.0.0.1."""
    port = free_port()
    bus = EventBus()
    stream = io.StringIO()
    pipeline = build_subscribers(ObservabilityConfig(prometheus_port=port), bus=bus,
                                 log_stream=stream)  # fmt: skip
    assert names(pipeline) == {"metrics", "l0_lifecycle", "logging"}
    assert {s.name for s in bus.subscribers} == names(pipeline)
    assert pipeline.prometheus is not None
    assert pipeline.prometheus.url == f"http://127.0.0.1:{port}/metrics"
    bus.start()
    s = EventScript()
    s.op("store", 0, 0.5, "r1", start_attrs=STORE, **STORE, tokens=16, bytes=100)
    for event in s.events:
        bus.publish(event)
    assert bus.flush(5.0)
    with urllib.request.urlopen(pipeline.prometheus.url, timeout=5) as reply:
        text = reply.read().decode()
    assert 'kvflow_store_requests_total{instance_id="gpu0"' in text
    assert pipeline.shutdown(5.0), pipeline.errors
    assert not bus.running
    assert port_is_free(port)
    assert pipeline.shutdown(5.0)  # idempotent


def test_disable_flags_are_honoured() -> None:
    """--disable-observability builds nothing; --disable-metrics/-logging drop their parts."""
    off = build_subscribers(ObservabilityConfig(enabled=False))
    assert names(off) == set() and off.prometheus is None
    no_metrics = build_subscribers(ObservabilityConfig(metrics_enabled=False),
                                   log_stream=io.StringIO())  # fmt: skip
    assert names(no_metrics) == {"logging"} and no_metrics.prometheus is None
    no_logging = build_subscribers(ObservabilityConfig(logging_enabled=False, prometheus_port=0),
                                   meter_provider=MetricsCapture().provider)  # fmt: skip
    assert names(no_logging) == {"metrics", "l0_lifecycle"}
    nowhere = build_subscribers(ObservabilityConfig(logging_enabled=False, prometheus_port=0))
    assert names(nowhere) == set()  # metrics on, but no exporter and no provider given
    for pipeline in (off, no_metrics, no_logging, nowhere):
        assert pipeline.shutdown(2.0)


def test_caller_providers_receive_everything_and_stay_open() -> None:
    """Given providers get metrics and spans; shutdown flushes but does not close them."""
    metrics, spans = MetricsCapture(), SpanCapture()
    bus = EventBus()
    config = ObservabilityConfig(tracing_enabled=True, otlp_endpoint="http://127.0.0.1:1",
                                 logging_enabled=False, l0_sample_rate=0.5, sample_seed=9)  # fmt: skip
    pipeline = build_subscribers(config, bus=bus, meter_provider=metrics.provider,
                                 tracer_provider=spans.provider)  # fmt: skip
    assert names(pipeline) == {"metrics", "l0_lifecycle", "tracing"}
    l0 = pipeline.subscriber("l0_lifecycle")
    assert isinstance(l0, L0LifecycleSubscriber) and l0.sample_rate == 0.5
    bus.start()
    s = EventScript()
    s.op("retrieve", 0, 0.25, "r1", start_attrs=STORE, **STORE, tokens=16, bytes=100)
    s.end_session(1, "r1")
    for event in s.events:
        bus.publish(event)
    assert pipeline.shutdown(5.0), pipeline.errors
    assert metrics.total("kvflow.retrieve.requests") == 1
    assert [sp.name for sp in spans.spans()] == ["kvflow.retrieve", "kvflow.request"]
    metrics.shutdown()
    spans.shutdown()


def test_busy_port_is_a_clear_error_and_leaks_nothing() -> None:
    """A Prometheus port in use raises OSError naming the address; logging is not left set up."""
    handlers = list(logging.getLogger().handlers)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            build_subscribers(ObservabilityConfig(prometheus_port=port), bus=EventBus(),
                              log_stream=io.StringIO())  # fmt: skip
    assert logging.getLogger().handlers == handlers


def test_shutdown_meets_its_deadline_with_an_unreachable_collector() -> None:
    """With the OTLP collector down, shutdown returns by its deadline and reports the failure."""
    dead = f"http://127.0.0.1:{free_port()}"
    bus = EventBus()
    config = ObservabilityConfig(otlp_endpoint=dead, tracing_enabled=True, prometheus_port=0,
                                 logging_enabled=False)  # fmt: skip
    pipeline = build_subscribers(config, bus=bus)
    bus.start()
    s = EventScript()
    s.op("store", 0, 0.1, "r1", start_attrs=STORE, **STORE, tokens=16, bytes=100)
    for event in s.events:
        bus.publish(event)
    started = time.monotonic()
    clean = pipeline.shutdown(2.0)
    assert time.monotonic() - started < 3.0
    assert not clean and pipeline.errors


@dataclass
class Settings:
    """Any object with the ObservabilitySettings attributes will do (no kvflow.core needed)."""

    enabled: bool = True
    metrics_enabled: bool = True
    logging_enabled: bool = False
    tracing_enabled: bool = False
    otlp_endpoint: str | None = None
    otlp_protocol: str = "grpc"
    prometheus_host: str = "127.0.0.1"
    prometheus_port: int = 0
    l0_sample_rate: float = 1.0
    sample_seed: int = 3
    log_level: str = "info"
    log_format: str = "json"
    tracing_ttl_s: float = 300.0
    export_interval_s: float = 5.0
    max_label_values: int = 256


def test_settings_protocol_is_duck_typed() -> None:
    """build_subscribers reads attributes only; a plain dataclass configures it."""
    metrics = MetricsCapture()
    pipeline = build_subscribers(Settings(), meter_provider=metrics.provider)
    assert names(pipeline) == {"metrics", "l0_lifecycle"}
    assert pipeline.force_flush(2.0)
    assert pipeline.shutdown(2.0)
    metrics.shutdown()
