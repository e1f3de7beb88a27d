"""L1's free space (`kvflow.core.tiers.l1space`): first fit within a segment, coalescing,
retired segments, and room found in a full L1 without trying every segment."""

from __future__ import annotations

import pytest

from kvflow.core.tiers import l1space
from kvflow.core.tiers.l1space import FreeList, FreeSpace


def test_a_free_list_fits_first_and_coalesces_both_neighbours() -> None:
    free = FreeList(100)
    assert [free.alloc(30), free.alloc(30), free.alloc(30)] == [0, 30, 60]
    assert free.alloc(11) is None and free.alloc(10) == 90
    free.free(30, 30)
    assert (free.starts, free.sizes) == ([30], [30])
    free.free(0, 30)  # joins the extent after it
    free.free(60, 30)  # joins the extent before it, then the one after it
    assert (free.starts, free.sizes) == ([0], [90])
    assert FreeList(0).alloc(1) is None


def test_room_is_found_in_whichever_segment_has_it() -> None:
    space = FreeSpace()
    assert [space.add(64), space.add(128)] == [0, 1]
    assert space.alloc(100) == (1, 0)
    assert space.alloc(64) == (0, 0)
    assert space.alloc(16) == (1, 100)
    assert space.alloc(16) is None
    assert len(space) == 2


def test_a_segment_that_cannot_fit_comes_back_once_something_in_it_is_freed() -> None:
    space = FreeSpace()
    space.add(100)
    assert space.alloc(60) == (0, 0)
    assert space.alloc(60) is None  # 40 bytes left: segment 0 is no candidate for 60 now
    space.free(0, 0, 60)
    assert space.alloc(60) == (0, 0)
    assert space.alloc_in(0, 40) == 60  # alloc_in asks the segment itself


def test_segments_in_order_then_the_one_freed_into_last_and_a_new_one_are_tried_first() -> None:
    space = FreeSpace()
    for _ in range(3):
        space.add(50)
    held = [space.alloc(50) for _ in range(3)]
    assert held == [(0, 0), (1, 0), (2, 0)]  # in order, the first segment first
    space.free(0, 0, 50)
    space.free(2, 0, 50)  # segment 2 was a candidate still (it held the last object)
    assert space.alloc(50) == (2, 0)
    assert space.alloc(50) == (0, 0)
    assert space.add(50) == 3
    assert space.alloc(50) == (3, 0)


def test_a_retired_segment_takes_no_object_and_gets_no_bytes_back() -> None:
    space = FreeSpace()
    space.add(100)
    space.add(100)
    assert space.alloc_in(1, 40) == 0
    space.retire(1)
    assert space.alloc(40) == (0, 0)
    space.free(1, 0, 40)  # its last object leaves
    assert space.alloc_in(1, 1) is None
    assert space.alloc(60) == (0, 40)
    assert space.alloc(1) is None  # nor for a size not asked before
    space.clear()
    assert len(space) == 0 and space.alloc(1) is None


def test_sizes_beyond_the_remembered_ones_are_still_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(l1space, "MAX_SIZES", 2)
    space = FreeSpace()
    space.add(1000)
    assert [space.alloc(n) for n in (10, 20, 30, 10)] == [(0, 0), (0, 10), (0, 30), (0, 60)]


def test_a_full_space_of_many_segments_finds_freed_room_in_a_few_tries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """512 full segments, each with a leftover too small for an object (so none is ever
    empty): after one pass that learns they are full, each free-then-alloc tries at most
    two segments, not 512 (L1 planning must not grow with its segment count)."""
    tries = 0
    alloc = FreeList.alloc

    def counted(self: FreeList, n: int) -> int | None:
        nonlocal tries
        tries += 1
        return alloc(self, n)

    space = FreeSpace()
    for _ in range(512):
        space.add(4 * 100 + 30)
    held = [space.alloc(100) for _ in range(4 * 512)]
    assert None not in held and space.alloc(100) is None
    monkeypatch.setattr(FreeList, "alloc", counted)
    for seg, offset in held[::7]:
        tries = 0
        space.free(seg, offset, 100)
        assert space.alloc(100) == (seg, offset)
        assert space.alloc(100) is None
        assert tries <= 2
