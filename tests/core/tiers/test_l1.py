"""L1 bookkeeping: two-phase writes, pins, LRU eviction, capacity accounting."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvflow.core.tiers.base import StoreOutcome, WritePlan
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


def test_a_plan_committed_when_done_appears_at_the_first_read_after_its_copies() -> None:
    """`commit_when_done`: invisible while `done()` is false; the first read after it
    turns true commits the plan (every kind of read); the store's own `commit` later
    changes nothing (no second count of the objects being written)."""
    l1 = make_l1(4)
    copied = [False]
    plan = l1.prepare_write(["a", "b"], ALIGN)
    l1.commit_when_done(plan, lambda: copied[0])
    assert l1.count_prefix([["a"]]) == 0
    assert l1.pin_prefix(["a"]) == []
    assert l1.contains(["a"]).result() == [False]
    assert l1.stats()["writing"] == 2
    copied[0] = True
    assert l1.count_prefix([["a"], ["b"]]) == 2
    l1.commit(plan)
    assert l1.stats()["objects"] == 2 and l1.stats()["writing"] == 0
    for read in (
        lambda m: m.pin_prefix(["c"]) != [],
        lambda m: m.contains(["c"]).result() == [True],
        lambda m: m.stats()["objects"] == 1,
    ):
        other = make_l1(2)
        flag = [False]
        later = other.prepare_write(["c"], ALIGN)
        other.commit_when_done(later, lambda flag=flag: flag[0])
        assert not read(other)
        flag[0] = True
        assert read(other)


def test_committing_one_landing_plan_leaves_the_others_landing() -> None:
    """Two stores answered early: the first committed by its own store, the second still
    committed by the first read after its copies."""
    l1 = make_l1(4)
    first, second = l1.prepare_write(["a"], ALIGN), l1.prepare_write(["b"], ALIGN)
    copied = [False]
    l1.commit_when_done(first, lambda: False)
    l1.commit_when_done(second, lambda: copied[0])
    l1.commit(first)
    assert l1.count_prefix([["b"]]) == 0
    copied[0] = True
    assert l1.count_prefix([["b"]]) == 1


def test_a_committed_plan_is_not_held_any_longer() -> None:
    """L1 lets go of a landing plan once it is committed (no plan kept per store)."""
    l1 = make_l1(2)
    plan = l1.prepare_write(["a"], ALIGN)
    l1.commit_when_done(plan, lambda: False)
    l1.commit(plan)
    held = weakref.ref(plan)
    del plan
    gc.collect()
    assert held() is None


def test_a_plan_landing_when_l1_closes_is_forgotten() -> None:
    """Close forgets a plan whose copies were only queued: no read after it commits one."""
    l1 = make_l1(2)
    plan = l1.prepare_write(["a"], ALIGN)
    l1.commit_when_done(plan, lambda: True)
    l1.close()
    assert l1.count_prefix([["a"]]) == 0
    assert l1.stats()["objects"] == 0 and l1.stats()["writing"] == 0


def test_an_aborted_plan_is_not_committed_when_its_copies_end_later() -> None:
    """An aborted plan stays invisible; another store's landing plan is still committed
    by the next read."""
    l1 = make_l1(2)
    plan, other = l1.prepare_write(["a"], ALIGN), l1.prepare_write(["b"], ALIGN)
    l1.commit_when_done(plan, lambda: True)
    l1.commit_when_done(other, lambda: True)
    l1.abort(plan)
    assert l1.count_prefix([["a"]]) == 0
    assert l1.count_prefix([["b"]]) == 1
    assert l1.stats()["usage_bytes"] == ALIGN and l1.stats()["writing"] == 0


def test_a_plan_names_the_objects_it_evicted_for_room() -> None:
    """A full L1 evicts its least recent objects for a new plan, which names their keys
    (what the KV-event stream reports as removed)."""
    l1 = make_l1(2)
    assert store(l1, ["a", "b"]) == 2
    plan = l1.prepare_write(["c", "d"], ALIGN)
    assert plan.covered == 2
    assert sorted(plan.evicted_keys) == ["a", "b"]
    assert (plan.evicted_chunks, plan.evicted_bytes) == (2, 2 * ALIGN)


def test_an_object_of_one_byte_is_stored() -> None:
    """The smallest object is one byte: it is planned, written and read back."""
    l1 = make_l1(2)
    plan = l1.prepare_write(["x"], 1)
    assert plan.covered == 1 and len(plan.new) == 1
    l1.view(plan.new[0][1]).fill_(7)
    l1.commit(plan)
    objs = l1.pin_prefix(["x"])
    assert [bytes(l1.view(o).numpy()) for o in objs] == [b"\x07"]
    l1.release(objs)


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


def test_objects_name_the_segment_they_lie_in_as_their_region() -> None:
    """Each segment is pinned on its own, so a copy may not run from one into the next:
    objects tell which segment (region) they lie in; two per segment here."""
    l1 = make_l1(4, segment_bytes=2 * ALIGN)
    store(l1, ["a", "b", "c"])
    objs = l1.pin_prefix(["a", "b", "c"])
    views = l1.views(objs)
    regions = [views.region(i) for i in range(3)]
    assert regions[0] == regions[1] != regions[2]
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
    with pytest.raises(
        ValueError, match=r"^extend_write needs keys that start with the plan's keys$"
    ):
        l1.extend_write(plan, ["b0", "b1", "b2"], ALIGN)
    with pytest.raises(ValueError, match="start with the plan's keys"):
        l1.extend_write(plan, ["a0"], ALIGN)
    l1.abort(plan)


# -- bytes and accounting through the generic tier calls ------------------------------


def payload(value: int, nbytes: int = ALIGN) -> torch.Tensor:
    return torch.full((nbytes,), value, dtype=torch.uint8)


def loaded(l1: L1Cache, key: str, nbytes: int = ALIGN) -> torch.Tensor | None:
    """The key's bytes as `load` gives them, or None on a miss."""
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    (hit,) = l1.load([key], [dst]).result(timeout=0)
    return dst if hit else None


