"""Op: a START/END pair whose END, when the op's work still runs on a device stream, says
how long the host took to queue it."""

from __future__ import annotations

import time
from typing import Any

from kvflow.core.engine.ops import Op
from kvflow.events import Event, EventType


class _Published:
    """A bus that keeps what is published (a stream END would need a CUDA stream to be
    stamped by a real bus: here the stream is only passed through)."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, Event]] = []

    def publish(self, event: Event) -> bool:
        self.events.append((None, event))
        return True

    def publish_on_stream(self, stream: Any, event: Event) -> bool:
        self.events.append((stream, event))
        return True


def test_an_end_on_a_stream_carries_the_hosts_time_until_it_was_queued() -> None:
    bus = _Published()
    op = Op(bus, EventType.STORE_START, "r", {"instance_id": "i"})  # type: ignore[arg-type]
    time.sleep(0.01)
    stream = object()
    op.end(stream, tokens=256)
    (_, start), (on, end) = bus.events
    assert (start.type, end.type, on) == (EventType.STORE_START, EventType.STORE_END, stream)
    assert 0.01e9 <= end.attrs["queued_ns"] < 5e9
    assert end.attrs["tokens"] == 256 and end.attrs["ok"] is True


def test_an_end_off_a_stream_or_a_failure_has_no_queued_time() -> None:
    bus = _Published()
    Op(bus, EventType.RETRIEVE_START, "r", {}).end(None, tokens=0)  # type: ignore[arg-type]
    Op(bus, EventType.STORE_START, "s", {}).fail(RuntimeError("copy failed"))  # type: ignore[arg-type]
    ends = [e for _, e in bus.events if e.type in (EventType.RETRIEVE_END, EventType.STORE_END)]
    assert len(ends) == 2
    assert all("queued_ns" not in e.attrs for e in ends)
