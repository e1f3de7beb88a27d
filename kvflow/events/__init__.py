"""The event vocabulary, the bounded bus, and the deterministic sampler.

Of kvflow it imports only `kvflow.cuda` (for GPU stream stamps, in `stream`, which
the bus itself never imports); every package above it depends on it.
"""

from kvflow.events.bus import EventBus, StreamStamper
from kvflow.events.sampler import Sampler
from kvflow.events.stats import BusStats
from kvflow.events.subscriber import Subscriber
from kvflow.events.types import (
    END_TO_START,
    START_TO_END,
    BlockAllocation,
    Event,
    EventType,
    monotonic_to_epoch_ns,
    next_op_id,
    now_ns,
)

__all__ = [
    "END_TO_START",
    "START_TO_END",
    "BlockAllocation",
    "BusStats",
    "Event",
    "EventBus",
    "EventType",
    "Sampler",
    "StreamStamper",
    "Subscriber",
    "monotonic_to_epoch_ns",
    "next_op_id",
    "now_ns",
]
