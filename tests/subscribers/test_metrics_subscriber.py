"""MetricsSubscriber: every metric of the docs/METRICS.md catalogue, from events."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from kvflow.events import Event, EventBus, EventType, now_ns
from kvflow.subscribers import L0LifecycleSubscriber, MetricsSubscriber
from kvflow.subscribers.buckets import GB_PER_S, OP_SECONDS, TOKENS
from kvflow.subscribers.testing import MetricsCapture
from tests.support.event_script import EventScript

STORE = {"instance_id": "gpu0", "model_name": "llama"}


@pytest.fixture
def cap() -> MetricsCapture:
    capture = MetricsCapture()
    yield capture
    capture.shutdown()


def test_store_and_retrieve_metrics(cap: MetricsCapture) -> None:
    """Requests, tokens, bytes, duration and GB/s come from paired START/END events."""
    sub = MetricsSubscriber(cap.provider)
    s = EventScript()
    s.op("store", 0.0, 0.002, "r1", start_attrs={**STORE, "tokens": 512},
         **STORE, tokens=512, bytes=8_000_000)  # fmt: skip
    s.op("store", 1.0, 1.5, "r2", start_attrs={**STORE, "tokens": 4096},
         **STORE, tokens=4096, bytes=2_000_000_000)  # fmt: skip
    s.op("retrieve", 2.0, 2.25, "r2", start_attrs={**STORE, "tokens": 4096},
         **STORE, tokens=4096, bytes=1_000_000_000)  # fmt: skip
    sub.on_events(s.events)

    assert cap.total("kvflow.store.requests", outcome="ok", **STORE) == 2
    assert cap.total("kvflow.store.tokens", **STORE) == 4608
    assert cap.total("kvflow.store.bytes", **STORE) == 2_008_000_000
    duration = cap.histogram("kvflow.store.duration", outcome="ok", **STORE)
    assert duration.count == 2
    assert duration.sum == pytest.approx(0.502)
    assert tuple(duration.explicit_bounds) == OP_SECONDS
    # 2 ms falls in (0.001, 0.0025]; 0.5 s in (0.25, 0.5]
    assert duration.bucket_counts[OP_SECONDS.index(0.0025)] == 1
    assert duration.bucket_counts[OP_SECONDS.index(0.5)] == 1
    throughput = cap.histogram("kvflow.store.throughput", **STORE)
    assert tuple(throughput.explicit_bounds) == GB_PER_S
    assert throughput.sum == pytest.approx(4.0 + 4.0)  # 8 MB / 2 ms and 2 GB / 0.5 s
    assert cap.total("kvflow.retrieve.requests", outcome="ok") == 1
    assert cap.total("kvflow.retrieve.tokens") == 4096
    assert cap.total("kvflow.retrieve.bytes") == 1_000_000_000
    assert cap.histogram("kvflow.retrieve.duration").sum == pytest.approx(0.25)
    assert cap.histogram("kvflow.retrieve.throughput").sum == pytest.approx(4.0)


def test_the_host_part_of_a_transfer_is_its_queued_time(cap: MetricsCapture) -> None:
    """An END that carries `queued_ns` (its copies ran on a GPU stream) feeds
    kvflow.<op>.queued with it; ENDs without it (CPU caches) feed nothing there."""
    sub = MetricsSubscriber(cap.provider)
    s = EventScript()
    s.op("store", 0.0, 0.011, "r1", start_attrs=STORE, **STORE, tokens=512, bytes=8_000_000,
         queued_ns=2_000_000)  # fmt: skip
    s.op("store", 1.0, 1.011, "r2", start_attrs=STORE, **STORE, tokens=512, bytes=8_000_000,
         queued_ns=5_000_000)  # fmt: skip
    s.op("retrieve", 2.0, 2.011, "r2", start_attrs=STORE, **STORE, tokens=512, bytes=8_000_000,
         queued_ns=1_500_000)  # fmt: skip
    s.op("store", 3.0, 3.011, "r3", start_attrs=STORE, **STORE, tokens=512, bytes=8_000_000)
    sub.on_events(s.events)
    queued = cap.histogram("kvflow.store.queued", **STORE)
    assert (queued.count, queued.sum) == (2, pytest.approx(0.007))
    assert tuple(queued.explicit_bounds) == OP_SECONDS
    assert cap.histogram("kvflow.retrieve.queued", **STORE).sum == pytest.approx(0.0015)
    assert cap.histogram("kvflow.store.duration", outcome="ok", **STORE).count == 3


def test_failed_operation_counts_as_error_without_throughput(cap: MetricsCapture) -> None:
    """An END with an error counts under outcome=error and records no throughput.

    Missing or None token and byte counts on a failure count as 0.
    """
    sub = MetricsSubscriber(cap.provider)
    s = EventScript()
    s.op("store", 0.0, 0.1, "r1", start_attrs=STORE, **STORE, tokens=None,
         ok=False, error="out_of_memory")  # fmt: skip
    sub.on_events(s.events)
    assert cap.total("kvflow.store.requests", outcome="error") == 1
    assert cap.total("kvflow.store.requests", outcome="ok") == 0
    assert cap.total("kvflow.store.tokens") == cap.total("kvflow.store.bytes") == 0
    assert cap.histogram("kvflow.store.duration", outcome="error").count == 1
    assert cap.points("kvflow.store.throughput") == []


def test_lookup_metrics(cap: MetricsCapture) -> None:
    """Lookups count requested and hit tokens per model, and the hit length distribution."""
    sub = MetricsSubscriber(cap.provider)
    s = EventScript()
    s.op("lookup", 0.0, 0.001, "r1", start_attrs={"model_name": "llama", "tokens": 1024},
         model_name="llama", requested_tokens=1024, hit_tokens=768)  # fmt: skip
    s.op("lookup", 1.0, 1.003, None, start_attrs={"model_name": "llama", "tokens": 100},
         model_name="llama", requested_tokens=100, hit_tokens=0)  # fmt: skip
    sub.on_events(s.events)
    assert cap.total("kvflow.lookup.requests", model_name="llama", outcome="ok") == 2
    assert cap.total("kvflow.lookup.requested_tokens", model_name="llama") == 1124
    assert cap.total("kvflow.lookup.hit_tokens", model_name="llama") == 768
    hits = cap.histogram("kvflow.lookup.prefix_hit_tokens", model_name="llama")
    assert (hits.count, hits.sum, tuple(hits.explicit_bounds)) == (2, 768, TOKENS)
    assert cap.histogram("kvflow.lookup.duration").sum == pytest.approx(0.004)


def test_inflight_returns_to_zero(cap: MetricsCapture) -> None:
    """inflight gauges rise with STARTs and fall back to 0 once every END arrived."""
    sub = MetricsSubscriber(cap.provider)
    s = EventScript()
    stores = [s.start("store", 0.0, f"r{i}", **STORE) for i in range(3)]
    retrieve = s.start("retrieve", 0.1, "r9", **STORE)
    lookup = s.start("lookup", 0.2, "r9", model_name="llama")
    sub.on_events(s.events)
    assert cap.total("kvflow.inflight.stores", **STORE) == 3
    assert cap.total("kvflow.inflight.retrieves") == 1
    assert cap.total("kvflow.inflight.lookups", model_name="llama") == 1
    s.events.clear()
    for op_id in stores:
        s.end("store", op_id, 1.0, **STORE, tokens=16, bytes=1)
    s.end("retrieve", retrieve, 1.0, **STORE, tokens=16, bytes=1)
    s.end("lookup", lookup, 1.0, model_name="llama", requested_tokens=16, hit_tokens=0)
    sub.on_events(s.events)
    for name in ("kvflow.inflight.stores", "kvflow.inflight.retrieves", "kvflow.inflight.lookups"):
        assert cap.total(name) == 0
    assert sub.pending_operations == 0


def test_unmatched_start_expires_after_ttl(cap: MetricsCapture) -> None:
    """A START without END leaves inflight once the TTL passes in event time, and is counted."""
    sub = MetricsSubscriber(cap.provider, pending_ttl_s=10.0)
    s = EventScript()
    s.start("store", 0.0, "lost", **STORE)
    sub.on_events(s.events)
    s.events.clear()
    s.op("retrieve", 5.0, 5.1, "r2", start_attrs=STORE, **STORE, tokens=1, bytes=1)
    sub.on_events(s.events)
    assert cap.total("kvflow.inflight.stores") == 1  # 5 s old: still waiting
    s.events.clear()
    s.add(EventType.L1_READ, 10.5, chunks=1, bytes=1)
    sub.on_events(s.events)
    assert cap.total("kvflow.inflight.stores") == 0
    assert cap.total("kvflow.inflight.expired", operation="store") == 1


def test_pending_starts_are_bounded(cap: MetricsCapture) -> None:
    """Beyond max_pending, the oldest STARTs are given up (bounded memory)."""
    sub = MetricsSubscriber(cap.provider, max_pending=5)
    s = EventScript()
    for i in range(8):
        s.start("store", i * 0.001, f"r{i}", **STORE)
    sub.on_events(s.events)
    assert sub.pending_operations == 5
    assert cap.total("kvflow.inflight.stores") == 5
    assert cap.total("kvflow.inflight.expired") == 3


def test_end_without_start_counts_but_never_goes_negative(cap: MetricsCapture) -> None:
    """An END whose START was dropped still counts the request, but has no duration."""
    sub = MetricsSubscriber(cap.provider)
    s = EventScript()
    s.end("store", 12345, 1.0, "r1", **STORE, tokens=256, bytes=100)
    sub.on_events(s.events)
    assert cap.total("kvflow.store.requests") == 1
    assert cap.total("kvflow.store.tokens") == 256
    assert cap.total("kvflow.inflight.stores") == 0
    assert cap.points("kvflow.store.duration") == []


def test_l1_metrics(cap: MetricsCapture) -> None:
    """L1 counters come from L1_* events; usage/capacity/objects from the l1_stats callback."""
    occupancy = {"usage_bytes": 3 << 20, "capacity_bytes": 1 << 30, "objects": 12}
    sub = MetricsSubscriber(cap.provider, l1_stats=lambda: occupancy)
    s = EventScript()
    s.add(EventType.L1_WRITE, 0.0, "r1", chunks=4, bytes=4000)
    s.add(EventType.L1_READ, 0.1, "r1", chunks=2, bytes=2000)
    s.add(EventType.L1_EVICT, 0.2, "r1", chunks=3, bytes=3000)
    s.add(EventType.L1_EVICT, 0.3, "r2", chunks=1, bytes=1000)
    sub.on_events(s.events)
    assert cap.total("kvflow.l1.written_chunks") == 4
    assert cap.total("kvflow.l1.written_bytes") == 4000
    assert cap.total("kvflow.l1.read_chunks") == 2
    assert cap.total("kvflow.l1.read_bytes") == 2000
    assert cap.total("kvflow.l1.evicted_chunks") == 4
    assert cap.total("kvflow.l1.evicted_bytes") == 4000
    assert cap.total("kvflow.l1.usage_bytes") == 3 << 20
    assert cap.total("kvflow.l1.capacity_bytes") == 1 << 30
    occupancy["objects"] = 7
    assert cap.total("kvflow.l1.objects") == 7  # read at every collection


def test_registered_instances(cap: MetricsCapture) -> None:
    """REGISTER/UNREGISTER move the registered-instances gauge per model."""
    sub = MetricsSubscriber(cap.provider)
    s = EventScript()
    for i in range(3):
        s.add(EventType.REGISTER, i, instance_id=f"gpu{i}", model_name="llama")
    s.add(EventType.UNREGISTER, 5, instance_id="gpu0", model_name="llama")
    sub.on_events(s.events)
    assert cap.total("kvflow.instances.registered", model_name="llama") == 2


class _Failing:
    name = "failing"
    event_types = frozenset({EventType.L1_READ})

    def on_events(self, events: Sequence[Event]) -> None:
        raise RuntimeError("boom")

    def shutdown(self) -> None:
        pass


def test_bus_self_metrics(cap: MetricsCapture) -> None:
    """kvflow.bus.* mirror EventBus.stats(): per-type counts, depth, lag, subscriber errors."""
    bus = EventBus(capacity=4)
    MetricsSubscriber(cap.provider, bus=bus)
    bus.register(_Failing())
    bus.publish(Event(EventType.L1_READ, now_ns() - 2_000_000_000, attrs={"chunks": 1}))
    for _ in range(5):  # not started: 4 admitted in all, 2 dropped
        bus.publish(Event(EventType.L1_READ, attrs={"chunks": 1, "bytes": 1}))
    assert cap.total("kvflow.bus.queue_depth") == 4
    assert cap.total("kvflow.bus.capacity") == 4
    assert cap.total("kvflow.bus.lag") >= 2.0  # the oldest queued event is 2 s old
    bus.start()
    assert bus.flush(5.0)
    assert cap.total("kvflow.bus.published", event_type="l1_read") == 6
    assert cap.total("kvflow.bus.delivered", event_type="l1_read") == 4
    assert cap.total("kvflow.bus.dropped", event_type="l1_read") == 2
    assert cap.total("kvflow.bus.dropped", event_type="store_start") == 0
    assert cap.total("kvflow.bus.subscriber_errors", subscriber="failing") >= 1
    assert cap.total("kvflow.bus.queue_depth") == 0
    bus.stop(5.0)


class _Slow:
    """Blocks in on_events until released, so its own backlog overflows."""

    name = "slow"
    event_types = None

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def on_events(self, events: Sequence[Event]) -> None:
        self.entered.set()
        self.release.wait(10.0)

    def shutdown(self) -> None:
        self.release.set()


def test_slow_subscriber_overflow_is_counted(cap: MetricsCapture) -> None:
    """Events a slow subscriber's backlog refuses appear per subscriber and event type."""
    bus = EventBus(capacity=100, subscriber_backlog=2)
    MetricsSubscriber(cap.provider, bus=bus)
    slow = _Slow()
    bus.register(slow)
    bus.start()
    bus.publish(Event(EventType.END_SESSION, session_id="first"))
    assert slow.entered.wait(5.0)
    for i in range(10):
        bus.publish(Event(EventType.END_SESSION, session_id=f"r{i}"))
        time.sleep(0.002)  # let the dispatcher offer them one by one
    slow.release.set()
    assert bus.flush(5.0)
    dropped = bus.stats().subscriber_dropped["slow"][EventType.END_SESSION]
    assert dropped >= 8
    assert cap.total("kvflow.bus.subscriber_dropped", subscriber="slow",
                     event_type="end_session") == dropped  # fmt: skip
    bus.stop(5.0)


