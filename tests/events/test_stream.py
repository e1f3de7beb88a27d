"""Stream events without a GPU: the C helper's build, stream handles, the CPU path, and the
stamper driven by a fake CUDA driver whose host functions run the real native waker."""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import threading
import time
from collections import defaultdict, deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvflow.events import Event, EventBus, EventType, native, stream
from kvflow.events.stream import NativeStreamStamper, attach_native_stamper, stream_handle
from kvflow.events.testing import RecordingSubscriber

T = EventType
needs_cc = pytest.mark.needs("cc", why="the native stream stamper is a C extension built here")

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_PUSH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_POP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
BAD_STREAM = 0xBAD0


class FakeCuda:
    """A CPU stand-in for the CUDA driver (a `StreamDriver`).

    A stream runs what is enqueued on it at once unless `hold` stops it until
    `release`; an event takes the time of a fake GPU clock (the host clock minus
    an offset) when its stream reaches it; host functions run the real native
    waker. `needs_context` makes records fail with CUDA_ERROR_INVALID_CONTEXT
    unless a context was pushed; `broken` makes every query fail.
    """

    GPU_OFFSET_NS = 7_000_000_123

    def __init__(self, *, fail_record: int = 0, needs_context: bool = False) -> None:
        self.fail_record = fail_record
        self.needs_context = needs_context
        self.broken = False
        self.current = 1
        self.pushed: list[int] = []
        self.destroyed_streams: list[int] = []
        self.created_streams = 0
        self.launched_wakers = 0  # host functions (native wakers) launched on side streams
        self._lock = threading.RLock()
        self._ops: dict[int, deque[tuple[str, int, int]]] = defaultdict(deque)
        self._held: set[int] = set()
        self._times: dict[int, int | None] = {}
        self._ids = itertools.count(0x100000, 0x10)
        self._callbacks = (
            _LAUNCH(self._launch),
            _WAIT(self._wait),
            _RECORD(self._record),
            _PUSH(lambda ctx: self.push_context(ctx or 0) or 0),
            _POP(lambda out: self.pop_context() or 0),
        )
        ptrs = [ctypes.cast(c, ctypes.c_void_p).value or 0 for c in self._callbacks]
        self.launch_ptr, self.wait_ptr, self.record_ptr, self.push_ptr, self.pop_ptr = ptrs
        self.record = self._record

    # the simulated GPU
    def _enqueue(self, stream: int | None, op: tuple[str, int, int]) -> int:
        with self._lock:
            self._ops[stream or 0].append(op)
            self._pump()
        return 0

    def _pump(self) -> None:
        progress = True
        while progress:
            progress = False
            for handle, ops in list(self._ops.items()):
                while ops and handle not in self._held:
                    kind, a, b = ops[0]
                    if kind == "wait" and self._times.get(a, 0) is None:
                        break
                    ops.popleft()
                    progress = True
                    if kind == "record":
                        self._times[a] = time.monotonic_ns() - self.GPU_OFFSET_NS
                    elif kind == "host":
                        _HOST_FN(a)(b)

    def hold(self, stream: int) -> None:
        with self._lock:
            self._held.add(stream)

    def release(self, stream: int) -> None:
        with self._lock:
            self._held.discard(stream)
            self._pump()

    def _record(self, event: int | None, stream: int | None) -> int:
        if self.fail_record:
            return self.fail_record
        if self.needs_context and not self.pushed:
            return 201
        with self._lock:
            self._times[event or 0] = None
        return self._enqueue(stream, ("record", event or 0, 0))

    def _wait(self, stream: int | None, event: int | None, flags: int) -> int:
        return self._enqueue(stream, ("wait", event or 0, 0))

    def _launch(self, stream: int | None, fn: int | None, user_data: int | None) -> int:
        self.launched_wakers += 1
        return self._enqueue(stream, ("host", fn or 0, user_data or 0))

    # the StreamDriver calls
    def stream_context(self, stream: int) -> int:
        return 0 if stream == BAD_STREAM else 1

    def current_context(self) -> int:
        return self.current

    def push_context(self, ctx: int) -> None:
        self.pushed.append(ctx)

    def pop_context(self) -> None:
        self.pushed.pop()

    def create_event(self) -> int:
        if self.fail_record:
            raise RuntimeError(f"cuEventCreate failed: FAKE_ERROR ({self.fail_record})")
        return next(self._ids)

    def create_stream(self) -> int:
        self.created_streams += 1
        return next(self._ids)

    def query(self, event: int) -> bool:
        if self.broken:
            raise RuntimeError("cuEventQuery failed: FAKE_ILLEGAL_ADDRESS (700)")
        with self._lock:
            return self._times.get(event) is not None

    def elapsed_ns(self, start: int, end: int) -> int | None:
        if self.broken:
            raise RuntimeError("cuEventElapsedTime failed: FAKE_ILLEGAL_ADDRESS (700)")
        with self._lock:
            a, b = self._times[start], self._times[end]
        assert a is not None
        return None if b is None else b - a

    def destroy_event(self, event: int) -> None:
        pass

    def destroy_stream(self, stream: int) -> None:
        self.destroyed_streams.append(stream)

    def error_name(self, code: int) -> str:
        return f"FAKE_ERROR ({code})"