def holds(l1: L1Cache, key: str, expected: torch.Tensor) -> bool:
    """Whether `load` of the key gives exactly `expected`."""
    got = loaded(l1, key, expected.numel())
    return got is not None and torch.equal(got, expected)


def put(l1: L1Cache, key: str, value: int, nbytes: int = ALIGN) -> WritePlan:
    """Two-phase write of one object filled with `value`; returns the committed plan."""
    plan = l1.prepare_write([key], nbytes)
    assert plan.covered == 1 and len(plan.new) == 1, f"no room for {key}"
    l1.view(plan.new[0][1]).fill_(value)
    l1.commit(plan)
    return plan


def test_objects_of_an_unaligned_size_do_not_overlap() -> None:
    """An object one byte past the alignment gets the next aligned size of room."""
    l1 = make_l1(4)
    nbytes = ALIGN + 1
    outcome = l1.store([("a", payload(1, nbytes)), ("b", payload(2, nbytes))]).result(timeout=0)
    assert outcome == StoreOutcome(stored=2)
    assert holds(l1, "a", payload(1, nbytes))
    assert holds(l1, "b", payload(2, nbytes))
    assert l1.stats()["usage_bytes"] == 4 * ALIGN


def test_objects_carved_from_one_segment_keep_their_own_bytes() -> None:
    l1 = make_l1(4)  # one segment of four objects
    l1.store([(f"k{i}", payload(10 + i)) for i in range(4)]).result(timeout=0)
    assert l1.stats()["reserved_bytes"] == 4 * ALIGN
    for i in range(4):
        assert holds(l1, f"k{i}", payload(10 + i))


@pytest.mark.parametrize(
    "freed_order",
    [["d", "e", "a", "b"], ["d", "e", "b", "a"]],
    ids=["each-after-its-neighbour", "each-before-its-neighbour"],
)
def test_freed_neighbours_coalesce_whichever_goes_first(freed_order: list[str]) -> None:
    """Objects freed next to each other (or to free room) make one extent, in any order:
    two double-size objects then fit without eviction, and nothing overlaps."""
    l1 = make_l1(5)  # one segment: a b c d e
    for i, key in enumerate("abcde"):
        put(l1, key, i + 1)
    for key in freed_order:  # the least recent go first
        l1.count_prefix([[key]])
    l1.count_prefix([["c"]])  # c stays: most recent, and not dropped
    assert l1.drop_where(lambda k: k != "c") == 4
    assert put(l1, "big1", 21, 2 * ALIGN).evicted_chunks == 0
    assert put(l1, "big2", 22, 2 * ALIGN).evicted_chunks == 0
    assert holds(l1, "c", payload(3))
    assert put(l1, "f", 23).evicted_chunks == 1  # the segment is full: big1 (least recent) goes
    expected = {"c": payload(3), "big2": payload(22, 2 * ALIGN), "f": payload(23)}
    for key, value in expected.items():
        assert holds(l1, key, value)
    assert loaded(l1, "big1", 2 * ALIGN) is None


