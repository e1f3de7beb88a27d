"""A subscriber that totals STORE/RETRIEVE/LOOKUP ops from their START/END events.

Durations come from event timestamps (START to END of one op_id), so GPU-stamped
events give GPU-side times. Used by the demo's summary and the engine benchmark.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.events import END_TO_START, START_TO_END, Event, EventType


@dataclass
class OpTotals:
    """Totals of one kind of op."""

    ops: int = 0
    failed: int = 0
    tokens: int = 0
    bytes: int = 0
    moving_ns: int = 0  # START-to-END time of the ops that moved bytes

    @property
    def gb_per_s(self) -> float:
        """Bytes moved per second of the moving ops' time (0 when nothing moved)."""
        return self.bytes / self.moving_ns if self.moving_ns else 0.0


class OpTally:
    """Pairs START with END by op_id and totals ops per START type."""

    name = "op-tally"
    event_types: frozenset[EventType] | None = frozenset(START_TO_END) | frozenset(END_TO_START)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: dict[int, int] = {}
        self._early_ends: dict[int, Event] = {}
        self.totals: dict[EventType, OpTotals] = {t: OpTotals() for t in START_TO_END}

    def on_events(self, events: Sequence[Event]) -> None:
        with self._lock:
            for ev in events:
                if ev.op_id is None:
                    continue
                if ev.type in START_TO_END:
                    end = self._early_ends.pop(ev.op_id, None)
                    if end is None:
                        self._starts[ev.op_id] = ev.ts_ns
                    else:
                        self._add(ev.type, ev.ts_ns, end)
                else:
                    start = self._starts.pop(ev.op_id, None)
                    if start is None:
                        self._early_ends[ev.op_id] = ev
                    else:
                        self._add(END_TO_START[ev.type], start, ev)

    def _add(self, start_type: EventType, start_ns: int, end: Event) -> None:
        t = self.totals[start_type]
        attrs = end.attrs
        t.ops += 1
        t.failed += 0 if attrs.get("ok", True) else 1
        nbytes = int(attrs.get("bytes", 0) or 0)
        duration = max(end.ts_ns - start_ns, 0)
        t.tokens += int(attrs.get("tokens", 0) or 0)
        t.bytes += nbytes
        t.moving_ns += duration if nbytes else 0

    def open_ops(self) -> int:
        """STARTs still waiting for their END (0 once everything finished and was delivered)."""
        with self._lock:
            return len(self._starts)

    def snapshot(self) -> dict[EventType, OpTotals]:
        with self._lock:
            return {t: OpTotals(**vars(v)) for t, v in self.totals.items()}

    def shutdown(self) -> None:
        return None
