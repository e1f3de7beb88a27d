"""Client-chosen label values are bounded (docs/METRICS.md, "Label bounds"; issue 18 item 9).

model_name and instance_id keep at most MAX_LABEL_VALUES distinct values per label;
later new values are folded into "other" and counted; an unregistered instance
leaves the L0 gauge at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.events import EventBus, EventType
from kvflow.subscribers import L0LifecycleSubscriber, MetricsSubscriber, build_subscribers
from kvflow.subscribers.batch import FOLDED_VALUE, MAX_LABEL_VALUES, LabelSets
from kvflow.subscribers.testing import MetricsCapture
from tests.support.event_script import EventScript

CHUNK = 8


@pytest.fixture
def cap() -> Iterator[MetricsCapture]:
    capture = MetricsCapture()
    yield capture
    capture.shutdown()


def _values(cap: MetricsCapture, label: str) -> dict[str, set[str]]:
    """metric name -> the distinct values of `label` among its points."""
    data = cap.reader.get_metrics_data()
    assert data is not None
    found: dict[str, set[str]] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    attrs = dict(point.attributes or {})
                    assert "otel.metric.overflow" not in attrs, metric.name
                    if label in attrs:
                        found.setdefault(metric.name, set()).add(str(attrs[label]))
    return found


def test_20k_distinct_model_names_in_lookups_stay_within_the_bound(cap: MetricsCapture) -> None:
    """A real engine on a bus with the metrics subscriber: 20k lookups with distinct model
    names give at most MAX_LABEL_VALUES + 1 model_name values per metric; the first models
    keep their own series (no overflow series), the rest count as "other"."""
    bus = EventBus(capacity=100_000)
    bus.register(MetricsSubscriber(cap.provider, bus=bus))
    bus.start()
    config = ServerConfig(
        chunk_size=CHUNK,
        l1_size_gb=(1 << 20) / (1 << 30),
        observability=ObservabilityConfig(prometheus_port=0),
    )
    engine = CacheEngine(config, bus=bus)
    tokens = np.arange(2 * CHUNK, dtype=np.int32)
    n = 20_000
    for i in range(n):
        engine.lookup(tokens, model_name=f"model-{i}")
        if i % 5000 == 4999:
            assert bus.flush(10.0)
    engine.lookup(tokens, model_name="model-0")  # a model seen early keeps its series
    assert bus.flush(10.0)

    values = _values(cap, "model_name")
    assert "kvflow.lookup.requests" in values
    for name, seen in values.items():
        assert len(seen) <= MAX_LABEL_VALUES + 1, (name, len(seen))
    lookups = values["kvflow.lookup.requests"]
    assert len(lookups) == MAX_LABEL_VALUES + 1 and FOLDED_VALUE in lookups
    assert cap.total("kvflow.lookup.requests", model_name="model-0") == 2
    assert cap.total("kvflow.lookup.requests", model_name=f"model-{MAX_LABEL_VALUES - 1}") == 1
    assert cap.total("kvflow.lookup.requests", model_name=FOLDED_VALUE) == n - MAX_LABEL_VALUES
    assert cap.total("kvflow.lookup.requests") == n + 1
    assert cap.total("kvflow.metrics.folded_labels", label="model_name") >= n - MAX_LABEL_VALUES
    assert cap.total("kvflow.metrics.folded_labels", label="instance_id") == 0
    engine.close()
    bus.stop()


def test_instance_ids_are_bounded_in_store_retrieve_and_prefetch_metrics(
    cap: MetricsCapture,
) -> None:
    sub = MetricsSubscriber(cap.provider, max_label_values=3)
    s = EventScript()
    for i in range(10):
        attrs = {"instance_id": f"inst-{i}", "model_name": f"m-{i % 5}"}
        s.op("store", i, i + 0.5, f"r{i}", start_attrs={**attrs, "tokens": 16},
             **attrs, tokens=16, bytes=100)  # fmt: skip
        s.op("retrieve", i, i + 0.5, f"r{i}", start_attrs={**attrs, "tokens": 16},
             **attrs, tokens=16, bytes=100, hit_tokens=16)  # fmt: skip
        s.op("prefetch", i, i + 0.5, f"p{i}", start_attrs={"model_name": f"pm-{i}"},
             model_name=f"pm-{i}", trigger="api")  # fmt: skip
    sub.on_events(s.events)
    instances = _values(cap, "instance_id")
    assert instances["kvflow.store.requests"] == {"inst-0", "inst-1", "inst-2", FOLDED_VALUE}
    assert instances["kvflow.retrieve.bytes"] == {"inst-0", "inst-1", "inst-2", FOLDED_VALUE}
    models = _values(cap, "model_name")
    # one bound per label name, shared by every metric of the subscriber
    assert all(len(v) <= 4 for v in models.values()), models
    assert cap.total("kvflow.store.bytes", instance_id=FOLDED_VALUE) == 700
    assert cap.total("kvflow.store.bytes") == 1000
    assert cap.total("kvflow.metrics.folded_labels", label="instance_id") > 0
    assert cap.total("kvflow.metrics.folded_labels", label="model_name") > 0
    assert cap.total("kvflow.inflight.stores") == 0  # folded label sets still pair up


def test_l0_labels_are_bounded_and_unregistered_instances_leave_the_gauge(
    cap: MetricsCapture,
) -> None:
    sub = L0LifecycleSubscriber(cap.provider, sample_rate=1.0, max_label_values=2)
    s = EventScript()
    for i in range(5):
        s.allocate(float(i), (f"q{i}", [1, 2], list(range(32))), instance_id=f"gpu{i}")
    sub.on_events(s.events)
    tracked = cap.points("kvflow.l0.tracked_blocks")
    assert {p.attributes["instance_id"]: p.value for p in tracked} == {
        "gpu0": 2, "gpu1": 2, FOLDED_VALUE: 6,
    }  # fmt: skip
    assert _values(cap, "instance_id")["kvflow.l0.allocated_blocks"] == {
        "gpu0", "gpu1", FOLDED_VALUE,
    }  # fmt: skip
    assert cap.total("kvflow.l0.folded_labels", label="instance_id") > 0

    s = EventScript()
    for i in (0, 3, 4):
        s.add(EventType.UNREGISTER, 10.0 + i, instance_id=f"gpu{i}", model_name="model")
    sub.on_events(s.events)
    tracked = cap.points("kvflow.l0.tracked_blocks")
    assert {p.attributes["instance_id"]: p.value for p in tracked} == {"gpu1": 2, FOLDED_VALUE: 2}
    s = EventScript()
    for i in (1, 2):
        s.add(EventType.UNREGISTER, 20.0 + i, instance_id=f"gpu{i}", model_name="model")
    sub.on_events(s.events)
    assert cap.points("kvflow.l0.tracked_blocks") == []  # no stale series of gone instances


def test_label_sets_fold_only_client_labels_and_keep_their_cache_bounded() -> None:
    labels = LabelSets(max_values=2)
    a = labels.get(("model_name", "outcome"), "a", "ok")
    assert a == {"model_name": "a", "outcome": "ok"}
    assert labels.get(("model_name", "outcome"), "a", "ok") is a
    labels.get(("model_name",), "b")
    other = labels.get(("model_name", "outcome"), "c", "ok")
    assert other == {"model_name": FOLDED_VALUE, "outcome": "ok"}
    assert labels.get(("model_name", "outcome"), "d", "ok") is other  # one dict: adds merge
    for i in range(1000):
        labels.get(("model_name", "outcome"), f"x{i}", "error")
        labels.get(("tier",), f"t{i % 3}")
    assert labels.folded == {"model_name": 1002, "instance_id": 0}
    assert len(labels._sets) < 20
    assert labels.get(("tier",), "t2") == {"tier": "t2"}  # kvflow's own labels are not bounded
    with pytest.raises(ValueError, match="max_values"):
        LabelSets(max_values=0)


def test_max_label_values_setting_bounds_the_built_subscribers(cap: MetricsCapture) -> None:
    """--max-label-values reaches the subscribers build_subscribers makes: with 3, the
    fourth distinct model name already counts as "other"."""
    bus = EventBus(capacity=10_000)
    config = ObservabilityConfig(prometheus_port=0, logging_enabled=False, max_label_values=3)
    pipeline = build_subscribers(config, bus=bus, meter_provider=cap.provider)
    bus.start()
    engine = CacheEngine(ServerConfig(chunk_size=CHUNK, observability=config), bus=bus)
    for i in range(5):
        engine.lookup(np.arange(CHUNK, dtype=np.int32), model_name=f"model-{i}")
    assert bus.flush(10.0)
    assert _values(cap, "model_name")["kvflow.lookup.requests"] == {
        "model-0",
        "model-1",
        "model-2",
        FOLDED_VALUE,
    }
    assert cap.total("kvflow.lookup.requests", model_name=FOLDED_VALUE) == 2
    pipeline.shutdown()
    bus.stop()


@pytest.mark.parametrize("bad", [0, -1, 65537, 2.5, True])
def test_max_label_values_out_of_range_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=r"--max-label-values must be an integer in 1\.\.65536"):
        ObservabilityConfig(max_label_values=bad)  # type: ignore[arg-type]
