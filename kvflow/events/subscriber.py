"""The one protocol every event consumer satisfies; no base class is required."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvflow.events.types import Event, EventType


@runtime_checkable
class Subscriber(Protocol):
    """A consumer of event batches.

    `on_events` runs on a bus delivery thread with batches in publish order and
    must treat the sequence as read-only (it may be shared with other
    subscribers). Durations are computed from event timestamps, never the clock.

    Optional attribute `blocking: bool` (default True): a subscriber whose
    `on_events` only does in-memory work sets it False, and the bus then calls it
    on its dispatcher thread instead of a delivery thread of its own. Such a
    subscriber must never block: while it runs, no other subscriber is served.
    """

    name: str
    event_types: frozenset[EventType] | None

    def on_events(self, events: Sequence[Event]) -> None: ...

    def shutdown(self) -> None: ...