def test_a_capacity_of_exactly_one_aligned_unit_holds_one_object() -> None:
    l1 = L1Cache(ALIGN, pool=HostPool(pinned=False))
    assert l1.store([("a", payload(5))]).result(timeout=0) == StoreOutcome(stored=1)
    assert holds(l1, "a", payload(5))
    assert l1.stats()["evicted_chunks"] == 0


def test_a_segment_as_small_as_the_room_left_is_added_without_evicting() -> None:
    l1 = make_l1(3, segment_bytes=2 * ALIGN)  # segments of 2, then the last 1
    l1.store([(k, payload(i)) for i, k in enumerate("abc")]).result(timeout=0)
    stats = l1.stats()
    assert (stats["objects"], stats["evicted_chunks"], stats["reserved_bytes"]) == (3, 0, 3 * ALIGN)


def test_objects_live_in_the_pool_given() -> None:
    pool = HostPool(pinned=False)
    l1 = L1Cache(4 * ALIGN, pool=pool)
    put(l1, "a", 7)
    (obj,) = l1.pin_prefix(["a"])
    assert l1.views([obj]).address(0, ALIGN) == pool.address(0, 0)
    assert torch.equal(pool.view(0, 0, ALIGN), payload(7))
    l1.release([obj])


def test_without_a_pool_l1_makes_its_own() -> None:
    l1 = L1Cache(4 * ALIGN)  # pinned only where CUDA is present
    assert l1.pool.pinned == torch.cuda.is_available()
    assert l1.store([("a", payload(3))]).result(timeout=0) == StoreOutcome(stored=1)
    assert holds(l1, "a", payload(3))
    l1.close()


def test_evictions_are_counted_in_chunks_and_bytes() -> None:
    """stats() and the store outcome sum every eviction: an object that needs two
    evictions counts both, a store of several items counts each item's."""
    nbytes = ALIGN - 6  # evictions count the objects' bytes, not their aligned room
    l1 = make_l1(4)
    assert (l1.stats()["evicted_chunks"], l1.stats()["evicted_bytes"]) == (0, 0)
    l1.store([(f"k{i}", payload(i, nbytes)) for i in range(4)]).result(timeout=0)
    outcome = l1.store([("n0", payload(9, nbytes)), ("n1", payload(9, nbytes))]).result(timeout=0)
    assert outcome == StoreOutcome(stored=2, evicted_chunks=2, evicted_bytes=2 * nbytes)
    plan = put(l1, "big", 8, 2 * ALIGN)  # k2 and k3 go: adjacent, room for one big object
    assert (plan.evicted_chunks, plan.evicted_bytes) == (2, 2 * nbytes)
    stats = l1.stats()
    assert (stats["evicted_chunks"], stats["evicted_bytes"]) == (4, 4 * nbytes)


def test_store_counts_each_item_failed_present_or_stored() -> None:
    l1 = make_l1(2)
    l1.store([("a", payload(1)), ("b", payload(2))]).result(timeout=0)
    assert l1.store([("a", payload(1)), ("b", payload(2))]).result(timeout=0) == StoreOutcome(
        present=2
    )
    assert l1.pin(["a", "b"]) == 2  # no room left for anything new
    items = [("x", payload(3)), ("y", payload(4)), ("a", payload(1))]
    assert l1.store(items).result(timeout=0) == StoreOutcome(present=1, failed=2)
    l1.unpin(["a", "b"])
    outcome = l1.store([("a", payload(1)), ("z", payload(5))]).result(timeout=0)
    assert outcome == StoreOutcome(stored=1, present=1, evicted_chunks=1, evicted_bytes=ALIGN)
    assert holds(l1, "z", payload(5))


def test_a_store_whose_copy_fails_leaves_nothing_behind() -> None:
    """A buffer torch cannot copy from (sparse) raises torch's error; the object reserved
    for it is freed and never visible."""
    l1 = make_l1(2)
    sparse = payload(1).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        l1.store([("a", sparse)])
    stats = l1.stats()
    assert (stats["objects"], stats["writing"], stats["usage_bytes"]) == (0, 0, 0)
    assert l1.contains(["a"]).result(timeout=0) == [False]