def test_whole_catalogue_is_emitted(cap: MetricsCapture) -> None:
    """A mixed workload through a real bus produces every metric of docs/METRICS.md."""
    bus = EventBus()
    bus.register(MetricsSubscriber(cap.provider, bus=bus, l1_stats=lambda: {
        "usage_bytes": 1, "capacity_bytes": 2, "objects": 1}))  # fmt: skip
    bus.register(L0LifecycleSubscriber(cap.provider, sample_rate=1.0))
    bus.start()
    s = EventScript()
    s.add(EventType.REGISTER, 0, instance_id="gpu0", model_name="llama")
    s.op("store", 0, 0.1, "r1", start_attrs=STORE, **STORE, tokens=16, bytes=10)
    s.op("retrieve", 1, 1.1, "r1", start_attrs=STORE, **STORE, tokens=16, bytes=10)
    s.op("lookup", 2, 2.1, "r1", start_attrs={"model_name": "llama"}, model_name="llama",
         requested_tokens=16, hit_tokens=16)  # fmt: skip
    s.add(EventType.L1_EVICT, 3, chunks=1, bytes=10)
    s.allocate(4, ("r1", [1], [1] * 16), instance_id="gpu0", model_name="llama")
    s.end_session(5, "r1")
    s.allocate(6, ("r2", [1], [2] * 16), instance_id="gpu0", model_name="llama")
    s.allocate(7, ("r2", [2], [2] * 16), instance_id="gpu0", model_name="llama")
    s.end_session(8, "r2")
    s.allocate(9, ("r3", [2], [2] * 16), instance_id="gpu0", model_name="llama")
    s.allocate(10, ("r4", [2], [3] * 16), instance_id="gpu0", model_name="llama")
    for ev in s.events:
        assert bus.publish(ev)
    assert bus.flush(5.0)
    catalogue = {
        f"kvflow.{op}.{m}" for op in ("store", "retrieve")
        for m in ("requests", "tokens", "bytes", "duration", "throughput")
    } | {
        "kvflow.lookup.requests", "kvflow.lookup.requested_tokens", "kvflow.lookup.hit_tokens",
        "kvflow.inflight.stores", "kvflow.inflight.retrieves",
        "kvflow.l1.usage_bytes", "kvflow.l1.capacity_bytes", "kvflow.l1.objects",
        "kvflow.l1.evicted_chunks",
        "kvflow.l0.block_lifetime", "kvflow.l0.block_idle_before_evict",
        "kvflow.l0.block_reuse_gap", "kvflow.l0.allocation_records", "kvflow.l0.allocated_blocks",
        "kvflow.bus.published", "kvflow.bus.delivered", "kvflow.bus.dropped",
        "kvflow.bus.queue_depth", "kvflow.bus.lag", "kvflow.bus.subscriber_errors",
    }  # fmt: skip
    assert catalogue <= cap.names()
    bus.stop(5.0)


def test_layer_waits_feed_one_histogram_value_per_layer(cap: MetricsCapture) -> None:
    """LAYER_WAIT (an engine's report of a layerwise retrieve) records each layer's wait."""
    sub = MetricsSubscriber(cap.provider)
    s = EventScript()
    s.add(EventType.LAYER_WAIT, 0.0, "r1", **STORE, waits_s=[0.0, 0.002, 0.0003], layers=3)
    s.add(EventType.LAYER_WAIT, 0.1, "r2", **STORE, waits_s=[0.5], layers=1)
    sub.on_events(s.events)
    waits = cap.histogram("kvflow.retrieve.layer_wait", **STORE)
    assert waits.count == 4
    assert waits.sum == pytest.approx(0.5023)
    assert tuple(waits.explicit_bounds) == OP_SECONDS
    assert waits.bucket_counts[0] == 1  # the layer whose copy was ahead: 0 s
    assert waits.bucket_counts[OP_SECONDS.index(0.0025)] == 1
