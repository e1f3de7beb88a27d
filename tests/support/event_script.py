"""Event sequences with explicit times, for subscriber tests that feed `on_events` directly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvflow.events import START_TO_END, BlockAllocation, Event, EventType, next_op_id

_START = {
    "store": EventType.STORE_START,
    "retrieve": EventType.RETRIEVE_START,
    "lookup": EventType.LOOKUP_START,
    "l2_store": EventType.L2_STORE_START,
    "l2_load": EventType.L2_LOAD_START,
    "prefetch": EventType.PREFETCH_START,
}


class EventScript:
    """Builds an event sequence with explicit times, given in seconds after `base_ns`."""

    def __init__(self, base_ns: int = 1_000_000_000_000) -> None:
        self.base_ns = base_ns
        self.events: list[Event] = []

    def ts(self, at_s: float) -> int:
        """The timestamp (ns) `at_s` seconds after `base_ns`."""
        return self.base_ns + round(at_s * 1e9)

    def add(
        self,
        etype: EventType,
        at_s: float,
        session_id: str | None = None,
        op_id: int | None = None,
        **attrs: Any,
    ) -> Event:
        """Append one event and return it."""
        event = Event(etype, self.ts(at_s), session_id, op_id, attrs)
        self.events.append(event)
        return event

    def start(
        self, operation: str, at_s: float, session_id: str | None = None, **attrs: Any
    ) -> int:
        """Append the START of `operation`; returns its op_id.

        Operations: store, retrieve, lookup, l2_store, l2_load, prefetch.
        """
        op_id = next_op_id()
        self.add(_START[operation], at_s, session_id, op_id, **attrs)
        return op_id

    def end(
        self, operation: str, op_id: int, at_s: float, session_id: str | None = None, **attrs: Any
    ) -> Event:
        """Append the END of `operation` for `op_id` (attrs default to ok=True, error=None)."""
        attrs.setdefault("ok", attrs.get("error") is None)
        attrs.setdefault("error", None)
        return self.add(START_TO_END[_START[operation]], at_s, session_id, op_id, **attrs)

    def op(
        self,
        operation: str,
        start_s: float,
        end_s: float,
        session_id: str | None = None,
        start_attrs: dict[str, Any] | None = None,
        **end_attrs: Any,
    ) -> int:
        """Append a START/END pair; returns the op_id."""
        op_id = self.start(operation, start_s, session_id, **(start_attrs or {}))
        self.end(operation, op_id, end_s, session_id, **end_attrs)
        return op_id

    def allocate(
        self,
        at_s: float,
        *records: tuple[str, Sequence[int], Sequence[int]],
        instance_id: str = "inst0",
        model_name: str = "model",
        block_size: int = 16,
    ) -> Event:
        """Append a BLOCK_ALLOCATION of `records` (req_id, block_ids, token_ids)."""
        return self.add(
            EventType.BLOCK_ALLOCATION,
            at_s,
            instance_id=instance_id,
            model_name=model_name,
            block_size=block_size,
            records=[BlockAllocation(*r) for r in records],
        )

    def end_session(self, at_s: float, session_id: str) -> Event:
        """Append an END_SESSION of `session_id`."""
        return self.add(EventType.END_SESSION, at_s, session_id)
