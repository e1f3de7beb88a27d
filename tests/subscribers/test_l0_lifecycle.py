"""L0LifecycleSubscriber: the lifecycle rules of docs/METRICS.md, sampling, and its bounds."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.events import Event, EventType, Sampler
from kvflow.subscribers import L0LifecycleSubscriber
from kvflow.subscribers.testing import MetricsCapture
from tests.support.event_script import EventScript

LIFETIME = "kvflow.l0.block_lifetime"
IDLE = "kvflow.l0.block_idle_before_evict"
REPO = Path(__file__).resolve().parents[2]  # the child imports tests.support from here
GAP = "kvflow.l0.block_reuse_gap"
A, B, C = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


def observed(cap: MetricsCapture, name: str) -> tuple[int, float]:
    """(count, sum) of a histogram across its label sets."""
    points = cap.points(name)
    return sum(p.count for p in points), round(sum(p.sum for p in points), 9)


@pytest.fixture(params=[False, True], ids=["plain-provider", "kvflow-provider"])
def cap(request: pytest.FixtureRequest) -> Iterator[MetricsCapture]:
    """Each test runs against SDK histograms and against kvflow's pre-aggregated ones."""
    capture = MetricsCapture(kvflow_provider=request.param)
    yield capture
    capture.shutdown()


def test_lifecycle_narrative(cap: MetricsCapture) -> None:
    """One block through every L0 lifecycle rule (docs/METRICS.md), checking each duration."""
    sub = L0LifecycleSubscriber(cap.provider, sample_rate=1.0, seed=0)
    s = EventScript()
    # t=0  case 1: request a allocates block 10 holding tokens A -> ACTIVE, history [0]
    s.allocate(0.0, ("a", [10], A), block_size=4)
    # t=1  case 2: a reports the same block with the same tokens again -> ignored
    s.allocate(1.0, ("a", [10], A), block_size=4)
    # t=2  case 3: b shares the prefix -> co-owner, still ACTIVE
    s.allocate(2.0, ("b", [10], A), block_size=4)
    # t=3  case 6 (co-owner release): a ends, but b still owns the block -> stays ACTIVE
    s.end_session(3.0, "a")
    # t=5  case 6: b, the last owner, ends -> RELEASED at 5
    s.end_session(5.0, "b")
    # t=8  case 4: c allocates the same tokens -> reuse, ACTIVE, history [0, 8]
    s.allocate(8.0, ("c", [10], A), block_size=4)
    # t=9  c ends -> RELEASED at 9 (last access was 8)
    s.end_session(9.0, "c")
    sub.on_events(s.events)
    assert observed(cap, LIFETIME) == (0, 0.0)  # nothing evicted yet

    # t=15 case 5: d gets block 10 with other tokens -> eviction of the old contents
    s.events.clear()
    s.allocate(15.0, ("d", [10], B), block_size=4)
    sub.on_events(s.events)
    assert observed(cap, LIFETIME) == (1, 15.0)  # 15 - allocation at 0
    assert observed(cap, IDLE) == (1, 6.0)  # measured from the release at 9, not access at 8
    assert observed(cap, GAP) == (1, 8.0)  # the first gap: allocation (0) to reuse (8)

    # t=20 eviction while ACTIVE: e takes block 10 (tokens A) while d still owns it
    s.events.clear()
    s.allocate(20.0, ("e", [10], A), block_size=4)
    # t=21 d ends: it no longer owns block 10, which must stay ACTIVE for e
    s.end_session(21.0, "d")
    # t=30 f takes block 10 (tokens C) while e is still active -> no idle time recorded
    s.allocate(30.0, ("f", [10], C), block_size=4)
    sub.on_events(s.events)
    assert observed(cap, LIFETIME) == (3, 15.0 + 5.0 + 10.0)
    assert observed(cap, IDLE) == (1, 6.0)  # unchanged: both evictions hit an ACTIVE block
    assert observed(cap, GAP) == (1, 8.0)  # single-access histories have no gap
    assert sub.tracked_block_ids("inst0") == {10}
    assert cap.total("kvflow.l0.tracked_blocks", instance_id="inst0", model_name="model") == 1


