"""`status()["bus"]`: the event bus's accounting as JSON-serialisable totals."""

from __future__ import annotations

from typing import Any

from kvflow.events import EventBus


def bus_status(bus: EventBus) -> dict[str, Any]:
    """Published, delivered and dropped totals, drops per event type (only types that
    dropped), queue depth, the oldest queued event's lag, capacity and subscriber errors."""
    stats = bus.stats()
    return {
        "published": stats.total_published,
        "delivered": stats.total_delivered,
        "dropped": stats.total_dropped,
        "dropped_by_type": {t.label: n for t, n in stats.dropped.items() if n},
        "queue_depth": stats.queue_depth,
        "oldest_lag_ns": stats.oldest_lag_ns,
        "capacity": stats.capacity,
        "subscriber_errors": dict(stats.subscriber_errors),
    }
