"""Behaviour of the bounded EventBus: bound, ordering, routing, isolation, flush and stop."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence, Sized

import pytest

from kvflow.events import Event, EventBus, EventType
from kvflow.events.testing import RecordingSubscriber

T = EventType


def _started(capacity: int = 10000, *subs: RecordingSubscriber, **kw: float) -> EventBus:
    bus = EventBus(capacity, **kw)  # type: ignore[arg-type]
    for sub in subs:
        bus.register(sub)
    return bus.start()


def _wait_for_count(received: Sized, count: int, timeout: float) -> bool:
    """Poll until `received` holds `count` items or `timeout` seconds pass; return whether it did."""
    deadline = time.monotonic() + timeout
    while len(received) < count:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def test_bound_is_exact_under_concurrent_publishers() -> None:
    """With nothing draining, 8 threads x 100k publishes admit exactly `capacity` events."""
    bus = EventBus(10000)
    admitted = [0] * 8

    def publisher(i: int) -> None:
        n = 0
        for _ in range(100_000):
            n += bus.publish(Event(T.L1_WRITE))
        admitted[i] = n

    threads = [threading.Thread(target=publisher, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = bus.stats()
    assert sum(admitted) == 10000
    assert stats.queue_depth == 10000
    assert stats.dropped[T.L1_WRITE] == 790_000
    assert stats.published[T.L1_WRITE] == 800_000
    bus.stop(5)


def test_every_event_accounted_under_concurrent_load() -> None:
    """With delivery running, published == delivered + dropped and subscribers got every delivery."""
    sub = RecordingSubscriber(event_types=None)
    bus = _started(1000, sub, subscriber_backlog=10**7)
    results = [0] * 8

    def publisher(i: int) -> None:
        etype = T.STORE_START if i % 2 else T.RETRIEVE_START
        results[i] = sum(bus.publish(Event(etype, op_id=j)) for j in range(100_000))

    threads = [threading.Thread(target=publisher, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bus.flush(30)
    stats = bus.stats()
    for etype in (T.STORE_START, T.RETRIEVE_START):
        assert stats.published[etype] == 400_000
        assert stats.published[etype] == stats.delivered.get(etype, 0) + stats.dropped.get(etype, 0)
    assert stats.total_delivered == sum(results) == len(sub.events)
    assert stats.queue_depth == 0
    bus.stop(5)


def test_delivery_preserves_publish_order() -> None:
    """Events from one publisher reach a subscriber in publish order, across batches."""
    sub = RecordingSubscriber()
    bus = _started(100_000, sub)
    for i in range(50_000):
        assert bus.publish(Event(T.L1_READ, op_id=i))
    assert bus.flush(10)
    assert [e.op_id for e in sub.events] == list(range(50_000))
    bus.stop(5)


def test_routing_by_declared_types_and_fan_out() -> None:
    """Each subscriber gets only its declared types; untyped subscribers get everything."""
    stores = RecordingSubscriber("stores", frozenset({T.STORE_START, T.STORE_END}))
    lookups = RecordingSubscriber("lookups", frozenset({T.LOOKUP_END}))
    everything = RecordingSubscriber("all", None)
    bus = _started(1000, stores, lookups, everything)
    sequence = [T.STORE_START, T.LOOKUP_END, T.L1_EVICT, T.STORE_END, T.LOOKUP_END]
    for i, etype in enumerate(sequence):
        bus.publish(Event(etype, op_id=i))
    assert bus.flush(5)
    assert [e.type for e in stores.events] == [T.STORE_START, T.STORE_END]
    assert [e.op_id for e in lookups.events] == [1, 4]
    assert [e.type for e in everything.events] == sequence
    bus.stop(5)


def test_failing_subscriber_is_isolated_and_counted() -> None:
    """A subscriber that raises never stops delivery to others; its errors are counted."""
    bad = RecordingSubscriber("bad", fail=True)
    good = RecordingSubscriber("good")
    bus = _started(1000, bad, good)
    for _ in range(3):
        bus.publish(Event(T.END_SESSION, session_id="r"))
        assert bus.flush(5)
    assert len(good.events) == 3
    stats = bus.stats()
    assert stats.subscriber_errors["bad"] >= 1
    assert stats.subscriber_errors["good"] == 0
    bus.stop(5)


def test_slow_subscriber_loses_only_its_own_overflow() -> None:
    """A blocked subscriber never blocks publishers or other subscribers; its overflow is counted."""
    gate = threading.Event()
    slow = RecordingSubscriber("slow", gate=gate)
    fast = RecordingSubscriber("fast")
    bus = _started(10_000, slow, fast, subscriber_backlog=100)
    started = time.monotonic()
    for i in range(2000):
        assert bus.publish(Event(T.L1_WRITE, op_id=i))
        if i % 50 == 49:
            # Bursts smaller than the fast subscriber's backlog: pace on its progress, not on a
            # sleep, so a loaded machine that starves its thread for a while cannot overflow it.
            assert _wait_for_count(fast.events, i + 1, 5), f"fast subscriber stalled at {i}"
    assert time.monotonic() - started < 10.0
    assert [e.op_id for e in fast.events] == list(range(2000))
    gate.set()
    assert bus.flush(5)
    stats = bus.stats()
    slow_dropped = stats.subscriber_dropped["slow"].get(T.L1_WRITE, 0)
    assert slow_dropped > 0
    assert len(slow.events) + slow_dropped == 2000
    assert stats.subscriber_dropped["fast"] == {}
    bus.stop(5)


def test_flush_waits_for_delivery() -> None:
    """flush() returns True only after every earlier event reached every subscriber."""
    gate = threading.Event()
    sub = RecordingSubscriber(gate=gate)
    bus = _started(1000, sub)
    bus.publish(Event(T.REGISTER))
    assert bus.flush(0.2) is False
    gate.set()
    assert bus.flush(5) is True
    assert len(sub.events) == 1
    bus.stop(5)


def test_stop_delivers_everything_admitted_even_while_publishing() -> None:
    """Every publish that returned True before or during stop() is delivered; later ones are refused."""
    sub = RecordingSubscriber()
    bus = _started(100_000, sub, subscriber_backlog=10**6)
    admitted = 0
    halt = threading.Event()

    def publisher() -> None:
        nonlocal admitted
        i = 0
        while not halt.is_set():
            admitted += bus.publish(Event(T.L1_READ, op_id=i))
            i += 1

    t = threading.Thread(target=publisher)
    t.start()
    time.sleep(0.1)
    assert bus.stop(60) is True  # a claim about delivery, not speed: loaded CI boxes are slow
    halt.set()
    t.join()
    assert admitted > 0
    assert len(sub.events) == admitted
    assert sub.shutdown_calls == 1
    assert bus.publish(Event(T.L1_READ)) is False


def test_stop_is_idempotent_and_gathers_shutdown_errors() -> None:
    """stop() twice is harmless; a failing shutdown() is reported, the others still run."""

    class BadShutdown(RecordingSubscriber):
        def shutdown(self) -> None:
            raise RuntimeError("exporter unreachable")

    good = RecordingSubscriber("good")
    bus = _started(100, BadShutdown("bad"), good)
    assert bus.stop(2) is False
    assert bus.stop(2) is False
    assert good.shutdown_calls == 1
    assert any("exporter unreachable" in str(e) for e in bus.shutdown_errors)


def test_stop_deadline_bounds_a_hanging_shutdown() -> None:
    """A subscriber whose shutdown() hangs cannot hold stop() past its deadline."""

    class Hangs(RecordingSubscriber):
        def shutdown(self) -> None:
            time.sleep(10)

    bus = _started(100, Hangs("hangs"))
    started = time.monotonic()
    assert bus.stop(0.5) is False
    assert time.monotonic() - started < 2
    assert any("deadline" in str(e) for e in bus.shutdown_errors)


def test_disabled_bus_refuses_cheaply() -> None:
    """A disabled bus returns False for every publish and counts nothing."""
    sub = RecordingSubscriber()
    bus = _started(10, sub, enabled=False)
    assert bus.publish(Event(T.STORE_START)) is False
    assert bus.stats().total_published == 0
    bus.stop(2)
    assert sub.events == []


def test_events_published_before_start_are_delivered() -> None:
    """Publishing before start() queues within the bound; start() delivers them."""
    sub = RecordingSubscriber()
    bus = EventBus(2)
    bus.register(sub)
    assert bus.publish(Event(T.REGISTER))
    assert bus.publish(Event(T.REGISTER))
    assert not bus.publish(Event(T.REGISTER))
    bus.start()
    assert bus.flush(5)
    assert len(sub.events) == 2
    assert bus.stats().dropped[T.REGISTER] == 1
    bus.stop(2)


def test_publish_stamps_monotonic_time_when_unset() -> None:
    """ts_ns 0 is stamped with the monotonic clock at publish; a given ts_ns is kept."""
    bus = EventBus(10)
    before = time.monotonic_ns()
    e1, e2 = Event(T.L1_EVICT), Event(T.L1_EVICT, ts_ns=42)
    bus.publish(e1)
    bus.publish(e2)
    assert before <= e1.ts_ns <= time.monotonic_ns()
    assert e2.ts_ns == 42
    bus.stop(1)


def test_publish_on_stream_without_gpu_stamps_now() -> None:
    """With no stream (CPU work) publish_on_stream behaves like publish, stamped now."""
    sub = RecordingSubscriber()
    bus = _started(10, sub)
    event = Event(T.STORE_START, ts_ns=1)
    assert bus.publish_on_stream(None, event)
    assert event.ts_ns > 1
    assert bus.flush(5)
    assert sub.events == [event]
    bus.stop(2)


def test_oldest_lag_reports_waiting_events() -> None:
    """stats().oldest_lag_ns is the age of the oldest undelivered event."""
    bus = EventBus(10)
    bus.publish(Event(T.LOOKUP_START))
    time.sleep(0.02)
    assert bus.stats().oldest_lag_ns >= 20_000_000
    bus.stop(1)


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_capacity_is_validated(bad: object) -> None:
    """Capacity below 1 (or not an integer) is rejected with a message naming it."""
    with pytest.raises(ValueError, match="capacity"):
        EventBus(bad)  # type: ignore[arg-type]


def test_subscriber_without_protocol_is_rejected() -> None:
    """register() names the missing attribute of a non-subscriber."""
    with pytest.raises(TypeError, match="lacks required attribute"):
        EventBus(10).register(object())  # type: ignore[arg-type]


class _NonBlocking(RecordingSubscriber):
    blocking = False

    def __init__(self, name: str, **kw: object) -> None:
        super().__init__(name, **kw)  # type: ignore[arg-type]
        self.threads: set[str] = set()

    def on_events(self, events: Sequence[Event]) -> None:
        self.threads.add(threading.current_thread().name)
        super().on_events(events)


def test_non_blocking_subscriber_runs_on_the_dispatcher_thread() -> None:
    """blocking=False subscribers are called on the bus's dispatcher thread, in order, with routing."""
    inline = _NonBlocking("inline", event_types=frozenset({T.STORE_END}))
    threaded = RecordingSubscriber("threaded")
    bus = _started(1000, inline, threaded)
    for i in range(100):
        bus.publish(Event(T.STORE_END if i % 2 else T.STORE_START, op_id=i))
    assert bus.flush(5)
    assert inline.threads == {"kvflow-bus"}
    assert [e.op_id for e in inline.events] == list(range(1, 100, 2))
    assert len(threaded.events) == 100
    bus.stop(5)
    assert inline.shutdown_calls == 1


