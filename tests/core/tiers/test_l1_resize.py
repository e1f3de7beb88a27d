"""Live L1 resize: a shrink evicts first and gives memory back, never dropping an object
a reader pins or a writer fills; a grow makes room at once; survivors keep their bytes."""

from __future__ import annotations

import pytest
import torch

from kvflow.core.tiers.base import ObjectKey
from kvflow.core.tiers.hostmem import HostPool
from kvflow.core.tiers.l1 import L1Cache

KIB = 1024
SEGMENT = 16 * KIB


def _key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(8, "little"), "m", 1, 0, None)


def _l1(capacity: int) -> L1Cache:
    return L1Cache(capacity, segment_bytes=SEGMENT, pool=HostPool(pinned=False), pin_ahead=False)


def _fill(l1: L1Cache, n: int) -> list[ObjectKey]:
    keys = [_key(i) for i in range(n)]
    for i, key in enumerate(keys):
        assert l1.store([(key, torch.full((KIB,), i, dtype=torch.uint8))]).result().stored == 1
    return keys


def _bytes_ok(l1: L1Cache, keys: list[ObjectKey]) -> int:
    """How many of `keys` L1 holds; AssertionError if one holds another's bytes."""
    held = 0
    for i, key in enumerate(keys):
        objs = l1.pin_prefix([key])
        try:
            if objs:
                assert torch.equal(l1.view(objs[0]), torch.full((KIB,), i, dtype=torch.uint8))
                held += 1
        finally:
            l1.release(objs)
    return held


def test_a_shrink_evicts_the_last_segments_and_gives_their_memory_back() -> None:
    """64 objects in four 16-KiB segments; shrinking to 32 KiB evicts the 32 objects of
    the last two segments at once, frees them, and the 32 left keep their bytes."""
    l1 = _l1(4 * SEGMENT)
    keys = _fill(l1, 64)
    assert l1.stats()["reserved_bytes"] == 4 * SEGMENT
    outcome = l1.resize(2 * SEGMENT)
    assert outcome == {
        "capacity_bytes": 2 * SEGMENT, "reserved_bytes": 2 * SEGMENT,
        "usage_bytes": 32 * KIB, "evicted_chunks": 32, "retiring_bytes": 0,
    }  # fmt: skip
    assert _bytes_ok(l1, keys) == 32
    for i in range(100, 140):  # new objects evict within the smaller budget
        assert l1.store([(_key(i), torch.zeros(KIB, dtype=torch.uint8))]).result().stored == 1
    stats = l1.stats()
    assert stats["usage_bytes"] <= 2 * SEGMENT and stats["reserved_bytes"] == 2 * SEGMENT


def test_a_shrink_keeps_pinned_and_in_flight_objects_until_they_are_done() -> None:
    """An object a reader pins and one being written live in the retired segment: both
    stay (the reader still sees its bytes, the write commits), and the segment's memory
    goes back when the last of them is evicted; the pool holds only the kept segment."""
    l1 = _l1(2 * SEGMENT)
    keys = _fill(l1, 20)  # 16 in segment 0, 4 in segment 1
    reading = l1.pin_prefix([keys[17]])
    plan = l1.prepare_write([_key(500)], KIB)  # lands in segment 1's free space
    outcome = l1.resize(SEGMENT)
    assert outcome["retiring_bytes"] == 2 * KIB and outcome["reserved_bytes"] == SEGMENT
    assert torch.equal(l1.view(reading[0]), torch.full((KIB,), 17, dtype=torch.uint8))
    l1.view(plan.new[0][1]).fill_(5)
    l1.commit(plan)
    l1.release(reading)
    assert l1.contains([keys[17], _key(500)]).result() == [True, True]
    for i in range(600, 640):  # later stores evict them (they are readable now)
        l1.store([(_key(i), torch.zeros(KIB, dtype=torch.uint8))]).result()
    stats = l1.stats()
    assert stats["reserved_bytes"] == SEGMENT and stats["usage_bytes"] <= SEGMENT
    assert l1.pool.view(1, 0, KIB).numel() == 0  # segment 1's memory was given back


def test_a_shrink_of_a_single_segment_lets_l1_grow_again_at_once() -> None:
    """One segment, shrunk while a reader pins an object in it: stores go on in a new,
    smaller segment at once (no 'L1 full' while the old one waits for its reader)."""
    l1 = _l1(SEGMENT)
    keys = _fill(l1, 16)
    reading = l1.pin_prefix([keys[3]])
    assert l1.resize(SEGMENT // 2)["retiring_bytes"] == KIB
    for i in range(200, 230):
        assert l1.store([(_key(i), torch.zeros(KIB, dtype=torch.uint8))]).result().stored == 1
    assert torch.equal(l1.view(reading[0]), torch.full((KIB,), 3, dtype=torch.uint8))
    l1.release(reading)
    assert l1.stats()["reserved_bytes"] == SEGMENT // 2


def test_a_grow_makes_room_at_once() -> None:
    l1 = _l1(SEGMENT)
    keys = _fill(l1, 32)
    assert _bytes_ok(l1, keys) == 16
    assert l1.resize(3 * SEGMENT)["evicted_chunks"] == 0
    more = [_key(1000 + i) for i in range(32)]
    for key in more:
        l1.store([(key, torch.ones(KIB, dtype=torch.uint8))]).result()
    assert _bytes_ok(l1, keys) == 16 and sum(l1.contains(more).result()) == 32
    assert l1.stats()["reserved_bytes"] == 3 * SEGMENT


def test_a_resize_to_nothing_is_refused() -> None:
    l1 = _l1(SEGMENT)
    for bad in (0, 100, 1.5, True):
        with pytest.raises(ValueError, match="L1 capacity"):
            l1.resize(bad)  # type: ignore[arg-type]
    assert l1.stats()["capacity_bytes"] == SEGMENT