def _live_rings() -> int:
    return int(native.load_library().live_rings())


def _bus_with_fake(
    capacity: int = 1000, **kw: Any
) -> tuple[EventBus, FakeCuda, RecordingSubscriber, NativeStreamStamper]:
    fake = FakeCuda()
    sub = RecordingSubscriber()
    bus = EventBus(capacity)
    bus.register(sub)
    stamper = NativeStreamStamper(bus, fake, **kw)
    bus.attach_stamper(stamper)
    bus.start()
    return bus, fake, sub, stamper


# -- the helper's build ---------------------------------------------------------------


@needs_cc
def test_helper_compiles_with_warnings_as_errors(tmp_path: Path) -> None:
    """The C sources build with -Wall -Wextra -Werror into an importable extension; the
    Python-free waker ring also builds with -Wpedantic."""
    assert {"-Wall", "-Wextra", "-Werror"} <= set(native.CFLAGS)
    built = native.build_library(directory=tmp_path)
    module = native.load_library(built)
    assert module.LaneTable and module.live_rings() >= 0
    lib = ctypes.CDLL(str(built))
    assert lib.kvf_wake and lib.kvf_ring_arm and lib.kvf_ring_drain
    compiler = native.find_compiler()
    assert compiler is not None
    out = tmp_path / "pedantic.so"
    cmd = f"{compiler} {' '.join(native.CFLAGS)} -Wpedantic -o {out} {native.SOURCES[0]}"
    assert os.system(cmd) == 0


@needs_cc
def test_helper_build_is_cached_by_source_hash(tmp_path: Path) -> None:
    """A second build reuses the cached object; an edited source gets a new one."""
    first = native.build_library(directory=tmp_path)
    mtime = first.stat().st_mtime_ns
    assert native.build_library(directory=tmp_path) == first
    assert first.stat().st_mtime_ns == mtime
    edited = tmp_path / "stream_lanes.c"
    edited.write_text(native.SOURCES[1].read_text() + "\n/* edited */\n")
    (tmp_path / "stream_wakers.h").write_text(native.HEADERS[0].read_text())
    second = native.build_library((native.SOURCES[0], edited), directory=tmp_path)
    assert second != first and second.exists()


@needs_cc
def test_helper_build_failure_names_the_compiler_error(tmp_path: Path) -> None:
    """A source that does not compile raises NativeBuildError carrying the compiler's message."""
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return undefined_name; }\n")
    with pytest.raises(native.NativeBuildError, match="undefined_name"):
        native.build_library((broken,), directory=tmp_path)
    assert not list(tmp_path.glob("*.so"))


# -- stream handles and the CPU path ------------------------------------------------------


def test_stream_handle_accepts_torch_pycuda_and_int() -> None:
    """torch streams give `.cuda_stream`, PyCUDA/kvflow streams `.handle`, ints themselves."""
    assert stream_handle(0) == 0
    assert stream_handle(0x7F00) == 0x7F00
    assert stream_handle(SimpleNamespace(cuda_stream=0x1234)) == 0x1234
    assert stream_handle(SimpleNamespace(handle=0x5678)) == 0x5678


