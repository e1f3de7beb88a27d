"""GPU stream events: timed by CUDA events on their stream, delivered through native wakers.

`NativeStreamStamper` is the bus's `StreamStamper`. On the launching thread,
`enqueue` (C: csrc/stream_lanes.c) reserves room on the bus and a CUDA event,
and records that event on the stream: the GPU writes its own timestamp when the
stream gets there, and the stream never waits for the host. On the dispatcher,
`collect` turns completed events' GPU times into `time.monotonic_ns` values and,
for a stream whose oldest event is still pending, arms a native waker
(csrc/stream_wakers.c) on a side stream that waits for it; the waker writes the
bus's eventfd without the GIL. docs/STREAM_EVENTS.md has the design, the
measurements behind it, and how the C extension is built and found.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from operator import attrgetter
from typing import Any, Protocol

from kvflow.cuda.driver import cuda_driver
from kvflow.events.bus import EventBus
from kvflow.events.native import NativeBuildError, load_library
from kvflow.events.types import Event

_log = logging.getLogger(__name__)
_ts_of = attrgetter("ts_ns")
_monotonic_ns = time.monotonic_ns
_attach_lock = threading.Lock()

#: Most CUDA events a stamper keeps in flight; the bus capacity bounds them too.
MAX_SLOTS = 65536
#: Most streams with events in flight at once (one waker slot each).
MAX_STREAMS = 1024
#: Handles of the default streams (legacy NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD):
#: they name the calling thread's current context, so their lanes are keyed by context too.
_DEFAULT_STREAMS = 2
#: Outcomes of the C extension's enqueue_lane (a positive value is a refused record's CUresult).
_RECORDED, _DROPPED, _NO_EVENT = 0, -1, -3
_REANCHOR_NS = 1_000_000_000
_ANCHOR_SPIN_NS = 50_000_000


def stream_handle(stream: Any) -> int:
    """The CUstream of `stream` as an int.

    Accepts a torch.cuda.Stream (`.cuda_stream`), a PyCUDA or kvflow stream
    (`.handle`), or a raw CUstream int (0 is the legacy default stream).
    """
    handle: Any = stream
    if not isinstance(stream, int) or isinstance(stream, bool):
        handle = getattr(stream, "cuda_stream", None)
        if handle is None:
            handle = getattr(stream, "handle", None)
        if not isinstance(handle, int) or isinstance(handle, bool):
            raise TypeError(
                "stream must be a torch.cuda.Stream, an object with an int `handle` "
                f"(PyCUDA, kvflow), a CUstream int, or None; got {type(stream).__name__}"
            )
    if handle < 0:
        raise ValueError(f"a CUstream handle is never negative, got {handle}")
    return int(handle)


class StreamDriver(Protocol):
    """The CUDA driver calls the stamper makes: `kvflow.cuda.driver.Driver` on a GPU, a
    fake one in CPU tests.

    Handles are ints. Methods other than `record` raise RuntimeError on a CUDA error.
    """

    #: Addresses of functions with the signatures of cuLaunchHostFunc, cuStreamWaitEvent,
    #: cuEventRecord (the launching thread's only driver call), cuCtxPushCurrent and
    #: cuCtxPopCurrent: the C extension calls them directly.
    launch_ptr: int
    wait_ptr: int
    record_ptr: int
    push_ptr: int
    pop_ptr: int
    #: cuEventRecord(event, stream) -> CUresult, callable from Python (the clock's anchors).
    record: Callable[[int, int], int]

    def stream_context(self, stream: int) -> int:
        """The context `stream` belongs to; 0 if it is no live stream."""
        ...

    def current_context(self) -> int:
        """This thread's current context; 0 if none."""
        ...

    def push_context(self, ctx: int) -> None: ...

    def pop_context(self) -> None: ...

    def create_event(self) -> int:
        """A timing event in the current context."""
        ...

    def create_stream(self) -> int:
        """A non-blocking stream in the current context."""
        ...

    def query(self, event: int) -> bool:
        """True when `event`'s last record has completed."""
        ...

    def elapsed_ns(self, start: int, end: int) -> int | None:
        """GPU time from completed event `start` to event `end` (may be negative); None
        while `end` has not completed."""
        ...

    def destroy_event(self, event: int) -> None: ...

    def destroy_stream(self, stream: int) -> None: ...

    def error_name(self, code: int) -> str: ...


