"""The bounded event bus: never-blocking publish, one dispatcher, isolated subscribers.

Publishing only appends to a list under a lock (admission is atomic, so the bound
holds exactly under concurrent publishers). One dispatcher thread swaps the list
out and hands each batch, filtered by type, to every subscriber's own bounded
backlog; each subscriber runs on its own delivery thread, so a slow or failing
subscriber only loses its own overflow and never stalls publishers or the others.
Subscribers that declare `blocking = False` (in-memory work only) are called on the
dispatcher thread instead, saving a thread hand-off per batch. The dispatcher sleeps on an eventfd that publishers (and native GPU wakers,
see `kvflow.events.stream`) write when there is work.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections import Counter
from collections.abc import Callable
from operator import attrgetter
from typing import Any, Protocol

from kvflow.events.deadline import run_by_deadline
from kvflow.events.stats import BusStats
from kvflow.events.subscriber import Subscriber
from kvflow.events.types import Event, EventType, now_ns

_monotonic_ns = time.monotonic_ns

_type_of = attrgetter("type")
_IDLE_POLL_S = 0.5


class StreamStamper(Protocol):
    """Source of events whose timestamps are stamped later by a GPU stream.

    The bus polls it on every dispatcher wake-up; see `kvflow.events.stream`.
    """

    def enqueue(self, stream: Any, event: Event) -> bool:
        """Reserve room and mark `event`'s point on `stream`; False = dropped."""
        ...

    def collect(self) -> list[Event]:
        """Return the events stamped since the last call, in stamp order."""
        ...

    def pending(self) -> int:
        """Events enqueued on streams whose stamp has not arrived yet."""
        ...

    def close(self) -> None: ...


class _Delivery:
    """One subscriber's delivery: a bounded backlog and its own thread, or inline.

    A subscriber that declares `blocking = False` (its `on_events` does only
    in-memory work) is called on the dispatcher thread: one thread hand-off per
    batch fewer, which matters to a GIL-bound process launching GPU copies.
    """

    def __init__(self, subscriber: Subscriber, backlog_limit: int, on_progress: Callable[[], None]):
        self.subscriber = subscriber
        self.name = subscriber.name
        types = subscriber.event_types
        self.types: frozenset[EventType] | None = None if types is None else frozenset(types)
        self.inline = getattr(subscriber, "blocking", True) is False
        self.backlog_limit = backlog_limit
        self.errors = 0
        self.dropped: Counter[EventType] = Counter()
        self.done_seq = 0
        self._items: list[Event] = []
        self._end_seq = 0
        self._closing = False
        self._cond = threading.Condition(threading.Lock())
        self._on_progress = on_progress
        self._thread = threading.Thread(
            target=self._run, name=f"kvflow-bus-{self.name}", daemon=True
        )

    def start(self) -> None:
        if not self.inline:
            self._thread.start()

    def offer(self, batch: list[Event], end_seq: int) -> None:
        """Deliver or queue the part of `batch` this subscriber wants; overflow is counted."""
        types = self.types
        events = batch if types is None else [e for e in batch if e.type in types]
        if self.inline:
            if events:
                self._deliver(events)
            self.done_seq = end_seq
            return
        with self._cond:
            if not events and not self._items and self.done_seq == self._end_seq:
                # nothing for it and nothing in flight: advance without waking its thread
                self.done_seq = self._end_seq = end_seq
                return
            room = self.backlog_limit - len(self._items)
            if len(events) > room:
                overflow = events[max(room, 0) :]
                self.dropped.update(map(_type_of, overflow))
                events = events[: max(room, 0)]
            self._items.extend(events)
            self._end_seq = end_seq
            self._cond.notify()

    def _deliver(self, events: list[Event]) -> None:
        try:
            self.subscriber.on_events(events)
        except Exception:
            self.errors += 1

    def oldest_ts(self) -> int | None:
        with self._cond:
            return self._items[0].ts_ns if self._items else None

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()

    def join(self, timeout: float) -> None:
        if not self.inline:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and self.done_seq == self._end_seq and not self._closing:
                    self._cond.wait()
                items, self._items = self._items, []
                end_seq = self._end_seq
                if not items and self._closing and self.done_seq == end_seq:
                    return
            if items:
                self._deliver(items)
            self.done_seq = end_seq
            self._on_progress()


