"""MetricsSubscriber's storage-tier metrics: kvflow.l2.*, prefetch, write-back, hits by tier."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvflow.core.config import ObservabilityConfig
from kvflow.core.engine import observability
from kvflow.core.engine.observability import Observability
from kvflow.events import EventBus, EventType
from kvflow.subscribers import MetricsSubscriber, build_subscribers
from kvflow.subscribers.buckets import GB_PER_S, OP_SECONDS
from kvflow.subscribers.testing import MetricsCapture
from tests.support.event_script import EventScript

DISK = {"tier": "disk", "chunks": 4, "bytes": 4_000_000}
PREFETCH = {"model_name": "llama", "world_size": 2, "chunks": 6, "tokens": 768, "trigger": "lookup"}


@pytest.fixture
def cap() -> Iterator[MetricsCapture]:
    capture = MetricsCapture()
    yield capture
    capture.shutdown()


def stored(**attrs: Any) -> dict[str, Any]:
    """L2_STORE_END attrs: DISK's, every submitted object stored, unless overridden."""
    end = {**DISK, "stored_chunks": 4, "stored_bytes": 4_000_000, "present_chunks": 0,
           "failed_chunks": 0}  # fmt: skip
    end.update(attrs)
    return end


def test_l2_store_metrics(cap: MetricsCapture) -> None:
    """Requests by outcome, stored objects and bytes, failed objects, duration and GB/s."""
    sub = MetricsSubscriber(cap.provider)
    s = EventScript()
    s.op("l2_store", 0.0, 0.004, "r1", start_attrs=DISK, **stored())
    # disk full for 3 of 4: the call itself succeeded
    s.op("l2_store", 1.0, 1.001, "r2", start_attrs=DISK,
         **stored(stored_chunks=1, stored_bytes=1_000_000, failed_chunks=3))  # fmt: skip
    # the whole call failed (backlog refused): nothing stored, no throughput
    s.op("l2_store", 2.0, 2.5, None, start_attrs=DISK,
         **stored(stored_chunks=0, stored_bytes=0, failed_chunks=4, ok=False,
                  error="resource_exhausted", error_message="backlog"))  # fmt: skip
    s.op("l2_store", 3.0, 3.002, None, start_attrs={**DISK, "tier": "redis"},
         **stored(tier="redis", stored_chunks=0, stored_bytes=0, present_chunks=4))  # fmt: skip
    sub.on_events(s.events)

    assert cap.total("kvflow.l2.store.requests", tier="disk", outcome="ok") == 2
    assert cap.total("kvflow.l2.store.requests", tier="disk", outcome="error") == 1
    assert cap.total("kvflow.l2.store.requests", tier="redis", outcome="ok") == 1
    assert cap.total("kvflow.l2.store.chunks", tier="disk") == 5
    assert cap.total("kvflow.l2.store.bytes", tier="disk") == 5_000_000
    assert cap.total("kvflow.l2.store.failed_chunks", tier="disk") == 7
    assert cap.total("kvflow.l2.store.chunks", tier="redis") == 0
    assert {p.attributes["tier"] for p in cap.points("kvflow.l2.store.chunks")} == {"disk", "redis"}
    ok = cap.histogram("kvflow.l2.store.duration", tier="disk", outcome="ok")
    assert (ok.count, ok.sum) == (2, pytest.approx(0.005))
    assert tuple(ok.explicit_bounds) == OP_SECONDS
    failed = cap.histogram("kvflow.l2.store.duration", tier="disk", outcome="error")
    assert (failed.count, failed.sum) == (1, pytest.approx(0.5))
    rate = cap.histogram("kvflow.l2.store.throughput", tier="disk")
    assert tuple(rate.explicit_bounds) == GB_PER_S
    assert rate.count == 2  # not the failed call
    assert rate.sum == pytest.approx(1.0 + 1.0)  # 4 MB / 4 ms, 1 MB / 1 ms
    assert cap.points("kvflow.l2.store.throughput", tier="redis") == []  # no bytes stored


