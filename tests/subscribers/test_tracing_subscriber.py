"""TracingSubscriber: request root spans, op_id-paired child spans, expiry, bounds."""

from __future__ import annotations

import pytest
from opentelemetry.trace import StatusCode

from kvflow.events import EventType, monotonic_to_epoch_ns
from kvflow.subscribers import TracingSubscriber
from kvflow.subscribers.testing import MetricsCapture, SpanCapture
from tests.support.event_script import EventScript

STORE = {"instance_id": "gpu0", "model_name": "llama"}


@pytest.fixture
def spans() -> SpanCapture:
    capture = SpanCapture()
    yield capture
    capture.shutdown()


def test_request_span_with_operation_children(spans: SpanCapture) -> None:
    """Each op is a child of its request's root span, timed by its own events' timestamps."""
    sub = TracingSubscriber(spans.provider)
    s = EventScript()
    s.op("lookup", 0.0, 0.001, "req-1", start_attrs={"model_name": "llama", "tokens": 512},
         model_name="llama", requested_tokens=512, hit_tokens=256)  # fmt: skip
    s.op("retrieve", 0.002, 0.010, "req-1", start_attrs={**STORE, "tokens": 256},
         **STORE, tokens=256, bytes=4096)  # fmt: skip
    store_op = s.op("store", 0.5, 0.75, "req-1", start_attrs={**STORE, "tokens": 512},
                    **STORE, tokens=256, bytes=4096)  # fmt: skip
    s.end_session(1.0, "req-1")
    sub.on_events(s.events)

    (root,) = spans.spans("kvflow.request")
    assert root.attributes["kvflow.session_id"] == "req-1"
    assert root.start_time == monotonic_to_epoch_ns(s.ts(0.0))
    assert root.end_time == monotonic_to_epoch_ns(s.ts(1.0))
    children = {sp.name: sp for sp in spans.spans() if sp.parent is not None}
    assert set(children) == {"kvflow.lookup", "kvflow.retrieve", "kvflow.store"}
    for child in children.values():
        assert child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
        assert child.status.status_code is StatusCode.UNSET
    store = children["kvflow.store"]
    assert store.start_time == monotonic_to_epoch_ns(s.ts(0.5))
    assert store.end_time == monotonic_to_epoch_ns(s.ts(0.75))
    assert store.attributes["kvflow.op_id"] == store_op
    assert store.attributes["kvflow.requested_tokens"] == 512
    assert store.attributes["kvflow.tokens"] == 256
    assert store.attributes["kvflow.bytes"] == 4096
    assert store.attributes["kvflow.instance_id"] == "gpu0"
    assert store.attributes["kvflow.ok"] is True
    assert children["kvflow.lookup"].attributes["kvflow.hit_tokens"] == 256


def test_failed_operation_is_an_error_span(spans: SpanCapture) -> None:
    """An END reporting an error gives its span ERROR status with the error's text."""
    sub = TracingSubscriber(spans.provider)
    s = EventScript()
    s.op("retrieve", 0.0, 0.1, "r", start_attrs=STORE, **STORE, tokens=0, bytes=0, ok=False,
         error="chunk_missing", error_message="chunk 3 evicted")  # fmt: skip
    sub.on_events(s.events)
    (span,) = spans.spans("kvflow.retrieve")
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "chunk_missing: chunk 3 evicted"


def test_unmatched_start_expires_as_error_span() -> None:
    """A START without END for the TTL (event time) ends as an ERROR span marked expired."""
    spans, metrics = SpanCapture(), MetricsCapture()
    sub = TracingSubscriber(spans.provider, ttl_s=30.0, meter_provider=metrics.provider)
    s = EventScript()
    s.start("store", 0.0, "r1", **STORE)
    s.op("lookup", 10.0, 10.1, "r2", model_name="llama", requested_tokens=1, hit_tokens=0)
    sub.on_events(s.events)
    assert spans.spans("kvflow.store") == []
    s.events.clear()
    s.op("lookup", 31.0, 31.1, "r2", model_name="llama", requested_tokens=1, hit_tokens=0)
    sub.on_events(s.events)
    (expired,) = spans.spans("kvflow.store")
    assert expired.status.status_code is StatusCode.ERROR
    assert expired.attributes["kvflow.expired"] is True
    assert expired.end_time - expired.start_time == 30 * 10**9
    assert sub.expired == 1
    assert metrics.total("kvflow.tracing.expired_spans", operation="store") == 1
    assert sub.pending_operations == 0
    spans.shutdown()
    metrics.shutdown()


