"""Stream events on a real GPU: accuracy against CUDA events, per-stream order, a GIL-hostile
stress, and stop with events still pending on their stream. Skipped without CUDA."""

from __future__ import annotations

import ctypes
import itertools
import os
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from kvflow.events import Event, EventBus, EventType
from kvflow.events.stream import NativeStreamStamper, attach_native_stamper
from kvflow.events.testing import RecordingSubscriber

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
T = EventType


def _cycles_per_us() -> float:
    """Clock cycles of torch.cuda._sleep per microsecond, measured with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(4_000_000)
    end.record()
    end.synchronize()
    return 4_000_000 / (start.elapsed_time(end) * 1000)


def _started_bus(capacity: int = 100_000) -> tuple[EventBus, RecordingSubscriber]:
    sub = RecordingSubscriber()
    bus = EventBus(capacity)
    bus.register(sub)
    bus.start()
    assert isinstance(attach_native_stamper(bus), NativeStreamStamper)
    return bus, sub


def _exact(bus: EventBus) -> bool:
    stats = bus.stats()
    return all(
        stats.published[t] == stats.delivered.get(t, 0) + stats.dropped.get(t, 0)
        for t in stats.published
    )


def test_stamps_match_cuda_event_timing() -> None:
    """A START/END pair around a 2 ms kernel spans the kernel's CUDA-event time within 50 us,
    and each stamp lies where the host clock says it can."""
    bus, sub = _started_bus()
    cycles = int(2000 * _cycles_per_us())
    stream = torch.cuda.Stream()
    pairs, bounds = [], []
    with torch.cuda.stream(stream):
        for i in range(30):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before = time.monotonic_ns()
            torch.cuda._sleep(cycles // 10)  # queue the pair before the GPU gets to it
            bus.publish_on_stream(stream, Event(T.STORE_START, op_id=i))
            begin.record(stream)
            torch.cuda._sleep(cycles)
            end.record(stream)
            bus.publish_on_stream(stream, Event(T.STORE_END, op_id=i))
            stream.synchronize()
            bounds.append((before, time.monotonic_ns()))
            pairs.append((begin, end))
    assert bus.flush(10)
    ts = {(e.type, e.op_id): e.ts_ns for e in sub.events}
    errors_us = []
    for i, (begin, end) in enumerate(pairs):
        stamped_us = (ts[T.STORE_END, i] - ts[T.STORE_START, i]) / 1000
        errors_us.append(abs(stamped_us - begin.elapsed_time(end) * 1000))
        lo, hi = bounds[i]
        assert lo <= ts[T.STORE_START, i] < ts[T.STORE_END, i] <= hi + 50_000
    print(
        f"stamp vs CUDA-event error (us): median {statistics.median(errors_us):.2f}, "
        f"max {max(errors_us):.2f}"
    )
    assert max(errors_us) <= 50
    assert bus.stop(5) and _exact(bus)


def test_order_is_preserved_per_stream_for_every_stream_kind() -> None:
    """Events on three streams (torch, PyCUDA-like `.handle`, raw int) keep their order and
    their stamps increase along each stream."""
    bus, sub = _started_bus()
    streams = [torch.cuda.Stream() for _ in range(3)]
    given = [streams[0], SimpleNamespace(handle=streams[1].cuda_stream), streams[2].cuda_stream]
    short = int(20 * _cycles_per_us())
    for i in range(3000):
        k = i % 3
        with torch.cuda.stream(streams[k]):
            torch.cuda._sleep(short)
        assert bus.publish_on_stream(given[k], Event(T.L1_WRITE, op_id=i))
    torch.cuda.synchronize()
    assert bus.flush(10)
    for k in range(3):
        mine = [e for e in sub.events if e.op_id is not None and e.op_id % 3 == k]
        assert [e.op_id for e in mine] == list(range(k, 3000, 3))
        assert all(a.ts_ns < b.ts_ns for a, b in itertools.pairwise(mine))
    assert bus.stop(5) and _exact(bus)


def test_publish_from_a_thread_new_to_cuda() -> None:
    """A thread that never touched CUDA can publish on a stream created elsewhere."""
    bus, sub = _started_bus()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(100 * _cycles_per_us()))
    done: list[bool] = []
    thread = threading.Thread(
        target=lambda: done.append(bus.publish_on_stream(stream, Event(T.RETRIEVE_END, op_id=1)))
    )
    thread.start()
    thread.join(10)
    stream.synchronize()
    assert done == [True]
    assert bus.flush(5) and [e.op_id for e in sub.events] == [1]
    assert bus.stop(5)


def test_stop_with_events_still_pending_loses_nothing() -> None:
    """stop() right after enqueueing behind a 300 ms kernel delivers every admitted event."""
    bus, sub = _started_bus()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(300_000 * _cycles_per_us()))
    admitted = sum(bus.publish_on_stream(stream, Event(T.STORE_END, op_id=i)) for i in range(500))
    assert bus.stats().pending_stream_events == admitted == 500
    assert bus.stop(10)
    assert [e.op_id for e in sub.events] == list(range(500))
    assert _exact(bus) and bus.stats().queue_depth == 0


class _OrderChecker:
    """Counts events per stream and checks each stream's op_ids and stamps only increase."""

    name = "order"
    event_types: frozenset[EventType] | None = None

    def __init__(self) -> None:
        self.last: dict[int, tuple[int, int]] = {}
        self.count: Counter[int] = Counter()
        self.disorder = 0

    def on_events(self, events: Sequence[Event]) -> None:
        for e in events:
            k, seq = divmod(e.op_id or 0, 10**9)
            last_seq, last_ts = self.last.get(k, (-1, 0))
            if seq <= last_seq or e.ts_ns < last_ts:
                self.disorder += 1
            self.last[k] = (seq, e.ts_ns)
            self.count[k] += 1

    def shutdown(self) -> None:
        pass


