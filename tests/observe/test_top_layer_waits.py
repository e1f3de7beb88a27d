"""`kvflow top` shows the layer waits engines report for their layerwise retrieves."""

from __future__ import annotations

import pytest
from rich.console import Console

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.errors import InvalidRequestError, UnknownInstanceError
from kvflow.core.observe.snapshot import Snapshot
from kvflow.core.observe.top import render
from kvflow.events import EventType
from kvflow.events.testing import RecordingSubscriber
from tests.support.engine import CHUNK, caches, events_of, small_engine


def _screen(status: dict[str, object]) -> str:
    console = Console(record=True, width=140)
    console.print(render(Snapshot.of(status), None))
    return console.export_text()


def test_reported_layer_waits_reach_the_event_status_and_top() -> None:
    """Two reports: one event each (stalls counted past 50 us), totals and quantiles in
    the status, a "Layer waits" line in top."""
    engine = CacheEngine(
        ServerConfig(
            chunk_size=CHUNK, l1_size_gb=(1 << 20) / (1 << 30),
            observability=ObservabilityConfig(prometheus_port=0),
        )
    )  # fmt: skip
    recorder = RecordingSubscriber()
    engine.bus.register(recorder)
    kv, kw = caches("vllm_flash_attn", seed=1)  # 2 layers
    engine.register_kv_caches("dst", kv, model_name="m", **kw)
    assert "Layer waits" not in _screen(engine.status())
    engine.report_layer_waits("dst", "r1", [0.0, 0.004])
    engine.report_layer_waits("dst", "r2", [0.00001, 0.0])
    assert engine.bus.flush(5.0)
    events = [e for e in recorder.events if e.type is EventType.LAYER_WAIT]
    assert [e.session_id for e in events] == ["r1", "r2"]
    assert events[0].attrs["stalled_layers"] == 1 and events[1].attrs["stalled_layers"] == 0
    assert events[0].attrs["instance_id"] == "dst" and events[0].attrs["model_name"] == "m"
    waits = engine.status()["activity"]["layer_waits"]
    assert waits["layers"] == 4 and waits["stalled_layers"] == 1 and waits["reports"] == 2
    assert waits["max_s"] == pytest.approx(0.004) and waits["sum_s"] == pytest.approx(0.00401)
    assert waits["p50_s"] <= waits["p99_s"] <= 0.004
    screen = _screen(engine.status())
    assert "Layer waits" in screen and "4 layers, 1 stalled" in screen
    engine.close()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([0.0, 0.0, 0.0], "3 entries for 2 layers"),
        ([-1.0], r"waits_s\[0\]"),
        ([float("nan")], r"waits_s\[0\]"),
        ([True], r"waits_s\[0\]"),
        ("0.1", "sequence"),
    ],
)
def test_a_bad_report_is_refused_naming_the_field(bad: object, message: str) -> None:
    engine, recorder = small_engine()
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("dst", kv, model_name="m", **kw)
    with pytest.raises(InvalidRequestError, match=message):
        engine.report_layer_waits("dst", "bad", bad)
    with pytest.raises(UnknownInstanceError):
        engine.report_layer_waits("nobody", "r3", [0.0])
    assert not [e for e in events_of(recorder, engine) if e.type is EventType.LAYER_WAIT]
    engine.close()