@pytest.mark.parametrize("bad", ["s", 1.5, True, SimpleNamespace(handle="x"), object()])
def test_stream_handle_rejects_other_types(bad: object) -> None:
    """Anything else is a TypeError naming the type."""
    with pytest.raises(TypeError, match="stream must be"):
        stream_handle(bad)


def test_stream_handle_rejects_negative() -> None:
    """A negative handle is a ValueError."""
    with pytest.raises(ValueError, match="never negative"):
        stream_handle(SimpleNamespace(handle=-1))


def test_cpu_path_stamps_at_publish() -> None:
    """publish_on_stream(None, e) stamps now and delivers like publish."""
    sub = RecordingSubscriber()
    bus = EventBus(100)
    bus.register(sub)
    bus.start()
    before = time.monotonic_ns()
    assert bus.publish_on_stream(None, Event(T.STORE_START, ts_ns=1, op_id=1))
    after = time.monotonic_ns()
    assert bus.flush(5)
    assert [e.op_id for e in sub.events] == [1]
    assert before <= sub.events[0].ts_ns <= after
    assert bus.stamper is None
    assert bus.stop(5)


def test_a_bus_without_a_stamper_stamps_stream_events_at_publish() -> None:
    """With no stamper attached, an event published on a stream handle is stamped now."""
    sub = RecordingSubscriber()
    bus = EventBus(100)
    bus.register(sub)
    bus.start()
    before = time.monotonic_ns()
    assert bus.publish_on_stream(0x1234, Event(T.RETRIEVE_START, ts_ns=1, op_id=7))
    after = time.monotonic_ns()
    assert bus.flush(5)
    assert [e.op_id for e in sub.events] == [7]
    assert before <= sub.events[0].ts_ns <= after
    assert bus.stamper is None
    assert bus.stop(5)


@pytest.mark.skipif(stream.cuda_driver() is not None, reason="this machine has CUDA")
def test_without_cuda_nothing_is_attached() -> None:
    """With no CUDA driver, attach_native_stamper attaches nothing and says so."""
    bus = EventBus(100)
    assert attach_native_stamper(bus) is None
    assert bus.stamper is None


def test_disabled_bus_takes_no_stream_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """A disabled bus gets no stamper and refuses stream events without counting drops."""
    monkeypatch.setattr(stream, "cuda_driver", FakeCuda)
    bus = EventBus(10, enabled=False)
    assert attach_native_stamper(bus) is None
    assert not bus.publish_on_stream(5, Event(T.STORE_START))
    assert bus.stamper is None
    assert bus.stats().total_published == 0


# -- the stamper, driven by the fake driver ---------------------------------------------------


@needs_cc
def test_attach_native_stamper_attaches_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """attach_native_stamper gives the bus a NativeStreamStamper once; stream events then
    wait on it for their stream."""
    fake = FakeCuda()
    monkeypatch.setattr(stream, "cuda_driver", lambda: fake)
    bus = EventBus(100)
    stamper = attach_native_stamper(bus)
    assert isinstance(stamper, NativeStreamStamper) and bus.stamper is stamper
    assert attach_native_stamper(bus) is stamper
    fake.hold(0x50)
    assert bus.publish_on_stream(SimpleNamespace(handle=0x50), Event(T.STORE_START, op_id=1))
    assert bus.publish_on_stream(0x50, Event(T.STORE_END, op_id=1))
    assert stamper.pending() == 2 and bus.stats().pending_stream_events == 2
    fake.release(0x50)
    assert bus.stop(5)
    assert bus.stats().delivered == {T.STORE_START: 1, T.STORE_END: 1}


