"""Public testing utility for users' own tests: a subscriber that records events.

Register a `RecordingSubscriber` on an `EventBus` (or a `CacheEngine`'s bus) to
assert on exactly what was published, as kvflow's own tests do; it can also fail
or block on purpose, to test how a bus treats a broken or slow subscriber.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvflow.events.types import Event, EventType


class RecordingSubscriber:
    """Keeps every event it receives, in order; optionally typed, failing or blocking.

    `event_types` limits delivery as any subscriber's does; `fail=True` raises after
    recording each batch; `gate` makes delivery wait until the event is set.
    """

    def __init__(
        self,
        name: str = "recorder",
        event_types: frozenset[EventType] | None = None,
        *,
        fail: bool = False,
        gate: threading.Event | None = None,
    ) -> None:
        self.name = name
        self.event_types = event_types
        self.events: list[Event] = []
        self.batches = 0
        self.shutdown_calls = 0
        self._fail = fail
        self._gate = gate

    def on_events(self, events: Sequence[Event]) -> None:
        if self._gate is not None:
            self._gate.wait()
        self.batches += 1
        self.events.extend(events)
        if self._fail:
            raise RuntimeError(f"{self.name} fails on purpose")

    def shutdown(self) -> None:
        self.shutdown_calls += 1
