"""GPU stream events: timed by CUDA events on their stream, delivered through native wakers.

`NativeStreamStamper` is the bus's `StreamStamper`. On the launching thread,
`enqueue` reserves room on the bus and a CUDA event, and records that event on
the stream: the GPU writes its own timestamp when the stream gets there, and the
stream never waits for the host. On the dispatcher, `collect` turns completed
events' GPU times into `time.monotonic_ns` values and, for a stream whose oldest
event is still pending, arms a native waker (csrc/stream_wakers.c) on a side
stream that waits for it; the waker writes the bus's eventfd without the GIL.
docs/STREAM_EVENTS.md has the design, the measurements behind it, and how the
C helper is built and found.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from operator import attrgetter
from typing import Any, Protocol

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
_CUDA_ERROR_INVALID_CONTEXT = 201
_CUDA_ERROR_NOT_READY = 600
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
    """The CUDA driver calls the stamper makes (a fake one drives it in CPU tests).

    Handles are ints. Methods other than `record` raise RuntimeError on a CUDA error.
    """

    #: Addresses of functions with cuLaunchHostFunc's and cuStreamWaitEvent's signatures.
    launch_ptr: int
    wait_ptr: int
    #: cuEventRecord(event, stream) -> CUresult: the launching thread's only driver call.
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


def _first(lib: ctypes.CDLL, *names: str) -> Any:
    for name in names:
        try:
            return getattr(lib, name)
        except AttributeError:
            continue
    raise AttributeError(f"libcuda lacks {names[0]}")


class CudaDriver:
    """`StreamDriver` over libcuda through ctypes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, vpp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        self.launch_ptr = ctypes.cast(lib.cuLaunchHostFunc, vp).value or 0
        self.wait_ptr = ctypes.cast(lib.cuStreamWaitEvent, vp).value or 0
        # PyDLL keeps the GIL: these calls are short and never wait for the GPU.
        fast = ctypes.PyDLL(lib._name)
        self.record: Callable[[int, int], int] = fast.cuEventRecord
        self._query = fast.cuEventQuery
        self._elapsed = fast.cuEventElapsedTime
        self._stream_ctx = lib.cuStreamGetCtx
        self._get_ctx = lib.cuCtxGetCurrent
        self._push = _first(lib, "cuCtxPushCurrent_v2", "cuCtxPushCurrent")
        self._pop = _first(lib, "cuCtxPopCurrent_v2", "cuCtxPopCurrent")
        self._event_create = lib.cuEventCreate
        self._stream_create = lib.cuStreamCreate
        self._event_destroy = _first(lib, "cuEventDestroy_v2", "cuEventDestroy")
        self._stream_destroy = _first(lib, "cuStreamDestroy_v2", "cuStreamDestroy")
        self._error_name = lib.cuGetErrorName
        for fn, args in (
            (fast.cuEventRecord, [vp, vp]),
            (self._query, [vp]),
            (self._elapsed, [ctypes.POINTER(ctypes.c_float), vp, vp]),
            (self._stream_ctx, [vp, vpp]),
            (self._get_ctx, [vpp]),
            (self._push, [vp]),
            (self._pop, [vpp]),
            (self._event_create, [vpp, ctypes.c_uint]),
            (self._stream_create, [vpp, ctypes.c_uint]),
            (self._event_destroy, [vp]),
            (self._stream_destroy, [vp]),
            (self._error_name, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]),
        ):
            fn.argtypes = args
            fn.restype = ctypes.c_int

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what} failed: {self.error_name(rc)}")

    def stream_context(self, stream: int) -> int:
        ctx = ctypes.c_void_p()
        return 0 if self._stream_ctx(stream, ctypes.byref(ctx)) else ctx.value or 0

    def current_context(self) -> int:
        ctx = ctypes.c_void_p()
        return 0 if self._get_ctx(ctypes.byref(ctx)) else ctx.value or 0

    def push_context(self, ctx: int) -> None:
        self._check(self._push(ctx), "cuCtxPushCurrent")

    def pop_context(self) -> None:
        self._check(self._pop(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")

    def create_event(self) -> int:
        event = ctypes.c_void_p()
        self._check(self._event_create(ctypes.byref(event), 0), "cuEventCreate")
        return event.value or 0

    def create_stream(self) -> int:
        stream = ctypes.c_void_p()
        self._check(self._stream_create(ctypes.byref(stream), 1), "cuStreamCreate")
        return stream.value or 0

    def query(self, event: int) -> bool:
        rc = self._query(event)
        if rc == _CUDA_ERROR_NOT_READY:
            return False
        self._check(rc, "cuEventQuery")
        return True

    def elapsed_ns(self, start: int, end: int) -> int | None:
        ms = ctypes.c_float()
        rc = self._elapsed(ctypes.byref(ms), start, end)
        if rc == _CUDA_ERROR_NOT_READY:
            return None
        self._check(rc, "cuEventElapsedTime")
        return round(ms.value * 1e6)

    def destroy_event(self, event: int) -> None:
        self._event_destroy(event)

    def destroy_stream(self, stream: int) -> None:
        self._stream_destroy(stream)

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._error_name(code, ctypes.byref(name)) or not name.value:
            return f"CUresult {code}"
        return f"{name.value.decode()} ({code})"


@functools.cache
def cuda_driver() -> CudaDriver | None:
    """The CUDA driver when it loads and sees at least one device; None otherwise (cached)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return None
    return CudaDriver(lib)


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
    """One stream's pending events, in record order, and whether its waker is armed."""

    __slots__ = ("armed", "ctx", "fifo", "lock", "pool", "retired", "side", "waker")

    def __init__(self, ctx: int, waker: int, pool: list[int]) -> None:
        self.ctx = ctx
        self.waker = waker
        self.pool = pool
        self.fifo: deque[tuple[int, Event]] = deque()
        self.lock = threading.Lock()
        self.armed = False
        self.side = 0
        self.retired = False


class NativeStreamStamper:
    """Times bus events on CUDA streams (see the module docstring).

    At most `slots` events (default: the bus capacity, at most MAX_SLOTS) wait for
    their stream at once; an event finding none free is dropped and counted like
    any other drop. `enqueue` costs a bus reservation, one cuEventRecord and, when
    its stream has no waker armed, an eventfd write.
    """

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
        self._lib = load_library()
        ring = self._lib.kvf_ring_create(
            max_streams, bus.wake_fd, driver.launch_ptr, driver.wait_ptr
        )
        if not ring:
            raise OSError(f"kvf_ring_create({max_streams}) failed (out of memory or bad wake fd)")
        self._ring: int = ring
        self._bus = bus
        self._wake = self._lib.kvf_ring_wake
        self._driver = driver
        self._record = driver.record
        self.slots = n
        self.max_streams = max_streams
        self._events_made = 0
        self._lanes: dict[int | tuple[int, int], _Lane] = {}
        self._by_waker: list[_Lane | None] = [None] * max_streams
        self._free_wakers = list(range(max_streams - 1, -1, -1))
        self._pools: dict[int, list[int]] = {}
        self._clocks: dict[int, _Clock] = {}
        self._setup_lock = threading.Lock()
        self._lock = threading.Lock()
        self._drained = (ctypes.c_uint32 * max_streams)()
        self._wake_pending = False
        self._closed = False
        self._failure_logged = False

    # -- launching thread -------------------------------------------------------------

    def enqueue(self, stream: Any, event: Event) -> bool:
        """Record `event`'s CUDA event on `stream`; False = dropped (bus full or no slot).

        Raises TypeError/ValueError for something that is no CUDA stream, and
        RuntimeError when CUDA refuses the record (the event then counts as dropped).
        """
        key: int | tuple[int, int]
        handle: Any
        if type(stream) is int and stream > _DEFAULT_STREAMS:
            handle = key = stream
        else:
            handle = getattr(stream, "cuda_stream", None)  # torch, checked inline: hot path
            if type(handle) is not int or handle < 0:
                handle = stream_handle(stream)
            key = handle if handle > _DEFAULT_STREAMS else (handle, self._driver.current_context())
        lane = self._lanes.get(key) or self._lane_for(key, handle)
        etype = event.type
        bus = self._bus
        if not bus.try_reserve(etype):
            return False
        try:
            cuda_event = lane.pool.pop()
        except IndexError:
            try:
                cuda_event = self._new_event(lane)
            except RuntimeError:
                bus.release_reservation(etype)
                raise
            if not cuda_event:
                bus.release_reservation(etype)
                return False
        lock = lane.lock
        lock.acquire()
        while lane.retired:  # pruned meanwhile: its successor shares the context's pool
            lock.release()
            lane = self._lane_for(key, handle)
            lock = lane.lock
            lock.acquire()
        try:
            rc = self._record(cuda_event, handle)
            if rc == _CUDA_ERROR_INVALID_CONTEXT:
                rc = self._record_in_context(lane.ctx, cuda_event, handle)
            if rc:
                lane.pool.append(cuda_event)
                bus.release_reservation(etype)
                raise RuntimeError(
                    f"cuEventRecord on stream {handle:#x} failed: "
                    f"{self._driver.error_name(rc)}; {etype.name} counted as dropped"
                )
            lane.fifo.append((cuda_event, event))
            # Without an armed waker on this stream, ask the dispatcher to look.
            if not lane.armed and not self._wake_pending:
                self._wake_pending = True
                self._wake(self._ring)
        finally:
            lock.release()
        return True

    def _record_in_context(self, ctx: int, cuda_event: int, handle: int) -> int:
        """Record again with the stream's context current (a thread that never used CUDA)."""
        self._driver.push_context(ctx)
        try:
            return self._record(cuda_event, handle)
        finally:
            self._driver.pop_context()

    def _lane_for(self, key: int | tuple[int, int], handle: int) -> _Lane:
        with self._setup_lock:
            lane = self._lanes.get(key)
            if lane is not None:
                return lane
            ctx = key[1] if isinstance(key, tuple) else self._driver.stream_context(handle)
            if not ctx:
                raise ValueError(
                    f"stream {handle:#x} is no CUDA stream of a live context "
                    "(or, for a default stream, no context is current on this thread)"
                )
            if not self._free_wakers:
                self._prune_locked()
            if not self._free_wakers:
                raise RuntimeError(
                    f"more than {self.max_streams} CUDA streams have stream events in flight"
                )
            lane = _Lane(ctx, self._free_wakers.pop(), self._pools.setdefault(ctx, []))
            self._by_waker[lane.waker] = lane
            self._lanes[key] = lane
            return lane

    def _new_event(self, lane: _Lane) -> int:
        """A new CUDA event for `lane`'s context, or 0 once `slots` events exist."""
        with self._setup_lock:
            if self._events_made >= self.slots:
                return 0
            self._events_made += 1
        driver = self._driver
        try:
            driver.push_context(lane.ctx)
            try:
                return driver.create_event()
            finally:
                driver.pop_context()
        except RuntimeError:
            with self._setup_lock:
                self._events_made -= 1
            raise

    # -- dispatcher ---------------------------------------------------------------------

    def collect(self) -> list[Event]:
        """Return the events whose stream reached them since the last call, in time order."""
        stamped: list[Event] = []
        with self._lock:
            if self._closed:
                return stamped
            self._wake_pending = False
            n = self._lib.kvf_ring_drain(self._ring, self._drained, self.max_streams)
            for i in range(n):
                lane = self._by_waker[self._drained[i]]
                assert lane is not None
                with lane.lock:
                    lane.armed = False
            for lane in list(self._lanes.values()):
                if lane.fifo:
                    self._settle(lane, stamped)
            if len(self._lanes) > self.max_streams // 2:
                with self._setup_lock:
                    self._prune_locked()
        if len(stamped) > 1:
            stamped.sort(key=_ts_of)
        return stamped

    def _settle(self, lane: _Lane, out: list[Event]) -> None:
        """Move `lane`'s completed events to `out`; unless its waker is still armed, arm it
        on the first pending one (one armed waker per lane keeps the C log bounded)."""
        driver = self._driver
        with lane.lock:
            fifo = lane.fifo
            try:
                driver.push_context(lane.ctx)
                try:
                    clock = self._clocks.get(lane.ctx) or self._clocks.setdefault(
                        lane.ctx, _Clock(driver)
                    )
                    clock.renew()
                    while fifo:
                        ts = clock.to_host(fifo[0][0])
                        if ts is None:
                            break
                        cuda_event, event = fifo.popleft()
                        event.ts_ns = ts
                        lane.pool.append(cuda_event)
                        out.append(event)
                    if fifo and not lane.side:
                        lane.side = driver.create_stream()
                finally:
                    driver.pop_context()
            except RuntimeError as exc:
                self._give_up(lane, out, exc)
                return
            if not fifo or lane.armed:
                return
            rc = self._lib.kvf_ring_arm(self._ring, lane.waker, lane.side, fifo[0][0])
            if rc:
                self._give_up(lane, out, RuntimeError(f"arming a waker failed: {rc}"))
                return
            lane.armed = True

    def _give_up(self, lane: _Lane, out: list[Event], exc: Exception) -> None:
        """CUDA failed for `lane` (a broken context): deliver its events stamped now."""
        if not self._failure_logged:
            self._failure_logged = True
            _log.warning("stream events fall back to host stamps: %s", exc)
        now = _monotonic_ns()
        while lane.fifo:
            _, event = lane.fifo.popleft()
            event.ts_ns = now
            out.append(event)

    def _prune_locked(self) -> None:
        """Forget idle lanes so streams that come and go do not pile up (hold _setup_lock)."""
        for key, lane in list(self._lanes.items()):
            with lane.lock:
                if lane.armed or lane.fifo:
                    continue
                lane.retired = True
            del self._lanes[key]
            self._by_waker[lane.waker] = None
            self._free_wakers.append(lane.waker)
            if lane.side:
                self._driver.destroy_stream(lane.side)

    # -- accounting and shutdown --------------------------------------------------------

    def pending(self) -> int:
        """Events recorded on streams and not collected yet."""
        return sum(len(lane.fifo) for lane in list(self._lanes.values()))

    def close(self) -> None:
        """Stop collecting. CUDA resources and the ring are released when this object goes."""
        with self._lock:
            self._closed = True

    def __del__(self) -> None:
        # Wakers still queued on a side stream hold their own reference to the ring, so
        # the C side frees it after the last has run; CUDA defers destroying a stream or
        # event that queued work still uses.
        ring = getattr(self, "_ring", 0)
        if not ring:
            return
        self._ring = 0
        self._lib.kvf_ring_release(ring)
        driver = self._driver
        try:
            for lane in self._lanes.values():
                if lane.side:
                    driver.destroy_stream(lane.side)
                for cuda_event, _ in lane.fifo:
                    driver.destroy_event(cuda_event)
            for pool in self._pools.values():
                for cuda_event in pool:
                    driver.destroy_event(cuda_event)
            for clock in self._clocks.values():
                driver.destroy_event(clock.anchor)
                driver.destroy_event(clock.spare)
                driver.destroy_stream(clock.stream)
        except Exception as exc:  # interpreter or CUDA shutting down
            _log.debug("stream stamper cleanup: %r", exc)


def attach_native_stamper(bus: EventBus) -> NativeStreamStamper | None:
    """Give `bus` a NativeStreamStamper unless it has a stamper already; None without CUDA.

    Without a GPU this is silent; with one but no working C compiler it logs a
    warning once and the bus keeps stamping stream events on the CPU at publish.
    """
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
