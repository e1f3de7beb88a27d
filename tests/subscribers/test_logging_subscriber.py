"""LoggingSubscriber and configure_logging: levels, fields, rate limit, foreign logs."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from kvflow.events import Event, EventBus, EventType
from kvflow.subscribers import LoggingSubscriber, configure_logging
from tests.support.event_script import EventScript

STORE = {"instance_id": "gpu0", "model_name": "llama"}


class Logs:
    """Root logging rendered into a buffer, removed again after the test."""

    def __init__(self, level: str, fmt: str = "json") -> None:
        self.stream = io.StringIO()
        self.setup = configure_logging(level, fmt, stream=self.stream)

    def lines(self) -> list[dict]:
        return [json.loads(line) for line in self.stream.getvalue().splitlines()]


@pytest.fixture
def info_logs() -> Iterator[Logs]:
    logs = Logs("info")
    yield logs
    logs.setup.close()


def test_info_level_logs_registrations_and_errors_only(info_logs: Logs) -> None:
    """At INFO: register/unregister at INFO, failed ENDs at WARNING, nothing else."""
    sub = LoggingSubscriber()
    s = EventScript()
    s.add(EventType.REGISTER, 0.0, instance_id="gpu0", model_name="llama", world_size=2, rank=1)
    s.op("store", 1.0, 1.1, "r1", start_attrs=STORE, **STORE, tokens=16, bytes=100)
    s.op("retrieve", 2.0, 2.1, "r2", start_attrs=STORE, **STORE, tokens=0, bytes=0,
         ok=False, error="chunk_missing", error_message="gone")  # fmt: skip
    sub.on_events(s.events)
    lines = info_logs.lines()
    assert [(line["level"], line["event"]) for line in lines] == [
        ("info", "register"),
        ("warning", "retrieve_end"),
    ]
    register, failure = lines
    assert register["rank"] == 1 and register["world_size"] == 2
    assert register["logger"] == "kvflow.events"
    assert "timestamp" in register and "event_time" in register
    assert failure["error"] == "chunk_missing"
    assert failure["error_message"] == "gone"
    assert failure["session_id"] == "r2" and isinstance(failure["op_id"], int)


def test_debug_level_logs_every_event_with_its_fields() -> None:
    """At DEBUG every event gets a line; allocation records are summarised as counts."""
    logs = Logs("debug")
    try:
        sub = LoggingSubscriber()
        s = EventScript()
        op_id = s.op("store", 0.0, 0.1, "r1", start_attrs=STORE, **STORE, tokens=16, bytes=64)
        s.allocate(0.2, ("r1", [1, 2], list(range(32))), ("r2", [3], []))
        s.end_session(0.3, "r1")
        sub.on_events(s.events)
        lines = [line for line in logs.lines() if line["logger"] == "kvflow.events"]
        assert [line["event"] for line in lines] == [
            "store_start", "store_end", "block_allocation", "end_session"
        ]  # fmt: skip
        assert all(line["level"] == "debug" for line in lines)
        assert lines[1]["op_id"] == op_id and lines[1]["bytes"] == 64
        assert (lines[2]["records"], lines[2]["blocks"]) == (2, 3)
    finally:
        logs.setup.close()


def test_flood_is_rate_limited_and_summarised(info_logs: Logs) -> None:
    """1000 failures within one second of event time yield about max_lines_per_s lines.

    Every suppressed line is accounted for: the next line of its kind carries the
    count, and shutdown reports what no later line could.
    """
    sub = LoggingSubscriber(max_lines_per_s=10.0)
    s = EventScript()
    for i in range(1000):
        s.op("store", i / 1000, i / 1000, f"r{i}", start_attrs=STORE, **STORE,
             tokens=0, bytes=0, ok=False, error="disk_full")  # fmt: skip
    s.op("store", 5.0, 5.0, "late", start_attrs=STORE, **STORE, ok=False, error="disk_full")
    sub.on_events(s.events)
    lines = info_logs.lines()
    assert 10 <= len(lines) <= 21  # the burst of 10, then one per 100 ms
    assert len(lines) + sum(line.get("suppressed", 0) for line in lines) == 1001
    assert lines[-1]["session_id"] == "late"
    s.events.clear()
    for i in range(50):
        s.op("store", 6.0, 6.0, f"x{i}", start_attrs=STORE, **STORE, ok=False, error="disk_full")
    sub.on_events(s.events)
    sub.shutdown()
    summary = info_logs.lines()[-1]
    assert summary["event"] == "log_lines_suppressed"
    assert summary["suppressed"] == {"warning:store_end": 40}  # 50 minus a refilled burst of 10


def test_library_logs_render_the_same_way(info_logs: Logs) -> None:
    """A foreign stdlib logger's record comes out as the same JSON line shape."""
    logging.getLogger("opentelemetry.exporter.test").warning("export failed: %s", "refused")
    (line,) = info_logs.lines()
    assert line["event"] == "export failed: refused"
    assert line["level"] == "warning"
    assert line["logger"] == "opentelemetry.exporter.test"
    assert "timestamp" in line


