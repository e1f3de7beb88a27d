"""OpenTelemetry providers and exporters: Prometheus pull endpoint, OTLP push.

Each piece is built explicitly (no global providers, no environment lookups
beyond the SDK's own), so a process can run several pipelines and tests can
start and stop them without leaking ports or threads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from urllib.parse import urlsplit
from wsgiref.simple_server import WSGIServer

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from prometheus_client import CollectorRegistry, start_http_server

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


def make_meter_provider(readers: Sequence[MetricReader]) -> MeterProvider:
    """A MeterProvider for kvflow's resource; exemplars are off (no spans on bus threads).

    No atexit hook: the pipeline shuts it down by its deadline, and an exit hook
    would block interpreter exit on an unreachable collector.
    """
    return MeterProvider(
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
