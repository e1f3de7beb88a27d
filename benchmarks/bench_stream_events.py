"""Benchmark GPU stream events: launch-thread cost, stamp-to-delivery lag, kernel throughput.

Needs a CUDA GPU and torch. Prints one table per measurement (docs/PERFORMANCE.md,
"Stream events"):
  1. cost of `publish_on_stream` on the launching thread (target <= 3 us);
  2. lag from the native stamp to a subscriber's `on_events` (target p99 <= 2 ms),
     alone and with a thread spinning in Python (holding the GIL);
  3. throughput of back-to-back kernels with a START/END pair per kernel, on vs off
     (target >= 0.98), for several kernel lengths.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvflow.events import Event, EventBus, EventType
from kvflow.events.stream import attach_native_stamper

T = EventType


class LagRecorder:
    """Subscriber recording, per event, delivery time minus the event's stamp."""

    name = "lag"
    event_types: frozenset[EventType] | None = None

    def __init__(self) -> None:
        self.lags_ns: list[int] = []

    def on_events(self, events: Sequence[Event]) -> None:
        now = time.monotonic_ns()
        self.lags_ns.extend(now - e.ts_ns for e in events)

    def shutdown(self) -> None:
        pass


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def cycles_per_us() -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    begin.record()
    torch.cuda._sleep(8_000_000)
    end.record()
    end.synchronize()
    return 8_000_000 / (begin.elapsed_time(end) * 1000)


def new_bus(capacity: int = 65536) -> tuple[EventBus, LagRecorder]:
    rec = LagRecorder()
    bus = EventBus(capacity)
    bus.register(rec)
    bus.start()
    if attach_native_stamper(bus) is None:
        raise SystemExit("no native stream stamper: needs CUDA and a C compiler")
    return bus, rec


def timer_overhead_ns() -> int:
    clock, best = time.perf_counter_ns, 10**9
    for _ in range(2000):
        t0 = clock()
        best = min(best, clock() - t0)
    return best


def publish_cost(
    batches: int, per_batch: int, cyc_us: float
) -> dict[str, tuple[float, float, float]]:
    """Per-call (p50, p99, mean) us on the launching thread: on an idle stream (events
    complete at once, the dispatcher runs meanwhile) and behind a 20 ms kernel."""
    bus, _ = new_bus()
    stream = torch.cuda.Stream()
    marker = torch.cuda.Event(enable_timing=True)

    def torch_record(e: Event) -> bool:
        marker.record(stream)
        return True

    calls: dict[str, tuple[Callable[[Event], bool], int]] = {
        "publish_on_stream, stream idle": (lambda e: bus.publish_on_stream(stream, e), 0),
        "publish_on_stream, stream busy": (
            lambda e: bus.publish_on_stream(stream, e),
            int(20_000 * cyc_us),
        ),
        "publish (CPU), for reference": (bus.publish, 0),
        "torch.cuda.Event.record, for reference": (torch_record, 0),
    }
    clock, overhead = time.perf_counter_ns, timer_overhead_ns()
    out = {}
    for label, (call, busy_cycles) in calls.items():
        samples: list[float] = []
        for _ in range(batches):
            events = [Event(T.STORE_START, op_id=i) for i in range(per_batch)]
            if busy_cycles:
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(busy_cycles)
            for e in events:
                t0 = clock()
                call(e)
                samples.append((clock() - t0 - overhead) / 1000)
            stream.synchronize()
            bus.flush(5)
        out[label] = (pct(samples, 0.5), pct(samples, 0.99), statistics.fmean(samples))
    bus.stop(10)
    return out


def delivery_lag(iters: int, cyc_us: float, hog: bool) -> tuple[float, float, float, int]:
    """Lag stamp -> on_events for START/END around 50 us kernels; optionally with a GIL hog."""
    bus, rec = new_bus()
    stream = torch.cuda.Stream()
    cycles = int(50 * cyc_us)
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    hogger = threading.Thread(target=spin, daemon=True)
    if hog:
        hogger.start()
    with torch.cuda.stream(stream):
        for i in range(iters):
            bus.publish_on_stream(stream, Event(T.STORE_START, op_id=i))
            torch.cuda._sleep(cycles)
            bus.publish_on_stream(stream, Event(T.STORE_END, op_id=i))
            if i % 16 == 15:
                stream.synchronize()
    stream.synchronize()
    bus.flush(10)
    stop.set()
    if hog:
        hogger.join()
    bus.stop(10)
    lags = [v / 1e6 for v in rec.lags_ns[20:]]
    return pct(lags, 0.5), pct(lags, 0.99), max(lags), len(rec.lags_ns)


def kernel_run(n: int, cycles: int, lead: int, events: bool, bus: EventBus, stream: Any) -> float:
    """GPU time (ms) of n back-to-back kernels, each between a START and an END event if
    `events`; a `lead` cycles kernel first lets the CPU get ahead of the GPU."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(lead)
        begin.record(stream)
        for i in range(n):
            if events:
                bus.publish_on_stream(stream, Event(T.STORE_START, op_id=i))
            torch.cuda._sleep(cycles)
            if events:
                bus.publish_on_stream(stream, Event(T.STORE_END, op_id=i))
        end.record(stream)
    end.synchronize()
    return begin.elapsed_time(end)


def throughput(
    kernel_us: Sequence[int], total_ms: float, reps: int, cyc_us: float
) -> list[tuple[int, int, float, float]]:
    """Per kernel length: (us, kernels, off us/kernel, on/off throughput), medians of `reps`."""
    bus, _ = new_bus()
    stream = torch.cuda.Stream()
    lead = int(3000 * cyc_us)
    rows = []
    for k_us in kernel_us:
        cycles = int(k_us * cyc_us)
        n = max(int(total_ms * 1000 / k_us), 20)
        off, on = [], []
        for _ in range(reps):
            off.append(kernel_run(n, cycles, lead, False, bus, stream))
            on.append(kernel_run(n, cycles, lead, True, bus, stream))
            bus.flush(10)
        t_off, t_on = statistics.median(off), statistics.median(on)
        rows.append((k_us, n, t_off / n * 1000, t_off / t_on))
    bus.stop(10)
    stats = bus.stats()
    assert stats.total_published == stats.total_delivered + stats.total_dropped
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    q = parser.parse_args().quick
    torch.zeros(1, device="cuda")
    cyc_us = cycles_per_us()
    print(
        f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"_sleep {cyc_us:.0f} cycles/us"
    )

    print("\n1. launching-thread cost per call (us)")
    print("| call | p50 | p99 | mean |\n|---|---:|---:|---:|")
    for label, (p50, p99, mean) in publish_cost(10 if q else 40, 500, cyc_us).items():
        print(f"| {label} | {p50:.2f} | {p99:.2f} | {mean:.2f} |")

    print("\n2. stamp -> subscriber lag (ms), START/END around 50 us kernels")
    print("| load | p50 | p99 | max | events |\n|---|---:|---:|---:|---:|")
    for hog in (False, True):
        p50, p99, worst, n = delivery_lag(1000 if q or hog else 5000, cyc_us, hog)
        label = "GIL-spinning thread" if hog else "launcher only"
        print(f"| {label} | {p50:.3f} | {p99:.3f} | {worst:.3f} | {n} |")

    print("\n3. back-to-back kernels, START/END per kernel: throughput on/off")
    print("| kernel us | kernels | off us/kernel | on/off |\n|---:|---:|---:|---:|")
    for k_us, n, per, ratio in throughput((20, 50, 100, 200, 1000), 150 if q else 400, 3, cyc_us):
        print(f"| {k_us} | {n} | {per:.1f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
