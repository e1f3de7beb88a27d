"""OpenTelemetry providers and exporters: Prometheus pull endpoint, OTLP push.

Each piece is built explicitly (no global providers, no environment lookups
beyond the SDK's own), so a process can run several pipelines and tests can
start and stop them without leaking ports or threads. kvflow's MeterProvider
also collects pre-aggregated metrics from producers (see preaggregated.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol
from urllib.parse import urlsplit
from wsgiref.simple_server import WSGIServer

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, ExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.view import View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from prometheus_client import CollectorRegistry, start_http_server

_logger = logging.getLogger(__name__)

OTLP_PROTOCOLS = ("grpc", "http")
SERVICE_NAME = "kvflow"


def kvflow_resource() -> Resource:
    """The resource every kvflow exporter reports (service.name = kvflow)."""
    return Resource.create({"service.name": SERVICE_NAME})


class PrometheusEndpoint:
    """A Prometheus scrape endpoint: an OTel reader on a private registry, served over HTTP.

    Create it, give `reader` to the MeterProvider, then `start()`; `close()`
    stops the HTTP server and frees the port. `port=0` binds a free port
    (read it back from `port` after `start()`).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 9464) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"prometheus port must be an integer in 0..65535, got {port!r}")
        self.host = host
        self.port = port
        self.registry = CollectorRegistry()
        # no otel_scope_* labels: every kvflow metric name is unique across its meters
        self.reader = PrometheusMetricReader(registry=self.registry, scope_info_enabled=False)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The scrape URL, e.g. http://127.0.0.1:9464/metrics."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> PrometheusEndpoint:
        """Listen on host:port (OSError naming the address if it cannot)."""
        try:
            server, thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        except OSError as exc:
            raise OSError(
                exc.errno, f"prometheus endpoint cannot listen on {self.host}:{self.port}: {exc}"
            ) from exc
        self._server, self._thread = server, thread
        self.port = server.server_address[1]
        return self

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


def _otlp_url(endpoint: str, protocol: str, signal: str) -> str:
    """Normalise an OTLP endpoint: plaintext unless https://; HTTP gets /v1/<signal> if bare."""
    if protocol not in OTLP_PROTOCOLS:
        raise ValueError(
            f"otlp protocol must be one of {', '.join(OTLP_PROTOCOLS)}, got {protocol!r}"
        )
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"otlp endpoint must look like http://host:port, got {endpoint!r}")
    if protocol == "http" and parts.path in ("", "/"):
        url = f"{parts.scheme}://{parts.netloc}/v1/{signal}"
    return url


def otlp_metric_reader(endpoint: str, protocol: str, interval_s: float) -> MetricReader:
    """A reader pushing metrics every `interval_s` to an OTLP collector (gRPC or HTTP)."""
    url = _otlp_url(endpoint, protocol, "metrics")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # type: ignore[assignment]
            OTLPMetricExporter,
        )
    return PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=url), export_interval_millis=interval_s * 1000.0
    )


def otlp_span_exporter(endpoint: str, protocol: str) -> SpanExporter:
    """An exporter pushing spans to an OTLP collector (gRPC or HTTP)."""
    url = _otlp_url(endpoint, protocol, "traces")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    return OTLPSpanExporter(endpoint=url)


class MetricProducer(Protocol):
    """A source of pre-aggregated metric data (the OpenTelemetry spec's MetricProducer)."""

    def produce(self) -> Sequence[ScopeMetrics]:
        """The producer's metrics as of now; called once per collection of every reader."""
        ...


