"""Blend lookups and retrieves through the subscribers: the kvflow.blend.* metrics beside
the prefix lookup ones, their in-flight gauges and expiry, their spans and log lines.

The events come from a real engine on CPU (tests/subscribers/blend_run.py): the system
prompt is the prefix hit, documents B and A are found past it and copied."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
from opentelemetry.trace import StatusCode

from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.events import END_TO_START, EventType
from kvflow.subscribers import LoggingSubscriber, MetricsSubscriber, TracingSubscriber
from kvflow.subscribers.logs import configure_logging
from kvflow.subscribers.testing import MetricsCapture, SpanCapture
from tests.subscribers.blend_run import CHUNK_BYTES, MODEL, blend_once, refused_blend, stored_docs
from tests.support.engine import BLOCK, CHUNK, events_of, small_engine
from tests.support.event_script import EventScript

LOOKUP = {"model_name": MODEL}
DST = {"instance_id": "dst", "model_name": MODEL}


@pytest.fixture
def cap() -> MetricsCapture:
    capture = MetricsCapture()
    yield capture
    capture.shutdown()


def test_a_blend_feeds_the_blend_metrics_beside_the_prefix_ones(cap: MetricsCapture) -> None:
    """Prefix hits stay in kvflow.lookup.*; the tokens found past the prefix, the blend
    lookup's tokens and the blended tokens copied are kvflow.blend.*, each counted once."""
    engine, recorder = small_engine()
    engine.bus.register(MetricsSubscriber(cap.provider))
    docs = stored_docs(engine)
    run = blend_once(engine, docs)
    assert (run.prefix_tokens, run.hit_tokens, run.blended_tokens) == (CHUNK, 3 * CHUNK, 3 * CHUNK)
    events_of(recorder, engine)  # delivered to every subscriber
    asked = len(run.prompt)
    assert cap.total("kvflow.lookup.requested_tokens", **LOOKUP) == asked
    assert cap.total("kvflow.lookup.hit_tokens", **LOOKUP) == CHUNK
    assert cap.total("kvflow.blend.lookup.requests", **LOOKUP, outcome="ok") == 1
    assert cap.total("kvflow.blend.lookup.requested_tokens", **LOOKUP) == asked
    assert cap.total("kvflow.blend.lookup.hit_tokens", **LOOKUP) == 3 * CHUNK
    assert cap.total("kvflow.blend.lookup.hit_tokens", **LOOKUP, tier="l1") == 3 * CHUNK
    assert cap.observations("kvflow.blend.lookup.duration", **LOOKUP) == 1
    assert cap.total("kvflow.blend.retrieve.requests", **DST, outcome="ok") == 1
    assert cap.total("kvflow.blend.retrieve.tokens", **DST) == 3 * CHUNK
    assert cap.total("kvflow.blend.retrieve.bytes", **DST) == 3 * CHUNK_BYTES
    assert cap.observations("kvflow.blend.retrieve.duration", **DST, outcome="ok") == 1
    assert cap.observations("kvflow.blend.retrieve.throughput", **DST) == 1
    # a blend retrieve is not a retrieve, nor a blend lookup a lookup
    assert cap.total("kvflow.retrieve.requests") == 0
    assert cap.total("kvflow.lookup.requests", **LOOKUP) == 1
    assert cap.total("kvflow.inflight.blend_lookups", **LOOKUP) == 0
    assert cap.total("kvflow.inflight.blend_retrieves", **DST) == 0

    refused_blend(engine, run)  # an error, no tokens
    events_of(recorder, engine)
    assert cap.total("kvflow.blend.retrieve.requests", **DST, outcome="error") == 1
    assert cap.total("kvflow.blend.retrieve.tokens", **DST) == 3 * CHUNK
    engine.close()


