"""Public testing utilities for users' own tests: in-memory metric and span capture.

`MetricsCapture` and `SpanCapture` are OpenTelemetry providers that keep what
kvflow's subscribers record in memory, so a test (kvflow's or a user's) can hand
them to `MetricsSubscriber`, `TracingSubscriber` or `L0LifecycleSubscriber` and
assert on metric points and finished spans without an exporter.
(`kvflow.events.testing.RecordingSubscriber` records the raw events.)
"""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvflow.subscribers.providers import kvflow_resource, make_meter_provider

__all__ = ["MetricsCapture", "SpanCapture"]


class MetricsCapture:
    """A MeterProvider with an in-memory reader; read points by metric name and labels.

    Labels given to the accessors select the points whose attributes contain them.
    `kvflow_provider=True` builds the provider as `build_subscribers` does
    (`make_meter_provider`: pre-aggregated L0 histograms); the default is a
    plain SDK MeterProvider, as a caller of kvflow might pass.
    """

    def __init__(self, *, kvflow_provider: bool = False) -> None:
        self.reader = InMemoryMetricReader()
        self.provider: MeterProvider = (
            make_meter_provider([self.reader])
            if kvflow_provider
            else MeterProvider(metric_readers=[self.reader], resource=kvflow_resource())
        )

    def points(self, name: str, **labels: Any) -> list[Any]:
        """Data points of metric `name` (collected now) whose attributes include `labels`."""
        data = self.reader.get_metrics_data()
        found: list[Any] = []
        if data is None:
            return found
        for resource_metrics in data.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.name == name:
                        found.extend(
                            p
                            for p in metric.data.data_points
                            if labels.items() <= dict(p.attributes or {}).items()
                        )
        return found

    def names(self) -> set[str]:
        """Names of every metric with at least one data point."""
        data = self.reader.get_metrics_data()
        if data is None:
            return set()
        return {
            m.name
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.data.data_points
        }

    def total(self, name: str, **labels: Any) -> float:
        """Sum of the values of the matching counter/gauge points (0 when none)."""
        return sum(p.value for p in self.points(name, **labels))

    def histogram(self, name: str, **labels: Any) -> HistogramDataPoint:
        """The single histogram point matching `labels` (AssertionError if not exactly one)."""
        points = self.points(name, **labels)
        assert len(points) == 1, f"{name} {labels}: expected one point, got {len(points)}"
        point: HistogramDataPoint = points[0]
        return point

    def observations(self, name: str, **labels: Any) -> int:
        """How many values the matching histogram points counted (0 when none)."""
        return sum(p.count for p in self.points(name, **labels))

    def shutdown(self) -> None:
        self.provider.shutdown()


class SpanCapture:
    """A TracerProvider exporting synchronously into memory."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(resource=kvflow_resource())
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        """Finished spans, oldest first, optionally only those called `name`."""
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]

    def shutdown(self) -> None:
        self.provider.shutdown()