@needs_cc
def test_event_gets_the_gpu_time_and_a_native_waker_wakes_the_bus() -> None:
    """An event pending on its stream arms a waker; when the stream gets there the waker
    writes the eventfd and the event carries the (fake) GPU time mapped to the host clock."""
    fake = FakeCuda()
    bus = EventBus(100)
    stamper = NativeStreamStamper(bus, fake)
    fake.hold(0x70)
    event = Event(T.STORE_START, ts_ns=1, op_id=3)
    assert stamper.enqueue(0x70, event)
    assert os.eventfd_read(bus.wake_fd) == 1  # the launcher asks the dispatcher to arm
    assert stamper.collect() == []
    with pytest.raises(BlockingIOError):
        os.eventfd_read(bus.wake_fd)
    before = time.monotonic_ns()
    fake.release(0x70)
    after = time.monotonic_ns()
    assert os.eventfd_read(bus.wake_fd) == 1  # written by the native waker
    assert stamper.collect() == [event]
    assert before <= event.ts_ns <= after + 2_000_000
    assert stamper.pending() == 0


@needs_cc
def test_completed_events_need_no_waker() -> None:
    """Events already done when the dispatcher looks are collected without arming anything:
    no side stream is made and no waker launched (an event still pending, after them,
    arms exactly one, which shows the counts would see it)."""
    bus, fake, sub, _ = _bus_with_fake()
    before = time.monotonic_ns()
    for i in range(5):
        assert bus.publish_on_stream(0x80, Event(T.L1_READ, op_id=i))
    assert bus.flush(5)
    assert [e.op_id for e in sub.events] == list(range(5))
    assert all(before <= e.ts_ns <= time.monotonic_ns() for e in sub.events)
    assert fake.launched_wakers == 0
    assert fake.created_streams == 1  # the clock's own stream; no waker side stream
    fake.hold(0x80)
    assert bus.publish_on_stream(0x80, Event(T.L1_READ, op_id=5))
    deadline = time.monotonic() + 5
    while fake.launched_wakers == 0:  # the dispatcher arms a waker for the pending event
        assert time.monotonic() < deadline, "no waker armed for a pending event"
        time.sleep(0.01)
    fake.release(0x80)
    assert bus.flush(5)
    assert [e.op_id for e in sub.events] == list(range(6))
    assert (fake.created_streams, fake.launched_wakers) == (2, 1)  # + the lane's side stream
    assert bus.stop(5)


@needs_cc
def test_stamped_events_are_delivered_in_each_streams_order() -> None:
    """Events from two streams released in turns arrive in each stream's record order."""
    bus, fake, sub, _ = _bus_with_fake()
    fake.hold(0x100)
    fake.hold(0x200)
    for i in range(200):
        assert bus.publish_on_stream(0x100 if i % 2 else 0x200, Event(T.L1_WRITE, op_id=i))
    fake.release(0x100)
    time.sleep(0.05)
    fake.release(0x200)
    assert bus.flush(5)
    for parity in (0, 1):
        got = [e for e in sub.events if e.op_id is not None and e.op_id % 2 == parity]
        assert [e.op_id for e in got] == list(range(parity, 200, 2))
        assert all(a.ts_ns <= b.ts_ns for a, b in itertools.pairwise(got))
    assert bus.stop(5)
    stats = bus.stats()
    assert stats.delivered[T.L1_WRITE] == 200 and stats.queue_depth == 0


@needs_cc
def test_no_free_slot_drops_and_counts_per_type() -> None:
    """With every slot in flight, further stream events are dropped and counted by type."""
    bus, fake, sub, _ = _bus_with_fake(100, slots=4)
    fake.hold(0x30)
    results = [bus.publish_on_stream(0x30, Event(T.STORE_START, op_id=i)) for i in range(4)]
    results += [bus.publish_on_stream(0x30, Event(T.RETRIEVE_START)) for _ in range(2)]
    assert results == [True] * 4 + [False] * 2
    fake.release(0x30)
    assert bus.flush(5)
    stats = bus.stats()
    assert stats.dropped == {T.RETRIEVE_START: 2}
    assert stats.published == {T.STORE_START: 4, T.RETRIEVE_START: 2}
    assert stats.delivered == {T.STORE_START: 4}
    assert bus.publish_on_stream(0x30, Event(T.STORE_START, op_id=9))
    assert bus.stop(5)
    assert [e.op_id for e in sub.events] == [0, 1, 2, 3, 9]


