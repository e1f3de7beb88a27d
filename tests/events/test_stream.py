"""Stream stamps without a GPU: the C helper's build, stream handles, the CPU path, and the
native ring driven by a fake CUDA driver that runs the real host function when told to."""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvflow.events import Event, EventBus, EventType, native, stream
from kvflow.events.stream import NativeStreamStamper, stream_handle
from kvflow.events.testing import RecordingSubscriber

T = EventType
needs_cc = pytest.mark.skipif(native.find_compiler() is None, reason="no C compiler")

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class FakeStreams:
    """A CPU stand-in for the CUDA driver: launches queue host functions per stream, and
    `run(stream)` executes them in order (the real native `kvf_stamp`, GIL released)."""

    def __init__(self, fail_code: int = 0) -> None:
        self.fail_code = fail_code
        self._queued: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self._lock = threading.Lock()
        self._callback = _LAUNCH(self._launch)
        self.launch_ptr = ctypes.cast(self._callback, ctypes.c_void_p).value or 0

    def _launch(self, handle: int | None, fn: int | None, user_data: int | None) -> int:
        if self.fail_code:
            return self.fail_code
        with self._lock:
            self._queued[handle or 0].append((fn or 0, user_data or 0))
        return 0

    def queued(self, handle: int) -> int:
        with self._lock:
            return len(self._queued[handle])

    def run(self, handle: int, n: int | None = None) -> int:
        """Run up to `n` (default all) queued host functions of stream `handle`; returns how many."""
        with self._lock:
            todo = self._queued[handle]
            n = len(todo) if n is None else min(n, len(todo))
            batch, self._queued[handle] = todo[:n], todo[n:]
        for fn, user_data in batch:
            _HOST_FN(fn)(user_data)
        return n

    def make_context_current(self, handle: int) -> bool:
        return False

    def error_name(self, code: int) -> str:
        return f"FAKE_ERROR ({code})"


def _live_rings() -> int:
    return int(native.load_library().kvf_live_ring_count())


# -- the helper's build ---------------------------------------------------------------


@needs_cc
def test_helper_compiles_with_warnings_as_errors(tmp_path: Path) -> None:
    """The C source builds with -Wall -Wextra -Werror (and -Wpedantic) into a loadable library."""
    assert {"-Wall", "-Wextra", "-Werror"} <= set(native.CFLAGS)
    built = native.build_library(directory=tmp_path)
    lib = ctypes.CDLL(str(built))
    assert lib.kvf_stamp and lib.kvf_ring_create and lib.kvf_ring_drain
    compiler = native.find_compiler()
    assert compiler is not None
    out = tmp_path / "pedantic.so"
    cmd = f"{compiler} {' '.join(native.CFLAGS)} -Wpedantic -o {out} {native.SOURCE}"
    assert os.system(cmd) == 0


@needs_cc
def test_helper_build_is_cached_by_source_hash(tmp_path: Path) -> None:
    """A second build reuses the cached object; an edited source gets a new one."""
    first = native.build_library(directory=tmp_path)
    mtime = first.stat().st_mtime_ns
    assert native.build_library(directory=tmp_path) == first
    assert first.stat().st_mtime_ns == mtime
    edited = tmp_path / "stream_stamps.c"
    edited.write_text(native.SOURCE.read_text() + "\n/* edited */\n")
    second = native.build_library(edited, directory=tmp_path)
    assert second != first and second.exists()


@needs_cc
def test_helper_build_failure_names_the_compiler_error(tmp_path: Path) -> None:
    """A source that does not compile raises NativeBuildError carrying the compiler's message."""
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return undefined_name; }\n")
    with pytest.raises(native.NativeBuildError, match="undefined_name"):
        native.build_library(broken, directory=tmp_path)
    assert not list(tmp_path.glob("*.so"))


