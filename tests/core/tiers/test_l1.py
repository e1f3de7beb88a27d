"""L1 bookkeeping: two-phase writes, pins, LRU eviction, capacity accounting."""

from __future__ import annotations

import pytest

from kvflow.core.tiers.hostmem import HostPool
from kvflow.core.tiers.l1 import ALIGN, L1Cache


def make_l1(objects: int, nbytes: int = ALIGN, segment_bytes: int = 1 << 30) -> L1Cache:
    return L1Cache(objects * nbytes, pool=HostPool(pinned=False), segment_bytes=segment_bytes)


def store(l1: L1Cache, keys: list[str], nbytes: int = ALIGN) -> int:
    plan = l1.prepare_write(keys, nbytes)
    for _, obj in plan.new:
        l1.view(obj).fill_(len(obj.key))
    l1.commit(plan)
    return plan.covered


def test_objects_being_written_are_invisible_until_commit() -> None:
    """prepare_write allocates; lookups and readers see nothing until commit."""
    l1 = make_l1(4)
    plan = l1.prepare_write(["a", "b"], ALIGN)
    assert plan.covered == 2 and len(plan.new) == 2
    assert l1.count_prefix([["a"]]) == 0
    assert l1.pin_prefix(["a"]) == []
    assert l1.stats()["writing"] == 2
    l1.commit(plan)
    assert l1.count_prefix([["a"], ["b"]]) == 2
    assert l1.stats()["objects"] == 2 and l1.stats()["writing"] == 0


def test_abort_leaves_nothing_visible_and_frees_the_bytes() -> None:
    """A failed store's objects vanish and their bytes become free again."""
    l1 = make_l1(2)
    plan = l1.prepare_write(["a", "b"], ALIGN)
    l1.abort(plan)
    assert l1.count_prefix([["a"]]) == 0
    assert l1.stats()["usage_bytes"] == 0
    assert store(l1, ["c", "d"]) == 2
    assert l1.stats()["evicted_chunks"] == 0


def test_present_keys_are_skipped() -> None:
    """A second store of the same keys allocates only the new ones."""
    l1 = make_l1(4)
    store(l1, ["a", "b"])
    plan = l1.prepare_write(["a", "b", "c"], ALIGN)
    assert [i for i, _ in plan.new] == [2] and plan.covered == 3
    l1.abort(plan)


def test_lru_evicts_a_prefix_tail_before_its_head() -> None:
    """Under pressure the least recent request goes first, its last chunk first."""
    l1 = make_l1(4)
    store(l1, ["a0", "a1"])
    store(l1, ["b0", "b1"])
    plan = l1.prepare_write(["c0"], ALIGN)
    l1.commit(plan)
    assert plan.evicted_chunks == 1
    assert l1.count_prefix([["a0"], ["a1"]]) == 1  # a1 evicted, a0 kept
    assert l1.stats()["evicted_chunks"] == 1


def test_pinned_objects_are_never_evicted() -> None:
    """Objects pinned by a reader survive pressure; when everything is pinned, writes stop."""
    l1 = make_l1(2)
    store(l1, ["a", "b"])
    pinned = l1.pin_prefix(["a", "b"])
    plan = l1.prepare_write(["c"], ALIGN)
    assert plan.covered == 0 and plan.new == []
    l1.release(pinned[1:])
    plan = l1.prepare_write(["c"], ALIGN)
    l1.commit(plan)
    assert l1.count_prefix([["a"]]) == 1 and l1.count_prefix([["b"]]) == 0
    assert l1.count_prefix([["c"]]) == 1
    l1.release(pinned[:1])


def test_a_store_does_not_evict_its_own_prefix() -> None:
    """Chunks already present for the request are protected while its new ones are placed."""
    l1 = make_l1(2)
    store(l1, ["a0"])
    plan = l1.prepare_write(["a0", "a1", "a2"], ALIGN)
    assert plan.covered == 2 and [i for i, _ in plan.new] == [1]
    l1.commit(plan)
    assert l1.count_prefix([["a0"], ["a1"]]) == 2


def test_count_prefix_needs_every_key_of_a_chunk() -> None:
    """A chunk hits only if all its keys (one per rank) are readable."""
    l1 = make_l1(4)
    store(l1, ["r0c0", "r0c1", "r1c0"])
    assert l1.count_prefix([["r0c0", "r1c0"], ["r0c1", "r1c1"]]) == 1