def _fail(message: str) -> None:
    raise RuntimeError(message)


def test_json_logs_carry_the_traceback_of_an_exception(info_logs: Logs) -> None:
    """An exception logged with exc_info (the server's own `log.exception`, or a structlog
    call of the event logger) comes out as one JSON line whose "exception" is the
    formatted traceback text, not a tuple of reprs (issue 18, item 5)."""
    try:
        _fail("boom in the handler")
    except RuntimeError:
        logging.getLogger("kvflow.server").exception("internal error while serving a request")
        LoggingSubscriber()._log.error("subscriber_failed", exc_info=True)
    assert len(info_logs.stream.getvalue().splitlines()) == 2
    server_line, event_line = info_logs.lines()
    for line in (server_line, event_line):
        assert "exc_info" not in line
        trace = line["exception"]
        assert trace.startswith("Traceback (most recent call last):")
        assert "in _fail" in trace and "raise RuntimeError(message)" in trace
        assert trace.rstrip().endswith("RuntimeError: boom in the handler")
    assert server_line["level"] == "error" and server_line["logger"] == "kvflow.server"
    assert event_line["level"] == "error" and event_line["logger"] == "kvflow.events"


def test_console_logs_show_a_plain_traceback_without_local_variables() -> None:
    """The console format prints the traceback under the line, never the frames' locals
    (a local may hold a credential)."""
    logs = Logs("info", "console")
    try:
        password = "pa55-never-logged"
        try:
            _fail(f"refused for user {len(password)}")
        except RuntimeError:
            logging.getLogger("kvflow.server").exception("internal error")
        text = logs.stream.getvalue()
        assert "Traceback (most recent call last):" in text
        assert "RuntimeError: refused for user 17" in text
        assert password not in text
    finally:
        logs.setup.close()


def test_console_format() -> None:
    """log_format=console renders human-readable key=value lines."""
    logs = Logs("info", "console")
    try:
        s = EventScript()
        s.add(EventType.UNREGISTER, 0.0, instance_id="gpu7", model_name="llama")
        LoggingSubscriber().on_events(s.events)
        text = logs.stream.getvalue()
        assert "unregister" in text and "instance_id=gpu7" in text
    finally:
        logs.setup.close()


def test_bus_drops_are_warned(info_logs: Logs) -> None:
    """With the bus attached, drops since the last check appear as one WARNING per check."""
    bus = EventBus(capacity=2)
    bus.register(LoggingSubscriber(bus=bus))
    for _ in range(5):
        bus.publish(Event(EventType.L1_READ, attrs={"chunks": 1, "bytes": 1}))
    bus.start()
    assert bus.flush(5.0)
    bus.stop(5.0)
    warnings = [line for line in info_logs.lines() if line["event"] == "events_dropped"]
    assert len(warnings) == 1
    assert warnings[0]["dropped"] == {"l1_read": 3}


