"""Who attaches the GPU stream stamper: the engine's pipeline when it builds its bus, and
on demand for a bus it was given (the bus itself never does)."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.core.config import ObservabilityConfig
from kvflow.core.engine import observability
from kvflow.core.engine.observability import Observability
from kvflow.events import EventBus


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
