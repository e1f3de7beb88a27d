"""GPU stream stamps: events stamped by native CUDA host functions when a stream reaches them.

`NativeStreamStamper` is the bus's `StreamStamper`: for each event it reserves
room on the bus and a slot of the C helper's bounded ring, then enqueues the
helper's host function on the stream with `cuLaunchHostFunc`. That function
(C, no Python, no GIL) stamps CLOCK_MONOTONIC, logs the slot and writes the
bus's eventfd; the dispatcher then `collect()`s the stamped events. See
docs/STREAM_EVENTS.md for the design and how the helper is built and cached.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from operator import attrgetter
from typing import Any, Protocol

from kvflow.events.bus import EventBus
from kvflow.events.native import NativeBuildError, load_library
from kvflow.events.types import Event

_log = logging.getLogger(__name__)
_ts_of = attrgetter("ts_ns")
_attach_lock = threading.Lock()

#: Most slots a stamper's ring holds; a bus capacity above it still bounds the total.
MAX_SLOTS = 65536
_CUDA_ERROR_INVALID_CONTEXT = 201


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
    return handle


class HostFuncDriver(Protocol):
    """What the stamper needs from the CUDA driver (a fake one lets CPU tests drive the ring)."""

    @property
    def launch_ptr(self) -> int:
        """Address of a function with cuLaunchHostFunc's signature and meaning."""
        ...

    def make_context_current(self, handle: int) -> bool:
        """Make `handle`'s context current on this thread; False if that is impossible."""
        ...

    def error_name(self, code: int) -> str: ...


class CudaDriver:
    """The few libcuda entry points the stamper uses, bound through ctypes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._launch_ptr = ctypes.cast(lib.cuLaunchHostFunc, ctypes.c_void_p).value or 0
        lib.cuStreamGetCtx.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    @property
    def launch_ptr(self) -> int:
        return self._launch_ptr

    def make_context_current(self, handle: int) -> bool:
        ctx = ctypes.c_void_p()
        if self._lib.cuStreamGetCtx(handle, ctypes.byref(ctx)) != 0 or not ctx.value:
            return False
        return int(self._lib.cuCtxSetCurrent(ctx)) == 0

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
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


class NativeStreamStamper:
    """Stamps bus events on CUDA streams through the C helper's bounded ring of slots.

    `enqueue` runs on the launching thread and costs one bus reservation, one list
    pop and one ctypes call; `collect` runs on the bus's dispatcher. The ring has
    `slots` slots (default: the bus capacity, at most MAX_SLOTS); an event finding
    no free slot is dropped and counted like any other drop.
    """

    def __init__(self, bus: EventBus, driver: HostFuncDriver, *, slots: int | None = None) -> None:
        n = min(bus.capacity, MAX_SLOTS) if slots is None else slots
        if not isinstance(n, int) or not 1 <= n <= MAX_SLOTS:
            raise ValueError(f"slots must be an integer in [1, {MAX_SLOTS}], got {slots!r}")
        self._lib = load_library()
        ring = self._lib.kvf_ring_create(n, bus.wake_fd, driver.launch_ptr)
        if not ring:
            raise OSError(f"kvf_ring_create({n}) failed (out of memory or bad wake fd)")
        self._ring: int = ring
        self._bus = bus
        self._driver = driver
        self._launch = self._lib.kvf_ring_launch
        self.slots = n
        self._events: list[Event | None] = [None] * n
        self._free = list(range(n - 1, -1, -1))
        self._out_index = (ctypes.c_uint32 * n)()
        self._out_ts = (ctypes.c_uint64 * n)()
        self._lock = threading.Lock()
        self._closed = False

    def enqueue(self, stream: Any, event: Event) -> bool:
        """Enqueue the native stamp of `event` on `stream`; False = dropped (bus full or no slot).

        Raises ValueError/TypeError for a bad stream and RuntimeError when CUDA refuses
        the launch (the event is then counted as dropped).
        """
        handle = stream if type(stream) is int and stream >= 0 else stream_handle(stream)
        etype = event.type
        bus = self._bus
        if not bus.try_reserve(etype):
            return False
        try:
            slot = self._free.pop()
        except IndexError:
            bus.release_reservation(etype)
            return False
        self._events[slot] = event
        rc = self._launch(self._ring, slot, handle)
        if rc:
            self._retry_launch(slot, handle, rc)
        return True

    def _retry_launch(self, slot: int, handle: int, rc: int) -> None:
        """Retry once after making the stream's context current (a thread new to CUDA), else fail."""
        if rc == _CUDA_ERROR_INVALID_CONTEXT and self._driver.make_context_current(handle):
            rc = self._launch(self._ring, slot, handle)
            if not rc:
                return
        event = self._events[slot]
        self._events[slot] = None
        self._free.append(slot)
        assert event is not None
        self._bus.release_reservation(event.type)
        raise RuntimeError(
            f"cuLaunchHostFunc on stream {handle:#x} failed: {self._driver.error_name(rc)}; "
            f"{event.type.name} counted as dropped"
        )

    def collect(self) -> list[Event]:
        """Return the events stamped since the last call, in stamp order (each stream's in order)."""
        with self._lock:
            if self._closed:
                return []
            n = self._lib.kvf_ring_drain(self._ring, self._out_index, self._out_ts, self.slots)
            if not n:
                return []
            events, free = self._events, self._free
            out_index, out_ts = self._out_index, self._out_ts
            stamped: list[Event] = []
            for i in range(n):
                slot = out_index[i]
                event = events[slot]
                assert event is not None
                events[slot] = None
                event.ts_ns = out_ts[i]
                stamped.append(event)
                free.append(slot)
        if n > 1:
            stamped.sort(key=_ts_of)
        return stamped

    def pending(self) -> int:
        """Events enqueued whose stamp has not been collected yet."""
        return self.slots - len(self._free)

    def close(self) -> None:
        """Stop collecting. The ring itself is released when this object goes away."""
        with self._lock:
            self._closed = True

    def __del__(self) -> None:
        # Drops the owner's reference only: host functions still queued on a stream hold
        # their own, so the C side frees the ring after the last of them has run.
        ring = getattr(self, "_ring", 0)
        if ring:
            self._ring = 0
            self._lib.kvf_ring_release(ring)


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
