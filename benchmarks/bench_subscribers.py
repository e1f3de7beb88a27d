"""Subscriber throughput and memory: L0 lifecycle blocks/s, state size, events/s.

Events are built before timing; each subscriber gets them through `on_events` in
batches (what its bus delivery thread does), recording into the MeterProvider
build_subscribers makes (L0 histograms pre-aggregated), with one in-memory reader
in place of the exporters; one L0 row uses a plain SDK MeterProvider instead.
Run: python benchmarks/bench_subscribers.py [--json]
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import platform
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvflow.events import BlockAllocation, Event, EventBus, EventType
from kvflow.subscribers import (
    L0LifecycleSubscriber,
    LoggingSubscriber,
    MetricsSubscriber,
    TracingSubscriber,
    configure_logging,
    kvflow_resource,
    make_meter_provider,
)
from kvflow.subscribers.eventlog import EventLogSubscriber

BLOCKS_PER_REQUEST = 64
BLOCK_SIZE = 16
STORE = {"instance_id": "gpu0", "model_name": "llama"}
OnEvents = Callable[[Sequence[Event]], None]


def l0_workload(
    n_requests: int, pool: int, *, first_id: int = 0, first_req: int = 0, reuse: bool = False
) -> list[Event]:
    """Requests of 64 blocks x 16 tokens taking block ids round-robin from a pool, then ending.

    By default every request holds new tokens, so once the pool wraps every
    allocation evicts the block's previous contents. With `reuse`, a block id
    always receives the same tokens, so reallocating it is a reuse (no eviction).
    """
    events = []
    ts = 1_000_000_000
    for r in range(first_req, first_req + n_requests):
        start = first_id + (r * BLOCKS_PER_REQUEST) % pool
        ids = list(range(start, start + BLOCKS_PER_REQUEST))
        base = (start if reuse else r * BLOCKS_PER_REQUEST) * BLOCK_SIZE
        tokens = list(range(base, base + BLOCKS_PER_REQUEST * BLOCK_SIZE))
        ts += 50_000
        attrs = {"instance_id": "gpu0", "model_name": "llama", "block_size": BLOCK_SIZE,
                 "records": [BlockAllocation(f"req-{r}", ids, tokens)]}  # fmt: skip
        events.append(Event(EventType.BLOCK_ALLOCATION, ts, None, None, attrs))
        ts += 50_000
        events.append(Event(EventType.END_SESSION, ts, f"req-{r}"))
    return events


def ops_workload(n_ops: int) -> list[Event]:
    """Lookup/retrieve/store START+END pairs, an L1 write every other op (2.5 events per op)."""
    events = []
    ts = 1_000_000_000
    ends = [
        (EventType.LOOKUP_START, EventType.LOOKUP_END,
         {"model_name": "llama", "requested_tokens": 1024, "hit_tokens": 512}),
        (EventType.RETRIEVE_START, EventType.RETRIEVE_END, {**STORE, "tokens": 512, "bytes": 1 << 22}),
        (EventType.STORE_START, EventType.STORE_END, {**STORE, "tokens": 1024, "bytes": 1 << 23}),
    ]  # fmt: skip
    for i in range(n_ops):
        start, end, attrs = ends[i % 3]
        ts += 10_000
        events.append(Event(start, ts, f"req-{i // 3}", i, {**STORE, "tokens": 1024}))
        ts += 1_000_000
        events.append(Event(end, ts, f"req-{i // 3}", i, {**attrs, "ok": True, "error": None}))
        if i % 2:
            events.append(
                Event(EventType.L1_WRITE, ts, None, None, {"chunks": 4, "bytes": 1 << 23})
            )
    return events


def drive(on_events: OnEvents, events: list[Event], batch: int) -> float:
    """Seconds to feed `events` in batches of `batch`."""
    gc.collect()
    started = time.perf_counter()
    for i in range(0, len(events), batch):
        on_events(events[i : i + batch])
    return time.perf_counter() - started


def production_provider() -> MeterProvider:
    """The provider build_subscribers makes, with an in-memory reader in place of exporters."""
    return make_meter_provider([InMemoryMetricReader()])


def plain_provider() -> MeterProvider:
    """A plain SDK MeterProvider (as a caller may pass): L0 records through SDK instruments."""
    return MeterProvider(
        metric_readers=[InMemoryMetricReader()],
        exemplar_filter=AlwaysOffExemplarFilter(),
        shutdown_on_exit=False,
    )


def noop_provider() -> NoOpMeterProvider:
    """OpenTelemetry's no-op provider: the subscriber's own cost alone."""
    return NoOpMeterProvider()


def bench_l0(rate: float, n_requests: int, pool: int, batch: int, repeats: int, *,
             reuse: bool = False,
             make_provider: Callable[[], Any] = production_provider) -> float:  # fmt: skip
    """Best-of-`repeats` blocks/s; a warm-up pass first fills the pool so timing is steady state."""
    best = 0.0
    for _ in range(repeats):
        provider = make_provider()
        sub = L0LifecycleSubscriber(provider, sample_rate=rate, seed=0)
        n_warm = pool // BLOCKS_PER_REQUEST
        drive(sub.on_events, l0_workload(n_warm, pool, reuse=reuse), batch)
        events = l0_workload(n_requests, pool, first_req=n_warm, reuse=reuse)
        best = max(best, n_requests * BLOCKS_PER_REQUEST / drive(sub.on_events, events, batch))
        if isinstance(provider, MeterProvider):
            provider.shutdown()
    return best


def bench_l0_first_touch(rate: float, n_requests: int, batch: int) -> float:
    """blocks/s when every block id is new (no evictions, hence no histogram observations)."""
    provider = production_provider()
    sub = L0LifecycleSubscriber(provider, sample_rate=rate, seed=0)
    events = l0_workload(n_requests, n_requests * BLOCKS_PER_REQUEST)
    seconds = drive(sub.on_events, events, batch)
    provider.shutdown()
    return n_requests * BLOCKS_PER_REQUEST / seconds


def bench_l0_bus(rate: float, n_requests: int, pool: int) -> float:
    """blocks/s publishing the warmed-up, evicting workload through a real EventBus."""
    provider = production_provider()
    bus = EventBus(capacity=1 << 20)
    bus.register(L0LifecycleSubscriber(provider, sample_rate=rate, seed=0))
    bus.start()
    n_warm = pool // BLOCKS_PER_REQUEST
    for event in l0_workload(n_warm, pool):
        bus.publish(event)
    assert bus.flush(120.0)
    events = l0_workload(n_requests, pool, first_req=n_warm)
    gc.collect()
    started = time.perf_counter()
    for event in events:
        bus.publish(event)
    assert bus.flush(120.0)
    seconds = time.perf_counter() - started
    bus.stop(5.0)
    provider.shutdown()
    return n_requests * BLOCKS_PER_REQUEST / seconds


def bench_l0_memory(rate: float, distinct_blocks: int, batch: int) -> tuple[int, int]:
    """(bytes retained, blocks tracked) after allocating and ending `distinct_blocks` ids."""
    provider = production_provider()
    sub = L0LifecycleSubscriber(provider, sample_rate=rate, seed=0)
    chunks = 20
    per_chunk = distinct_blocks // BLOCKS_PER_REQUEST // chunks
    gc.collect()
    tracemalloc.start()
    baseline = tracemalloc.get_traced_memory()[0]
    for c in range(chunks):  # events are built chunk by chunk and freed, so they are not state
        events = l0_workload(per_chunk, distinct_blocks, first_req=c * per_chunk)
        for i in range(0, len(events), batch):
            sub.on_events(events[i : i + batch])
        del events
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0] - baseline
    tracemalloc.stop()
    tracked = len(sub.tracked_block_ids("gpu0"))
    provider.shutdown()
    return retained, tracked


def bench_events(make: Callable[[], tuple[OnEvents, Callable[[], object]]],
                 events: list[Event], batch: int) -> float:  # fmt: skip
    """events/s of the subscriber `make` builds (it returns on_events and a close function)."""
    on_events, close = make()
    seconds = drive(on_events, events, batch)
    close()
    return len(events) / seconds


def metrics_subscriber() -> tuple[OnEvents, Callable[[], object]]:
    provider = production_provider()
    return MetricsSubscriber(provider).on_events, provider.shutdown


def tracing_subscriber() -> tuple[OnEvents, Callable[[], object]]:
    """Spans exported synchronously into memory, so ending a span includes its export."""
    provider = TracerProvider(resource=kvflow_resource())
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    return TracingSubscriber(provider).on_events, provider.shutdown


def logging_subscriber() -> tuple[OnEvents, Callable[[], object]]:
    setup = configure_logging("info", "json", stream=io.StringIO())
    return LoggingSubscriber().on_events, setup.close


def event_log_subscriber() -> tuple[OnEvents, Callable[[], object]]:
    """Batches written to segment files in a temporary directory (fsync when a segment closes)."""
    tmp = tempfile.TemporaryDirectory(prefix="kvflow-bench-eventlog-")
    sub = EventLogSubscriber(tmp.name, fsync="segment")

    def close() -> None:
        sub.shutdown()
        tmp.cleanup()

    return sub.on_events, close


def with_chunk_hashes(events: list[Event], chunks: int = 16) -> list[Event]:
    """The ops workload with `chunks` 32-byte chunk hashes on every END, as the engine
    publishes them for kvflow whatif (the log keeps 8 bytes of each)."""
    hashes = [bytes([i]) * 32 for i in range(chunks)]
    return [
        Event(e.type, e.ts_ns, e.session_id, e.op_id, {**e.attrs, "chunk_hashes": hashes})
        if e.type in (EventType.LOOKUP_END, EventType.RETRIEVE_END, EventType.STORE_END)
        else e
        for e in events
    ]


def machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=256, help="events per on_events call")
    parser.add_argument("--pool", type=int, default=100_000, help="engine block ids in the pool")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    args = parser.parse_args()
    batch, pool, repeats = args.batch, args.pool, args.repeats

    rows: list[tuple[str, float, str]] = []
    for rate, n in ((0.01, 40_000), (1.0, 2_000)):
        rows.append((f"L0 rate {rate}: steady state, every allocation evicts",
                     bench_l0(rate, n, pool, batch, repeats), "blocks/s"))  # fmt: skip
        rows.append((f"L0 rate {rate}: steady state, every allocation reuses",
                     bench_l0(rate, 2 * n, pool, batch, repeats, reuse=True), "blocks/s"))  # fmt: skip
        rows.append((f"L0 rate {rate}: first touch (no evictions)",
                     bench_l0_first_touch(rate, n, batch), "blocks/s"))  # fmt: skip
        rows.append((f"L0 rate {rate}: evicting, through a real EventBus",
                     bench_l0_bus(rate, n, pool), "blocks/s"))  # fmt: skip
        rows.append((f"L0 rate {rate}: evicting, plain SDK MeterProvider",
                     bench_l0(rate, n, pool, batch, 1, make_provider=plain_provider),
                     "blocks/s"))  # fmt: skip
        rows.append((f"L0 rate {rate}: evicting, no-op meter (subscriber alone)",
                     bench_l0(rate, n, pool, batch, 1, make_provider=noop_provider),
                     "blocks/s"))  # fmt: skip
    for rate in (0.0, 0.01):
        retained, tracked = bench_l0_memory(rate, 1_000_000, batch)
        rows.append((f"L0 rate {rate}: state after 1M distinct blocks ({tracked} tracked)",
                     retained, "bytes"))  # fmt: skip
    ops = ops_workload(60_000)
    rows.append(("metrics subscriber", bench_events(metrics_subscriber, ops, batch), "events/s"))
    rows.append(("tracing subscriber", bench_events(tracing_subscriber, ops[:15_000], batch),
                 "events/s"))  # fmt: skip
    rows.append(("logging subscriber (level info)", bench_events(logging_subscriber, ops, batch),
                 "events/s"))  # fmt: skip

    rows.append(("event log subscriber (fsync segment)",
                 bench_events(event_log_subscriber, ops, batch), "events/s"))  # fmt: skip
    rows.append(("event log subscriber, 16 chunk hashes per END",
                 bench_events(event_log_subscriber, with_chunk_hashes(ops), batch),
                 "events/s"))  # fmt: skip

    header = f"{machine()}; batch {batch} events; pool {pool} block ids"
    if args.json:
        print(json.dumps({"machine": header, "results": rows}, indent=2))
        return
    print(header)
    for name, value, unit in rows:
        shown = f"{value / 2**20:.2f} MiB" if unit == "bytes" else f"{value:,.0f} {unit}"
        print(f"{name:<64} {shown:>22}")


if __name__ == "__main__":
    main()