def test_l2_load_metrics(cap: MetricsCapture) -> None:
    """Loads count loaded objects and bytes; requests and duration also carry the reason."""
    sub = MetricsSubscriber(cap.provider)
    s = EventScript()
    start = {**DISK, "reason": "prefetch"}
    s.op("l2_load", 0.0, 0.002, "r1", start_attrs=start, **start, loaded_chunks=3,
         loaded_bytes=3_000_000, failed_chunks=1)  # fmt: skip
    start = {**DISK, "reason": "retrieve"}
    s.op("l2_load", 1.0, 1.004, "r2", start_attrs=start, **start, loaded_chunks=4,
         loaded_bytes=4_000_000, failed_chunks=0)  # fmt: skip
    # timed out after one object landed: counted, but a failed call records no throughput
    s.op("l2_load", 2.0, 2.1, "r3", start_attrs=start, **start, loaded_chunks=1,
         loaded_bytes=1_000_000, failed_chunks=3, ok=False, error="timeout")  # fmt: skip
    sub.on_events(s.events)

    assert cap.total("kvflow.l2.load.requests", tier="disk") == 3
    assert cap.total("kvflow.l2.load.requests", reason="retrieve", outcome="ok") == 1
    assert cap.total("kvflow.l2.load.requests", reason="retrieve", outcome="error") == 1
    assert cap.total("kvflow.l2.load.requests", reason="prefetch", outcome="ok") == 1
    assert cap.total("kvflow.l2.load.chunks", tier="disk") == 8
    assert cap.total("kvflow.l2.load.bytes", tier="disk") == 8_000_000
    assert cap.total("kvflow.l2.load.failed_chunks", tier="disk") == 4
    retrieve = cap.histogram("kvflow.l2.load.duration", reason="retrieve", outcome="ok")
    assert (retrieve.count, retrieve.sum) == (1, pytest.approx(0.004))
    assert cap.observations("kvflow.l2.load.duration", tier="disk") == 3
    rate = cap.histogram("kvflow.l2.load.throughput", tier="disk")
    assert (rate.count, rate.sum) == (2, pytest.approx(1.5 + 1.0))  # 3 MB / 2 ms, 4 MB / 4 ms


def test_l2_evictions_and_write_back(cap: MetricsCapture) -> None:
    """L2_EVICT counts per tier; WRITE_BACK counts kept and discarded objects per reason."""
    sub = MetricsSubscriber(cap.provider)
    s = EventScript()
    s.add(EventType.L2_EVICT, 0.0, "r1", tier="disk", chunks=3, bytes=3000)
    s.add(EventType.L2_EVICT, 0.1, None, tier="disk", chunks=2, bytes=2000)
    s.add(EventType.L2_EVICT, 0.2, None, tier="redis", chunks=1, bytes=1000)
    s.add(EventType.WRITE_BACK, 0.3, "r1", kept=4, discarded=2, bytes=4000, reason="prefetch")
    s.add(EventType.WRITE_BACK, 0.4, "r2", kept=1, discarded=0, bytes=1000, reason="prefetch")
    s.add(EventType.WRITE_BACK, 0.5, "r3", kept=0, discarded=3, bytes=0, reason="retrieve")
    sub.on_events(s.events)

    assert cap.total("kvflow.l2.evicted_chunks", tier="disk") == 5
    assert cap.total("kvflow.l2.evicted_bytes", tier="disk") == 5000
    assert cap.total("kvflow.l2.evicted_chunks", tier="redis") == 1
    assert cap.total("kvflow.write_back.kept_chunks", reason="prefetch") == 5
    assert cap.total("kvflow.write_back.discarded_chunks", reason="prefetch") == 2
    assert cap.total("kvflow.write_back.kept_chunks", reason="retrieve") == 0
    assert cap.total("kvflow.write_back.discarded_chunks", reason="retrieve") == 3
    assert cap.total("kvflow.l1.evicted_chunks") == 0  # L2 evictions are not L1's


