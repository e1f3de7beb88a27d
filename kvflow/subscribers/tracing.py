"""Spans rebuilt from events: a root span per request, a child per operation.

A child span is created when its END arrives, with the START's and END's own
timestamps converted to epoch time, so spans show when work happened, not when
the bus delivered it. Pending STARTs and open requests are bounded and expire
after a TTL measured in event time. Background operations (L2 stores and loads,
prefetches) may outlive their request: one whose request recently ended joins
the ended request's trace rather than opening a new root span for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import Span, Status, StatusCode, TracerProvider

from kvflow.events import END_TO_START, START_TO_END, Event, EventType, monotonic_to_epoch_ns
from kvflow.subscribers.expiry import drain_expired

_ET = EventType
_SPAN_NAME = {
    _ET.STORE_START: "kvflow.store",
    _ET.RETRIEVE_START: "kvflow.retrieve",
    _ET.LOOKUP_START: "kvflow.lookup",
    _ET.BLEND_LOOKUP_START: "kvflow.blend_lookup",
    _ET.BLEND_RETRIEVE_START: "kvflow.blend_retrieve",
    _ET.L2_STORE_START: "kvflow.l2_store",
    _ET.L2_LOAD_START: "kvflow.l2_load",
    _ET.PREFETCH_START: "kvflow.prefetch",
}
#: Operations that run beside their request rather than within its API call.
_BACKGROUND = frozenset({_ET.L2_STORE_START, _ET.L2_LOAD_START, _ET.PREFETCH_START})
_ATTR_TYPES = (str, bool, int, float)


class _Start:
    """A START waiting for its END."""

    __slots__ = ("attrs", "session_id", "ts", "type")

    def __init__(self, ev: Event) -> None:
        self.ts = ev.ts_ns
        self.type = ev.type
        self.session_id = ev.session_id
        self.attrs = ev.attrs


class _Request:
    """An open request: its root span, the context children attach to, its last event time."""

    __slots__ = ("context", "last_ts", "span")

    def __init__(self, span: Span, ts: int) -> None:
        self.span = span
        self.context: Context = trace.set_span_in_context(span)
        self.last_ts = ts


class _Ended:
    """A request whose root span ended: background operations may still join its trace.

    Only the span's ids are kept, not the ended span (its attributes and all).
    """

    __slots__ = ("span_context", "ts")

    def __init__(self, span: Span, ts: int) -> None:
        self.span_context = span.get_span_context()
        self.ts = ts

    def context(self) -> Context:
        return trace.set_span_in_context(trace.NonRecordingSpan(self.span_context))


class TracingSubscriber:
    """Emits `kvflow.request` root spans with `kvflow.{store,retrieve,lookup,blend_lookup,
    blend_retrieve,l2_store,l2_load,prefetch}` children.

    A START without its END for `ttl_s` of event time (or pushed out by
    `max_pending`) ends as an ERROR span with attribute `kvflow.expired`; a
    request idle for `ttl_s` (or pushed out by `max_requests`) has its root span
    ended at its last event. `expired` counts the expired operation spans.
    """

    name = "tracing"
    event_types: frozenset[EventType] | None = frozenset(
        {*START_TO_END, *END_TO_START, _ET.END_SESSION}
    )

    def __init__(
        self,
        tracer_provider: TracerProvider,
        *,
        ttl_s: float = 300.0,
        max_pending: int = 10_000,
        max_requests: int = 10_000,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        for field, value in (("max_pending", max_pending), ("max_requests", max_requests)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")
        self._tracer = tracer_provider.get_tracer("kvflow")
        self._ttl_ns = int(ttl_s * 1e9)
        self._max_pending = max_pending
        self._max_requests = max_requests
        self._starts: dict[int, _Start] = {}
        self._requests: dict[str, _Request] = {}
        self._ended: dict[str, _Ended] = {}
        self.expired = 0
        self._expired_counter = None
        if meter_provider is not None:
            self._expired_counter = (
                meter_provider.get_meter("kvflow.tracing")
                .create_counter(
                    "kvflow.tracing.expired_spans",
                    unit="{span}",
                    description="Operation spans ended without an END (TTL, bound or shutdown)",
                )
                .add
            )

    @property
    def pending_operations(self) -> int:
        return len(self._starts)

    @property
    def open_requests(self) -> int:
        return len(self._requests)

    def on_events(self, events: Sequence[Event]) -> None:
        """Pair STARTs with ENDs by op_id; END_SESSION closes the request's root span."""
        latest = 0
        for ev in events:
            etype = ev.type
            latest = max(latest, ev.ts_ns)
            if etype in START_TO_END:
                if ev.op_id is None:
                    continue
                self._starts[ev.op_id] = _Start(ev)
                if ev.session_id is not None and not self._after_end(etype, ev.session_id):
                    self._touch(ev.session_id, ev.ts_ns)
            elif etype in END_TO_START:
                start = None if ev.op_id is None else self._starts.pop(ev.op_id, None)
                self._finish(start, ev)
            elif etype is _ET.END_SESSION:  # other types (fed directly, not by the bus) are ignored
                self._end_request(ev.session_id, ev.ts_ns)
        self._expire(latest)

    # -- requests ---------------------------------------------------------------------

    def _touch(self, session_id: str, ts: int) -> _Request:
        """The request's open root span (started at `ts` if new), moved to most recent."""
        request = self._requests.pop(session_id, None)
        if request is None:
            span = self._tracer.start_span(
                "kvflow.request",
                context=Context(),
                start_time=monotonic_to_epoch_ns(ts),
                attributes={"kvflow.session_id": session_id},
            )
            request = _Request(span, ts)
        request.last_ts = max(request.last_ts, ts)
        self._requests[session_id] = request
        return request

    def _end_request(self, session_id: str | None, ts: int) -> None:
        if session_id is None:
            return
        request = self._requests.pop(session_id, None)
        if request is not None:
            self._close(session_id, request, ts)

    def _close(self, session_id: str, request: _Request, ts: int, *, expired: bool = False) -> None:
        """End the root span; remember its context for background operations still running."""
        _close_request(request, ts, expired=expired)
        self._ended.pop(session_id, None)
        self._ended[session_id] = _Ended(request.span, max(ts, request.last_ts))

    def _after_end(self, etype: EventType, session_id: str) -> bool:
        """A background op of a request that ended (and was not reopened): it joins the
        ended trace and neither reopens nor extends the request."""
        return (
            etype in _BACKGROUND and session_id in self._ended and session_id not in self._requests
        )

    # -- operations ---------------------------------------------------------------------

    def _finish(self, start: _Start | None, end: Event) -> None:
        """Emit the child span for an END (zero-length and flagged if its START was lost)."""
        start_type = END_TO_START[end.type]
        session_id = end.session_id if start is None else start.session_id
        attributes = _span_attributes(None if start is None else start.attrs, end.attrs)
        attributes["kvflow.op_id"] = end.op_id if end.op_id is not None else -1
        if start is None:
            attributes["kvflow.start_missing"] = True
        start_ts = end.ts_ns if start is None else start.ts
        span = self._start_span(start_type, session_id, start_ts, attributes)
        if session_id is not None and not self._after_end(start_type, session_id):
            self._touch(session_id, end.ts_ns)
        error = end.attrs.get("error")
        if error is not None or end.attrs.get("ok") is False:
            message = end.attrs.get("error_message")
            text = f"{error}: {message}" if error and message else (error or message)
            span.set_status(Status(StatusCode.ERROR, str(text or "operation failed")))
        span.end(end_time=monotonic_to_epoch_ns(max(end.ts_ns, start_ts)))

    def _start_span(
        self,
        etype: EventType,
        session_id: str | None,
        ts: int,
        attributes: dict[str, Any],
        *,
        open_root: bool = True,
    ) -> Span:
        """Start an op span under its request's root (opened if needed and `open_root`).

        A background op of a request that ended recently joins the ended trace.
        """
        context = Context()
        if session_id is not None:
            if etype in _BACKGROUND:
                attributes["kvflow.session_id"] = session_id
            request = self._requests.get(session_id)
            if request is not None:
                context = request.context
            elif etype in _BACKGROUND and (ended := self._ended.get(session_id)) is not None:
                context = ended.context()
            elif open_root:
                context = self._touch(session_id, ts).context
        return self._tracer.start_span(
            _SPAN_NAME[etype],
            context=context,
            start_time=monotonic_to_epoch_ns(ts),
            attributes=attributes,
        )

    def _give_up(self, op_id: int, start: _Start, end_ts: int, reason: str) -> None:
        attributes = _span_attributes(start.attrs, None)
        attributes["kvflow.op_id"] = op_id
        attributes["kvflow.expired"] = True
        span = self._start_span(start.type, start.session_id, start.ts, attributes, open_root=False)
        span.set_status(Status(StatusCode.ERROR, f"no END event: {reason}"))
        span.end(end_time=monotonic_to_epoch_ns(end_ts))
        self.expired += 1
        if self._expired_counter is not None:
            self._expired_counter(1, {"operation": _SPAN_NAME[start.type].removeprefix("kvflow.")})

    def _expire(self, latest_ns: int) -> None:
        """End STARTs and requests older than the TTL (event time) or beyond their bounds."""
        horizon = latest_ns - self._ttl_ns
        for op_id, start in drain_expired(self._starts, horizon, self._max_pending, _start_ts):
            overflow = start.ts >= horizon
            reason = "pending bound reached" if overflow else "TTL passed"
            self._give_up(op_id, start, latest_ns if overflow else start.ts + self._ttl_ns, reason)
        for session_id, request in drain_expired(
            self._requests, horizon, self._max_requests, _last_ts
        ):
            self._close(session_id, request, request.last_ts, expired=True)
        for _ in drain_expired(self._ended, horizon, self._max_requests, _ended_ts):
            pass  # forgotten: a later background op of that request opens a new root

    def shutdown(self) -> None:
        """End every pending operation (ERROR, expired) and every open request span."""
        for op_id, start in list(self._starts.items()):
            last = self._requests.get(start.session_id or "")
            self._give_up(op_id, start, max(start.ts, last.last_ts if last else 0), "shutdown")
        self._starts.clear()
        for request in self._requests.values():
            _close_request(request, request.last_ts, expired=True)
        self._requests.clear()
        self._ended.clear()


