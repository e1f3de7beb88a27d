"""`kvflow replay --traces / --otlp-endpoint`: the live run's spans, from the log.

A live run of the demo workload (in-process CacheEngine, CPU, no L2) records its
event log while the tracing subscriber, registered on the same bus, exports its
spans to memory. The replay's spans (JSON lines) must be the live ones: the same
names, attributes, statuses and parents, with times that are the recorded event
times plus the log's epoch offset. OTLP export is checked against a real receiver.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.demo.sim import ModelShape, SimEngine, kv_bytes_per_token
from kvflow.core.demo.workload import WorkloadShape, make_workload
from kvflow.core.engine.cache_engine import GIB, CacheEngine
from kvflow.core.replay import replay as replay_cli
from kvflow.events import END_TO_START, EventBus, EventType, monotonic_to_epoch_ns
from kvflow.subscribers import TracingSubscriber, build_subscribers
from kvflow.subscribers.eventlog_read import LogReader
from kvflow.subscribers.testing import MetricsCapture
from tests.support.collectors import OTLPReceiver

CHUNK = 256
FORMAT = "vllm_flash_attn"
OPS = {EventType.STORE_END: "kvflow.store", EventType.RETRIEVE_END: "kvflow.retrieve",
       EventType.LOOKUP_END: "kvflow.lookup"}  # fmt: skip


@dataclass
class TracedRun:
    log: Path
    spans: list[ReadableSpan]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> TracedRun:
    """Serve the demo workload with the event log on and live spans kept in memory."""
    log = tmp_path_factory.mktemp("traced") / "log"
    shape = ModelShape()
    chunk_nbytes = kv_bytes_per_token(FORMAT, shape) * CHUNK
    obs = ObservabilityConfig(prometheus_port=0, logging_enabled=False, l0_sample_rate=1.0,
                              event_log_dir=str(log))  # fmt: skip
    config = ServerConfig(chunk_size=CHUNK, l1_size_gb=20 * chunk_nbytes / GIB,
                          observability=obs)  # fmt: skip
    capture = MetricsCapture(kvflow_provider=True)
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    bus = EventBus(capacity=1_000_000)
    pipeline = build_subscribers(obs, bus=bus, meter_provider=capture.provider)
    bus.register(TracingSubscriber(tracer_provider, meter_provider=capture.provider))
    bus.start()
    engine = CacheEngine(config, bus=bus)
    sim = SimEngine(engine, kv_format=FORMAT, shape=shape, device="cpu")
    for req in make_workload(WorkloadShape(chats=3, turns=2, docs=2, questions=3), seed=2):
        sim.serve(req)
    sim.close()
    engine.close()
    assert pipeline.shutdown(10.0)
    assert bus.stats().total_dropped == 0
    tracer_provider.shutdown()
    capture.shutdown()
    return TracedRun(log, list(exporter.get_finished_spans()))


def _read_spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _comparable(spans: list[dict[str, Any]], offset_ns: int) -> Counter[tuple[Any, ...]]:
    """Each span without its ids: name, event times (epoch minus `offset_ns`), status,
    attributes and its parent's name and attributes."""
    by_id = {s["span_id"]: s for s in spans}
    out: Counter[tuple[Any, ...]] = Counter()
    for s in spans:
        parent = by_id.get(s["parent_id"]) if s["parent_id"] else None
        out[(
            s["name"], s["start_time_unix_nano"] - offset_ns, s["end_time_unix_nano"] - offset_ns,
            s["status"]["code"], s["status"]["description"],
            tuple(sorted(s["attributes"].items())),
            None if parent is None else (parent["name"], tuple(sorted(parent["attributes"].items()))),
        )] += 1  # fmt: skip
    return out


def _live_as_json(spans: list[ReadableSpan]) -> list[dict[str, Any]]:
    from kvflow.core.replay.spans import span_json_line

    return [json.loads(span_json_line(s)) for s in spans]