def test_refused_buffers_are_named_by_argument() -> None:
    l1 = make_l1(2)
    bad = torch.zeros(ALIGN, dtype=torch.float32)
    with pytest.raises(
        ValueError,
        match=r"^items' bytes\[0\] must be a 1-D uint8 CPU tensor, got torch.float32 \(256,\) on cpu$",
    ):
        l1.store([("a", bad)])
    with pytest.raises(
        ValueError,
        match=r"^dsts\[0\] must be a 1-D uint8 CPU tensor, got torch.float32 \(256,\) on cpu$",
    ):
        l1.load(["a"], [bad])


def test_a_write_plan_leaves_readers_pins_as_they_were() -> None:
    """Planning over present keys protects them only while planning: a reader's pins
    are the same after, whether the plan is committed or aborted."""
    l1 = make_l1(4)
    put(l1, "a0", 1)
    assert l1.pin(["a0"]) == 1 and l1.pin(["a0"]) == 1
    plan = l1.prepare_write(["a0", "a1"], ALIGN)
    l1.abort(plan)
    plan = l1.prepare_write(["a0", "a1"], ALIGN)
    l1.commit(plan)
    l1.unpin(["a0"])
    l1.unpin(["a0"])
    with pytest.raises(ValueError, match="not pinned"):
        l1.unpin(["a0"])
    l1.drop_where(lambda k: True)  # nothing pinned is left: both go
    assert l1.stats()["objects"] == 0


def test_a_plan_over_present_keys_covers_them_all() -> None:
    l1 = make_l1(4)
    store(l1, ["a", "b"])
    plan = l1.prepare_write(["a", "b"], ALIGN)
    assert plan.covered == 2 and plan.new == []
    l1.extend_write(plan, ["a", "b"], ALIGN)  # the same keys again: nothing to add
    assert plan.covered == 2 and plan.new == []
    l1.extend_write(plan, ["a", "b", "c"], ALIGN)
    assert plan.covered == 3 and [i for i, _ in plan.new] == [2]
    l1.commit(plan)


def test_extending_does_not_replan_a_key_that_went_between_steps() -> None:
    """A present key of the plan's first step that is dropped before the next step stays
    gone: it is not reserved again (its bytes would never be written)."""
    l1 = make_l1(4)
    put(l1, "a0", 1)
    plan = l1.prepare_write(["a0"], ALIGN)
    assert plan.covered == 1 and plan.new == []
    assert l1.drop_where(lambda k: k == "a0") == 1
    l1.extend_write(plan, ["a0", "a1"], ALIGN)
    assert [i for i, _ in plan.new] == [1]
    l1.commit(plan)
    assert l1.contains(["a0", "a1"]).result(timeout=0) == [False, True]


def test_count_prefix_refreshes_every_rank_of_a_hit_chunk() -> None:
    """Chunks found by count_prefix become the most recent, all their ranks' objects."""
    l1 = make_l1(4)
    store(l1, ["x0", "x1"])  # one chunk, two ranks
    store(l1, ["y"])
    store(l1, ["z"])
    assert l1.count_prefix([["x0", "x1"]]) == 1
    store(l1, ["n0"])
    store(l1, ["n1"])  # y and z, now the least recent, went
    assert l1.contains(["x0", "x1", "y", "z"]).result(timeout=0) == [True, True, False, False]


def test_aborting_after_close_or_commit_changes_nothing() -> None:
    """A plan settled late (a staged load freed after shutdown, an abort after commit)
    is a no-op."""
    l1 = make_l1(4)
    committed = put(l1, "a", 1)
    l1.abort(committed)
    assert holds(l1, "a", payload(1))
    pending = l1.prepare_write(["b"], ALIGN)
    l1.close()
    l1.abort(pending)
    stats = l1.stats()
    assert (stats["objects"], stats["writing"], stats["usage_bytes"]) == (0, 0, 0)


def test_close_zeroes_the_accounting() -> None:
    l1 = make_l1(4)
    put(l1, "a", 1)
    l1.prepare_write(["b"], ALIGN)  # still being written at close
    l1.close()
    stats = l1.stats()
    assert (stats["usage_bytes"], stats["objects"], stats["writing"], stats["reserved_bytes"]) == (
        0,
        0,
        0,
        0,
    )


def test_object_views_are_each_objects_bytes() -> None:
    l1 = make_l1(4)
    put(l1, "a", 1)
    put(l1, "b", 2)
    objs = l1.pin_prefix(["a", "b"])
    views = l1.views(objs)
    assert len(views) == 2
    assert torch.equal(views[0], payload(1)) and torch.equal(views[1], payload(2))
    assert views[1].data_ptr() == views.address(1, ALIGN)
    l1.release(objs)