def test_bytes_round_trip_and_segments_grow_within_capacity() -> None:
    """Views hold what was written; segments are added lazily up to the capacity."""
    l1 = make_l1(4, segment_bytes=2 * ALIGN)
    assert l1.stats()["reserved_bytes"] == 0
    store(l1, ["x", "yy", "zzz"])
    (obj,) = l1.pin_prefix(["yy"])
    assert bool((l1.view(obj) == 2).all())
    l1.release([obj])
    stats = l1.stats()
    assert stats["reserved_bytes"] == 4 * ALIGN and stats["usage_bytes"] == 3 * ALIGN


def test_object_addresses_are_their_views_addresses_and_sizes_are_checked() -> None:
    """Movers copy by address: each object's address is where its view's bytes start, in
    whichever segment it lives; asking for another size is an error, not a wild copy."""
    l1 = make_l1(4, segment_bytes=2 * ALIGN)
    store(l1, ["a", "b", "c"])
    objs = l1.pin_prefix(["a", "b", "c"])
    views = l1.views(objs)
    assert [views.address(i, ALIGN) for i in range(3)] == [l1.view(o).data_ptr() for o in objs]
    with pytest.raises(ValueError, match=f"holds {ALIGN} bytes, not {2 * ALIGN}"):
        views.address(0, 2 * ALIGN)
    l1.release(objs)


def test_freed_extents_coalesce_for_a_larger_object() -> None:
    """Two adjacent freed objects make room for one object of twice the size."""
    l1 = make_l1(2)
    store(l1, ["a", "b"])
    plan = l1.prepare_write(["big"], 2 * ALIGN)
    assert plan.evicted_chunks == 2 and plan.covered == 1
    l1.commit(plan)


def test_drop_where_removes_matching_unpinned_objects() -> None:
    """drop_where forgets matching readable objects only."""
    l1 = make_l1(4)
    store(l1, ["a", "b"])
    assert l1.drop_where(lambda k: k == "a") == 1
    assert l1.count_prefix([["a"]]) == 0 and l1.count_prefix([["b"]]) == 1


def test_capacity_below_one_aligned_unit_is_rejected() -> None:
    """A capacity too small for any object is a construction error."""
    with pytest.raises(ValueError, match="capacity"):
        L1Cache(10)


def test_a_plan_made_in_steps_matches_one_plan_of_all_keys() -> None:
    """prepare_write of a head, then extend_write: the same objects, one commit."""
    l1 = make_l1(4)
    store(l1, ["a1"])
    plan = l1.prepare_write(["a0"], ALIGN)
    l1.extend_write(plan, ["a0", "a1", "a2"], ALIGN)
    assert plan.covered == 3 and [i for i, _ in plan.new] == [0, 2]
    assert list(plan.keys) == ["a0", "a1", "a2"]
    assert l1.count_prefix([["a0"]]) == 0  # still invisible
    l1.commit(plan)
    assert l1.count_prefix([["a0"], ["a1"], ["a2"]]) == 3


def test_extending_protects_the_whole_request_and_stops_where_room_ends() -> None:
    """The rest of a request never evicts its own present chunks; past no room, nothing is added."""
    l1 = make_l1(3)
    store(l1, ["a1"])
    store(l1, ["z"])
    plan = l1.prepare_write(["a0"], ALIGN)  # takes the last free slot
    l1.extend_write(plan, ["a0", "a1", "a2", "a3"], ALIGN)  # a2 evicts z; a1 is protected
    assert plan.covered == 3 and [i for i, _ in plan.new] == [0, 2]
    assert plan.evicted_chunks == 1 and l1.count_prefix([["z"]]) == 0
    l1.extend_write(plan, ["a0", "a1", "a2", "a3", "a4"], ALIGN)  # already short: a no-op
    assert plan.covered == 3 and len(plan.new) == 2
    l1.abort(plan)
    assert l1.count_prefix([["a1"]]) == 1 and l1.stats()["writing"] == 0


def test_extend_write_refuses_keys_that_do_not_continue_the_plan() -> None:
    l1 = make_l1(4)
    plan = l1.prepare_write(["a0", "a1"], ALIGN)
    with pytest.raises(ValueError, match="start with the plan's keys"):
        l1.extend_write(plan, ["b0", "b1", "b2"], ALIGN)
    with pytest.raises(ValueError, match="start with the plan's keys"):
        l1.extend_write(plan, ["a0"], ALIGN)
    l1.abort(plan)