def test_tokens_split_by_block_size_not_by_count(cap: MetricsCapture) -> None:
    """9 tokens over 3 blocks of size 4 are [0:4], [4:8], [8:9] (not 3 per block)."""
    sub = L0LifecycleSubscriber(cap.provider, sample_rate=1.0, seed=0)
    s = EventScript()
    tokens = list(range(100, 109))
    s.allocate(0.0, ("a", [1, 2, 3], tokens), block_size=4)
    s.end_session(1.0, "a")
    # b finds blocks 2 and 3 with the very tokens a left there: reuse, no eviction
    s.allocate(2.0, ("b", [2], tokens[4:8]), ("b", [3], tokens[8:9]), block_size=4)
    # c puts a 3-token prefix into block 1, which held 4 tokens: an eviction
    s.allocate(3.0, ("c", [1], tokens[0:3]), block_size=4)
    sub.on_events(s.events)
    assert observed(cap, LIFETIME) == (1, 3.0)
    assert observed(cap, IDLE) == (1, 2.0)


def test_allocation_counters_count_every_block(cap: MetricsCapture) -> None:
    """allocation_records and allocated_blocks count sampled and unsampled blocks alike."""
    sub = L0LifecycleSubscriber(cap.provider, sample_rate=0.0, seed=0)
    s = EventScript()
    s.allocate(0.0, ("a", [1, 2], list(range(32))), ("b", [3], []), model_name="m1")
    s.allocate(1.0, ("c", [4, 5, 6], list(range(40))), instance_id="inst1", model_name="m1")
    sub.on_events(s.events)
    assert cap.total("kvflow.l0.allocation_records", instance_id="inst0", model_name="m1") == 2
    assert cap.total("kvflow.l0.allocated_blocks", instance_id="inst0") == 3
    assert cap.total("kvflow.l0.allocated_blocks", instance_id="inst1") == 3
    assert sub.tracked_block_ids("inst0") == frozenset()


def test_malformed_records_are_counted_and_skipped(cap: MetricsCapture) -> None:
    """Too many tokens for the blocks, a bad block_size or a non-record are counted, not fatal."""
    sub = L0LifecycleSubscriber(cap.provider, sample_rate=1.0, seed=0)
    s = EventScript()
    s.allocate(0.0, ("a", [1], list(range(17))), ("b", [2], list(range(16))))
    s.allocate(1.0, ("c", [3], [1]), block_size=0)
    s.add(EventType.BLOCK_ALLOCATION, 2.0, instance_id="inst0", model_name="model",
          block_size=16, records=[("d", 5)])  # fmt: skip
    sub.on_events(s.events)
    assert cap.total("kvflow.l0.invalid_records") == 3
    assert cap.total("kvflow.l0.allocation_records") == 1
    assert sub.tracked_block_ids("inst0") == {2}


def test_sampling_decided_once_per_block_by_the_seeded_hash(cap: MetricsCapture) -> None:
    """Exactly the blocks the sampler keeps hold state, however often they are reallocated."""
    sub = L0LifecycleSubscriber(cap.provider, sample_rate=0.25, seed=7)
    s = EventScript()
    rng = random.Random(1)
    for i in range(300):
        blocks = rng.sample(range(500), 8)
        s.allocate(i, (f"r{i}", blocks, [rng.randrange(1000) for _ in range(8 * 16)]))
        s.end_session(i + 0.5, f"r{i}")
    sub.on_events(s.events)
    allocated = {b for e in s.events if e.type is EventType.BLOCK_ALLOCATION
                 for b in e.attrs["records"][0].new_block_ids}  # fmt: skip
    sampler = Sampler(0.25, seed=7)
    expected = {b for b in allocated if sampler.keep("inst0", b)}
    assert sub.tracked_block_ids("inst0") == expected
    assert 0.15 < len(expected) / len(allocated) < 0.35