@needs_cc
def test_bus_capacity_bounds_stream_events() -> None:
    """Events waiting for their stream count against the bus capacity like queued ones."""
    fake = FakeCuda()
    bus = EventBus(3)
    bus.attach_stamper(NativeStreamStamper(bus, fake))
    fake.hold(0x10)
    assert bus.publish(Event(T.L1_READ))
    assert bus.publish_on_stream(0x10, Event(T.STORE_START))
    assert bus.publish_on_stream(0x10, Event(T.STORE_END))
    assert not bus.publish_on_stream(0x10, Event(T.STORE_START))
    assert not bus.publish(Event(T.L1_READ))
    stats = bus.stats()
    assert stats.queue_depth == 3 and stats.dropped == {T.STORE_START: 1, T.L1_READ: 1}
    fake.release(0x10)
    assert bus.stop(5)
    assert bus.stats().delivered == {T.L1_READ: 1, T.STORE_START: 1, T.STORE_END: 1}


@needs_cc
def test_refused_record_raises_and_counts_a_drop() -> None:
    """A record (or event creation) CUDA refuses raises RuntimeError naming the error;
    the event counts as dropped."""
    fake = FakeCuda(fail_record=400)
    bus = EventBus(10)
    stamper = NativeStreamStamper(bus, fake)
    bus.attach_stamper(stamper)
    bus.start()
    with pytest.raises(RuntimeError, match=r"cuEventCreate failed: FAKE_ERROR \(400\)"):
        bus.publish_on_stream(0x99, Event(T.STORE_END))
    fake.fail_record = 0
    assert bus.publish_on_stream(0x99, Event(T.STORE_START))  # creates a CUDA event
    assert bus.flush(5)
    fake.fail_record = 400
    with pytest.raises(RuntimeError, match=r"FAKE_ERROR \(400\).*STORE_END counted as dropped"):
        bus.publish_on_stream(0x99, Event(T.STORE_END))
    stats = bus.stats()
    assert stats.dropped == {T.STORE_END: 2}
    assert stats.published == {T.STORE_START: 1, T.STORE_END: 2}
    assert stamper.pending() == 0 and stats.queue_depth == 0
    assert bus.stop(5)


@needs_cc
def test_thread_without_context_records_in_the_streams_context() -> None:
    """A record refused for want of a current context is retried with the stream's pushed."""
    fake = FakeCuda(needs_context=True)
    bus = EventBus(10)
    bus.attach_stamper(NativeStreamStamper(bus, fake))
    assert bus.publish_on_stream(0x44, Event(T.RETRIEVE_START))
    assert fake.pushed == []
    assert bus.stop(5) and bus.stats().delivered == {T.RETRIEVE_START: 1}


@needs_cc
def test_bad_streams_are_rejected_without_counting() -> None:
    """A handle of no live context, or a default stream with no current context, is a
    ValueError; nothing is published or dropped."""
    fake = FakeCuda()
    bus = EventBus(10)
    bus.attach_stamper(NativeStreamStamper(bus, fake))
    with pytest.raises(ValueError, match="no CUDA stream of a live context"):
        bus.publish_on_stream(BAD_STREAM, Event(T.STORE_START))
    fake.current = 0
    with pytest.raises(ValueError, match="no context is current"):
        bus.publish_on_stream(0, Event(T.STORE_START))
    fake.current = 1
    assert bus.publish_on_stream(0, Event(T.STORE_START))
    assert bus.stop(5)
    assert bus.stats().published == {T.STORE_START: 1}


@needs_cc
def test_broken_context_falls_back_to_host_stamps() -> None:
    """When CUDA fails on the dispatcher (a broken context), pending events are delivered
    stamped with the host clock, so nothing hangs and the accounting stays exact."""
    bus, fake, sub, _ = _bus_with_fake()
    fake.hold(0x60)
    assert bus.publish_on_stream(0x60, Event(T.STORE_START, op_id=1))
    fake.broken = True
    before = time.monotonic_ns()
    assert bus.publish_on_stream(0x60, Event(T.STORE_END, op_id=1))
    assert bus.stop(5)
    assert [e.op_id for e in sub.events] == [1, 1]
    assert sub.events[1].ts_ns >= before
    assert bus.stats().delivered == {T.STORE_START: 1, T.STORE_END: 1}


