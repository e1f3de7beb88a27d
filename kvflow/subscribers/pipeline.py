"""`build_subscribers`: subscribers, providers and exporters from one config.

The returned `ObservabilityPipeline` owns what it built; `shutdown(timeout)`
stops the bus (delivering every admitted event), then flushes and closes the
exporters, all by one shared deadline, gathering every component's error.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.trace import TracerProvider

from kvflow.events import EventBus, Subscriber
from kvflow.events.deadline import run_by_deadline
from kvflow.subscribers.eventlog import EventLogSubscriber
from kvflow.subscribers.l0 import L0LifecycleSubscriber
from kvflow.subscribers.logs import LoggingSetup, LoggingSubscriber, configure_logging
from kvflow.subscribers.metrics import L1Stats, MetricsSubscriber
from kvflow.subscribers.providers import (
    PrometheusEndpoint,
    make_meter_provider,
    make_tracer_provider,
    otlp_metric_reader,
    otlp_span_exporter,
)
from kvflow.subscribers.settings import EventLogSettings, ObservabilitySettings
from kvflow.subscribers.tiers import TierStats
from kvflow.subscribers.tracing import TracingSubscriber


class ObservabilityPipeline:
    """The subscribers of one process and the providers/exporters feeding their output out.

    Providers passed in by the caller are flushed but never shut down; those
    built here are shut down. `shutdown` and `force_flush` never raise: they
    return False and append to `errors` when a component fails or misses the
    deadline. Usable as a context manager.
    """

    def __init__(
        self,
        subscribers: Sequence[Subscriber],
        *,
        bus: EventBus | None = None,
        meter_provider: MeterProvider | None = None,
        tracer_provider: TracerProvider | None = None,
        owns_meter_provider: bool = False,
        owns_tracer_provider: bool = False,
        prometheus: PrometheusEndpoint | None = None,
        logging_setup: LoggingSetup | None = None,
    ) -> None:
        self.subscribers: tuple[Subscriber, ...] = tuple(subscribers)
        self.bus = bus
        self.meter_provider = meter_provider
        self.tracer_provider = tracer_provider
        self.prometheus = prometheus
        self._owns_meter = owns_meter_provider
        self._owns_tracer = owns_tracer_provider
        self._logging = logging_setup
        self._lock = threading.Lock()
        self._closed = False
        self.errors: list[BaseException] = []

    def add_tracing(self, tracer_provider: TracerProvider, ttl_s: float) -> None:
        """Trace through `tracer_provider`: adopt it and add a TracingSubscriber on it."""
        self.tracer_provider = tracer_provider
        self.subscribers += (
            TracingSubscriber(tracer_provider, ttl_s=ttl_s, meter_provider=self.meter_provider),
        )

    def subscriber(self, name: str) -> Subscriber | None:
        """The subscriber called `name` (metrics, l0_lifecycle, tracing, logging), if built."""
        return next((s for s in self.subscribers if s.name == name), None)

    def force_flush(self, timeout: float = 5.0) -> bool:
        """Deliver what the bus holds, then push every exporter's data, by one deadline."""
        deadline = time.monotonic() + timeout
        ok = True
        if self.bus is not None and self.bus.running:
            ok = self.bus.flush(timeout)
            if not ok:
                self.errors.append(TimeoutError("bus flush passed the deadline"))
        ms = _ms_left(deadline)
        tasks: list[tuple[str, Callable[[], object]]] = []
        if self.meter_provider is not None:
            mp = self.meter_provider
            tasks.append(("meter provider flush", lambda: mp.force_flush(timeout_millis=ms)))
        if self.tracer_provider is not None:
            tp = self.tracer_provider
            tasks.append(("tracer provider flush", lambda: tp.force_flush(timeout_millis=int(ms))))
        return self._run_all(tasks, deadline) and ok

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Stop the bus, flush and close exporters, free the port; idempotent. True if clean."""
        with self._lock:
            if self._closed:
                return not self.errors
            self._closed = True
        deadline = time.monotonic() + timeout
        if self.bus is not None and not self.bus.stop(timeout):
            self.errors.extend(self.bus.shutdown_errors)
        ms = _ms_left(deadline)
        tasks: list[tuple[str, Callable[[], object]]] = []
        mp, tp = self.meter_provider, self.tracer_provider
        if mp is not None:
            if self._owns_meter:
                tasks.append(("meter provider shutdown", lambda: mp.shutdown(timeout_millis=ms)))
            else:
                tasks.append(("meter provider flush", lambda: mp.force_flush(timeout_millis=ms)))
        if tp is not None:
            tasks.append(("tracer provider flush", lambda: tp.force_flush(timeout_millis=int(ms))))
        clean = self._run_all(tasks, deadline)
        if tp is not None and self._owns_tracer:
            clean = self._run_all([("tracer provider shutdown", tp.shutdown)], deadline) and clean
        if self.prometheus is not None:
            self.prometheus.close()
        if self._logging is not None:
            self._logging.close()
        return clean and not self.errors

    def _run_all(self, tasks: list[tuple[str, Callable[[], object]]], deadline: float) -> bool:
        """Run tasks concurrently; a task that raises, returns False or outlives `deadline` fails."""
        clean = True
        for name, outcome in run_by_deadline(tasks, deadline).items():
            if isinstance(outcome, BaseException):
                clean = False
                self.errors.append(RuntimeError(f"{name} failed: {outcome!r}"))
            elif outcome is False:
                clean = False
                self.errors.append(RuntimeError(f"{name} did not complete"))
        return clean

    def __enter__(self) -> ObservabilityPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _ms_left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0) * 1000.0


def build_subscribers(
    config: ObservabilitySettings,
    *,
    bus: EventBus | None = None,
    meter_provider: MeterProvider | None = None,
    tracer_provider: TracerProvider | None = None,
    l1_stats: L1Stats | None = None,
    tier_stats: TierStats | None = None,
    configure_root_logging: bool = True,
    log_stream: IO[str] | None = None,
) -> ObservabilityPipeline:
    """Build the subscribers `config` asks for, register them on `bus` (if given).

    Metrics go to a MeterProvider built with a Prometheus endpoint (unless
    prometheus_port is 0) and an OTLP reader (if otlp_endpoint is set), or to
    `meter_provider` if given; spans likewise to OTLP or `tracer_provider`.
    `l1_stats` / `tier_stats` feed the L1 and per-tier L2 occupancy gauges
    (None: no such gauges). `configure_root_logging` renders every library's
    logs like kvflow's.
    """
    pipeline = ObservabilityPipeline([], bus=bus)
    if not config.enabled:
        return pipeline
    try:
        _populate(pipeline, config, meter_provider, tracer_provider, l1_stats, tier_stats)
        if config.logging_enabled:
            if configure_root_logging:
                pipeline._logging = configure_logging(
                    config.log_level, config.log_format, stream=log_stream
                )
            pipeline.subscribers += (LoggingSubscriber(bus=bus),)
        event_log = _event_log(config, tier_stats)
        if event_log is not None:
            pipeline.subscribers += (event_log,)
    except BaseException:
        pipeline.bus = None  # the caller's bus is not ours to stop on a failed build
        pipeline.shutdown(timeout=1.0)
        raise
    if bus is not None:
        for subscriber in pipeline.subscribers:
            bus.register(subscriber)
    return pipeline


def _populate(
    pipeline: ObservabilityPipeline,
    config: ObservabilitySettings,
    meter_provider: MeterProvider | None,
    tracer_provider: TracerProvider | None,
    l1_stats: L1Stats | None,
    tier_stats: TierStats | None,
) -> None:
    """Create providers/exporters and the metric and tracing subscribers on `pipeline`."""
    if config.metrics_enabled and meter_provider is None:
        readers: list[MetricReader] = []
        if config.prometheus_port:
            pipeline.prometheus = PrometheusEndpoint(config.prometheus_host, config.prometheus_port)
            readers.append(pipeline.prometheus.reader)
        if config.otlp_endpoint:
            readers.append(
                otlp_metric_reader(
                    config.otlp_endpoint, config.otlp_protocol, config.export_interval_s
                )
            )
        if readers:
            meter_provider = make_meter_provider(readers)
            pipeline._owns_meter = True
    if config.metrics_enabled and meter_provider is not None:
        pipeline.meter_provider = meter_provider
        pipeline.subscribers += (
            MetricsSubscriber(
                meter_provider,
                bus=pipeline.bus,
                l1_stats=l1_stats,
                tier_stats=tier_stats,
                pending_ttl_s=config.tracing_ttl_s,
                max_label_values=config.max_label_values,
            ),
            L0LifecycleSubscriber(
                meter_provider,
                config.l0_sample_rate,
                config.sample_seed,
                max_label_values=config.max_label_values,
            ),
        )
        if pipeline.prometheus is not None:
            _start_prometheus(pipeline.prometheus)
    if config.tracing_enabled:
        if tracer_provider is None:
            if not config.otlp_endpoint:
                raise ValueError(
                    "--enable-tracing requires --otlp-endpoint (an OTLP collector URL)"
                )
            tracer_provider = make_tracer_provider(
                otlp_span_exporter(config.otlp_endpoint, config.otlp_protocol)
            )
            pipeline._owns_tracer = True
        pipeline.add_tracing(tracer_provider, config.tracing_ttl_s)


def _event_log(
    config: ObservabilitySettings, tier_stats: TierStats | None = None
) -> EventLogSubscriber | None:
    """The event log subscriber when the settings name a directory (`--event-log`);
    its headers record the disk L2 tier's capacity when `tier_stats` has a "disk" one.

    Read with getattr: settings objects written before the event log existed
    (duck-typed `ObservabilitySettings`) simply build none.
    """
    directory = getattr(config, "event_log_dir", None)
    if not directory:
        return None
    settings: EventLogSettings = config  # type: ignore[assignment]
    return EventLogSubscriber(
        directory,
        max_mb=settings.event_log_max_mb,
        segment_mb=settings.event_log_segment_mb,
        fsync=settings.event_log_fsync,
        l0_sample_rate=config.l0_sample_rate,
        sample_seed=config.sample_seed,
        l2_disk_bytes=_disk_capacity(tier_stats),
    )


def _disk_capacity(tier_stats: TierStats | None) -> int | None:
    """The "disk" tier's `capacity_bytes` in `tier_stats`, or None."""
    disk = tier_stats().get("disk") if tier_stats is not None else None
    capacity = disk.get("capacity_bytes") if disk is not None else None
    return int(capacity) if capacity else None


def _start_prometheus(endpoint: PrometheusEndpoint) -> None:
    """Start the scrape endpoint; if it cannot listen, one OSError line naming the flag.

    The usual cause is a second server on the same host: its message says how to
    pick another port or turn the endpoint off (the original error is the cause).
    """
    try:
        endpoint.start()
    except OSError as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
        reason = cause.strerror or str(cause)
        host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
        hint = (
            "another server may be using it: pass --prometheus-port with a free port,"
            if cause.errno == errno.EADDRINUSE
            else "check --prometheus-host and --prometheus-port, or pass --prometheus-port"
        )
        raise OSError(
            f"the metrics endpoint cannot listen on {host}:{endpoint.port} ({reason}); {hint}"
            " or 0 to turn it off"
        ) from exc