def test_stress_with_gil_hogs_and_synchronizing_threads() -> None:
    """Launcher threads publish on streams while others spin holding the GIL and synchronize
    (one through a libcuda call that keeps the GIL): no hang, exact stats, order kept."""
    seconds = float(os.environ.get("KVFLOW_STREAM_STRESS_S", "60"))
    checker = _OrderChecker()
    bus = EventBus(4096)
    bus.register(checker)
    bus.start()
    assert attach_native_stamper(bus) is not None
    n_launchers = 4
    streams = [torch.cuda.Stream() for _ in range(n_launchers)]
    cycles = int(30 * _cycles_per_us())
    deadline = time.monotonic() + seconds
    admitted = [0] * n_launchers
    published = [0] * n_launchers
    libcuda = ctypes.PyDLL("libcuda.so.1")  # PyDLL: cuStreamSynchronize keeps the GIL
    libcuda.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
    errors: list[BaseException] = []

    def launcher(k: int) -> None:
        try:
            stream, seq = streams[k], 0
            with torch.cuda.stream(stream):
                while time.monotonic() < deadline:
                    for _ in range(64):
                        ok = bus.publish_on_stream(
                            stream, Event(T.STORE_START, op_id=k * 10**9 + seq)
                        )
                        torch.cuda._sleep(cycles)
                        ok2 = bus.publish_on_stream(
                            stream, Event(T.STORE_END, op_id=k * 10**9 + seq + 1)
                        )
                        admitted[k] += ok + ok2
                        published[k] += 2
                        seq += 2
                    if seq % 512 == 0:
                        stream.synchronize()
        except BaseException as exc:
            errors.append(exc)

    def hog(k: int) -> None:
        try:
            n = 0
            torch.cuda.synchronize()  # makes the device's context current on this thread
            while time.monotonic() < deadline:
                for _ in range(20_000):  # pure Python: holds the GIL
                    n += 1
                if k == 0:
                    assert libcuda.cuStreamSynchronize(streams[n % n_launchers].cuda_stream) == 0
                elif k == 1:
                    torch.cuda.synchronize()
                else:
                    streams[n % n_launchers].synchronize()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=launcher, args=(k,), daemon=True) for k in range(n_launchers)
    ]
    threads += [threading.Thread(target=hog, args=(k,), daemon=True) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    assert not [t.name for t in threads if t.is_alive()], "a thread hung"
    assert not errors, errors
    torch.cuda.synchronize()
    assert bus.stop(30)
    stats = bus.stats()
    assert _exact(bus) and stats.queue_depth == 0 and stats.pending_stream_events == 0
    assert stats.total_published == sum(published)
    assert stats.total_delivered == sum(admitted) == sum(checker.count.values())
    assert checker.disorder == 0
    per_type = defaultdict(int, stats.dropped)
    print(
        f"stress {seconds:.0f}s: published {sum(published)}, delivered {sum(admitted)}, "
        f"dropped {dict(per_type)}"
    )


@pytest.mark.gpu2
def test_streams_of_both_gpus_under_the_other_gpus_context() -> None:
    """Events on a cuda:1 stream published while cuda:0's context is current, and on a
    cuda:0 stream published from cuda:1's, are stamped in order by each stream's own
    context's clock (no CUDA error falls back to host stamps)."""
    from tests.support.gpus import make_context_current, require_gpus

    require_gpus(2)
    bus, sub = _started_bus()
    streams = [torch.cuda.Stream(device=d) for d in (0, 1)]
    for i in range(400):
        d = i % 2
        make_context_current(1 - d)  # the other device's context is current
        with torch.cuda.device(d), torch.cuda.stream(streams[d]):
            torch.cuda._sleep(20_000)
        assert bus.publish_on_stream(streams[d], Event(T.L1_WRITE, op_id=i))
    for d in (0, 1):
        torch.cuda.synchronize(d)
    assert bus.flush(10)
    for d in (0, 1):
        mine = [e for e in sub.events if e.op_id is not None and e.op_id % 2 == d]
        assert [e.op_id for e in mine] == list(range(d, 400, 2))
        assert all(a.ts_ns < b.ts_ns for a, b in itertools.pairwise(mine))
    assert bus.stop(5) and _exact(bus)