def test_replay_traces_are_the_live_spans_at_the_recorded_times(
    traced: TracedRun, tmp_path: Path
) -> None:
    out_file = tmp_path / "spans.jsonl"
    assert replay_cli.run([str(traced.log), "--traces", str(out_file)], io.StringIO()) == 0
    replayed = _read_spans(out_file)
    reader = LogReader.open(traced.log)
    events = list(reader)
    assert reader.first_header is not None
    log_offset = reader.first_header.epoch_offset_ns

    # one span per recorded store/retrieve/lookup op, at its START's and END's times
    starts = {ev.op_id: ev for ev in events if ev.type in (END_TO_START[t] for t in OPS)}
    ends = [ev for ev in events if ev.type in OPS]
    assert len(ends) >= 10 and len(starts) == len(ends)
    op_spans = {s["attributes"]["kvflow.op_id"]: s for s in replayed if s["name"] in OPS.values()}
    assert len(op_spans) == len([s for s in replayed if s["name"] in OPS.values()]) == len(ends)
    for end in ends:
        span = op_spans[end.op_id]
        assert span["name"] == OPS[end.type]
        assert span["start_time_unix_nano"] == starts[end.op_id].ts_ns + log_offset
        assert span["end_time_unix_nano"] == end.ts_ns + log_offset
        assert span["status"]["code"] == "UNSET"
    sessions = {ev.session_id for ev in events if ev.session_id is not None}
    roots = [s for s in replayed if s["name"] == "kvflow.request"]
    assert {r["attributes"]["kvflow.session_id"] for r in roots} == sessions
    assert all(s["parent_id"] in {r["span_id"] for r in roots} for s in op_spans.values())
    assert all(r["parent_id"] is None for r in roots)

    # the live subscriber made the same spans; it converted with its own process's offset
    live = _live_as_json(traced.spans)
    assert len(live) == len(replayed)
    assert _comparable(replayed, log_offset) == _comparable(live, monotonic_to_epoch_ns(0))
    assert {"kvflow.hit_tokens", "kvflow.requested_tokens", "kvflow.tokens"} <= {
        k for s in replayed for k in s["attributes"]
    }


def test_replay_traces_follow_the_window(traced: TracedRun, tmp_path: Path) -> None:
    """--to 0 replays nothing: an empty traces file."""
    out_file = tmp_path / "none.jsonl"
    assert replay_cli.run([str(traced.log), "--to", "0", "--traces", str(out_file)],
                          io.StringIO()) == 0  # fmt: skip
    assert out_file.read_text() == ""


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_replay_exports_metrics_and_spans_over_otlp(
    traced: TracedRun, tmp_path: Path, protocol: str
) -> None:
    receiver = OTLPReceiver(protocol)
    try:
        out = io.StringIO()
        spans_file = tmp_path / "spans.jsonl"
        args = [str(traced.log), "--format", "json", "--otlp-endpoint", receiver.endpoint,
                "--otlp-protocol", protocol, "--traces", str(spans_file)]  # fmt: skip
        assert replay_cli.run(args, out) == 0
        points = json.loads(out.getvalue())["metrics"]
        metrics = {m.name: m for m in receiver.metrics()}
        assert {"kvflow.store.requests", "kvflow.lookup.hit_tokens",
                "kvflow.store.duration"} <= set(metrics)  # fmt: skip
        local = sorted(p["value"] for p in points if p["name"] == "kvflow.store.requests")
        pushed = sorted(p.as_int for p in metrics["kvflow.store.requests"].sum.data_points)
        assert pushed == local and sum(local) > 0
        assert {"service.name": "kvflow"}.items() <= receiver.resources()[0].items()
        spans = receiver.spans()
        in_file = _read_spans(spans_file)
        assert len(spans) == len(in_file) > 0
        assert Counter((sp.name, sp.start_time_unix_nano, sp.end_time_unix_nano) for sp in spans) \
            == Counter((s["name"], s["start_time_unix_nano"], s["end_time_unix_nano"])
                       for s in in_file)  # fmt: skip
    finally:
        receiver.close()


def test_bad_otlp_flags_are_usage_errors(traced: TracedRun,
                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    log = str(traced.log)
    assert replay_cli.main("replay", [log, "--otlp-endpoint", "x:1", "--otlp-protocol", "udp"]) == 2
    err = capsys.readouterr().err
    assert "--otlp-protocol" in err and "udp" in err
    assert replay_cli.main("replay", [log, "--otlp-protocol", "http"]) == 2
    assert "--otlp-protocol needs --otlp-endpoint" in capsys.readouterr().err
    assert replay_cli.main("replay", [log, "--otlp-endpoint", "ftp://host:1"]) == 2
    assert "--otlp-endpoint" in capsys.readouterr().err


def test_replay_log_lines_carry_the_runs_wall_time(traced: TracedRun, tmp_path: Path) -> None:
    """--logs stamps `event_time` with the log's epoch offset, like the spans."""
    logs = tmp_path / "lines.jsonl"
    assert replay_cli.run([str(traced.log), "--logs", str(logs)], io.StringIO()) == 0
    reader = LogReader.open(traced.log)
    first = next(iter(reader))
    assert reader.first_header is not None
    line = json.loads(logs.read_text().splitlines()[0])
    assert line["event_type"] == first.type.label
    expected = (first.ts_ns + reader.first_header.epoch_offset_ns) / 1e9
    assert line["event_time"] == pytest.approx(expected, abs=1e-6)