class KvflowMeterProvider(MeterProvider):
    """An SDK MeterProvider whose readers also collect the metrics of registered producers.

    The Python SDK has no MetricProducer, so each reader's collect callback (the
    private hook MeterProvider itself sets) is pointed at a wrapper: the SDK's own
    collection, then every producer's ScopeMetrics under the provider's resource.
    Producers' metrics bypass Views and the readers' temporality and aggregation
    preferences: they arrive as the producer built them.
    """

    def __init__(
        self,
        metric_readers: Sequence[MetricReader] = (),
        resource: Resource | None = None,
        exemplar_filter: ExemplarFilter | None = None,
        shutdown_on_exit: bool = True,
        views: Sequence[View] = (),
    ) -> None:
        if not callable(getattr(MetricReader, "_set_collect_callback", None)):
            raise _hooks_missing("MetricReader._set_collect_callback")
        super().__init__(
            metric_readers=metric_readers,
            resource=resource,
            exemplar_filter=exemplar_filter,
            shutdown_on_exit=shutdown_on_exit,
            views=views,
        )
        consumer = getattr(self, "_measurement_consumer", None)
        if not callable(getattr(consumer, "collect", None)):
            raise _hooks_missing("MeterProvider._measurement_consumer.collect")
        if not isinstance(getattr(getattr(self, "_sdk_config", None), "resource", None), Resource):
            raise _hooks_missing("MeterProvider._sdk_config.resource")
        self._producers: tuple[MetricProducer, ...] = ()
        self._producers_lock = threading.Lock()
        for reader in metric_readers:
            self._route(reader)

    def add_producer(self, producer: MetricProducer) -> None:
        """Include `producer`'s metrics in every later collection of every reader."""
        with self._producers_lock:
            self._producers = (*self._producers, producer)

    def add_metric_reader(self, metric_reader: MetricReader) -> None:
        """Register a reader as the SDK does, then route its collections through producers."""
        super().add_metric_reader(metric_reader)
        # the SDK skips (with a warning) a reader registered before: only re-point one it took
        if getattr(metric_reader, "_collect", None) == self._measurement_consumer.collect:
            self._route(metric_reader)

    def _route(self, reader: MetricReader) -> None:
        """Point `reader`'s collections at `_collect` instead of the SDK's consumer."""
        # the SDK annotates the callback's 2nd argument as a temporality; it passes timeout_millis
        reader._set_collect_callback(self._collect)  # type: ignore[arg-type]

    def _collect(self, reader: MetricReader, timeout_millis: float = 10_000) -> MetricsData | None:
        """The SDK's collection for `reader`, with every producer's scopes merged in."""
        data = self._measurement_consumer.collect(reader, timeout_millis=timeout_millis)
        produced: list[ScopeMetrics] = []
        for producer in self._producers:
            try:
                produced.extend(producer.produce())
            except Exception:  # one broken producer must not cost the SDK's metrics
                _logger.exception("metric producer %r failed; its metrics are skipped", producer)
        if not produced:
            return data
        return _merge(data, self._sdk_config.resource, produced)


def _hooks_missing(hook: str) -> RuntimeError:
    """The error for an SDK without a private hook KvflowMeterProvider needs (fail early)."""
    return RuntimeError(
        f"this opentelemetry-sdk lacks {hook}, which KvflowMeterProvider relies on; "
        "install the opentelemetry-sdk version range pinned in kvflow's pyproject.toml"
    )


def _merge(
    data: MetricsData | None, resource: Resource, produced: list[ScopeMetrics]
) -> MetricsData:
    """`data` with `produced` added to `resource`'s entry (a scope's metrics join its entry)."""
    resource_metrics = list(data.resource_metrics) if data is not None else []
    index = next((i for i, rm in enumerate(resource_metrics) if rm.resource == resource), None)
    if index is None:
        resource_metrics.append(
            ResourceMetrics(
                resource=resource, scope_metrics=produced, schema_url=resource.schema_url
            )
        )
        return MetricsData(resource_metrics=resource_metrics)
    target = resource_metrics[index]
    scopes = list(target.scope_metrics)
    for extra in produced:
        at = next((i for i, sm in enumerate(scopes) if sm.scope == extra.scope), None)
        if at is None:
            scopes.append(extra)
        else:
            scopes[at] = ScopeMetrics(
                scope=extra.scope,
                metrics=[*scopes[at].metrics, *extra.metrics],
                schema_url=scopes[at].schema_url,
            )
    resource_metrics[index] = ResourceMetrics(
        resource=target.resource, scope_metrics=scopes, schema_url=target.schema_url
    )
    return MetricsData(resource_metrics=resource_metrics)


def make_meter_provider(readers: Sequence[MetricReader]) -> KvflowMeterProvider:
    """A KvflowMeterProvider for kvflow's resource; exemplars are off (no spans on bus threads).

    No atexit hook: the pipeline shuts it down by its deadline, and an exit hook
    would block interpreter exit on an unreachable collector.
    """
    return KvflowMeterProvider(
        metric_readers=list(readers),
        resource=kvflow_resource(),
        exemplar_filter=AlwaysOffExemplarFilter(),
        shutdown_on_exit=False,
    )


def make_tracer_provider(exporter: SpanExporter) -> TracerProvider:
    """A TracerProvider batching spans to `exporter` (no atexit hook, as above)."""
    provider = TracerProvider(resource=kvflow_resource(), shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
