"""The bus's room accounting for stream events, its backlog lag, and its eventfd's lifetime.

A stream stamper (the native one in kvflow.events.stream) reserves room with
`try_reserve` before marking an event on a GPU stream, hands the stamped events back
through `collect`, and gives a reservation back with `release_reservation` when its
enqueue fails. `_Stamper` below does the same on the CPU, so these tests check the
bus's side of that contract without a GPU. (Written against surviving mutants,
docs/TESTING.md "Mutation testing".)
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvflow.events import Event, EventBus, EventType
from kvflow.events.testing import RecordingSubscriber

T = EventType
STREAM = object()  # any non-None stream: the bus hands it to the stamper untouched


class _Stamper:
    """A CPU stream stamper on the bus's reservation hooks, as the native one is."""

    def __init__(self, bus: EventBus, *, enqueue_fails: bool = False) -> None:
        self._bus = bus
        self.enqueue_fails = enqueue_fails
        self._lock = threading.Lock()
        self._waiting: list[Event] = []
        self._done: list[Event] = []

    def enqueue(self, stream: Any, event: Event) -> bool:
        if not self._bus.try_reserve(event.type):
            return False
        if self.enqueue_fails:  # e.g. no CUDA event free after reserving
            self._bus.release_reservation(event.type)
            return False
        with self._lock:
            self._waiting.append(event)
        return True

    def complete(self, *, wake: bool = True) -> None:
        """The stream reached every marked point: stamp them and wake the dispatcher."""
        with self._lock:
            for event in self._waiting:
                event.ts_ns = time.monotonic_ns()
            self._done += self._waiting
            self._waiting = []
        if wake:
            os.eventfd_write(self._bus.wake_fd, 1)

    def collect(self) -> list[Event]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def pending(self) -> int:
        with self._lock:
            return len(self._waiting)

    def close(self) -> None:
        pass


def _bus_with_stamper(capacity: int, **kw: bool) -> tuple[EventBus, _Stamper, RecordingSubscriber]:
    sub = RecordingSubscriber()
    bus = EventBus(capacity)
    bus.register(sub)
    stamper = _Stamper(bus, **kw)
    bus.attach_stamper(stamper)
    bus.start()
    return bus, stamper, sub


def _stream_room(bus: EventBus) -> int:
    """How many stream events the bus admits now (each stays reserved: nothing drains)."""
    n = 0
    while bus.publish_on_stream(STREAM, Event(T.L1_WRITE, op_id=n)):
        n += 1
        assert n <= 10 * bus.capacity, "the bus admits past its capacity"
    return n


def test_stream_events_hold_room_until_stamped_and_give_it_back() -> None:
    """Reserved stream events count against capacity; once stamped and delivered, the whole
    capacity is free again, and no more; every refused reservation is counted as a drop."""
    bus, stamper, sub = _bus_with_stamper(4)
    assert all(bus.publish_on_stream(STREAM, Event(T.STORE_START, op_id=i)) for i in range(3))
    stats = bus.stats()
    assert stats.queue_depth == 3 and stats.pending_stream_events == 3
    assert stats.published == {T.STORE_START: 3}
    stamper.complete()
    assert bus.flush(5)
    assert [e.op_id for e in sub.events] == [0, 1, 2]
    stats = bus.stats()
    assert stats.queue_depth == 0 and stats.pending_stream_events == 0
    assert stats.delivered == {T.STORE_START: 3}
    assert _stream_room(bus) == 4  # the fifth is refused and counted
    assert not bus.publish_on_stream(STREAM, Event(T.L1_WRITE))
    assert bus.stats().dropped == {T.L1_WRITE: 2}
    stamper.complete()
    assert bus.flush(5)
    assert len(sub.events) == 7
    assert bus.stop(5)


def test_a_released_reservation_gives_its_room_back_and_counts_as_a_drop() -> None:
    """An enqueue that fails after reserving releases the room (exactly one slot) and
    the event is counted dropped, not pending."""
    bus, stamper, sub = _bus_with_stamper(4, enqueue_fails=True)
    for i in range(6):
        assert not bus.publish_on_stream(STREAM, Event(T.RETRIEVE_START, op_id=i))
    stats = bus.stats()
    assert stats.dropped == {T.RETRIEVE_START: 6}
    assert stats.queue_depth == 0 and stats.pending_stream_events == 0
    stamper.enqueue_fails = False
    assert _stream_room(bus) == 4  # the whole capacity is still there, and no more
    stamper.complete()
    assert bus.flush(5)
    assert len(sub.events) == 4
    assert bus.stop(5)