def test_pending_starts_and_requests_are_bounded(spans: SpanCapture) -> None:
    """Beyond max_pending the oldest STARTs expire; beyond max_requests the oldest roots end."""
    sub = TracingSubscriber(spans.provider, max_pending=3, max_requests=2)
    s = EventScript()
    for i in range(5):
        s.start("store", i * 0.01, f"r{i}", **STORE)
    sub.on_events(s.events)
    assert sub.pending_operations == 3
    assert sub.open_requests == 2
    assert sub.expired == 2
    assert len(spans.spans("kvflow.store")) == 2
    assert all(sp.attributes["kvflow.expired"] for sp in spans.spans("kvflow.request"))


def test_idle_request_root_span_expires(spans: SpanCapture) -> None:
    """A request with no END_SESSION is ended at its last event once idle for the TTL."""
    sub = TracingSubscriber(spans.provider, ttl_s=5.0)
    s = EventScript()
    s.op("store", 0.0, 1.0, "forgotten", start_attrs=STORE, **STORE, tokens=1, bytes=1)
    s.op("store", 7.0, 7.5, "other", start_attrs=STORE, **STORE, tokens=1, bytes=1)
    sub.on_events(s.events)
    roots = {sp.attributes["kvflow.session_id"]: sp for sp in spans.spans("kvflow.request")}
    assert set(roots) == {"forgotten"}
    assert roots["forgotten"].end_time == monotonic_to_epoch_ns(s.ts(1.0))
    assert roots["forgotten"].attributes["kvflow.expired"] is True
    assert sub.open_requests == 1


def test_end_without_start_and_op_without_session(spans: SpanCapture) -> None:
    """An END whose START was lost is a zero-length flagged span; no session means no root."""
    sub = TracingSubscriber(spans.provider)
    s = EventScript()
    s.end("store", 777, 2.0, "r1", **STORE, tokens=1, bytes=1)
    s.op("lookup", 3.0, 3.5, None, model_name="llama", requested_tokens=1, hit_tokens=1)
    sub.on_events(s.events)
    (store,) = spans.spans("kvflow.store")
    assert store.attributes["kvflow.start_missing"] is True
    assert store.start_time == store.end_time
    (lookup,) = spans.spans("kvflow.lookup")
    assert lookup.parent is None


def test_shutdown_ends_everything_pending(spans: SpanCapture) -> None:
    """shutdown() ends open STARTs as expired ERROR spans and closes open request spans."""
    sub = TracingSubscriber(spans.provider)
    s = EventScript()
    s.start("retrieve", 0.0, "r1", **STORE)
    sub.on_events(s.events)
    sub.shutdown()
    (retrieve,) = spans.spans("kvflow.retrieve")
    assert retrieve.status.status_code is StatusCode.ERROR
    assert "shutdown" in retrieve.status.description
    assert len(spans.spans("kvflow.request")) == 1
    assert sub.pending_operations == sub.open_requests == 0


def test_invalid_settings_are_rejected() -> None:
    """ttl_s and the bounds are validated with a message naming the field."""
    capture = SpanCapture()
    with pytest.raises(ValueError, match="ttl_s"):
        TracingSubscriber(capture.provider, ttl_s=0)
    with pytest.raises(ValueError, match="max_pending"):
        TracingSubscriber(capture.provider, max_pending=0)
    capture.shutdown()


DISK = {"tier": "disk", "chunks": 4, "bytes": 4096}
PREFETCH = {"model_name": "llama", "world_size": 1, "chunks": 2, "tokens": 512, "trigger": "lookup"}


