"""A point-in-time snapshot of the bus's own accounting."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvflow.events.types import EventType


@dataclass(frozen=True, slots=True)
class BusStats:
    """Counts per EventType, per-subscriber errors and overflow, and queue state.

    Invariant once the bus is idle: published[t] == delivered[t] + dropped[t].
    `subscriber_dropped` counts events a slow subscriber's own backlog refused;
    they were delivered by the bus to the other subscribers.
    """

    published: Mapping[EventType, int]
    delivered: Mapping[EventType, int]
    dropped: Mapping[EventType, int]
    subscriber_errors: Mapping[str, int]
    subscriber_dropped: Mapping[str, Mapping[EventType, int]]
    queue_depth: int
    oldest_lag_ns: int
    capacity: int
    pending_stream_events: int = 0
    extra: Mapping[str, int] = field(default_factory=dict)

    @property
    def total_published(self) -> int:
        return sum(self.published.values())

    @property
    def total_delivered(self) -> int:
        return sum(self.delivered.values())

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped.values())
