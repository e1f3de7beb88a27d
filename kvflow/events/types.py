"""Event vocabulary: the event types, the event record, and allocation records.

Events are plain slotted records so that building and publishing one stays cheap
on the hot path; `EventType` is an IntEnum so hashing and set membership are C-fast.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from enum import IntEnum
from types import MappingProxyType
from typing import Any, NamedTuple

import msgspec


class EventType(IntEnum):
    """Every kind of event kvflow publishes (docs/EVENTS.md documents their attrs)."""

    STORE_START = 1
    STORE_END = 2
    RETRIEVE_START = 3
    RETRIEVE_END = 4
    LOOKUP_START = 5
    LOOKUP_END = 6
    BLOCK_ALLOCATION = 7
    END_SESSION = 8
    REGISTER = 9
    UNREGISTER = 10
    L1_WRITE = 11
    L1_READ = 12
    L1_EVICT = 13
    L2_STORE_START = 14
    L2_STORE_END = 15
    L2_LOAD_START = 16
    L2_LOAD_END = 17
    PREFETCH_START = 18
    PREFETCH_END = 19
    L2_EVICT = 20
    WRITE_BACK = 21
    #: how long an engine waited for each layer of a layerwise retrieve (its report)
    LAYER_WAIT = 22
    #: blend (docs/BLEND.md): the search for stored chunks past a prompt's prefix, and
    #: the copy of the segments found into an instance's blocks, K turned to fit
    BLEND_LOOKUP_START = 23
    BLEND_LOOKUP_END = 24
    BLEND_RETRIEVE_START = 25
    BLEND_RETRIEVE_END = 26
    #: an operator's call (clear, resize, drain, quota): who, what, and how it ended
    ADMIN = 40

    @property
    def label(self) -> str:
        """Lower-case name used as a metric label and log field."""
        return self.name.lower()


#: START type -> its END type, for op_id pairing.
START_TO_END: Mapping[EventType, EventType] = MappingProxyType(
    {
        EventType.STORE_START: EventType.STORE_END,
        EventType.RETRIEVE_START: EventType.RETRIEVE_END,
        EventType.LOOKUP_START: EventType.LOOKUP_END,
        EventType.BLEND_LOOKUP_START: EventType.BLEND_LOOKUP_END,
        EventType.BLEND_RETRIEVE_START: EventType.BLEND_RETRIEVE_END,
        EventType.L2_STORE_START: EventType.L2_STORE_END,
        EventType.L2_LOAD_START: EventType.L2_LOAD_END,
        EventType.PREFETCH_START: EventType.PREFETCH_END,
    }
)
END_TO_START: Mapping[EventType, EventType] = MappingProxyType(
    {end: start for start, end in START_TO_END.items()}
)

EMPTY_ATTRS: Mapping[str, Any] = MappingProxyType({})


class Event(msgspec.Struct, gc=False):
    """One observation. `ts_ns` is `time.monotonic_ns()`; 0 means "stamp at publish".

    A msgspec Struct: constructed in C (about half the cost of a slotted class),
    mutable so the bus can stamp `ts_ns`, and never tracked by the cycle GC.
    """

    type: EventType
    ts_ns: int = 0
    session_id: str | None = None
    op_id: int | None = None
    attrs: Mapping[str, Any] = EMPTY_ATTRS


class BlockAllocation(NamedTuple):
    """One request's newly allocated engine blocks and the tokens they now hold."""

    req_id: str
    new_block_ids: Sequence[int]
    new_token_ids: Sequence[int]


_op_ids = itertools.count(1)


def next_op_id() -> int:
    """A process-wide unique id pairing a START event with its END (thread-safe)."""
    return next(_op_ids)


def now_ns() -> int:
    """The clock every event uses: monotonic nanoseconds."""
    return time.monotonic_ns()


def monotonic_to_epoch_ns(ts_ns: int) -> int:
    """Convert an event's monotonic timestamp to Unix-epoch nanoseconds (for spans)."""
    return ts_ns + _EPOCH_OFFSET_NS


_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()