class EventBus:
    """Bounded, never-blocking event bus (docs/EVENTS.md, The bus).

    `capacity` bounds the events admitted but not yet dispatched (including GPU
    events waiting for their stream stamp); `subscriber_backlog` bounds each
    subscriber's own queue (defaults to `capacity`); `coalesce_s` is how long the
    dispatcher waits after waking from idle before it takes a batch, once GPU stream
    stamps are in use and the queue is under half full (0 = never waits).

    The bus stamps `publish_on_stream` events on the GPU only once a stream stamper is
    attached (`attach_stamper`): whoever builds the bus attaches one
    (`kvflow.events.stream.attach_native_stamper`), since the bus itself never loads
    CUDA. A bus without a stamper stamps those events at publish, like `publish`.
    """

    def __init__(
        self,
        capacity: int = 10000,
        *,
        enabled: bool = True,
        subscriber_backlog: int | None = None,
        coalesce_s: float = 0.001,
    ) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        if subscriber_backlog is not None and subscriber_backlog < 1:
            raise ValueError(f"subscriber_backlog must be >= 1, got {subscriber_backlog!r}")
        if not isinstance(coalesce_s, (int, float)) or not 0 <= coalesce_s <= 0.1:
            raise ValueError(f"coalesce_s must be a number in [0, 0.1] seconds, got {coalesce_s!r}")
        self._coalesce_s = float(coalesce_s)
        self.capacity = capacity
        self.enabled = enabled
        self._backlog = subscriber_backlog or capacity
        self._lock = threading.Lock()
        self._queue: list[Event] = []
        # Stream events reserved and not yet stamped, per type (indexed by EventType value:
        # a list index is cheaper than a Counter key on the GPU launch path).
        self._reserved = [0] * (max(EventType) + 1)
        self._n_reserved = 0
        self._accepting = enabled
        self._started = False
        self._stopped = False
        self._limit = capacity if enabled else 0
        self._dispatched = 0
        self._dropped: Counter[EventType] = Counter()
        self._delivered: Counter[EventType] = Counter()
        self._deliveries: list[_Delivery] = []
        self._progress = threading.Condition(threading.Lock())
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stamper: StreamStamper | None = None
        self._dispatcher = threading.Thread(
            target=self._dispatch_loop, name="kvflow-bus", daemon=True
        )
        self.shutdown_errors: list[BaseException] = []

    # -- set-up -----------------------------------------------------------------

    @property
    def wake_fd(self) -> int:
        """The eventfd the dispatcher sleeps on; native GPU wakers write it."""
        return self._wake_fd

    def register(self, subscriber: Subscriber) -> None:
        """Add a subscriber; it receives events dispatched from now on."""
        for attr in ("name", "event_types", "on_events", "shutdown"):
            if not hasattr(subscriber, attr):
                raise TypeError(f"subscriber {subscriber!r} lacks required attribute {attr!r}")
        delivery = _Delivery(subscriber, self._backlog, self._notify_progress)
        with self._lock:
            if self._stopped:
                raise RuntimeError("cannot register a subscriber on a stopped bus")
            delivery.done_seq = delivery._end_seq = self._dispatched
            self._deliveries = [*self._deliveries, delivery]
            started = self._started
        if started:
            delivery.start()

    @property
    def subscribers(self) -> list[Subscriber]:
        return [d.subscriber for d in self._deliveries]

    def start(self) -> EventBus:
        """Start the dispatcher and delivery threads (idempotent). Returns self."""
        with self._lock:
            if self._started or self._stopped:
                return self
            self._started = True
            deliveries = list(self._deliveries)
        for delivery in deliveries:
            delivery.start()
        self._dispatcher.start()
        return self

    @property
    def running(self) -> bool:
        return self._accepting

    # -- publishing ---------------------------------------------------------------

    def publish(self, event: Event) -> bool:
        """Admit `event` if there is room; never blocks. False means dropped (or bus off)."""
        if not self._accepting:
            return False
        if not event.ts_ns:
            event.ts_ns = _monotonic_ns()
        lock = self._lock
        lock.acquire()
        try:
            queue = self._queue
            if len(queue) >= self._limit:
                if self._accepting:
                    self._dropped[event.type] += 1
                return False
            queue.append(event)
            if len(queue) != 1:
                return True
        finally:
            lock.release()
        os.eventfd_write(self._wake_fd, 1)
        return True

    def publish_on_stream(self, stream: Any, event: Event) -> bool:
        """Publish `event` stamped when `stream` reaches this point.

        Needs an attached stamper; without one, or for CPU work (`stream` None), the
        event is stamped now and published like `publish`.
        """
        stamper = self._stamper
        if stream is None or stamper is None:
            event.ts_ns = 0
            return self.publish(event)
        return stamper.enqueue(stream, event)

    # -- hooks for the GPU stamp path -------------------------------------------

    @property
    def stamper(self) -> StreamStamper | None:
        """The attached stream stamper, if any."""
        return self._stamper

    def attach_stamper(self, stamper: StreamStamper) -> None:
        """Attach the native stream stamper whose completed events the dispatcher drains."""
        self._stamper = stamper

    def try_reserve(self, etype: EventType) -> bool:
        """Reserve room for one stream event (counted against capacity); count a drop if none."""
        lock = self._lock  # acquire/release, not `with`: this is the GPU launch path
        lock.acquire()
        try:
            if len(self._queue) >= self._limit:  # the limit is 0 once the bus stops accepting
                if self._accepting:
                    self._dropped[etype] += 1
                return False
            self._reserved[etype] += 1
            self._n_reserved += 1
            self._limit -= 1
            return True
        finally:
            lock.release()

    def count_drop(self, etype: EventType) -> None:
        """Count one stream event dropped before it could reserve (e.g. no CUDA event free)."""
        with self._lock:
            if self._accepting:
                self._dropped[etype] += 1

    def release_reservation(self, etype: EventType) -> None:
        """Give back a reservation whose enqueue failed; it is counted as a drop."""
        with self._lock:
            self._reserved[etype] -= 1
            self._n_reserved -= 1
            if self._accepting:
                self._limit += 1
            self._dropped[etype] += 1

    def _admit_stamped(self, events: list[Event]) -> None:
        """Move stamped stream events (already reserved) into the queue."""
        with self._lock:
            reserved = self._reserved
            for event in events:
                reserved[event.type] -= 1
            self._n_reserved -= len(events)
            if self._accepting:
                self._limit += len(events)
            was_empty = not self._queue
            self._queue.extend(events)
        if was_empty:
            os.eventfd_write(self._wake_fd, 1)

    # -- delivery -----------------------------------------------------------------

    def _notify_progress(self) -> None:
        with self._progress:
            self._progress.notify_all()

    def _take_batch(self) -> tuple[list[Event], int]:
        stamper = self._stamper
        if stamper is not None:
            stamped = stamper.collect()
            if stamped:
                self._admit_stamped(stamped)
        with self._lock:
            batch, self._queue = self._queue, []
            self._dispatched += len(batch)
            return batch, self._dispatched

    def _dispatch_loop(self) -> None:
        fd = self._wake_fd
        while True:
            batch, end_seq = self._take_batch()
            if batch:
                self._delivered.update(map(_type_of, batch))
                for delivery in self._deliveries:
                    delivery.offer(batch, end_seq)
                self._notify_progress()
                continue
            with self._lock:
                finished = not self._accepting and self._stopped and self._n_reserved == 0
            if finished:
                return
            ready, _, _ = select.select([fd], [], [], _IDLE_POLL_S)
            if ready:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(fd)
                if (
                    self._coalesce_s
                    and self._stamper is not None
                    and len(self._queue) < self.capacity // 2
                ):
                    # A stream waker fires as the GPU finishes an op, just when the
                    # engine's thread wants the GIL to launch the next one: let it go
                    # first, and deliver what arrives meanwhile as one batch.
                    time.sleep(self._coalesce_s)

    def _admitted(self) -> int:
        """Events admitted so far (call with the lock held)."""
        return self._dispatched + len(self._queue) + self._n_reserved

    def _all_done(self, target: int) -> bool:
        if self._dispatched < target:
            return False
        return all(d.done_seq >= target for d in self._deliveries)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event admitted before this call is delivered; True on success."""
        if not self._started:
            return self._admitted() == self._dispatched
        with self._lock:
            target = self._admitted()
        deadline = None if timeout is None else time.monotonic() + timeout
        os.eventfd_write(self._wake_fd, 1)
        with self._progress:
            while not self._all_done(target):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._progress.wait(0.05 if remaining is None else min(remaining, 0.05))
        return True

    def stop(self, timeout: float = 5.0) -> bool:
        """Deliver everything admitted, then shut subscribers down by one shared deadline.

        Idempotent. Returns True when everything was delivered and every
        subscriber shut down cleanly; errors are gathered in `shutdown_errors`.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._stopped:
                return not self.shutdown_errors
            needs_start = not self._started and self._admitted() > 0
        if needs_start:
            self.start()
        with self._lock:
            self._stopped = True
            was_started = self._started
        delivered = self.flush(timeout) if was_started else True
        with self._lock:
            self._accepting = False
            self._limit = 0
        if was_started:
            delivered = self.flush(max(deadline - time.monotonic(), 0.0)) and delivered
        os.eventfd_write(self._wake_fd, 1)
        for delivery in self._deliveries:
            delivery.close()
        for delivery in self._deliveries:
            delivery.join(max(deadline - time.monotonic(), 0.0))
        if was_started:
            self._dispatcher.join(max(deadline - time.monotonic(), 0.0))
        if self._stamper is not None:
            self._stamper.close()
        self._shutdown_subscribers(deadline)
        if not delivered:
            self.shutdown_errors.append(
                TimeoutError("events were still undelivered at the stop deadline")
            )
        return not self.shutdown_errors

    def _shutdown_subscribers(self, deadline: float) -> None:
        """Call every subscriber's shutdown() concurrently, bounded by `deadline`."""
        tasks = [(d.name, d.subscriber.shutdown) for d in self._deliveries]
        for name, outcome in run_by_deadline(tasks, deadline).items():
            if isinstance(outcome, BaseException):
                self.shutdown_errors.append(
                    RuntimeError(f"subscriber {name!r} shutdown failed: {outcome!r}")
                )

    # -- accounting -----------------------------------------------------------------

    def stats(self) -> BusStats:
        """Snapshot the accounting; exact once the bus is idle (see BusStats)."""
        with self._lock:
            queued = Counter(map(_type_of, self._queue))
            queued.update({EventType(i): n for i, n in enumerate(self._reserved) if n})
            depth = len(self._queue) + self._n_reserved
            oldest = self._queue[0].ts_ns if self._queue else None
            dropped = dict(self._dropped)
            delivered = dict(self._delivered)
            reserved = self._n_reserved
        stamper = self._stamper
        pending_stream = stamper.pending() if stamper is not None else 0
        published: Counter[EventType] = Counter(delivered)
        published.update(dropped)
        published.update(queued)
        for delivery in self._deliveries:
            ts = delivery.oldest_ts()
            if ts is not None and (oldest is None or ts < oldest):
                oldest = ts
        return BusStats(
            published=dict(published),
            delivered=delivered,
            dropped=dropped,
            subscriber_errors={d.name: d.errors for d in self._deliveries},
            subscriber_dropped={d.name: dict(d.dropped) for d in self._deliveries},
            queue_depth=depth,
            oldest_lag_ns=0 if oldest is None else max(now_ns() - oldest, 0),
            capacity=self.capacity,
            pending_stream_events=max(pending_stream, reserved),
        )

    def __del__(self) -> None:
        fd = getattr(self, "_wake_fd", -1)
        if fd >= 0:
            os.close(fd)