def test_prefetch_metrics(cap: MetricsCapture) -> None:
    """Prefetches count per model (requests also by trigger and outcome) and are timed."""
    sub = MetricsSubscriber(cap.provider)
    s = EventScript()
    s.op("prefetch", 0.0, 0.01, "r1", start_attrs=PREFETCH, **PREFETCH, loaded_chunks=6,
         written_back_chunks=4, discarded_chunks=2)  # fmt: skip
    api = {**PREFETCH, "trigger": "api"}
    s.op("prefetch", 1.0, 1.03, None, start_attrs=api, **api, loaded_chunks=2,
         written_back_chunks=2, discarded_chunks=0, ok=False, error="timeout")  # fmt: skip
    sub.on_events(s.events)

    assert cap.total("kvflow.prefetch.requests", model_name="llama") == 2
    assert cap.total("kvflow.prefetch.requests", trigger="lookup", outcome="ok") == 1
    assert cap.total("kvflow.prefetch.requests", trigger="api", outcome="error") == 1
    assert cap.total("kvflow.prefetch.chunks", model_name="llama") == 8
    assert cap.total("kvflow.prefetch.written_back_chunks", model_name="llama") == 6
    assert cap.total("kvflow.prefetch.discarded_chunks", model_name="llama") == 2
    ok = cap.histogram("kvflow.prefetch.duration", model_name="llama", outcome="ok")
    assert (ok.count, ok.sum) == (1, pytest.approx(0.01))
    assert cap.histogram("kvflow.prefetch.duration", outcome="error").sum == pytest.approx(0.03)


def test_hit_tokens_are_split_by_tier(cap: MetricsCapture) -> None:
    """kvflow.lookup.hit_tokens carries model_name and tier; without the split, all is l1."""
    sub = MetricsSubscriber(cap.provider)
    s = EventScript()
    s.op("lookup", 0.0, 0.001, "r1", start_attrs={"model_name": "llama"}, model_name="llama",
         requested_tokens=1024, hit_tokens=768,
         hit_tokens_by_tier={"l1": 512, "disk": 256})  # fmt: skip
    s.op("lookup", 1.0, 1.001, "r2", start_attrs={"model_name": "llama"}, model_name="llama",
         requested_tokens=1024, hit_tokens=1024,
         hit_tokens_by_tier={"disk": 512, "redis": 512})  # fmt: skip
    s.op("lookup", 2.0, 2.001, "r3", start_attrs={"model_name": "qwen"}, model_name="qwen",
         requested_tokens=64, hit_tokens=32)  # an older producer: no split  # fmt: skip
    sub.on_events(s.events)

    hits = {
        (p.attributes["model_name"], p.attributes["tier"]): p.value
        for p in cap.points("kvflow.lookup.hit_tokens")
    }
    assert hits == {
        ("llama", "l1"): 512,
        ("llama", "disk"): 768,
        ("llama", "redis"): 512,
        ("qwen", "l1"): 32,
    }
    assert cap.total("kvflow.lookup.hit_tokens", model_name="llama") == 1792
    prefix = cap.histogram("kvflow.lookup.prefix_hit_tokens", model_name="llama")
    assert (prefix.count, prefix.sum) == (2, 1792)


