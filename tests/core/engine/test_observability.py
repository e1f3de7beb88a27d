"""Who attaches the GPU stream stamper: the engine's pipeline when it builds its bus, and
on demand for a bus it was given (the bus itself never does)."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest

from kvflow.core.config import ObservabilityConfig
from kvflow.core.engine import observability
from kvflow.core.engine.observability import Observability
from kvflow.events import EventBus, now_ns
from tests.support.collectors import free_port
from tests.support.event_script import EventScript


class _Stamper:
    """Stands in for the native stamper (nothing is ever enqueued on it here)."""

    def enqueue(self, stream: Any, event: Any) -> bool:
        return False

    def collect(self) -> list[Any]:
        return []

    def pending(self) -> int:
        return 0

    def close(self) -> None:
        return None


@pytest.fixture
def attached(monkeypatch: pytest.MonkeyPatch) -> list[EventBus]:
    """Replaces attach_native_stamper: records each bus it is called for and attaches."""
    calls: list[EventBus] = []

    def attach(bus: EventBus) -> None:
        calls.append(bus)
        bus.attach_stamper(_Stamper())

    monkeypatch.setattr(observability, "attach_native_stamper", attach)
    return calls


def test_the_engines_own_bus_gets_the_stamper_when_built(attached: list[EventBus]) -> None:
    obs = Observability(ObservabilityConfig(prometheus_port=0), None, l1_stats=dict)
    assert attached == [obs.bus] and obs.bus.stamper is not None
    obs.stamp_on_streams()  # has one: nothing more
    assert attached == [obs.bus]
    obs.close()


def test_a_given_bus_gets_one_only_on_demand(attached: list[EventBus]) -> None:
    bus = EventBus(10)
    obs = Observability(ObservabilityConfig(prometheus_port=0), bus, l1_stats=dict)
    assert attached == [] and bus.stamper is None
    obs.stamp_on_streams()
    assert attached == [bus] and bus.stamper is not None
    obs.close()


def _workload(bus: EventBus) -> None:
    """Two stores (one failing) and a GPU block that lives 0.2 s before it is evicted."""
    s = EventScript(base_ns=now_ns())
    s.allocate(0.0, ("req-1", [7], [1, 2, 3, 4]), block_size=4)
    s.op("store", 0.01, 0.02, "req-1", tokens=512, bytes=1 << 21)
    s.op("store", 0.03, 0.04, "req-1", tokens=0, bytes=0, ok=False, error="l1_full")
    s.end_session(0.06, "req-1")
    s.allocate(0.2, ("req-2", [7], [5, 6, 7, 8]), block_size=4)
    for event in s.events:
        assert bus.publish(event)


def test_the_engines_pipeline_serves_its_metrics_and_activity(attached: list[EventBus]) -> None:
    """An owned bus feeds the metric subscribers (with the L1 and per-tier L2 gauges from
    the callbacks), the L0 histograms and the activity totals; close stops the bus."""
    config = ObservabilityConfig(
        prometheus_port=free_port(), logging_enabled=False, l0_sample_rate=1.0,
        event_bus_capacity=123,
    )  # fmt: skip
    obs = Observability(
        config,
        None,
        l1_stats=lambda: {"usage_bytes": 4096, "capacity_bytes": 1 << 30, "objects": 2},
        tier_stats=lambda: {"disk": {"usage_bytes": 777, "capacity_bytes": 1 << 20, "objects": 3}},
    )
    try:
        assert obs.bus.capacity == 123 and obs.bus.enabled is True and obs.bus.running
        _workload(obs.bus)
        assert obs.bus.flush(5.0)
        assert obs.pipeline is not None and obs.pipeline.prometheus is not None
        with urllib.request.urlopen(obs.pipeline.prometheus.url, timeout=5.0) as reply:
            text = reply.read().decode()
        status = obs.activity_status()
    finally:
        assert obs.close() is True
    assert not obs.bus.running
    assert obs.close() is True  # idempotent
    lines = text.splitlines()
    assert "kvflow_l1_usage_bytes 4096.0" in lines
    assert [ln for ln in lines if ln.startswith("kvflow_l2_usage_bytes{")] == [
        'kvflow_l2_usage_bytes{tier="disk"} 777.0'
    ]
    assert status is not None
    assert set(status) == {
        "monotonic_s",
        "ops",
        "inflight",
        "l1",
        "l2",
        "l0",
        "l0_histograms",
        "layer_waits",
    }
    assert isinstance(status["monotonic_s"], float)
    store = status["ops"]["store"]
    assert (store["requests"], store["errors"], store["tokens"]) == (2, 1, 512)
    lifetime = status["l0_histograms"]["lifetime"]
    assert lifetime["count"] == 1 and lifetime["sum_s"] == pytest.approx(0.2)


def test_without_metrics_the_activity_has_no_l0_histograms(attached: list[EventBus]) -> None:
    """No Prometheus port and no OTLP endpoint: no L0 subscriber, so no histograms."""
    obs = Observability(ObservabilityConfig(prometheus_port=0), None, l1_stats=dict)
    try:
        status = obs.activity_status()
    finally:
        assert obs.close() is True
    assert status is not None and status["l0_histograms"] == {}


def test_a_disabled_pipeline_keeps_no_tally(attached: list[EventBus]) -> None:
    """Observability off: the bus refuses events and status has no activity."""
    obs = Observability(ObservabilityConfig(enabled=False, prometheus_port=0), None, l1_stats=dict)
    assert obs.bus.enabled is False
    assert obs.activity_status() is None
    assert obs.close() is True


def test_a_given_bus_is_left_running_and_keeps_no_tally(attached: list[EventBus]) -> None:
    """The caller's bus: no activity totals, and close() leaves the bus to the caller."""
    bus = EventBus(10)
    bus.start()
    try:
        obs = Observability(ObservabilityConfig(prometheus_port=0), bus, l1_stats=dict)
        assert obs.activity_status() is None
        assert obs.close() is True
        assert obs.close() is True
        assert bus.running
    finally:
        bus.stop(5.0)


def test_l1_that_cannot_be_built_leaves_no_pipeline_behind() -> None:
    """The engine builds its pipeline before L1 (L1's threads log from start-up): an L1
    that cannot be built closes the pipeline again, its bus thread and log handler too."""
    import logging
    import threading

    from kvflow.core.config import ServerConfig
    from kvflow.core.engine.cache_engine import CacheEngine

    handlers = list(logging.getLogger().handlers)
    threads = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="L1 capacity must be at least"):
        CacheEngine(
            ServerConfig(l1_size_gb=1e-9, observability=ObservabilityConfig(prometheus_port=0))
        )
    assert logging.getLogger().handlers == handlers
    assert {t.name for t in threading.enumerate() if t.is_alive()} <= threads
