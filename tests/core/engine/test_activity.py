"""The engine's activity totals (what `kvflow top` and `kvflow report` read from status):
the tally's snapshot, the histogram quantile and the L0 block-age summary."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.core.engine.activity import ActivityTally, l0_summary, quantile
from kvflow.events import EventType
from kvflow.subscribers.preaggregated import HistogramStore
from tests.support.event_script import EventScript


def _workload() -> EventScript:
    """Every kind of event the tally counts, with distinct numbers so a mix-up shows."""
    s = EventScript()
    s.op(
        "lookup",
        0.0,
        0.1,
        "r1",
        requested_tokens=10,
        hit_tokens=5,
        hit_tokens_by_tier={"l1": 3, "disk": 2},
    )
    s.op("store", 0.1, 0.2, "r1", tokens=512, bytes=2048)
    s.start("store", 0.3, "r1")  # still in flight
    s.op("retrieve", 0.4, 0.5, "r1", tokens=64, bytes=256, ok=False, error="boom")
    s.add(EventType.L1_WRITE, 0.6, chunks=2, bytes=100)
    s.add(EventType.L1_EVICT, 0.6, chunks=1, bytes=50)
    s.op("l2_store", 0.7, 0.8, tier="disk", stored_bytes=300, failed_chunks=1)
    s.op("l2_load", 0.7, 0.8, tier="disk", loaded_bytes=200, failed_chunks=0)
    s.add(EventType.L2_EVICT, 0.9, tier="disk", chunks=4, bytes=400)
    s.add(EventType.L2_EVICT, 0.9, tier="disk", chunks=1, bytes=40)
    s.add(EventType.L2_EVICT, 0.9, tier="redis", chunks=1, bytes=10)
    s.allocate(1.0, ("r1", [1, 2], [7] * 32), ("r2", [3], [8] * 16))
    s.add(EventType.LAYER_WAIT, 1.1, "r1", waits_s=[0.0, 0.003], layers=2, stalled_layers=1)
    return s


def test_snapshot_reports_every_total_and_what_is_in_flight() -> None:
    """One snapshot: per-operation totals, hits by tier, in-flight counts, L1, L2 per tier, L0."""
    tally = ActivityTally()
    tally.on_events(_workload().events)
    snapshot = tally.snapshot()
    # two layer waits, 0 and 3 ms: quantiles interpolated in their buckets, capped at max
    assert snapshot.pop("layer_waits") == pytest.approx(
        {"reports": 1, "stalled_layers": 1, "layers": 2, "sum_s": 0.003, "max_s": 0.003,
         "p50_s": 1e-5, "p90_s": 0.003, "p99_s": 0.003}
    )  # fmt: skip
    assert snapshot == {
        "ops": {
            "store": {"requests": 1, "errors": 0, "tokens": 512, "bytes": 2048},
            "retrieve": {"requests": 1, "errors": 1, "tokens": 64, "bytes": 256},
            "lookup": {
                "requests": 1,
                "errors": 0,
                "requested_tokens": 10,
                "hit_tokens": 5,
                "hit_tokens_by_tier": {"l1": 3, "disk": 2},
            },
        },
        "inflight": {"lookup": 0, "store": 1, "retrieve": 0, "l2_store": 0, "l2_load": 0},
        "l1": {"written_chunks": 2, "written_bytes": 100, "evicted_chunks": 1, "evicted_bytes": 50},
        "l2": {
            "disk": {
                "store_requests": 1,
                "store_errors": 0,
                "stored_bytes": 300,
                "store_failed_chunks": 1,
                "load_requests": 1,
                "load_errors": 0,
                "loaded_bytes": 200,
                "load_failed_chunks": 0,
                "evicted_chunks": 5,
                "evicted_bytes": 440,
            },
            "redis": {"evicted_chunks": 1, "evicted_bytes": 10},
        },
        "l0": {"allocation_records": 2, "allocated_blocks": 3},
    }


def test_a_fresh_tally_reports_zero_and_snapshots_are_copies() -> None:
    """Before any event: empty totals; a snapshot does not change as more events arrive."""
    tally = ActivityTally()
    empty = tally.snapshot()
    assert empty == {
        "ops": {"store": {}, "retrieve": {}, "lookup": {"hit_tokens_by_tier": {}}},
        "inflight": {},
        "l1": {},
        "l2": {},
        "l0": {},
        "layer_waits": {},
    }
    tally.on_events(_workload().events)
    assert empty["ops"]["store"] == {} and empty["l2"] == {} and empty["inflight"] == {}


# -- quantile -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("q", "bounds", "counts", "expected"),
    [
        # in the first bucket, which starts at 0
        (0.5, [1.0, 3.0, 7.0], [4, 0, 0, 0], 0.5),
        # in a later bucket: from its lower bound, by the rank's share of the bucket
        (0.75, [1.0, 3.0, 7.0], [2, 4, 0, 0], 2.25),
        (0.9, [1.0, 3.0, 7.0], [1, 2, 3, 0], 6.2),
        # the second bucket starts at the first bound, not at 0
        (0.5, [1.0, 3.0, 7.0], [0, 2, 0, 0], 2.0),
        # a rank exactly at a bucket's top stays in that bucket
        (0.5, [1.0, 2.0, 3.0], [1, 0, 1, 0], 1.0),
        # a single value
        (0.5, [1.0, 2.0], [0, 1, 0], 1.5),
        # the overflow bucket reports its lower bound: the last bound
        (0.5, [1.0, 2.0, 4.0], [0, 0, 0, 3], 4.0),
        (0.99, [1.0, 2.0, 4.0], [1, 0, 0, 1], 4.0),
    ],
)
def test_quantile_interpolates_within_the_bucket_of_the_rank(
    q: float, bounds: list[float], counts: list[int], expected: float
) -> None:
    """Linear within the bucket holding the rank, as Prometheus's histogram_quantile."""
    assert quantile(q, bounds, counts) == pytest.approx(expected)