class _Clock:
    """Maps one context's CUDA event times onto time.monotonic_ns.

    An anchor event recorded on an idle private stream and spun on until it
    completes pins GPU time to host time within a few microseconds; it is
    renewed every second so float32 elapsed times keep sub-microsecond precision.
    Call with the context current.
    """

    def __init__(self, driver: StreamDriver) -> None:
        self._driver = driver
        self.stream = driver.create_stream()
        self.anchor, self.spare = driver.create_event(), driver.create_event()
        self.host_ns = self._pin(self.anchor)

    def _pin(self, event: int) -> int:
        driver = self._driver
        rc = driver.record(event, self.stream)
        if rc:
            raise RuntimeError(f"cuEventRecord failed: {driver.error_name(rc)}")
        deadline = _monotonic_ns() + _ANCHOR_SPIN_NS
        while not driver.query(event) and _monotonic_ns() < deadline:
            pass
        return _monotonic_ns()

    def renew(self) -> None:
        """Re-pin on a fresh anchor once the current one is a second old."""
        if _monotonic_ns() - self.host_ns > _REANCHOR_NS:
            self.host_ns = self._pin(self.spare)
            self.anchor, self.spare = self.spare, self.anchor

    def to_host(self, event: int) -> int | None:
        """`event`'s time on the host clock; None while it has not completed."""
        elapsed = self._driver.elapsed_ns(self.anchor, event)
        return None if elapsed is None else self.host_ns + elapsed


class _Lane:
    """What the dispatcher keeps of one stream: its key, context, event pool and side stream."""

    __slots__ = ("ctx", "key", "pool", "side")

    def __init__(self, key: int | tuple[int, int], ctx: int, pool: int) -> None:
        self.key = key
        self.ctx = ctx
        self.pool = pool
        self.side = 0


