"""Blend events in the event log and through `kvflow replay`.

A live run (an engine on CPU, tests/subscribers/blend_run.py: a blend, a refused blend
retrieve) records its event log while the server's subscribers record into memory and
a recorder keeps the raw events. The log must read back the four blend event types with
every attr as published (the by-tier dict included), and a replay must give the live
run's kvflow.blend.* metric values and the blend spans."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import GIB, CacheEngine
from kvflow.core.replay import replay as replay_cli
from kvflow.core.replay.replay import replay
from kvflow.events import Event, EventBus, EventType
from kvflow.events.testing import RecordingSubscriber
from kvflow.subscribers import build_subscribers
from kvflow.subscribers.eventlog_read import LogReader
from kvflow.subscribers.testing import MetricsCapture
from tests.subscribers.blend_run import MODEL, Blended, blend_once, refused_blend, stored_docs
from tests.support.engine import CHUNK
from tests.support.metric_points import metric_points

BLEND_TYPES = (
    EventType.BLEND_LOOKUP_START, EventType.BLEND_LOOKUP_END,
    EventType.BLEND_RETRIEVE_START, EventType.BLEND_RETRIEVE_END,
)  # fmt: skip


@dataclass
class BlendRun:
    log: Path
    capture: MetricsCapture
    events: list[Event]
    blended: Blended


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> BlendRun:
    """A blend and a refused blend retrieve, logged, measured and recorded."""
    log = tmp_path_factory.mktemp("blend") / "log"
    obs = ObservabilityConfig(prometheus_port=0, logging_enabled=False, event_log_dir=str(log))
    config = ServerConfig(chunk_size=CHUNK, l1_size_gb=(1 << 20) / GIB, observability=obs)
    capture = MetricsCapture(kvflow_provider=True)
    bus = EventBus(capacity=100_000)
    recorder = RecordingSubscriber()
    bus.register(recorder)
    pipeline = build_subscribers(obs, bus=bus, meter_provider=capture.provider)
    bus.start()
    engine = CacheEngine(config, bus=bus)
    blended = blend_once(engine, stored_docs(engine))
    refused_blend(engine, blended)
    engine.end_session("q")
    engine.close()
    assert pipeline.shutdown(10.0)
    assert bus.stats().total_dropped == 0
    return BlendRun(log, capture, list(recorder.events), blended)


def _blend_events(events: list[Event]) -> list[tuple[Any, ...]]:
    return [(e.type, e.ts_ns, e.session_id, e.op_id, dict(e.attrs))
            for e in events if e.type in BLEND_TYPES]  # fmt: skip


def test_the_log_reads_back_every_blend_event_as_published(run: BlendRun) -> None:
    logged = _blend_events(list(LogReader.open(run.log)))
    assert logged == _blend_events(run.events)
    assert [e[0] for e in logged] == list(BLEND_TYPES) + list(BLEND_TYPES[2:])
    lookup_end = logged[1][4]
    assert lookup_end["blend_hit_tokens_by_tier"] == {"l1": 3 * CHUNK}
    assert isinstance(lookup_end["blend_hit_tokens_by_tier"], dict)
    assert lookup_end["prefix_tokens"] == CHUNK and lookup_end["segments"] == 3
    refused = logged[-1][4]
    assert refused["ok"] is False and refused["error"] == "invalid_argument"


def _blend_points(capture: MetricsCapture) -> dict[tuple[Any, ...], Any]:
    """Every kvflow.blend.* and kvflow.inflight.blend_* point."""
    return metric_points(
        capture, lambda name: name.startswith(("kvflow.blend.", "kvflow.inflight.blend_"))
    )


def test_replay_gives_the_live_blend_metrics(run: BlendRun) -> None:
    replayed = MetricsCapture(kvflow_provider=True)
    replay(LogReader.open(run.log), replayed.provider)
    live, again = _blend_points(run.capture), _blend_points(replayed)
    replayed.shutdown()
    assert again == live
    hit = ("kvflow.blend.lookup.hit_tokens", (("model_name", MODEL), ("tier", "l1")))
    assert live[hit] == run.blended.hit_tokens == 3 * CHUNK
    names = {k[0] for k in live}
    assert {"kvflow.blend.lookup.requests", "kvflow.blend.lookup.requested_tokens",
            "kvflow.blend.lookup.duration", "kvflow.blend.retrieve.requests",
            "kvflow.blend.retrieve.tokens", "kvflow.blend.retrieve.duration"} <= names  # fmt: skip


def test_the_replay_command_prints_blend_metrics_and_spans(run: BlendRun, tmp_path: Path) -> None:
    out, traces = io.StringIO(), tmp_path / "spans.jsonl"
    argv = [str(run.log), "--format", "json", "--traces", str(traces)]
    assert replay_cli.run(argv, out) == 0
    points = json.loads(out.getvalue())["metrics"]
    tokens = [p for p in points if p["name"] == "kvflow.blend.retrieve.tokens"]
    assert [p["value"] for p in tokens] == [run.blended.blended_tokens]
    spans = [json.loads(line) for line in traces.read_text().splitlines()]
    lookups = [s for s in spans if s["name"] == "kvflow.blend_lookup"]
    retrieves = [s for s in spans if s["name"] == "kvflow.blend_retrieve"]
    assert len(lookups) == 1 and len(retrieves) == 2
    assert lookups[0]["attributes"]["kvflow.blend_hit_tokens_by_tier.l1"] == 3 * CHUNK
    assert sorted(s["status"]["code"] for s in retrieves) == ["ERROR", "UNSET"]