def test_tier_inflight_returns_to_zero_and_expires(cap: MetricsCapture) -> None:
    """l2_stores / l2_loads (by tier) and prefetches (by model) go back to 0 when idle.

    A START whose END never comes leaves its gauge after the TTL and is counted
    as expired under its operation.
    """
    sub = MetricsSubscriber(cap.provider, pending_ttl_s=10.0)
    s = EventScript()
    stores = [s.start("l2_store", 0.0, f"r{i}", **DISK) for i in range(3)]
    load = s.start("l2_load", 0.1, None, **DISK, reason="retrieve")
    prefetch = s.start("prefetch", 0.2, "r9", **PREFETCH)
    s.start("l2_load", 0.3, None, **{**DISK, "tier": "redis"}, reason="prefetch")  # never ends
    sub.on_events(s.events)
    assert cap.total("kvflow.inflight.l2_stores", tier="disk") == 3
    assert cap.total("kvflow.inflight.l2_loads", tier="disk") == 1
    assert cap.total("kvflow.inflight.l2_loads", tier="redis") == 1
    assert cap.total("kvflow.inflight.prefetches", model_name="llama") == 1
    s.events.clear()
    for op_id in stores:
        s.end("l2_store", op_id, 1.0, **stored())
    s.end("l2_load", load, 1.0, **DISK, reason="retrieve", loaded_chunks=4, loaded_bytes=4,
          failed_chunks=0)  # fmt: skip
    s.end("prefetch", prefetch, 1.0, **PREFETCH, loaded_chunks=6, written_back_chunks=6,
          discarded_chunks=0)  # fmt: skip
    sub.on_events(s.events)
    assert cap.total("kvflow.inflight.l2_stores") == 0
    assert cap.total("kvflow.inflight.prefetches") == 0
    assert cap.total("kvflow.inflight.l2_loads", tier="disk") == 0
    assert cap.total("kvflow.inflight.l2_loads", tier="redis") == 1
    assert sub.pending_operations == 1
    s.events.clear()
    s.add(EventType.L2_EVICT, 11.0, tier="disk", chunks=1, bytes=1)
    sub.on_events(s.events)
    assert cap.total("kvflow.inflight.l2_loads") == 0
    assert cap.total("kvflow.inflight.expired", operation="l2_load") == 1
    assert sub.pending_operations == 0


def test_end_without_start_counts_without_duration(cap: MetricsCapture) -> None:
    """An L2 END whose START was lost counts its objects, records no duration, inflight stays 0."""
    sub = MetricsSubscriber(cap.provider)
    s = EventScript()
    s.end("l2_store", 424242, 1.0, "r1", **stored())
    sub.on_events(s.events)
    assert cap.total("kvflow.l2.store.requests", tier="disk", outcome="ok") == 1
    assert cap.total("kvflow.l2.store.chunks", tier="disk") == 4
    assert cap.points("kvflow.l2.store.duration") == []
    assert cap.total("kvflow.inflight.l2_stores") == 0


def test_tier_gauges_read_tier_stats_at_each_collection(cap: MetricsCapture) -> None:
    """usage_bytes, capacity_bytes and objects per tier, from one tier_stats() per collection."""
    stats = {
        "disk": {"usage_bytes": 3 << 30, "capacity_bytes": 100 << 30, "objects": 40, "hits": 9},
        "redis": {"usage_bytes": 1 << 20, "capacity_bytes": 1 << 30, "objects": 2},
    }
    calls = []

    def tier_stats() -> dict[str, dict[str, int]]:
        calls.append(1)
        return stats

    MetricsSubscriber(cap.provider, tier_stats=tier_stats)
    assert cap.total("kvflow.l2.usage_bytes", tier="disk") == 3 << 30
    assert cap.total("kvflow.l2.capacity_bytes", tier="disk") == 100 << 30
    assert cap.total("kvflow.l2.objects", tier="disk") == 40
    assert cap.total("kvflow.l2.usage_bytes", tier="redis") == 1 << 20
    assert cap.total("kvflow.l2.objects", tier="redis") == 2
    calls.clear()
    stats["disk"] = {**stats["disk"], "objects": 41}
    assert cap.total("kvflow.l2.objects", tier="disk") == 41  # read again at every collection
    assert len(calls) == 1  # one snapshot for the three gauges
    assert "kvflow.l2.hits" not in cap.names()


def test_no_tier_stats_means_no_tier_gauges(cap: MetricsCapture) -> None:
    MetricsSubscriber(cap.provider, l1_stats=lambda: {"usage_bytes": 1})
    names = cap.names()
    assert "kvflow.l1.usage_bytes" in names
    assert not {"kvflow.l2.usage_bytes", "kvflow.l2.capacity_bytes", "kvflow.l2.objects"} & names


def test_build_subscribers_passes_tier_stats_through(cap: MetricsCapture) -> None:
    """tier_stats given to build_subscribers reaches the MetricsSubscriber's gauges."""
    stats = {"disk": {"usage_bytes": 7, "capacity_bytes": 8, "objects": 1}}
    config = ObservabilityConfig(prometheus_port=0, logging_enabled=False)
    pipeline = build_subscribers(config, meter_provider=cap.provider, tier_stats=lambda: stats)
    assert cap.total("kvflow.l2.usage_bytes", tier="disk") == 7
    assert pipeline.shutdown(2.0)