def test_quantile_of_an_empty_histogram_is_none() -> None:
    assert quantile(0.5, [1.0, 2.0], [0, 0, 0]) is None


# -- l0_summary -----------------------------------------------------------------------------


def _store() -> HistogramStore:
    """L0 histograms as the lifecycle subscriber keeps them, after an unrelated one."""
    store = HistogramStore("kvflow.l0")
    other = store.histogram("kvflow.l0.something_else", unit="s", description="", boundaries=[1.0])
    other.record(0.5, {"m": "a"})
    lifetime = store.histogram(
        "kvflow.l0.block_lifetime", unit="s", description="", boundaries=[0.1, 0.25, 1.0]
    )
    for value, model in ((0.05, "a"), (0.2, "a"), (0.2, "b"), (0.3, "b"), (2.0, "b")):
        lifetime.record(value, {"model_name": model})
    idle = store.histogram(
        "kvflow.l0.block_idle_before_evict", unit="s", description="", boundaries=[0.1, 0.25, 1.0]
    )
    idle.record(0.2, {"model_name": "a"})
    store.histogram(
        "kvflow.l0.block_reuse_gap", unit="s", description="", boundaries=[1.0]
    )  # no values: absent
    return store


def test_l0_summary_merges_label_sets_and_reports_clamped_percentiles() -> None:
    """Counts, sum, min, max and buckets over all label sets; p50/p90/p99 interpolated,
    then clamped into [min, max]; other metrics and empty histograms are left out."""
    summary = l0_summary(_store())
    assert summary.keys() == {"lifetime", "idle_before_evict"}
    lifetime = summary["lifetime"]
    assert lifetime.keys() == {
        "count",
        "sum_s",
        "min_s",
        "max_s",
        "bounds_s",
        "bucket_counts",
        "p50_s",
        "p90_s",
        "p99_s",
    }
    assert lifetime["count"] == 5
    assert lifetime["sum_s"] == pytest.approx(2.75)
    assert (lifetime["min_s"], lifetime["max_s"]) == (0.05, 2.0)
    assert lifetime["bounds_s"] == [0.1, 0.25, 1.0]
    assert lifetime["bucket_counts"] == [1, 2, 1, 1]
    # rank 2.5 of 5: in (0.1, 0.25] holding values 2 and 3 -> 0.1 + 0.15 * 1.5 / 2
    assert lifetime["p50_s"] == pytest.approx(0.2125)
    # rank 4.5 and 4.95: in the overflow bucket -> its lower bound, 1.0
    assert (lifetime["p90_s"], lifetime["p99_s"]) == (1.0, 1.0)
    # one value of 0.2: the interpolation (0.175, 0.235, 0.2485) is clamped to it
    assert summary["idle_before_evict"] == {
        "count": 1,
        "sum_s": 0.2,
        "min_s": 0.2,
        "max_s": 0.2,
        "bounds_s": [0.1, 0.25, 1.0],
        "bucket_counts": [0, 1, 0, 0],
        "p50_s": 0.2,
        "p90_s": 0.2,
        "p99_s": 0.2,
    }


def test_l0_summary_without_a_store_or_values_is_empty() -> None:
    """Metrics off (no store), or a store with nothing recorded yet: an empty summary."""
    assert l0_summary(None) == {}
    store = HistogramStore("kvflow.l0")
    store.histogram("kvflow.l0.block_lifetime", unit="s", description="", boundaries=[1.0])
    assert l0_summary(store) == {}


def test_l0_summary_reports_a_non_finite_float_as_null() -> None:
    """A sum that overflows to infinity is reported as None, so status stays valid JSON."""
    store = HistogramStore("kvflow.l0")
    gap = store.histogram("kvflow.l0.block_reuse_gap", unit="s", description="", boundaries=[1.0])
    gap.record(1.5e308, {})
    gap.record(1.5e308, {})
    expected: dict[str, Any] = {
        "count": 2,
        "sum_s": None,
        "min_s": 1.5e308,
        "max_s": 1.5e308,
        "bounds_s": [1.0],
        "bucket_counts": [0, 2],
        "p50_s": 1.5e308,
        "p90_s": 1.5e308,
        "p99_s": 1.5e308,
    }
    assert l0_summary(store) == {"reuse_gap": expected}
