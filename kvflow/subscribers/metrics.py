"""The metric catalogue of docs/METRICS.md, recorded from the event stream.

Durations come from op_id-paired START/END timestamps; counter increments are
summed per delivered batch and added once per label set; bus self-metrics and
L1 occupancy are observed through callbacks when a reader collects. Blend lookups and
retrieves (kvflow.blend.*) are counted as lookups and retrieves are, under names of
their own. The storage tier instruments (kvflow.l2/prefetch/write_back) live in
`tiers.TierMetrics`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from kvflow.events import END_TO_START, START_TO_END, BusStats, Event, EventBus, EventType
from kvflow.subscribers.batch import (
    FOLDED_VALUE,
    MAX_LABEL_VALUES,
    Adds,
    LabelSets,
    add,
    flush,
)
from kvflow.subscribers.buckets import GB_PER_S, OP_SECONDS, TOKENS
from kvflow.subscribers.expiry import drain_expired
from kvflow.subscribers.tiers import (
    INFLIGHT_LABEL,
    OPERATIONS,
    TIER_ENDS,
    TIER_EVENTS,
    TierMetrics,
    TierStats,
)

_ET = EventType
_NS = 1e-9
_EMPTY: dict[str, str] = {}
_M = ("model_name",)
_MO = ("model_name", "outcome")
_MT = ("model_name", "tier")
_IM = ("instance_id", "model_name")
_IMO = ("instance_id", "model_name", "outcome")
_OP = ("operation",)
_OPERATION = {
    _ET.STORE_START: "store",
    _ET.RETRIEVE_START: "retrieve",
    _ET.LOOKUP_START: "lookup",
    _ET.BLEND_LOOKUP_START: "blend_lookup",
    _ET.BLEND_RETRIEVE_START: "blend_retrieve",
    **OPERATIONS,
}
#: operation -> the START attrs its inflight gauge is labelled by
_INFLIGHT_LABEL = {"store": _IM, "retrieve": _IM, "lookup": _M, "blend_lookup": _M,
                   "blend_retrieve": _IM, **INFLIGHT_LABEL}  # fmt: skip
#: operations moving KV between L1 and an instance's blocks -> (metric prefix, its words);
#: their ENDs carry `tokens` and `bytes`
_TRANSFERS = {
    "store": ("kvflow.store", "store"),
    "retrieve": ("kvflow.retrieve", "retrieve"),
    "blend_retrieve": ("kvflow.blend.retrieve", "blend retrieve"),
}
#: transfers whose END may come on a GPU stream, with `queued_ns`
_QUEUED_ON_STREAM = ("store", "retrieve")
_TRANSFER_ENDS = {
    _ET.STORE_END: "store",
    _ET.RETRIEVE_END: "retrieve",
    _ET.BLEND_RETRIEVE_END: "blend_retrieve",
}
#: lookup END -> (operation, metric prefix, END attrs of: tokens asked for, tokens found,
#: tokens found per tier)
_LOOKUPS = {
    _ET.LOOKUP_END: (
        "lookup", "kvflow.lookup", "requested_tokens", "hit_tokens", "hit_tokens_by_tier",
    ),
    _ET.BLEND_LOOKUP_END: (
        "blend_lookup", "kvflow.blend.lookup", "tokens", "blend_hit_tokens",
        "blend_hit_tokens_by_tier",
    ),
}  # fmt: skip
_INFLIGHT_NAME = {"store": "stores", "retrieve": "retrieves", "lookup": "lookups",
                  "blend_lookup": "blend_lookups", "blend_retrieve": "blend_retrieves"}  # fmt: skip

#: Returns L1 occupancy: keys usage_bytes, capacity_bytes, objects.
L1Stats = Callable[[], Mapping[str, int]]


class _Pending:
    """A START waiting for its END: when it started and which inflight labels it holds."""

    __slots__ = ("labels", "operation", "ts")

    def __init__(self, ts: int, operation: str, labels: dict[str, str]) -> None:
        self.ts = ts
        self.operation = operation
        self.labels = labels


class _Lookup:
    """The instruments of one kind of lookup (prefix or blend) and the END attrs they count.

    `requested_key`: tokens asked for; `hit_key`: tokens found; `by_tier_key`: those
    split by the slowest tier each found chunk needed (absent: all counted as `l1`).
    """

    __slots__ = ("by_tier_key", "duration", "hit", "hit_key", "requested", "requested_key",
                 "requests")  # fmt: skip

    def __init__(self, meter: Any, end_type: EventType) -> None:
        operation, prefix, self.requested_key, self.hit_key, self.by_tier_key = _LOOKUPS[end_type]
        words = operation.replace("_", " ")
        self.requests = meter.create_counter(
            f"{prefix}.requests", unit="{request}", description=f"Finished {words}s"
        )
        self.requested = meter.create_counter(
            f"{prefix}.requested_tokens", unit="{token}", description=f"Tokens {words}s asked for"
        )
        found = "Prefix tokens" if end_type is _ET.LOOKUP_END else "Tokens past the prefix"
        self.hit = meter.create_counter(
            f"{prefix}.hit_tokens",
            unit="{token}",
            description=f"{found} found, by the slowest tier each hit chunk needed",
        )
        self.duration = meter.create_histogram(
            f"{prefix}.duration",
            unit="s",
            description=f"{words} latency, START to END",
            explicit_bucket_boundaries_advisory=OP_SECONDS,
        )


class MetricsSubscriber:
    """Records kvflow.{store,retrieve,lookup,blend,inflight,l1,l2,prefetch,write_back,instances,
    bus}.* (the catalogue of docs/METRICS.md). `bus` enables the kvflow.bus.*
    self-metrics, `l1_stats` the L1 occupancy gauges, `tier_stats` the per-tier
    L2 occupancy gauges. A START whose END has not arrived within
    `pending_ttl_s` (event time) or beyond `max_pending` is given up: it leaves
    the inflight gauge and counts in kvflow.inflight.expired, so inflight cannot
    leak. Client-chosen label values (model_name, instance_id) are bounded: at most
    `max_label_values` distinct values per label, later new ones are folded into
    "other" and counted in kvflow.metrics.folded_labels (docs/METRICS.md).
    """

    name = "metrics"
    #: in-memory aggregation only (exporters read on their own threads): run inline on the bus
    blocking = False
    event_types: frozenset[EventType] | None = None

    def __init__(
        self,
        meter_provider: MeterProvider,
        *,
        bus: EventBus | None = None,
        l1_stats: L1Stats | None = None,
        tier_stats: TierStats | None = None,
        pending_ttl_s: float = 300.0,
        max_pending: int = 100_000,
        max_label_values: int = MAX_LABEL_VALUES,
    ) -> None:
        if not pending_ttl_s > 0:
            raise ValueError(f"pending_ttl_s must be > 0, got {pending_ttl_s!r}")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an integer >= 1, got {max_pending!r}")
        self._bus = bus
        self._l1_stats = l1_stats
        self._ttl_ns = int(pending_ttl_s * 1e9)
        self._max_pending = max_pending
        self._pending: dict[int, _Pending] = {}
        self._labels = LabelSets(max_label_values)
        self._stats: BusStats | None = None
        self._stats_lock = threading.Lock()
        meter = meter_provider.get_meter("kvflow")
        self._build_op_instruments(meter)
        self._build_l1_instruments(meter)
        self._tiers = TierMetrics(meter, self._labels, tier_stats)
        self._inflight.update(self._tiers.inflight)
        self._build_bus_instruments(meter)
        meter.create_observable_counter(
            "kvflow.metrics.folded_labels",
            callbacks=[self._observe_folded],
            unit="{label_set}",
            description=(
                f"Label sets recorded with a client-chosen value folded into {FOLDED_VALUE!r} "
                f"(beyond {max_label_values} distinct values of the label)"
            ),
        )

    # -- instruments -----------------------------------------------------------------

    def _build_op_instruments(self, meter: Any) -> None:
        self._build_transfer_instruments(meter)
        self._lookups = {end: _Lookup(meter, end) for end in _LOOKUPS}
        self._lookup_hit_hist = meter.create_histogram(
            "kvflow.lookup.prefix_hit_tokens",
            unit="{token}",
            description="Hit prefix length per lookup",
            explicit_bucket_boundaries_advisory=TOKENS,
        )
        self._inflight = {
            op: meter.create_up_down_counter(
                f"kvflow.inflight.{plural}",
                unit="{operation}",
                description=f"{op.replace('_', ' ')}s started and not yet finished",
            )
            for op, plural in _INFLIGHT_NAME.items()
        }
        self._expired = meter.create_counter(
            "kvflow.inflight.expired",
            unit="{operation}",
            description="STARTs given up without an END (TTL or pending bound)",
        )
        self._instances = meter.create_up_down_counter(
            "kvflow.instances.registered", unit="{instance}", description="Registered KV instances"
        )
        self._layer_wait = meter.create_histogram(
            "kvflow.retrieve.layer_wait",
            unit="s",
            description="How long an engine waited for each layer of a layerwise retrieve",
            explicit_bucket_boundaries_advisory=OP_SECONDS,
        )

    def _build_transfer_instruments(self, meter: Any) -> None:
        """Requests, tokens, bytes, duration and throughput of stores, retrieves and blend
        retrieves."""
        counter, hist = meter.create_counter, meter.create_histogram
        self._requests, self._tokens, self._bytes = {}, {}, {}
        self._duration, self._throughput = {}, {}
        for op, (prefix, words) in _TRANSFERS.items():
            self._requests[op] = counter(
                f"{prefix}.requests", unit="{request}", description=f"Finished {words} operations"
            )
            self._tokens[op] = counter(
                f"{prefix}.tokens", unit="{token}", description=f"Tokens moved by {words}s"
            )
            self._bytes[op] = counter(
                f"{prefix}.bytes", unit="By", description=f"Bytes moved by {words}s"
            )
            self._duration[op] = hist(
                f"{prefix}.duration",
                unit="s",
                description=f"{words} latency, START to END",
                explicit_bucket_boundaries_advisory=OP_SECONDS,
            )
            self._throughput[op] = hist(
                f"{prefix}.throughput",
                unit="GBy/s",
                description=f"{words} bytes / duration of successful {words}s, in 1e9 bytes/s",
                explicit_bucket_boundaries_advisory=GB_PER_S,
            )
        # the host's part of a transfer whose copies run on a GPU stream (END `queued_ns`)
        self._queued = {
            op: hist(
                f"{_TRANSFERS[op][0]}.queued",
                unit="s",
                description=f"Host time of a {op} from START until its copies were queued on"
                " the GPU (the rest of its duration is the copies)",
                explicit_bucket_boundaries_advisory=OP_SECONDS,
            )
            for op in _QUEUED_ON_STREAM
        }

    def _build_l1_instruments(self, meter: Any) -> None:
        self._l1_counters = {
            _ET.L1_WRITE: (
                meter.create_counter("kvflow.l1.written_chunks", unit="{chunk}"),
                meter.create_counter("kvflow.l1.written_bytes", unit="By"),
            ),
            _ET.L1_READ: (
                meter.create_counter("kvflow.l1.read_chunks", unit="{chunk}"),
                meter.create_counter("kvflow.l1.read_bytes", unit="By"),
            ),
            _ET.L1_EVICT: (
                meter.create_counter(
                    "kvflow.l1.evicted_chunks", unit="{chunk}", description="Chunks evicted from L1"
                ),
                meter.create_counter("kvflow.l1.evicted_bytes", unit="By"),
            ),
        }
        if self._l1_stats is None:
            return
        for key, unit, text in (
            ("usage_bytes", "By", "L1 bytes in use"),
            ("capacity_bytes", "By", "L1 capacity"),
            ("objects", "{object}", "Chunk objects held in L1"),
        ):
            meter.create_observable_gauge(
                f"kvflow.l1.{key}", callbacks=[self._l1_callback(key)], unit=unit, description=text
            )

    def _build_bus_instruments(self, meter: Any) -> None:
        if self._bus is None:
            return
        for field, text in (
            ("published", "Events offered to the bus"),
            ("delivered", "Events handed to subscribers"),
            ("dropped", "Events refused because the bus was full"),
        ):
            meter.create_observable_counter(
                f"kvflow.bus.{field}",
                callbacks=[self._per_type_callback(field)],
                unit="{event}",
                description=text,
            )
        meter.create_observable_gauge(
            "kvflow.bus.queue_depth",
            callbacks=[lambda o: [Observation(self._bus_stats().queue_depth)]],
            unit="{event}",
            description="Events admitted and not yet dispatched",
        )
        meter.create_observable_gauge(
            "kvflow.bus.capacity",
            callbacks=[lambda o: [Observation(self._bus_stats().capacity)]],
            unit="{event}",
            description="Bound on queued events",
        )
        meter.create_observable_gauge(
            "kvflow.bus.lag",
            callbacks=[lambda o: [Observation(self._bus_stats().oldest_lag_ns * _NS)]],
            unit="s",
            description="Age of the oldest event not yet handled by every subscriber",
        )
        meter.create_observable_counter(
            "kvflow.bus.subscriber_errors",
            callbacks=[self._observe_subscriber_errors],
            unit="{batch}",
            description="Batches whose on_events raised, per subscriber",
        )
        meter.create_observable_counter(
            "kvflow.bus.subscriber_dropped",
            callbacks=[self._observe_subscriber_dropped],
            unit="{event}",
            description="Events a slow subscriber's own backlog refused",
        )

    def _bus_stats(self, refresh: bool = False) -> BusStats:
        """The stats snapshot of the current collection.

        The SDK runs callbacks in registration order, so the first bus instrument
        (kvflow.bus.published) refreshes it and the others reuse it: one
        collection reports counts from one consistent snapshot.
        """
        assert self._bus is not None
        with self._stats_lock:
            if refresh or self._stats is None:
                self._stats = self._bus.stats()
            return self._stats

    def _per_type_callback(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            stats = self._bus_stats(refresh=field == "published")
            counts: Mapping[EventType, int] = getattr(stats, field)
            return [Observation(counts.get(t, 0), {"event_type": t.label}) for t in EventType]

        return observe

    def _observe_subscriber_errors(self, options: CallbackOptions) -> Iterable[Observation]:
        errors = self._bus_stats().subscriber_errors
        return [Observation(n, {"subscriber": name}) for name, n in errors.items()]

    def _observe_subscriber_dropped(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(n, {"subscriber": name, "event_type": t.label})
            for name, per_type in self._bus_stats().subscriber_dropped.items()
            for t, n in per_type.items()
        ]

    def _observe_folded(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"label": name}) for name, n in self._labels.folded.items()]

    def _l1_callback(self, key: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            assert self._l1_stats is not None
            value = self._l1_stats().get(key)
            return [] if value is None else [Observation(value)]

        return observe

    # -- event processing ---------------------------------------------------------------

    def on_events(self, events: Sequence[Event]) -> None:
        """Record one batch; counter increments are summed and added once per label set."""
        adds: Adds = {}
        latest = 0
        for ev in events:
            etype = ev.type
            if ev.ts_ns > latest:
                latest = ev.ts_ns
            if etype in START_TO_END:
                self._on_start(ev, adds)
            elif etype in END_TO_START:
                self._on_end(ev, adds)
            elif etype in TIER_EVENTS:
                self._tiers.on_event(ev, adds)
            elif etype in self._l1_counters:
                chunks, nbytes = self._l1_counters[etype]
                add(adds, chunks, _EMPTY, ev.attrs.get("chunks") or 0)
                add(adds, nbytes, _EMPTY, ev.attrs.get("bytes") or 0)
            elif etype is _ET.LAYER_WAIT:
                attrs = ev.attrs
                labels = self._labels.get(
                    _IM, attrs.get("instance_id", ""), attrs.get("model_name", "")
                )
                for wait in attrs.get("waits_s") or ():
                    self._layer_wait.record(wait, labels)
            elif etype is _ET.REGISTER or etype is _ET.UNREGISTER:
                labels = self._labels.get(_M, ev.attrs.get("model_name", ""))
                add(adds, self._instances, labels, 1 if etype is _ET.REGISTER else -1)
        self._expire(latest, adds)
        flush(adds)

    def _on_start(self, ev: Event, adds: Adds) -> None:
        op_id = ev.op_id
        if op_id is None:
            return
        operation = _OPERATION[ev.type]
        attrs = ev.attrs
        names = _INFLIGHT_LABEL[operation]
        if len(names) == 1:
            labels = self._labels.get(names, attrs.get(names[0], ""))
        else:
            labels = self._labels.get(names, attrs.get(names[0], ""), attrs.get(names[1], ""))
        self._pending[op_id] = _Pending(ev.ts_ns, operation, labels)
        add(adds, self._inflight[operation], labels, 1)

    def _on_end(self, ev: Event, adds: Adds) -> None:
        attrs = ev.attrs
        error = attrs.get("error")
        outcome = "ok" if attrs.get("ok", error is None) and error is None else "error"
        pending = None if ev.op_id is None else self._pending.pop(ev.op_id, None)
        if pending is not None:
            add(adds, self._inflight[pending.operation], pending.labels, -1)
        if ev.type in TIER_ENDS:
            self._tiers.on_end(ev, None if pending is None else pending.ts, outcome, adds)
            return
        lookup = self._lookups.get(ev.type)
        if lookup is not None:
            self._on_lookup_end(ev, lookup, pending, outcome, adds)
            return
        operation = _TRANSFER_ENDS[ev.type]
        instance, model = attrs.get("instance_id", ""), attrs.get("model_name", "")
        labels = self._labels.get(_IM, instance, model)
        with_outcome = self._labels.get(_IMO, instance, model, outcome)
        add(adds, self._requests[operation], with_outcome, 1)
        add(adds, self._tokens[operation], labels, attrs.get("tokens") or 0)
        nbytes = attrs.get("bytes") or 0
        add(adds, self._bytes[operation], labels, nbytes)
        queued_ns = attrs.get("queued_ns")
        queued = self._queued.get(operation)
        if queued is not None and isinstance(queued_ns, int) and queued_ns >= 0:
            queued.record(queued_ns * _NS, labels)
        if pending is None:
            return
        duration_ns = max(ev.ts_ns - pending.ts, 0)
        self._duration[operation].record(duration_ns * _NS, with_outcome)
        if outcome == "ok" and nbytes > 0 and duration_ns > 0:
            self._throughput[operation].record(nbytes / duration_ns, labels)

    def _on_lookup_end(
        self, ev: Event, lookup: _Lookup, pending: _Pending | None, outcome: str, adds: Adds
    ) -> None:
        """A LOOKUP_END or BLEND_LOOKUP_END: requests, tokens asked for, tokens found per
        tier, duration (and, for a prefix lookup, its hit length)."""
        attrs = ev.attrs
        model = attrs.get("model_name", "")
        labels = self._labels.get(_M, model)
        add(adds, lookup.requests, self._labels.get(_MO, model, outcome), 1)
        add(adds, lookup.requested, labels, attrs.get(lookup.requested_key) or 0)
        hit = attrs.get(lookup.hit_key) or 0
        by_tier = attrs.get(lookup.by_tier_key)
        if by_tier:
            for tier, tokens in by_tier.items():
                add(adds, lookup.hit, self._labels.get(_MT, model, tier), tokens or 0)
        else:  # producers before L2 tiers (or a failed END): every hit came from L1
            add(adds, lookup.hit, self._labels.get(_MT, model, "l1"), hit)
        if outcome == "ok" and ev.type is _ET.LOOKUP_END:
            self._lookup_hit_hist.record(hit, labels)
        if pending is not None:
            lookup.duration.record(max(ev.ts_ns - pending.ts, 0) * _NS, labels)

    def _expire(self, latest_ns: int, adds: Adds) -> None:
        """Give up STARTs older than the TTL (event time) or beyond the pending bound."""
        horizon = latest_ns - self._ttl_ns
        for _, first in drain_expired(self._pending, horizon, self._max_pending, _ts_of):
            add(adds, self._inflight[first.operation], first.labels, -1)
            add(adds, self._expired, self._labels.get(_OP, first.operation), 1)

    @property
    def pending_operations(self) -> int:
        """STARTs still waiting for their END."""
        return len(self._pending)

    def shutdown(self) -> None:
        """Nothing to release: counters are added at the end of every batch."""


def _ts_of(pending: _Pending) -> int:
    return pending.ts
