"""Test helpers: in-memory metric and span sinks, and an event script builder.

Shipped in the package so that tests of other packages (the engine, the server)
can assert on kvflow's metrics and spans the same way this package's tests do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvflow.events import START_TO_END, BlockAllocation, Event, EventType, next_op_id
from kvflow.subscribers.providers import kvflow_resource

_START = {
    "store": EventType.STORE_START,
    "retrieve": EventType.RETRIEVE_START,
    "lookup": EventType.LOOKUP_START,
}


class MetricsCapture:
    """A MeterProvider with an in-memory reader; read points by metric name and labels.

    Labels given to the accessors select the points whose attributes contain them.
    """

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader], resource=kvflow_resource())

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


class EventScript:
    """Builds an event sequence with explicit times, given in seconds after `base_ns`."""

    def __init__(self, base_ns: int = 1_000_000_000_000) -> None:
        self.base_ns = base_ns
        self.events: list[Event] = []

    def ts(self, at_s: float) -> int:
        return self.base_ns + round(at_s * 1e9)

    def add(
        self,
        etype: EventType,
        at_s: float,
        session_id: str | None = None,
        op_id: int | None = None,
        **attrs: Any,
    ) -> Event:
        """Append one event and return it."""
        event = Event(etype, self.ts(at_s), session_id, op_id, attrs)
        self.events.append(event)
        return event

    def start(
        self, operation: str, at_s: float, session_id: str | None = None, **attrs: Any
    ) -> int:
        """Append the START of `operation` (store, retrieve, lookup); returns its op_id."""
        op_id = next_op_id()
        self.add(_START[operation], at_s, session_id, op_id, **attrs)
        return op_id

    def end(
        self, operation: str, op_id: int, at_s: float, session_id: str | None = None, **attrs: Any
    ) -> Event:
        """Append the END of `operation` for `op_id` (attrs default to ok=True, error=None)."""
        attrs.setdefault("ok", attrs.get("error") is None)
        attrs.setdefault("error", None)
        return self.add(START_TO_END[_START[operation]], at_s, session_id, op_id, **attrs)

    def op(
        self,
        operation: str,
        start_s: float,
        end_s: float,
        session_id: str | None = None,
        start_attrs: dict[str, Any] | None = None,
        **end_attrs: Any,
    ) -> int:
        """Append a START/END pair; returns the op_id."""
        op_id = self.start(operation, start_s, session_id, **(start_attrs or {}))
        self.end(operation, op_id, end_s, session_id, **end_attrs)
        return op_id

    def allocate(
        self,
        at_s: float,
        *records: tuple[str, Sequence[int], Sequence[int]],
        instance_id: str = "inst0",
        model_name: str = "model",
        block_size: int = 16,
    ) -> Event:
        """Append a BLOCK_ALLOCATION of `records` (req_id, block_ids, token_ids)."""
        return self.add(
            EventType.BLOCK_ALLOCATION,
            at_s,
            instance_id=instance_id,
            model_name=model_name,
            block_size=block_size,
            records=[BlockAllocation(*r) for r in records],
        )

    def end_session(self, at_s: float, session_id: str) -> Event:
        return self.add(EventType.END_SESSION, at_s, session_id)