def test_oldest_lag_counts_events_waiting_in_a_subscriber_backlog() -> None:
    """Events dispatched to a stalled subscriber but not yet delivered still age in
    stats().oldest_lag_ns, though the bus's own queue is empty."""
    gate = threading.Event()
    sub = RecordingSubscriber(gate=gate)
    bus = EventBus(100)
    bus.register(sub)
    bus.start()

    def dispatched() -> None:
        deadline = time.monotonic() + 5
        while bus.stats().queue_depth and time.monotonic() < deadline:
            time.sleep(0.005)
        assert bus.stats().queue_depth == 0

    try:
        bus.publish(Event(T.L1_READ, op_id=0))  # its delivery thread takes it and stalls
        dispatched()
        time.sleep(0.02)
        bus.publish(Event(T.L1_READ, op_id=1))  # so this one waits in the backlog
        dispatched()
        time.sleep(0.05)
        assert 50_000_000 <= bus.stats().oldest_lag_ns < 60 * 10**9
    finally:
        gate.set()
    assert bus.flush(5)
    assert [e.op_id for e in sub.events] == [0, 1]
    assert bus.stats().oldest_lag_ns == 0
    assert bus.stop(5)


def _eventfds() -> int:
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (or the listing's own fd)
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sum(link == "anon_inode:[eventfd]" for link in fds)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_dropped_bus_closes_its_eventfd() -> None:
    """Buses that are garbage-collected (started or not) leave no eventfd behind."""
    gc.collect()
    before = _eventfds()
    for _ in range(20):
        EventBus(10)
        bus = EventBus(10)
        bus.start()
        assert bus.stop(5)
        del bus
    gc.collect()
    assert _eventfds() <= before  # 40 more with a leak


def test_a_bus_that_failed_to_construct_is_collected_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EventBus.__del__ on a half-built bus (its constructor raised before the eventfd
    existed) raises nothing: no 'Exception ignored in __del__' noise."""
    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    for bad in (0, -1):
        with pytest.raises(ValueError):
            EventBus(bad)
    gc.collect()
    assert seen == []


def test_flush_waits_for_a_batch_in_flight_when_later_batches_are_filtered_out() -> None:
    """A typed subscriber busy with one batch is not marked done by later batches it filters
    out entirely: flush() keeps waiting for the batch in flight."""
    gate = threading.Event()
    sub = RecordingSubscriber(event_types=frozenset({T.STORE_END}), gate=gate)
    bus = EventBus(100)
    bus.register(sub)
    bus.start()
    try:
        bus.publish(Event(T.STORE_END, op_id=0))
        deadline = time.monotonic() + 5
        while bus.stats().queue_depth and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)  # its delivery thread has taken the batch and waits on the gate
        bus.publish(Event(T.L1_READ, op_id=1))  # nothing in it for this subscriber
        assert not bus.flush(0.3)
    finally:
        gate.set()
    assert bus.flush(5)
    assert [e.op_id for e in sub.events] == [0]
    assert bus.stop(5)


def _delivery_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvflow-bus-")]


def test_stop_ends_every_delivery_thread_promptly() -> None:
    """stop() closes each threaded subscriber's delivery: its thread exits, and stop does
    not sit out its timeout waiting for it."""
    before = set(_delivery_threads())
    subs = [RecordingSubscriber(f"mut-stop-{i}") for i in range(3)]
    bus = EventBus(100)
    for sub in subs:
        bus.register(sub)
    bus.start()
    try:
        # named for thread dumps (py-spy, faulthandler), and daemons: an unstopped bus
        # never holds the interpreter's exit
        running = {t.name: t for t in set(_delivery_threads()) - before}
        assert sorted(running) == [f"kvflow-bus-mut-stop-{i}" for i in range(3)]
        assert all(t.daemon for t in running.values())
    except AssertionError:
        bus.stop(1)
        raise
    bus.publish(Event(T.L1_READ))
    started = time.monotonic()
    assert bus.stop(10)
    assert time.monotonic() - started < 3
    assert set(_delivery_threads()) <= before
    assert all(len(sub.events) == 1 and sub.shutdown_calls == 1 for sub in subs)


def test_stop_deadline_bounds_a_subscriber_stuck_in_on_events() -> None:
    """A subscriber that never returns from on_events cannot hold stop() past its timeout:
    stop returns False, with the undelivered events named in shutdown_errors."""
    gate = threading.Event()
    stuck = RecordingSubscriber("mut-stuck", gate=gate)
    bus = EventBus(100)
    bus.register(stuck)
    bus.start()
    bus.publish(Event(T.L1_READ))
    release = threading.Timer(8, gate.set)  # frees the thread whatever happens
    release.start()
    try:
        started = time.monotonic()
        assert not bus.stop(0.2)
        assert time.monotonic() - started < 1.0
        assert [str(e) for e in bus.shutdown_errors if isinstance(e, TimeoutError)] == [
            "events were still undelivered at the stop deadline"
        ]
    finally:
        gate.set()
        release.cancel()


def test_a_subscriber_registered_on_a_running_bus_gets_what_follows() -> None:
    bus = EventBus(100).start()
    late = RecordingSubscriber("late")
    bus.register(late)
    bus.publish(Event(T.L1_READ, op_id=7))
    assert bus.flush(5)
    assert [e.op_id for e in late.events] == [7]
    assert bus.stop(5)
    with pytest.raises(RuntimeError, match=r"^cannot register a subscriber on a stopped bus$"):
        bus.register(RecordingSubscriber("too-late"))


def test_one_event_on_an_idle_bus_wakes_the_dispatcher() -> None:
    """A publish onto an empty queue wakes the dispatcher at once, rather than leaving the
    event for its idle poll (0.5 s); with no stream stamper attached it does not wait
    coalesce_s either. Median of 5 latencies, so load spikes do not decide."""
    sub = RecordingSubscriber()
    bus = EventBus(100, coalesce_s=0.1)
    bus.register(sub)
    bus.start()
    latencies = []
    for i in range(5):
        time.sleep(0.05)  # idle: the dispatcher sleeps on its eventfd
        started = time.monotonic()
        bus.publish(Event(T.L1_READ, op_id=i))
        while len(sub.events) <= i and time.monotonic() - started < 5:
            time.sleep(0.001)
        latencies.append(time.monotonic() - started)
    assert sorted(latencies)[2] < 0.08, latencies
    assert bus.stop(5)


def test_a_never_started_bus_stops_cleanly() -> None:
    """flush() on a bus never started is True only while nothing waits; stop() is clean."""
    bus = EventBus(10)
    assert bus.flush(0.1)
    bus.publish(Event(T.L1_READ))
    assert not bus.flush(0.1)  # nothing can deliver it until start (or stop)
    empty = EventBus(10)
    assert empty.stop(1)
    assert empty.shutdown_errors == []
    assert bus.stop(5)


@contextlib.contextmanager
def _delivery_held_for(seconds: float) -> Iterator[tuple[EventBus, RecordingSubscriber]]:
    """A bus (not started) whose one subscriber cannot take a delivery for `seconds`."""
    gate = threading.Event()
    sub = RecordingSubscriber(gate=gate)
    bus = EventBus(100)
    bus.register(sub)
    opener = threading.Timer(seconds, gate.set)
    opener.start()
    try:
        yield bus, sub
    finally:
        gate.set()
        opener.cancel()


def test_flush_without_a_timeout_waits_for_delivery() -> None:
    """flush() with no timeout waits (here 0.1 s) for a delivery; start() is idempotent."""
    with _delivery_held_for(0.1) as (bus, sub):
        assert bus.start() is bus
        assert bus.start() is bus  # a second start starts nothing
        bus.publish(Event(T.L1_READ, op_id=3))
        assert bus.flush()
        assert [e.op_id for e in sub.events] == [3]
    assert bus.stop(5)
    assert bus.start() is bus  # nor does a start after stop
    assert not bus.running


def test_a_stopped_bus_refuses_stream_events_without_counting_drops() -> None:
    bus, stamper, _sub = _bus_with_stamper(4)
    assert bus.stop(5)
    assert not bus.publish_on_stream(STREAM, Event(T.STORE_START))
    assert not bus.publish(Event(T.STORE_START))
    stats = bus.stats()
    assert stats.dropped == {} and stats.pending_stream_events == 0
    assert stamper.pending() == 0


class _BusyStamper(_Stamper):
    """A stamper with stream work of its own the bus holds no reservation for."""

    def pending(self) -> int:
        return 7


def test_stats_report_capacity_and_the_stampers_pending_events() -> None:
    plain = EventBus(12)
    stats = plain.stats()
    assert stats.capacity == 12 and stats.pending_stream_events == 0
    assert stats.queue_depth == 0 and stats.oldest_lag_ns == 0
    assert plain.stop(1)
    bus = EventBus(12)
    bus.attach_stamper(_BusyStamper(bus))
    assert bus.stats().pending_stream_events == 7
    assert bus.stop(1)


def test_flush_uses_all_of_a_short_timeout() -> None:
    """flush(0.9) waits out a delivery that takes 0.1 s rather than giving up early."""
    with _delivery_held_for(0.1) as (bus, sub):
        bus.start()
        bus.publish(Event(T.L1_READ))
        assert bus.flush(0.9)
        assert len(sub.events) == 1
    assert bus.stop(5)


class _StuckInline(RecordingSubscriber):
    """Runs on the dispatcher thread (blocking = False) and hangs there until the gate opens."""

    blocking = False


def test_stop_deadline_bounds_a_dispatcher_stuck_in_an_inline_subscriber() -> None:
    gate = threading.Event()
    bus = EventBus(100)
    bus.register(_StuckInline("mut-inline-stuck", gate=gate))
    bus.start()
    bus.publish(Event(T.L1_READ))
    release = threading.Timer(8, gate.set)
    release.start()
    try:
        started = time.monotonic()
        assert not bus.stop(0.2)
        assert time.monotonic() - started < 1.0
    finally:
        gate.set()
        release.cancel()


def test_stamped_events_without_a_wake_are_collected_by_the_idle_poll() -> None:
    """A stamp whose waker never fired is still collected: the idle dispatcher polls the
    stamper every 0.5 s (flush is not used here: it would wake the dispatcher itself)."""
    bus, stamper, sub = _bus_with_stamper(4)
    assert bus.publish_on_stream(STREAM, Event(T.STORE_END, op_id=5))
    stamper.complete(wake=False)
    deadline = time.monotonic() + 5
    while not sub.events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [e.op_id for e in sub.events] == [5]
    assert bus.stop(5)


def test_constructor_bounds_and_defaults() -> None:
    """The smallest valid settings are accepted, the next ones down refused by name."""
    assert EventBus().capacity == 10000 and EventBus().enabled is True
    assert EventBus(1, subscriber_backlog=1, coalesce_s=0).capacity == 1
    assert EventBus(1, coalesce_s=0.1).enabled is True
    assert EventBus(1, enabled=False).enabled is False
    with pytest.raises(ValueError, match=r"^subscriber_backlog must be >= 1, got 0$"):
        EventBus(10, subscriber_backlog=0)


def test_every_event_type_can_be_reserved_as_a_stream_event() -> None:
    bus, stamper, sub = _bus_with_stamper(len(EventType))
    for etype in EventType:
        assert bus.publish_on_stream(STREAM, Event(etype))
    assert bus.stats().published == dict.fromkeys(EventType, 1)
    stamper.complete()
    assert bus.flush(5)
    assert sorted(e.type for e in sub.events) == sorted(EventType)
    assert bus.stop(5)


def test_a_disabled_bus_reserves_nothing_and_its_dispatcher_is_a_daemon() -> None:
    off = EventBus(10, enabled=False)
    off.attach_stamper(_Stamper(off))
    assert not off.publish_on_stream(STREAM, Event(T.STORE_START))
    assert off.stats().pending_stream_events == 0
    assert off.stop(1)
    bus = EventBus(10).start()
    daemons = [t.daemon for t in threading.enumerate() if t.name == "kvflow-bus"]
    assert bus.stop(5)
    assert daemons and all(daemons)
