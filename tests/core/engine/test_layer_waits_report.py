"""CacheEngine.report_layer_waits: what it publishes for good waits, how it refuses bad ones."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import pytest

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import STALL_S, CacheEngine
from kvflow.core.errors import InvalidRequestError
from kvflow.events import Event, EventType
from kvflow.events.testing import RecordingSubscriber
from tests.support.engine import CHUNK, GIB, caches, events_of, of_type

LAYERS = 4
SEQUENCE_MESSAGE = "waits_s must be a sequence of seconds, one per layer"


@pytest.fixture
def engine() -> Iterator[tuple[CacheEngine, RecordingSubscriber]]:
    """An engine on its own bus (so its status keeps the activity tally) with a recorder
    and instance "dst" (model "m", LAYERS layers) registered."""
    eng = CacheEngine(
        ServerConfig(
            chunk_size=CHUNK,
            l1_size_gb=(1 << 20) / GIB,
            observability=ObservabilityConfig(prometheus_port=0),
        )
    )
    recorder = RecordingSubscriber()
    eng.bus.register(recorder)
    kv, kw = caches("vllm_flash_attn", seed=1, num_layers=LAYERS)
    eng.register_kv_caches("dst", kv, model_name="m", **kw)
    yield eng, recorder
    eng.close()


def _layer_waits(recorder: RecordingSubscriber, eng: CacheEngine) -> list[Event]:
    return of_type(events_of(recorder, eng), EventType.LAYER_WAIT)


def test_a_report_publishes_one_event_with_exact_attrs(
    engine: tuple[CacheEngine, RecordingSubscriber],
) -> None:
    """One LAYER_WAIT for the request, its attrs exactly: instance, model, float waits,
    layer count, stalls (strictly past STALL_S) and their total."""
    eng, recorder = engine
    eng.report_layer_waits("dst", "r1", [0, 0.0, STALL_S, 0.25])
    (event,) = _layer_waits(recorder, eng)
    assert event.session_id == "r1"
    assert dict(event.attrs) == {
        "instance_id": "dst",
        "model_name": "m",
        "waits_s": [0.0, 0.0, STALL_S, 0.25],
        "layers": 4,
        "stalled_layers": 1,
        "total_s": pytest.approx(0.25 + STALL_S),
    }
    assert all(type(w) is float for w in event.attrs["waits_s"])


def test_a_wait_of_exactly_the_stall_threshold_is_not_a_stall(
    engine: tuple[CacheEngine, RecordingSubscriber],
) -> None:
    """A layer that waited exactly STALL_S is not counted as stalled, in the event or the
    status; fewer waits than layers are fine."""
    eng, recorder = engine
    eng.report_layer_waits("dst", "r2", [STALL_S, STALL_S])
    (event,) = _layer_waits(recorder, eng)
    assert event.attrs["stalled_layers"] == 0 and event.attrs["layers"] == 2
    assert event.attrs["total_s"] == pytest.approx(2 * STALL_S)
    waits = eng.status()["activity"]["layer_waits"]
    assert waits["reports"] == 1 and waits["layers"] == 2 and waits["stalled_layers"] == 0


def test_reports_add_up_in_the_status(engine: tuple[CacheEngine, RecordingSubscriber]) -> None:
    """Two reports (zero waits accepted) show in the status: reports, layers, stalls,
    sum and max of the waits."""
    eng, recorder = engine
    eng.report_layer_waits("dst", "a", [0.0, 0.001, 0])
    eng.report_layer_waits("dst", "b", (0.002,))
    assert [e.session_id for e in _layer_waits(recorder, eng)] == ["a", "b"]
    waits = eng.status()["activity"]["layer_waits"]
    assert waits["reports"] == 2 and waits["layers"] == 4 and waits["stalled_layers"] == 2
    assert waits["sum_s"] == pytest.approx(0.003) and waits["max_s"] == pytest.approx(0.002)


def test_an_empty_report_is_one_event_with_no_layers(
    engine: tuple[CacheEngine, RecordingSubscriber],
) -> None:
    """No waits at all: still one event, with zero layers, stalls and total."""
    eng, recorder = engine
    eng.report_layer_waits("dst", "r0", [])
    (event,) = _layer_waits(recorder, eng)
    assert event.attrs["layers"] == 0 and event.attrs["stalled_layers"] == 0
    assert event.attrs["total_s"] == 0 and event.attrs["waits_s"] == []


@pytest.mark.parametrize("request_id", ["", None, 7])
def test_a_bad_request_id_is_refused_by_name(
    engine: tuple[CacheEngine, RecordingSubscriber], request_id: Any
) -> None:
    """A request id that is not a non-empty string is refused, the message naming
    request_id; nothing is published."""
    eng, recorder = engine
    message = f"request_id must be a non-empty string, got {request_id!r}"
    with pytest.raises(InvalidRequestError, match=f"^{re.escape(message)}$"):
        eng.report_layer_waits("dst", request_id, [0.0])
    assert not _layer_waits(recorder, eng)


@pytest.mark.parametrize(
    "waits",
    ["0.1", b"\x00", 0.5, {0.0}, {0: 0.0}, iter([0.0]), None],
    ids=["str", "bytes", "float", "set", "dict", "iterator", "none"],
)
def test_waits_that_are_not_a_sequence_are_refused(
    engine: tuple[CacheEngine, RecordingSubscriber], waits: Any
) -> None:
    """Strings, bytes and non-sequences (sets, dicts, iterators, scalars) are refused
    with the sequence message; nothing is published."""
    eng, recorder = engine
    with pytest.raises(InvalidRequestError, match=f"^{re.escape(SEQUENCE_MESSAGE)}$"):
        eng.report_layer_waits("dst", "r", waits)
    assert not _layer_waits(recorder, eng)


def test_more_waits_than_layers_are_refused(
    engine: tuple[CacheEngine, RecordingSubscriber],
) -> None:
    """One wait more than the instance has layers is refused, counting both."""
    eng, recorder = engine
    with pytest.raises(InvalidRequestError, match=r"^waits_s has 5 entries for 4 layers$"):
        eng.report_layer_waits("dst", "r", [0.0] * (LAYERS + 1))
    assert not _layer_waits(recorder, eng)


@pytest.mark.parametrize(
    "bad",
    [-1.0, -1, -1e-9, math.nan, math.inf, -math.inf, True, False, "0.1", None],
    ids=["neg", "neg-int", "tiny-neg", "nan", "inf", "-inf", "true", "false", "str", "none"],
)
def test_a_bad_wait_is_refused_naming_its_index_and_value(
    engine: tuple[CacheEngine, RecordingSubscriber], bad: Any
) -> None:
    """A negative, non-finite, bool or non-number wait is refused: the message names its
    index and value; nothing is published."""
    eng, recorder = engine
    message = f"waits_s[2] must be seconds >= 0, got {bad!r}"
    with pytest.raises(InvalidRequestError, match=f"^{re.escape(message)}$"):
        eng.report_layer_waits("dst", "r", [0.0, 0.1, bad])
    assert not _layer_waits(recorder, eng)