@needs_cc
def test_stop_waits_for_events_still_on_their_stream() -> None:
    """stop() while events still wait on their stream delivers every admitted one."""
    bus, fake, sub, _ = _bus_with_fake()
    fake.hold(0x40)
    for i in range(50):
        assert bus.publish_on_stream(0x40, Event(T.STORE_END, op_id=i))
    gpu = threading.Timer(0.3, fake.release, args=(0x40,))
    gpu.start()
    assert bus.stop(10)
    gpu.join()
    assert [e.op_id for e in sub.events] == list(range(50))
    stats = bus.stats()
    assert stats.delivered == {T.STORE_END: 50} and stats.pending_stream_events == 0


@needs_cc
def test_ring_outlives_its_owner_until_armed_wakers_ran() -> None:
    """Dropping the stamper with a waker still armed keeps the ring alive until it runs."""
    fake = FakeCuda()
    bus = EventBus(10)
    stamper = NativeStreamStamper(bus, fake)
    gc.collect()
    live = _live_rings()
    fake.hold(0x20)
    assert stamper.enqueue(0x20, Event(T.STORE_START))
    assert stamper.collect() == []  # arms the waker
    stamper.close()
    del stamper
    gc.collect()
    assert _live_rings() == live
    fake.release(0x20)
    assert _live_rings() == live - 1


@needs_cc
def test_streams_that_come_and_go_are_pruned() -> None:
    """Idle streams are forgotten (their side stream destroyed), so many short-lived streams
    fit in a few waker slots; too many streams busy at once is a clear error."""
    fake = FakeCuda()
    stamper = NativeStreamStamper(EventBus(100), fake, max_streams=4)
    for i in range(20):
        fake.hold(0x1000 + i)
        assert stamper.enqueue(0x1000 + i, Event(T.L1_WRITE, op_id=i))
        assert stamper.collect() == []  # arms a waker on the stream's side stream
        fake.release(0x1000 + i)
        assert [e.op_id for e in stamper.collect()] == [i]
    assert len(fake.destroyed_streams) >= 16
    for s in (0x2000, 0x2001, 0x2002, 0x2003):
        fake.hold(s)
        assert stamper.enqueue(s, Event(T.L1_READ))
    with pytest.raises(RuntimeError, match="more than 4 CUDA streams"):
        stamper.enqueue(0x2004, Event(T.L1_READ))
    for s in (0x2000, 0x2001, 0x2002, 0x2003):
        fake.release(s)
    assert len(stamper.collect()) == 4 and stamper.pending() == 0


@needs_cc
def test_concurrent_publishers_and_a_moving_gpu_keep_exact_stats() -> None:
    """Four publisher threads on four streams while another thread holds and releases them:
    every event is delivered or counted dropped, and each stream keeps its order."""
    bus, fake, sub, _ = _bus_with_fake(256, slots=64)
    admitted = [0] * 4
    stop = threading.Event()

    def publisher(i: int) -> None:
        for j in range(3000):
            event = Event(T.L1_WRITE, op_id=i * 10**6 + j)
            admitted[i] += bus.publish_on_stream(0x500 + i, event)

    def gpu() -> None:
        k = 0
        while not stop.is_set():
            fake.hold(0x500 + k % 4)
            time.sleep(0.001)
            fake.release(0x500 + k % 4)
            k += 1

    mover = threading.Thread(target=gpu)
    mover.start()
    pubs = [threading.Thread(target=publisher, args=(i,)) for i in range(4)]
    for t in pubs:
        t.start()
    for t in pubs:
        t.join()
    stop.set()
    mover.join()
    assert bus.flush(10)
    stats = bus.stats()
    assert stats.published[T.L1_WRITE] == 12000
    assert stats.delivered[T.L1_WRITE] == sum(admitted) == len(sub.events)
    assert stats.delivered[T.L1_WRITE] + stats.dropped.get(T.L1_WRITE, 0) == 12000
    for i in range(4):
        ids = [e.op_id for e in sub.events if e.op_id is not None and e.op_id // 10**6 == i]
        assert ids == sorted(ids)
    assert bus.stop(5)
