"""Subscribers that total what the event stream saw, for the demo and the benchmarks.

`OpTally` totals ops (STORE, RETRIEVE, LOOKUP, and the L2 START/END pairs) from their
START/END events. Durations come from event timestamps (START to END of one op_id),
so GPU-stamped events give GPU-side times. `TierTrace` records, per request, which
tier its lookup hits lay in, whether it started a prefetch and what its retrieve took
from L2, and totals the L1 chunks moved and the write-backs.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

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


@dataclass
class RequestTiers:
    """One request's L2 view: its lookup's hit tokens per tier (the slowest tier each
    chunk needed), the prefetches its lookup started, the chunks its retrieve got
    from an L2 tier rather than L1 (0 when a prefetch had written them back already)."""

    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    prefetches: int = 0
    retrieved: bool = False
    retrieved_l2_chunks: int = 0

    @property
    def l2_hit_tokens(self) -> int:
        """Hit tokens that lay in some L2 tier."""
        return sum(n for tier, n in self.hit_tokens_by_tier.items() if tier != "l1")


@dataclass
class WriteBackTotals:
    """WRITE_BACK events summed: chunks loaded from L2 kept in L1 or discarded, by reason."""

    events: int = 0
    kept: int = 0
    discarded: int = 0
    bytes: int = 0
    kept_by_reason: Counter[str] = field(default_factory=Counter)


class TierTrace:
    """Per-request lookup/prefetch/retrieve records keyed by request id, plus totals."""

    name = "tier-trace"
    event_types: frozenset[EventType] | None = frozenset(
        {
            EventType.LOOKUP_END,
            EventType.RETRIEVE_END,
            EventType.PREFETCH_START,
            EventType.WRITE_BACK,
            EventType.L1_WRITE,
            EventType.L1_READ,
        }
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, RequestTiers] = {}
        self.write_back = WriteBackTotals()
        self.l1_chunks: Counter[str] = Counter()  # "written" by stores, "read" by retrieves

    def on_events(self, events: Sequence[Event]) -> None:
        with self._lock:
            for ev in events:
                self._add(ev)

    def _add(self, ev: Event) -> None:
        attrs = ev.attrs
        if ev.type is EventType.WRITE_BACK:
            wb = self.write_back
            wb.events += 1
            wb.kept += int(attrs.get("kept", 0))
            wb.discarded += int(attrs.get("discarded", 0))
            wb.bytes += int(attrs.get("bytes", 0))
            wb.kept_by_reason[str(attrs.get("reason"))] += int(attrs.get("kept", 0))
        elif ev.type in (EventType.L1_WRITE, EventType.L1_READ):
            side = "written" if ev.type is EventType.L1_WRITE else "read"
            self.l1_chunks[side] += int(attrs.get("chunks", 0))
        elif ev.session_id is not None:
            self._add_request(self._requests.setdefault(ev.session_id, RequestTiers()), ev)

    @staticmethod
    def _add_request(rec: RequestTiers, ev: Event) -> None:
        attrs = ev.attrs
        if ev.type is EventType.LOOKUP_END:
            rec.hit_tokens_by_tier = dict(attrs.get("hit_tokens_by_tier") or {})
        elif ev.type is EventType.PREFETCH_START:
            rec.prefetches += 1
        elif attrs.get("ok", True):  # RETRIEVE_END
            rec.retrieved = True
            rec.retrieved_l2_chunks += int(attrs.get("l2_chunks", 0))

    def request(self, request_id: str) -> RequestTiers:
        """What the delivered events said of this request (empty when nothing yet)."""
        with self._lock:
            return self._requests.get(request_id, RequestTiers())

    def hit_tokens_by_tier(self) -> Counter[str]:
        """Lookup hit tokens per tier, over every request."""
        totals: Counter[str] = Counter()
        with self._lock:
            for rec in self._requests.values():
                totals.update(rec.hit_tokens_by_tier)
        return totals

    def shutdown(self) -> None:
        return None