def test_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """$KVFLOW_CACHE_DIR wins over $XDG_CACHE_HOME."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("KVFLOW_CACHE_DIR", raising=False)
    assert native.cache_dir() == tmp_path / "xdg" / "kvflow" / "native"
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "kv"))
    assert native.cache_dir() == tmp_path / "kv" / "native"


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


@pytest.mark.skipif(stream.cuda_driver() is not None, reason="this machine has CUDA")
def test_without_cuda_a_stream_event_is_stamped_at_publish() -> None:
    """With no CUDA driver, an event published on a stream handle is stamped now, no stamper."""
    sub = RecordingSubscriber()
    bus = EventBus(100)
    bus.register(sub)
    bus.start()
    before = time.monotonic_ns()
    assert bus.publish_on_stream(0x1234, Event(T.RETRIEVE_START, op_id=7))
    assert bus.enable_stream_stamps() is None
    assert bus.flush(5)
    assert [e.op_id for e in sub.events] == [7]
    assert sub.events[0].ts_ns >= before
    assert bus.stop(5)


def test_disabled_bus_takes_no_stream_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """A disabled bus refuses stream events without attaching a stamper or counting drops."""
    monkeypatch.setattr(stream, "cuda_driver", FakeStreams)
    bus = EventBus(10, enabled=False)
    assert not bus.publish_on_stream(5, Event(T.STORE_START))
    assert bus.stamper is None
    assert bus.stats().total_published == 0


# -- the native ring, driven by a fake driver ------------------------------------------------


@needs_cc
def test_first_stream_publish_attaches_the_native_stamper(monkeypatch: pytest.MonkeyPatch) -> None:
    """publish_on_stream with a stream attaches a NativeStreamStamper once and enqueues on it."""
    fake = FakeStreams()
    monkeypatch.setattr(stream, "cuda_driver", lambda: fake)
    bus = EventBus(100)
    assert bus.publish_on_stream(SimpleNamespace(handle=5), Event(T.STORE_START, op_id=1))
    stamper = bus.stamper
    assert isinstance(stamper, NativeStreamStamper)
    assert bus.publish_on_stream(5, Event(T.STORE_END, op_id=1))
    assert bus.enable_stream_stamps() is stamper
    assert fake.queued(5) == 2 and stamper.pending() == 2
    assert bus.stats().pending_stream_events == 2
    fake.run(5)
    assert bus.stop(5)


@needs_cc
def test_host_function_stamps_slot_and_wakes_the_bus() -> None:
    """The native host function stamps CLOCK_MONOTONIC into the slot and writes the eventfd."""
    fake = FakeStreams()
    bus = EventBus(100)
    stamper = NativeStreamStamper(bus, fake)
    event = Event(T.STORE_START, ts_ns=1, op_id=3)
    assert stamper.enqueue(7, event)
    assert stamper.collect() == []
    with pytest.raises(BlockingIOError):
        os.eventfd_read(bus.wake_fd)
    before = time.monotonic_ns()
    assert fake.run(7) == 1
    after = time.monotonic_ns()
    assert os.eventfd_read(bus.wake_fd) == 1
    (stamped,) = stamper.collect()
    assert stamped is event and before <= event.ts_ns <= after
    assert stamper.pending() == 0


@needs_cc
def test_stamped_events_are_delivered_in_each_streams_order() -> None:
    """Events from two streams run in different orders arrive in each stream's enqueue order."""
    fake = FakeStreams()
    sub = RecordingSubscriber()
    bus = EventBus(1000)
    bus.register(sub)
    bus.attach_stamper(NativeStreamStamper(bus, fake))
    bus.start()
    for i in range(200):
        assert bus.publish_on_stream(1 + i % 2, Event(T.L1_WRITE, op_id=i))
    fake.run(2, 30)
    fake.run(1, 70)
    fake.run(2)
    fake.run(1)
    assert bus.flush(5)
    for s in (0, 1):
        got = [e.op_id for e in sub.events if e.op_id is not None and e.op_id % 2 == s]
        assert got == list(range(s, 200, 2))
    assert bus.stop(5)
    stats = bus.stats()
    assert stats.delivered[T.L1_WRITE] == 200 and stats.queue_depth == 0


@needs_cc
def test_full_ring_drops_and_counts_per_type() -> None:
    """With every slot in flight, further stream events are dropped and counted by type."""
    fake = FakeStreams()
    sub = RecordingSubscriber()
    bus = EventBus(100)
    bus.register(sub)
    bus.attach_stamper(NativeStreamStamper(bus, fake, slots=4))
    bus.start()
    results = [bus.publish_on_stream(3, Event(T.STORE_START, op_id=i)) for i in range(4)]
    results += [bus.publish_on_stream(3, Event(T.RETRIEVE_START)) for _ in range(2)]
    assert results == [True] * 4 + [False] * 2
    assert fake.run(3) == 4
    assert bus.flush(5)
    stats = bus.stats()
    assert stats.dropped == {T.RETRIEVE_START: 2}
    assert stats.published == {T.STORE_START: 4, T.RETRIEVE_START: 2}
    assert stats.delivered == {T.STORE_START: 4}
    assert bus.publish_on_stream(3, Event(T.STORE_START, op_id=9))
    fake.run(3)
    assert bus.stop(5)
    assert [e.op_id for e in sub.events] == [0, 1, 2, 3, 9]


