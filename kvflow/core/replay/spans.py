"""Where a replay's spans go: a JSON-lines file (`--traces`) and/or an OTLP collector.

Both are the OpenTelemetry SDK's own machinery on one TracerProvider of kvflow's
resource: the file is a `ConsoleSpanExporter` writing one JSON object per span
through a `SimpleSpanProcessor` (every span, synchronously, none dropped), the
collector the server's OTLP span exporter behind a `BatchSpanProcessor` whose
queue a replay keeps from overflowing by flushing (see `FLUSH_EVERY_EVENTS`).
"""

from __future__ import annotations

import json
from typing import IO, Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.trace import format_span_id, format_trace_id

from kvflow.subscribers import kvflow_resource, otlp_span_exporter

#: A replay flushes the tracer provider after feeding this many events to the tracing
#: subscriber. Each event ends at most one span, and a burst of expiries or the final
#: shutdown ends at most `max_pending + max_requests` (20,000 by default) more, so the
#: batch processor's queue (`OTLP_QUEUE_SPANS`) never fills and drops spans.
FLUSH_EVERY_EVENTS = 8192
OTLP_QUEUE_SPANS = 1 << 16


def span_json_line(span: ReadableSpan) -> str:
    """One span as a JSON line: ids (hex), parent, Unix-ns and ISO times, status, attributes."""
    ctx = span.context
    parent = span.parent
    doc: dict[str, Any] = {
        "name": span.name,
        "trace_id": format_trace_id(ctx.trace_id) if ctx is not None else None,
        "span_id": format_span_id(ctx.span_id) if ctx is not None else None,
        "parent_id": format_span_id(parent.span_id) if parent is not None else None,
        "kind": span.kind.name,
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "attributes": dict(span.attributes or {}),
    }
    return json.dumps(doc, separators=(",", ":")) + "\n"


def replay_tracer_provider(
    traces: IO[str] | None,
    otlp_endpoint: str | None,
    otlp_protocol: str = "grpc",
) -> TracerProvider:
    """A TracerProvider writing spans as JSON lines to `traces` and/or exporting them to
    `otlp_endpoint` (ValueError for a bad endpoint or protocol). Shut it down to flush."""
    provider = TracerProvider(resource=kvflow_resource(), shutdown_on_exit=False)
    if otlp_endpoint is not None:
        exporter = otlp_span_exporter(otlp_endpoint, otlp_protocol)
        provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=OTLP_QUEUE_SPANS))
    if traces is not None:
        provider.add_span_processor(
            SimpleSpanProcessor(ConsoleSpanExporter(out=traces, formatter=span_json_line))
        )
    return provider
