"""Consumers of the event stream: metrics, sampled L0 lifecycle, tracing, logging.

Typical use (the engine does this)::

    bus = EventBus(cfg.event_bus_capacity)
    # builds the subscribers and registers them on bus
    pipeline = build_subscribers(cfg, bus=bus, l1_stats=l1.stats, tier_stats=tiers.stats)
    bus.start()
    ...
    pipeline.shutdown(timeout=5.0)  # stops the bus, flushes exporters, frees the port

`cfg` is any object with the `ObservabilitySettings` attributes (e.g.
`kvflow.core.ObservabilityConfig`). Each subscriber can also be built and
registered alone with an OpenTelemetry provider of the caller's choosing;
`kvflow.subscribers.testing` has in-memory providers for tests, kvflow's and users'.
"""

from kvflow.subscribers.l0 import L0LifecycleSubscriber
from kvflow.subscribers.logs import LoggingSetup, LoggingSubscriber, configure_logging
from kvflow.subscribers.metrics import L1Stats, MetricsSubscriber
from kvflow.subscribers.pipeline import ObservabilityPipeline, build_subscribers
from kvflow.subscribers.preaggregated import HistogramStore
from kvflow.subscribers.providers import (
    KvflowMeterProvider,
    MetricProducer,
    PrometheusEndpoint,
    kvflow_resource,
    make_meter_provider,
    make_tracer_provider,
    otlp_metric_reader,
    otlp_span_exporter,
)
from kvflow.subscribers.settings import ObservabilitySettings
from kvflow.subscribers.tiers import TierStats
from kvflow.subscribers.tracing import TracingSubscriber

__all__ = [
    "HistogramStore",
    "KvflowMeterProvider",
    "L0LifecycleSubscriber",
    "L1Stats",
    "LoggingSetup",
    "LoggingSubscriber",
    "MetricProducer",
    "MetricsSubscriber",
    "ObservabilityPipeline",
    "ObservabilitySettings",
    "PrometheusEndpoint",
    "TierStats",
    "TracingSubscriber",
    "build_subscribers",
    "configure_logging",
    "kvflow_resource",
    "make_meter_provider",
    "make_tracer_provider",
    "otlp_metric_reader",
    "otlp_span_exporter",
]