@needs_cc
def test_bus_capacity_bounds_stream_events() -> None:
    """Events waiting for a stamp count against the bus capacity like queued ones."""
    fake = FakeStreams()
    bus = EventBus(3)
    bus.attach_stamper(NativeStreamStamper(bus, fake))
    assert bus.publish(Event(T.L1_READ))
    assert bus.publish_on_stream(1, Event(T.STORE_START))
    assert bus.publish_on_stream(1, Event(T.STORE_END))
    assert not bus.publish_on_stream(1, Event(T.STORE_START))
    assert not bus.publish(Event(T.L1_READ))
    stats = bus.stats()
    assert stats.queue_depth == 3 and stats.dropped == {T.STORE_START: 1, T.L1_READ: 1}
    fake.run(1)
    assert bus.stop(5)
    assert bus.stats().delivered == {T.L1_READ: 1, T.STORE_START: 1, T.STORE_END: 1}


@needs_cc
def test_failed_launch_raises_and_counts_a_drop() -> None:
    """A launch CUDA refuses raises RuntimeError naming the error; the event counts as dropped."""
    bus = EventBus(10)
    stamper = NativeStreamStamper(bus, FakeStreams(fail_code=400))
    bus.attach_stamper(stamper)
    with pytest.raises(RuntimeError, match=r"FAKE_ERROR \(400\).*STORE_END counted as dropped"):
        bus.publish_on_stream(0x99, Event(T.STORE_END))
    stats = bus.stats()
    assert stats.dropped == {T.STORE_END: 1} and stats.published == {T.STORE_END: 1}
    assert stamper.pending() == 0 and stats.queue_depth == 0
    assert bus.stop(5)


@needs_cc
def test_stop_waits_for_queued_stamps() -> None:
    """stop() while host functions are still queued delivers every admitted event."""
    fake = FakeStreams()
    sub = RecordingSubscriber()
    bus = EventBus(1000)
    bus.register(sub)
    bus.attach_stamper(NativeStreamStamper(bus, fake))
    bus.start()
    for i in range(50):
        assert bus.publish_on_stream(4, Event(T.STORE_END, op_id=i))
    driver = threading.Timer(0.3, fake.run, args=(4,))
    driver.start()
    assert bus.stop(10)
    driver.join()
    assert [e.op_id for e in sub.events] == list(range(50))
    stats = bus.stats()
    assert stats.delivered == {T.STORE_END: 50} and stats.pending_stream_events == 0


@needs_cc
def test_ring_outlives_its_owner_until_queued_host_functions_ran() -> None:
    """Dropping the stamper with stamps still queued keeps the ring alive until the last one runs."""
    fake = FakeStreams()
    bus = EventBus(10)
    stamper = NativeStreamStamper(bus, fake)
    gc.collect()
    live = _live_rings()
    assert stamper.enqueue(2, Event(T.STORE_START))
    assert stamper.enqueue(2, Event(T.STORE_END))
    stamper.close()
    del stamper
    gc.collect()
    assert _live_rings() == live
    fake.run(2, 1)
    assert _live_rings() == live
    fake.run(2)
    assert _live_rings() == live - 1


@needs_cc
def test_concurrent_publishers_and_driver_thread_keep_exact_stats() -> None:
    """Four publisher threads on four streams, a driver thread running host functions meanwhile:
    every event is delivered or counted dropped, and each stream keeps its order."""
    fake = FakeStreams()
    sub = RecordingSubscriber(event_types=None)
    bus = EventBus(256)
    bus.register(sub)
    bus.attach_stamper(NativeStreamStamper(bus, fake, slots=64))
    bus.start()
    admitted = [0] * 4
    stop = threading.Event()

    def publisher(i: int) -> None:
        for j in range(3000):
            admitted[i] += bus.publish_on_stream(10 + i, Event(T.L1_WRITE, op_id=i * 10**6 + j))

    def driver() -> None:
        while not stop.is_set():
            for s in range(10, 14):
                fake.run(s, 7)

    drive = threading.Thread(target=driver)
    drive.start()
    pubs = [threading.Thread(target=publisher, args=(i,)) for i in range(4)]
    for t in pubs:
        t.start()
    for t in pubs:
        t.join()
    stop.set()
    drive.join()
    for s in range(10, 14):
        fake.run(s)
    assert bus.flush(10)
    stats = bus.stats()
    assert stats.published[T.L1_WRITE] == 12000
    assert stats.delivered[T.L1_WRITE] == sum(admitted) == len(sub.events)
    assert stats.delivered[T.L1_WRITE] + stats.dropped.get(T.L1_WRITE, 0) == 12000
    for i in range(4):
        ids = [e.op_id for e in sub.events if e.op_id is not None and e.op_id // 10**6 == i]
        assert ids == sorted(ids)
    assert bus.stop(5)