def test_l2_and_prefetch_spans_join_their_requests_trace(spans: SpanCapture) -> None:
    """L2 stores/loads and prefetches are spans under the request's root, with every attr.

    A background op that ends after END_SESSION still joins the ended request's
    trace, and neither reopens nor extends its root span.
    """
    sub = TracingSubscriber(spans.provider)
    s = EventScript()
    s.op("lookup", 0.0, 0.001, "req-1", start_attrs={"model_name": "llama", "tokens": 1024},
         model_name="llama", requested_tokens=1024, hit_tokens=768,
         hit_tokens_by_tier={"l1": 256, "disk": 512})  # fmt: skip
    prefetch = s.op("prefetch", 0.001, 0.02, "req-1", start_attrs=PREFETCH, **PREFETCH,
                    loaded_chunks=2, written_back_chunks=1, discarded_chunks=1)  # fmt: skip
    load = {**DISK, "reason": "prefetch"}
    s.op("l2_load", 0.002, 0.019, "req-1", start_attrs=load, **load, loaded_chunks=2,
         loaded_bytes=2048, failed_chunks=0)  # fmt: skip
    s.add(EventType.WRITE_BACK, 0.02, "req-1", kept=1, discarded=1, bytes=1024,
          reason="prefetch")  # fmt: skip
    store = s.start("l2_store", 0.5, "req-1", **DISK)
    s.end_session(1.0, "req-1")
    s.end("l2_store", store, 3.0, "req-1", **DISK, stored_chunks=3, stored_bytes=3072,
          present_chunks=0, failed_chunks=1)  # fmt: skip
    sub.on_events(s.events)

    (root,) = spans.spans("kvflow.request")
    assert root.end_time == monotonic_to_epoch_ns(s.ts(1.0))  # not extended by the L2 store
    assert sub.open_requests == 0  # the late END did not reopen the request
    by_name = {sp.name: sp for sp in spans.spans() if sp.name != "kvflow.request"}
    assert set(by_name) == {"kvflow.lookup", "kvflow.prefetch", "kvflow.l2_load",
                            "kvflow.l2_store"}  # fmt: skip
    for span in by_name.values():
        assert span.parent is not None and span.parent.span_id == root.context.span_id
        assert span.context.trace_id == root.context.trace_id
    late = by_name["kvflow.l2_store"]
    assert late.start_time == monotonic_to_epoch_ns(s.ts(0.5))
    assert late.end_time == monotonic_to_epoch_ns(s.ts(3.0))
    assert late.attributes["kvflow.tier"] == "disk"
    assert late.attributes["kvflow.stored_chunks"] == 3
    assert late.attributes["kvflow.failed_chunks"] == 1
    assert late.attributes["kvflow.session_id"] == "req-1"
    assert late.status.status_code is StatusCode.UNSET  # a partial failure is not an error
    pre = by_name["kvflow.prefetch"]
    assert pre.attributes["kvflow.op_id"] == prefetch
    assert pre.attributes["kvflow.trigger"] == "lookup"
    assert pre.attributes["kvflow.written_back_chunks"] == 1
    assert pre.attributes["kvflow.requested_tokens"] == 512
    assert by_name["kvflow.l2_load"].attributes["kvflow.reason"] == "prefetch"
    lookup = by_name["kvflow.lookup"].attributes
    assert (lookup["kvflow.hit_tokens_by_tier.l1"], lookup["kvflow.hit_tokens_by_tier.disk"]) == (
        256, 512)  # fmt: skip


def test_background_op_opens_its_request_unless_that_request_ended(spans: SpanCapture) -> None:
    """The engine publishes a lookup's START with its END, after the PREFETCH_START the lookup
    caused: the prefetch opens the request's root and the lookup joins it. An op with no
    session is a root span of its own."""
    sub = TracingSubscriber(spans.provider)
    s = EventScript()
    prefetch = s.start("prefetch", 0.0005, "q", **PREFETCH)
    s.op("lookup", 0.0, 0.001, "q", start_attrs={"model_name": "llama"}, model_name="llama",
         requested_tokens=512, hit_tokens=512)  # fmt: skip
    s.end("prefetch", prefetch, 0.05, "q", **PREFETCH, loaded_chunks=0, written_back_chunks=0,
          discarded_chunks=0, ok=False, error="timeout",
          error_message="disk tier did not answer")  # fmt: skip
    s.end_session(1.0, "q")
    s.op("l2_store", 2.0, 2.1, None, start_attrs=DISK, **DISK, stored_chunks=4,
         stored_bytes=4096, present_chunks=0, failed_chunks=0)  # fmt: skip
    sub.on_events(s.events)
    (root,) = spans.spans("kvflow.request")
    assert root.start_time == monotonic_to_epoch_ns(s.ts(0.0005))
    assert root.end_time == monotonic_to_epoch_ns(s.ts(1.0))
    (pre,) = spans.spans("kvflow.prefetch")
    (lookup,) = spans.spans("kvflow.lookup")
    assert pre.parent.span_id == lookup.parent.span_id == root.context.span_id
    assert pre.attributes["kvflow.session_id"] == "q"
    assert pre.status.status_code is StatusCode.ERROR
    assert pre.status.description == "timeout: disk tier did not answer"
    (store,) = spans.spans("kvflow.l2_store")
    assert store.parent is None and "kvflow.session_id" not in store.attributes
    assert sub.open_requests == 0


def test_unfinished_l2_load_expires_under_its_operation() -> None:
    """An L2 load with no END ends as an expired ERROR span counted as operation=l2_load."""
    spans, metrics = SpanCapture(), MetricsCapture()
    sub = TracingSubscriber(spans.provider, ttl_s=30.0, meter_provider=metrics.provider)
    s = EventScript()
    s.start("l2_load", 0.0, None, **DISK, reason="retrieve")
    s.end_session(31.0, "other")
    sub.on_events(s.events)
    (load,) = spans.spans("kvflow.l2_load")
    assert load.attributes["kvflow.expired"] is True
    assert load.status.status_code is StatusCode.ERROR
    assert metrics.total("kvflow.tracing.expired_spans", operation="l2_load") == 1
    spans.shutdown()
    metrics.shutdown()