class NativeStreamStamper:
    """Times bus events on CUDA streams (see the module docstring).

    At most `slots` events (default: the bus capacity, at most MAX_SLOTS) wait for
    their stream at once; an event finding none free is dropped and counted like
    any other drop. `enqueue` is the C extension's: a bus reservation, one
    cuEventRecord and, when its stream has no waker armed, an eventfd write.
    """

    #: Record `event`'s CUDA event on `stream`; False = dropped (bus full or no slot).
    #: Raises TypeError/ValueError for something that is no CUDA stream, and RuntimeError
    #: when CUDA refuses the record (the event then counts as dropped).
    enqueue: Callable[[Any, Event], bool]

    def __init__(
        self,
        bus: EventBus,
        driver: StreamDriver,
        *,
        slots: int | None = None,
        max_streams: int = MAX_STREAMS,
    ) -> None:
        n = min(bus.capacity, MAX_SLOTS) if slots is None else slots
        if not isinstance(n, int) or not 1 <= n <= MAX_SLOTS:
            raise ValueError(f"slots must be an integer in [1, {MAX_SLOTS}], got {slots!r}")
        if not isinstance(max_streams, int) or max_streams < 1:
            raise ValueError(f"max_streams must be an integer >= 1, got {max_streams!r}")
        self._bus = bus
        self._driver = driver
        self.slots = n
        self.max_streams = max_streams
        self._events_made = 0
        # Stream key -> lane index, read by the C enqueue: an int key is a CUstream; the
        # default streams are keyed (handle, context) and always resolved here.
        self._keys: dict[int | tuple[int, int], int] = {}
        self._lanes: dict[int, _Lane] = {}
        self._free_lanes = list(range(max_streams - 1, -1, -1))
        self._pools: dict[int, int] = {}
        self._clocks: dict[int, _Clock] = {}
        self._setup_lock = threading.Lock()
        self._lock = threading.Lock()
        self._closed = False
        self._failure_logged = False
        self._table = load_library().LaneTable(
            max_streams,
            bus.wake_fd,
            driver.record_ptr,
            driver.push_ptr,
            driver.pop_ptr,
            driver.launch_ptr,
            driver.wait_ptr,
            self._keys,
            bus.try_reserve,
            bus.release_reservation,
            self._enqueue_slow,
        )
        self.enqueue = self._table.enqueue

    # -- launching thread: what the C enqueue hands back ------------------------------

    def _enqueue_slow(self, stream: Any, event: Event, code: int) -> bool:
        """Finish an enqueue the C side could not: find or open the stream's lane, add a
        CUDA event to an empty pool, or report a refused record."""
        handle = stream_handle(stream)
        while True:
            if code > 0:
                raise RuntimeError(
                    f"cuEventRecord on stream {handle:#x} failed: "
                    f"{self._driver.error_name(code)}; {event.type.name} counted as dropped"
                )
            key = handle if handle > _DEFAULT_STREAMS else (handle, self._driver.current_context())
            index = self._keys.get(key)
            if index is None:
                index = self._open_lane(key, handle)
            elif code == _NO_EVENT:
                try:
                    added = self._add_event(self._lanes[index])
                except RuntimeError:
                    self._bus.count_drop(event.type)
                    raise
                if not added:  # every slot is in flight
                    self._bus.count_drop(event.type)
                    return False
            code = self._table.enqueue_lane(index, handle, event)
            if code == _RECORDED:
                return True
            if code == _DROPPED:
                return False

    def _open_lane(self, key: int | tuple[int, int], handle: int) -> int:
        with self._setup_lock:
            index = self._keys.get(key)
            if index is not None:
                return index
            ctx = key[1] if isinstance(key, tuple) else self._driver.stream_context(handle)
            if not ctx:
                raise ValueError(
                    f"stream {handle:#x} is no CUDA stream of a live context "
                    "(or, for a default stream, no context is current on this thread)"
                )
            if not self._free_lanes:
                self._prune_locked()
            if not self._free_lanes:
                raise RuntimeError(
                    f"more than {self.max_streams} CUDA streams have stream events in flight"
                )
            pool = self._pools.get(ctx)
            if pool is None:
                pool = self._pools[ctx] = self._table.add_pool()
            index = self._free_lanes.pop()
            self._lanes[index] = _Lane(key, ctx, pool)
            self._table.open_lane(index, key, ctx, pool)
            return index

    def _add_event(self, lane: _Lane) -> bool:
        """Create a CUDA event in `lane`'s context for its pool; False once `slots` exist."""
        with self._setup_lock:
            if self._events_made >= self.slots:
                return False
            self._events_made += 1
        driver = self._driver
        try:
            driver.push_context(lane.ctx)
            try:
                cuda_event = driver.create_event()
            finally:
                driver.pop_context()
        except RuntimeError:
            with self._setup_lock:
                self._events_made -= 1
            raise
        self._table.give(lane.pool, cuda_event)
        return True

    # -- dispatcher ---------------------------------------------------------------------

    def collect(self) -> list[Event]:
        """Return the events whose stream reached them since the last call, in time order."""
        stamped: list[Event] = []
        table = self._table
        with self._lock:
            if self._closed:
                return stamped
            table.drain()  # disarms the lanes whose waker ran
            for index, lane in list(self._lanes.items()):
                if table.pending(index):
                    self._settle(index, lane, stamped)
            if len(self._lanes) > self.max_streams // 2:
                with self._setup_lock:
                    self._prune_locked()
        if len(stamped) > 1:
            stamped.sort(key=_ts_of)
        return stamped

    def _settle(self, index: int, lane: _Lane, out: list[Event]) -> None:
        """Move `lane`'s completed events to `out`; unless its waker is still armed, arm it
        on the first pending one (one armed waker per lane keeps the C log bounded)."""
        driver, table = self._driver, self._table
        try:
            driver.push_context(lane.ctx)
            try:
                clock = self._clocks.get(lane.ctx) or self._clocks.setdefault(
                    lane.ctx, _Clock(driver)
                )
                clock.renew()
                while cuda_event := table.head(index):
                    ts = clock.to_host(cuda_event)
                    if ts is None:
                        break
                    out.append(table.pop(index, ts))
                waiting = table.pending(index)
                if waiting and not lane.side:
                    lane.side = driver.create_stream()
            finally:
                driver.pop_context()
        except RuntimeError as exc:
            self._give_up(index, out, exc)
            return
        if not waiting or table.armed(index):
            return
        rc = table.arm(index, lane.side)
        if rc:
            self._give_up(index, out, RuntimeError(f"arming a waker failed: {rc}"))

    def _give_up(self, index: int, out: list[Event], exc: Exception) -> None:
        """CUDA failed for a lane (a broken context): deliver its events stamped now."""
        if not self._failure_logged:
            self._failure_logged = True
            _log.warning("stream events fall back to host stamps: %s", exc)
        now = _monotonic_ns()
        table = self._table
        while table.head(index):
            out.append(table.pop(index, now))

    def _prune_locked(self) -> None:
        """Forget idle lanes so streams that come and go do not pile up (hold _setup_lock)."""
        for index, lane in list(self._lanes.items()):
            if not self._table.close_lane(index, lane.key):
                continue
            del self._lanes[index]
            self._free_lanes.append(index)
            if lane.side:
                self._driver.destroy_stream(lane.side)

    # -- accounting and shutdown --------------------------------------------------------

    def pending(self) -> int:
        """Events recorded on streams and not collected yet."""
        return int(self._table.pending(-1))

    def close(self) -> None:
        """Stop collecting. CUDA resources and the ring are released when this object goes."""
        with self._lock:
            self._closed = True

    def __del__(self) -> None:
        # Wakers still queued on a side stream hold their own reference to the C ring, so it
        # is freed after the last has run; CUDA defers destroying a stream or event that
        # queued work still uses.
        table = getattr(self, "_table", None)
        if table is None:
            return
        driver = self._driver
        try:
            for cuda_event in table.take_all():
                driver.destroy_event(cuda_event)
            for lane in self._lanes.values():
                if lane.side:
                    driver.destroy_stream(lane.side)
            for clock in self._clocks.values():
                driver.destroy_event(clock.anchor)
                driver.destroy_event(clock.spare)
                driver.destroy_stream(clock.stream)
        except Exception as exc:  # interpreter or CUDA shutting down
            _log.debug("stream stamper cleanup: %r", exc)


def attach_native_stamper(bus: EventBus) -> NativeStreamStamper | None:
    """Give `bus` a NativeStreamStamper unless it has a stamper already; None without CUDA.

    Whoever builds a bus calls this (the bus never imports this module), ideally at
    start-up: the first call per machine and Python builds the C extension. Without a
    GPU, or for a bus that takes no events (disabled or stopped), nothing is attached;
    with a GPU but no working C compiler a warning is logged once. Either way the bus
    then stamps stream events on the CPU at publish.
    """
    if not bus.running:
        return None
    driver = cuda_driver()
    if driver is None:
        return None
    with _attach_lock:
        current = bus.stamper
        if isinstance(current, NativeStreamStamper):
            return current
        if current is not None or not _helper_available():
            return None
        stamper = NativeStreamStamper(bus, driver)
        bus.attach_stamper(stamper)
        return stamper


@functools.cache
def _helper_available() -> bool:
    try:
        load_library()
    except (NativeBuildError, OSError) as exc:
        _log.warning("GPU stream stamps disabled, events are stamped at publish: %s", exc)
        return False
    return True