def _close_request(request: _Request, ts: int, *, expired: bool = False) -> None:
    """End a request's root span (flagged when it expired rather than ended)."""
    if expired:
        request.span.set_attribute("kvflow.expired", True)
    request.span.end(end_time=monotonic_to_epoch_ns(max(ts, request.last_ts)))


def _start_ts(start: _Start) -> int:
    return start.ts


def _last_ts(request: _Request) -> int:
    return request.last_ts


def _ended_ts(ended: _Ended) -> int:
    return ended.ts


def _span_attributes(
    start: Mapping[str, Any] | None, end: Mapping[str, Any] | None
) -> dict[str, Any]:
    """`kvflow.<attr>` for every scalar attr; END values win, START tokens stay as requested.

    A mapping attr (LOOKUP_END `hit_tokens_by_tier`, BLEND_LOOKUP_END
    `blend_hit_tokens_by_tier`) gives `kvflow.<attr>.<key>` per scalar value.
    """
    attributes: dict[str, Any] = {}
    if start is not None:
        _copy_attrs(start, attributes)
        if "tokens" in start:
            attributes["kvflow.requested_tokens"] = start["tokens"]
    if end is not None:
        _copy_attrs(end, attributes)
    return attributes


def _copy_attrs(attrs: Mapping[str, Any], attributes: dict[str, Any]) -> None:
    for key, value in attrs.items():
        if isinstance(value, _ATTR_TYPES):
            attributes[f"kvflow.{key}"] = value
        elif isinstance(value, Mapping):
            for inner, item in value.items():
                if isinstance(item, _ATTR_TYPES):
                    attributes[f"kvflow.{key}.{inner}"] = item