def test_the_engines_observability_passes_tier_stats_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Observability(config, None, l1_stats=..., tier_stats=...) hands both to build_subscribers;
    tier_stats defaults to None (no L2 gauges) for callers that have no tiers."""
    calls: list[dict[str, Any]] = []

    def build(config: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real_build(config, **kwargs)

    real_build = observability.build_subscribers
    monkeypatch.setattr(observability, "build_subscribers", build)
    monkeypatch.setattr(observability, "attach_native_stamper", lambda bus: None)
    config = ObservabilityConfig(prometheus_port=0, logging_enabled=False)

    def tier_stats() -> dict[str, dict[str, int]]:
        return {}

    Observability(config, None, l1_stats=dict, tier_stats=tier_stats).close()
    Observability(config, None, l1_stats=dict).close()
    assert [c["tier_stats"] for c in calls] == [tier_stats, None]
    assert all(c["l1_stats"] is dict for c in calls)


def test_whole_tier_catalogue_through_a_bus(cap: MetricsCapture) -> None:
    """A storage-tier workload through a real bus emits every tier metric of docs/METRICS.md."""
    bus = EventBus()
    bus.register(MetricsSubscriber(cap.provider, bus=bus, tier_stats=lambda: {
        "disk": {"usage_bytes": 1, "capacity_bytes": 2, "objects": 1}}))  # fmt: skip
    bus.start()
    s = EventScript()
    s.op("l2_store", 0, 0.1, "r1", start_attrs=DISK, **stored())
    load = {**DISK, "reason": "prefetch"}
    s.op("l2_load", 1, 1.1, "r1", start_attrs=load, **load, loaded_chunks=4,
         loaded_bytes=4_000_000, failed_chunks=0)  # fmt: skip
    s.op("prefetch", 1, 1.2, "r1", start_attrs=PREFETCH, **PREFETCH, loaded_chunks=4,
         written_back_chunks=4, discarded_chunks=0)  # fmt: skip
    s.add(EventType.WRITE_BACK, 1.2, "r1", kept=4, discarded=0, bytes=4, reason="prefetch")
    s.add(EventType.L2_EVICT, 2, tier="disk", chunks=1, bytes=10)
    s.op("lookup", 3, 3.1, "r1", start_attrs={"model_name": "llama"}, model_name="llama",
         requested_tokens=16, hit_tokens=16, hit_tokens_by_tier={"disk": 16})  # fmt: skip
    for ev in s.events:
        assert bus.publish(ev)
    assert bus.flush(5.0)
    catalogue = {
        f"kvflow.l2.{op}.{m}" for op in ("store", "load")
        for m in ("requests", "chunks", "bytes", "failed_chunks", "duration", "throughput")
    } | {
        "kvflow.l2.usage_bytes", "kvflow.l2.capacity_bytes", "kvflow.l2.objects",
        "kvflow.l2.evicted_chunks", "kvflow.l2.evicted_bytes",
        "kvflow.prefetch.requests", "kvflow.prefetch.chunks", "kvflow.prefetch.duration",
        "kvflow.prefetch.written_back_chunks", "kvflow.prefetch.discarded_chunks",
        "kvflow.write_back.kept_chunks", "kvflow.write_back.discarded_chunks",
        "kvflow.inflight.l2_stores", "kvflow.inflight.l2_loads", "kvflow.inflight.prefetches",
        "kvflow.lookup.hit_tokens",
    }  # fmt: skip
    assert catalogue <= cap.names()
    assert cap.total("kvflow.lookup.hit_tokens", tier="disk") == 16
    for name in ("kvflow.inflight.l2_stores", "kvflow.inflight.l2_loads",
                 "kvflow.inflight.prefetches"):  # fmt: skip
        assert cap.total(name) == 0
    bus.stop(5.0)