def test_non_blocking_subscriber_errors_are_isolated() -> None:
    """A raising inline subscriber is counted and never stops delivery to the others."""
    bad = _NonBlocking("bad", fail=True)
    good = RecordingSubscriber("good")
    bus = _started(1000, bad, good)
    for _ in range(3):
        bus.publish(Event(T.L1_READ))
        assert bus.flush(5)
    assert len(good.events) == 3
    assert bus.stats().subscriber_errors["bad"] == 3
    bus.stop(5)


def test_flush_with_a_typed_subscriber_that_receives_nothing() -> None:
    """flush() completes when a threaded subscriber's filter leaves every batch empty."""
    idle = RecordingSubscriber("idle", frozenset({T.END_SESSION}))
    bus = _started(1000, idle)
    for _ in range(5):
        bus.publish(Event(T.L1_WRITE))
        assert bus.flush(2)
    assert idle.events == [] and idle.batches == 0
    bus.stop(5)


class _NoStreams:
    """A stream stamper with no stream work: attaching it turns on the wake coalescing."""

    def enqueue(self, stream: object, event: Event) -> bool:
        raise AssertionError("no stream events in this test")

    def collect(self) -> list[Event]:
        return []

    def pending(self) -> int:
        return 0

    def close(self) -> None:
        pass


def test_dispatcher_coalesces_events_arriving_after_an_idle_wake() -> None:
    """With stream stamps in use, events published within coalesce_s of an idle wake arrive as one batch."""
    sub = RecordingSubscriber()
    bus = EventBus(100, coalesce_s=0.05)
    bus.register(sub)
    bus.attach_stamper(_NoStreams())
    bus.start()
    bus.publish(Event(T.STORE_START, op_id=1))
    time.sleep(0.01)
    bus.publish(Event(T.STORE_END, op_id=1))
    assert bus.flush(5)
    assert sub.batches == 1
    assert [e.op_id for e in sub.events] == [1, 1]
    bus.stop(5)


@pytest.mark.parametrize("bad", [-0.001, 1.0, "1ms"])
def test_coalesce_is_validated(bad: object) -> None:
    """coalesce_s outside [0, 0.1] s is rejected with a message naming it."""
    with pytest.raises(ValueError, match="coalesce_s"):
        EventBus(10, coalesce_s=bad)  # type: ignore[arg-type]