def test_invalid_configuration_is_rejected() -> None:
    """Unknown levels and formats raise ValueError naming the allowed values."""
    with pytest.raises(ValueError, match="log level must be one of"):
        configure_logging("verbose")
    with pytest.raises(ValueError, match="log format must be one of json, console"):
        configure_logging("info", "xml")
    with pytest.raises(ValueError, match="max_lines_per_s"):
        LoggingSubscriber(max_lines_per_s=0)


DISK = {"tier": "disk", "chunks": 4, "bytes": 4096}


def test_l2_failures_are_warnings_even_when_the_call_succeeded(info_logs: Logs) -> None:
    """At INFO: an L2 END with failed objects (disk full, ok=True) or ok=False is a WARNING
    carrying its attrs; successful L2 and prefetch ENDs, evictions and write-backs are not."""
    sub = LoggingSubscriber()
    s = EventScript()
    s.op("l2_store", 0.0, 0.1, "r1", start_attrs=DISK, **DISK, stored_chunks=4,
         stored_bytes=4096, present_chunks=0, failed_chunks=0)  # fmt: skip
    s.op("l2_store", 1.0, 1.1, "r2", start_attrs=DISK, **DISK, stored_chunks=1,
         stored_bytes=1024, present_chunks=0, failed_chunks=3)  # fmt: skip
    load = {**DISK, "reason": "retrieve"}
    s.op("l2_load", 2.0, 2.1, None, start_attrs=load, **load, loaded_chunks=0, loaded_bytes=0,
         failed_chunks=4, ok=False, error="timeout", error_message="no answer in 1.0 s")  # fmt: skip
    prefetch = {"model_name": "llama", "world_size": 1, "chunks": 2, "tokens": 512,
                "trigger": "lookup"}  # fmt: skip
    s.op("prefetch", 3.0, 3.1, "r3", start_attrs=prefetch, **prefetch, loaded_chunks=2,
         written_back_chunks=1, discarded_chunks=1)  # fmt: skip
    s.add(EventType.L2_EVICT, 4.0, tier="disk", chunks=2, bytes=2048)
    s.add(EventType.WRITE_BACK, 4.1, "r3", kept=1, discarded=1, bytes=1024, reason="prefetch")
    sub.on_events(s.events)
    lines = info_logs.lines()
    assert [(line["level"], line["event"]) for line in lines] == [
        ("warning", "l2_store_end"),
        ("warning", "l2_load_end"),
    ]
    partial, failed = lines
    assert (partial["tier"], partial["failed_chunks"], partial["stored_chunks"]) == ("disk", 3, 1)
    assert partial["ok"] is True and partial["session_id"] == "r2"
    assert (failed["error"], failed["error_message"]) == ("timeout", "no answer in 1.0 s")
    assert failed["reason"] == "retrieve" and "session_id" not in failed


def test_debug_logs_tier_events_and_hits_by_tier() -> None:
    """At DEBUG every new event is a line with its attrs; hit_tokens_by_tier is an object."""
    logs = Logs("debug")
    try:
        s = EventScript()
        s.op("lookup", 0.0, 0.1, "r1", start_attrs={"model_name": "llama"}, model_name="llama",
             requested_tokens=1024, hit_tokens=768,
             hit_tokens_by_tier={"l1": 256, "disk": 512})  # fmt: skip
        s.add(EventType.L2_EVICT, 0.2, None, tier="disk", chunks=2, bytes=2048)
        s.add(EventType.WRITE_BACK, 0.3, "r1", kept=3, discarded=1, bytes=3072, reason="retrieve")
        LoggingSubscriber().on_events(s.events)
        lines = [line for line in logs.lines() if line["logger"] == "kvflow.events"]
        assert [line["event"] for line in lines] == [
            "lookup_start", "lookup_end", "l2_evict", "write_back"
        ]  # fmt: skip
        assert all(line["level"] == "debug" for line in lines)
        assert lines[1]["hit_tokens_by_tier"] == {"l1": 256, "disk": 512}
        assert (lines[2]["tier"], lines[2]["chunks"], lines[2]["bytes"]) == ("disk", 2, 2048)
        assert (lines[3]["kept"], lines[3]["discarded"], lines[3]["reason"]) == (3, 1, "retrieve")
    finally:
        logs.setup.close()