def test_batching_does_not_change_results() -> None:
    """Delivering events one by one or in one batch records the same histograms."""
    rng = random.Random(3)
    s = EventScript()
    for i in range(400):
        n = rng.randrange(1, 6)
        blocks = rng.sample(range(60), n)
        tokens = [rng.randrange(4) for _ in range(n * 4 - rng.randrange(4))]
        s.allocate(i, (f"r{i}", blocks, tokens), block_size=4)
        if rng.random() < 0.8:
            s.end_session(i + 0.5, f"r{i}")
    results = []
    for batch in (1, len(s.events)):
        cap = MetricsCapture()
        sub = L0LifecycleSubscriber(cap.provider, sample_rate=0.5, seed=11)
        for i in range(0, len(s.events), batch):
            sub.on_events(s.events[i : i + batch])
        results.append([observed(cap, n) for n in (LIFETIME, IDLE, GAP)])
        cap.shutdown()
    assert results[0] == results[1]
    assert results[0][0][0] > 50  # the workload really evicts


def test_hot_block_history_is_bounded(cap: MetricsCapture) -> None:
    """A block reused more than max_history times records its gaps early; totals are exact."""
    sub = L0LifecycleSubscriber(cap.provider, sample_rate=1.0, seed=0, max_history=3)
    s = EventScript()
    for i in range(10):  # accessed at 0, 2, 4, ... 18
        s.allocate(2.0 * i, (f"r{i}", [1], A), block_size=4)
        s.end_session(2.0 * i + 1, f"r{i}")
    s.allocate(30.0, ("x", [1], B), block_size=4)
    sub.on_events(s.events)
    assert observed(cap, GAP) == (9, 18.0)
    assert observed(cap, LIFETIME) == (1, 30.0)


def test_unregister_forgets_the_instance(cap: MetricsCapture) -> None:
    """After UNREGISTER the instance's blocks hold no state and re-allocation starts afresh."""
    sub = L0LifecycleSubscriber(cap.provider, sample_rate=1.0, seed=0)
    s = EventScript()
    s.allocate(0.0, ("a", [1, 2], A + B), block_size=4)
    s.add(EventType.UNREGISTER, 1.0, instance_id="inst0", model_name="model")
    sub.on_events(s.events)
    assert sub.tracked_block_ids("inst0") == frozenset()
    assert cap.total("kvflow.l0.tracked_blocks") == 0


def test_state_scales_with_the_sample_not_the_ids() -> None:
    """200k distinct blocks at rate 0.01 retain well under 1 MiB; at rate 0 almost nothing."""
    retained = {}
    for rate in (0.0, 0.01):
        cap = MetricsCapture()
        sub = L0LifecycleSubscriber(cap.provider, sample_rate=rate, seed=0)
        events = []
        for r in range(200_000 // 64):
            ids = list(range(r * 64, r * 64 + 64))
            events.append(Event(EventType.BLOCK_ALLOCATION, 1 + r, None, None, {
                "instance_id": "inst0", "model_name": "m", "block_size": 16,
                "records": [(f"r{r}", ids, list(range(r, r + 1024)))]}))  # fmt: skip
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(0, len(events), 256):
            sub.on_events(events[i : i + 256])
        retained[rate] = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert len(sub.tracked_block_ids("inst0")) == (
            0 if rate == 0 else pytest.approx(2000, rel=0.2)
        )
        cap.shutdown()
    assert retained[0.0] < 64 * 1024
    assert retained[0.01] < 1024 * 1024


_CHILD = """
import json, random, sys
from kvflow.subscribers import L0LifecycleSubscriber
from kvflow.subscribers.testing import MetricsCapture
from tests.support.event_script import EventScript
cap = MetricsCapture()
sub = L0LifecycleSubscriber(cap.provider, sample_rate=0.1, seed=1234)
s, rng = EventScript(), random.Random(5)
for i in range(200):
    s.allocate(i, (f"r{i}", rng.sample(range(10**6), 32), []), instance_id="gpu-3")
sub.on_events(s.events)
print(json.dumps(sorted(sub.tracked_block_ids("gpu-3"))))
"""


def test_sampling_identical_across_processes() -> None:
    """Two interpreters with different hash seeds track exactly the same blocks."""
    outputs = []
    for hash_seed in ("1", "98765"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                              text=True, timeout=60, check=True, cwd=REPO)  # fmt: skip
        outputs.append(json.loads(proc.stdout))
    assert outputs[0] == outputs[1]
    assert 400 < len(outputs[0]) < 880  # ~10% of 6400 distinct ids