def test_chunks_found_on_disk_count_for_the_disk_tier(tmp_path: Path, cap: MetricsCapture) -> None:
    """Documents L1 evicted but the disk tier holds are blended hits of tier `disk`."""
    engine, recorder = small_engine(
        l1_bytes=4 * CHUNK_BYTES, l2_disk_paths=(str(tmp_path),), l2_disk_size_gb=0.01
    )
    engine.bus.register(MetricsSubscriber(cap.provider))
    docs = stored_docs(engine)
    _settle(engine)
    filler = np.arange(500, 500 + 4 * CHUNK, dtype=np.int32)  # pushes the documents out of L1
    assert engine.store("src", filler, list(range(4 * CHUNK // BLOCK)), request_id="f") > 0
    _settle(engine)
    run = blend_once(engine, docs, prefetch=False)
    assert run.blended_tokens == 3 * CHUNK
    events = events_of(recorder, engine)
    (end,) = [e for e in events if e.type is EventType.BLEND_LOOKUP_END]
    by_tier = end.attrs["blend_hit_tokens_by_tier"]
    assert by_tier.get("disk", 0) > 0 and sum(by_tier.values()) == 3 * CHUNK
    for tier, tokens in by_tier.items():
        assert cap.total("kvflow.blend.lookup.hit_tokens", **LOOKUP, tier=tier) == tokens
    assert cap.total("kvflow.blend.retrieve.tokens", **DST) == 3 * CHUNK
    engine.close()


def _settle(engine: CacheEngine, timeout: float = 10.0) -> None:
    """Wait until the engine's L2 write-through has nothing pending."""
    deadline = time.monotonic() + timeout
    while engine.pending_l2_writes():
        assert time.monotonic() < deadline, "the write-through did not finish"
        time.sleep(0.01)


def test_a_blend_start_without_end_expires_under_its_operation(cap: MetricsCapture) -> None:
    """The in-flight gauges of blend ops rise on START; a START whose END never comes is
    given up after the TTL and counted as `blend_lookup` / `blend_retrieve`."""
    sub = MetricsSubscriber(cap.provider, pending_ttl_s=1.0)
    s = EventScript()
    s.add(EventType.BLEND_LOOKUP_START, 0.0, "r1", 1, **LOOKUP, tokens=64, prefix_tokens=0)
    s.add(EventType.BLEND_RETRIEVE_START, 0.0, "r1", 2, **DST, tokens=64)
    sub.on_events(s.events)
    assert cap.total("kvflow.inflight.blend_lookups", **LOOKUP) == 1
    assert cap.total("kvflow.inflight.blend_retrieves", **DST) == 1
    sub.on_events([s.add(EventType.END_SESSION, 5.0, "r1")])
    assert cap.total("kvflow.inflight.blend_lookups", **LOOKUP) == 0
    assert cap.total("kvflow.inflight.blend_retrieves", **DST) == 0
    assert cap.total("kvflow.inflight.expired", operation="blend_lookup") == 1
    assert cap.total("kvflow.inflight.expired", operation="blend_retrieve") == 1


def test_blend_ops_are_spans_and_log_lines_as_lookups_and_retrieves_are() -> None:
    """Child spans kvflow.blend_lookup / kvflow.blend_retrieve under the request's root,
    the by-tier map one attribute per tier; DEBUG lines with it nested; a failed blend
    retrieve is an ERROR span and a WARNING line."""
    spans = SpanCapture()
    stream = io.StringIO()
    setup = configure_logging("debug", "json", stream=stream)
    try:
        engine, recorder = small_engine()
        engine.bus.register(TracingSubscriber(spans.provider))
        engine.bus.register(LoggingSubscriber())
        refused_blend(engine, blend_once(engine, stored_docs(engine)), request_id="q")
        engine.end_session("q")
        events_of(recorder, engine)
        engine.close()
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        setup.close()
        spans.shutdown()
    (root,) = spans.spans("kvflow.request")
    (lookup,) = [s for s in spans.spans("kvflow.blend_lookup")]
    ok, failed = spans.spans("kvflow.blend_retrieve")
    assert all(s.parent is not None and s.parent.span_id == root.context.span_id
               for s in (lookup, ok, failed))  # fmt: skip
    assert lookup.attributes["kvflow.blend_hit_tokens"] == 3 * CHUNK
    assert lookup.attributes["kvflow.blend_hit_tokens_by_tier.l1"] == 3 * CHUNK
    assert lookup.attributes["kvflow.prefix_tokens"] == CHUNK
    assert lookup.attributes["kvflow.requested_tokens"] == lookup.attributes["kvflow.tokens"]
    assert ok.attributes["kvflow.blended_tokens"] == 3 * CHUNK
    assert ok.attributes["kvflow.instance_id"] == "dst"
    assert failed.status.status_code is StatusCode.ERROR
    ends = {line["event"]: line for line in lines if line["event"].startswith("blend_")}
    assert ends["blend_lookup_end"]["level"] == "debug"
    assert ends["blend_lookup_end"]["blend_hit_tokens_by_tier"] == {"l1": 3 * CHUNK}
    warnings = [
        ln for ln in lines if ln["event"] == "blend_retrieve_end" and ln["level"] == "warning"
    ]
    assert len(warnings) == 1 and warnings[0]["error"] == "invalid_argument"


EVENTS_MD = Path(__file__).resolve().parents[2] / "docs" / "EVENTS.md"


def test_every_event_type_and_blend_attr_is_documented() -> None:
    """docs/EVENTS.md names every EventType, and its blend sections every attr the
    engine's blend events carry (a successful and a failed blend retrieve)."""
    text = EVENTS_MD.read_text()
    for etype in EventType:
        assert etype.name in text, f"{etype.name} is not in docs/EVENTS.md"
    engine, recorder = small_engine()
    refused_blend(engine, blend_once(engine, stored_docs(engine)))
    events = events_of(recorder, engine)
    engine.close()
    sections = text.split("### ")
    for etype in (EventType.BLEND_LOOKUP_END, EventType.BLEND_RETRIEVE_END):
        (section,) = [s for s in sections if s.startswith(END_TO_START[etype].name)]
        pair = (END_TO_START[etype], etype)
        attrs = {k for e in events if e.type in pair for k in e.attrs}
        missing = {k for k in attrs if f"`{k}`" not in section}
        assert not missing, f"{etype.name}: {sorted(missing)} undocumented"
