"""How a layerwise CUDA op groups L1 objects into 2-D copies (`even_runs`, `even_pitch`).

A run of objects one pitch apart becomes one 2-D copy per part; anything else must fall
back to copies that cannot overlap or cross the pitch limit."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.core.engine.movers import even_pitch, even_runs
from kvflow.cuda import MAX_PITCH

MB = 1 << 20


def runs(hosts: Sequence[int], width: int) -> list[tuple[int, int, int]]:
    """`even_runs` of objects that all lie in one region (one pinned segment)."""
    return even_runs(hosts, width, [0] * len(hosts))


def test_a_request_laid_out_one_after_another_is_one_run() -> None:
    hosts = [1000 * MB + i * 4 * MB for i in range(6)]
    assert runs(hosts, 4 * MB) == [(0, 6, 4 * MB)]


def test_gaps_and_a_new_spacing_start_new_runs() -> None:
    base = 1 << 40
    hosts = [base, base + 8, base + 16, base + 40, base + 48, base + 100, base + 150, base + 200]
    assert runs(hosts, 8) == [(0, 3, 8), (3, 2, 8), (5, 3, 50)]


def test_descending_overlapping_or_too_far_objects_stand_alone() -> None:
    base = 1 << 40
    descending = [base + 64, base + 32, base]
    assert runs(descending, 16) == [(0, 1, 0), (1, 1, 0), (2, 1, 0)]
    closer_than_a_row = [base, base + 8, base + 16]
    assert runs(closer_than_a_row, 16) == [(0, 1, 0), (1, 1, 0), (2, 1, 0)]
    too_far = [base, base + MAX_PITCH + 1, base + 2 * (MAX_PITCH + 1)]
    assert runs(too_far, 16) == [(0, 1, 0), (1, 1, 0), (2, 1, 0)]
    at_the_limit = [base, base + MAX_PITCH]
    assert runs(at_the_limit, 16) == [(0, 2, MAX_PITCH)]


def test_a_lone_last_object_and_an_empty_op() -> None:
    assert runs([64, 128, 192, 1000], 64) == [(0, 3, 64), (3, 1, 0)]
    assert runs([5], 1) == [(0, 1, 0)]
    assert runs([], 1) == []


def test_no_run_crosses_from_one_region_into_another() -> None:
    """A request's first object alone at the end of one L1 segment and the rest at the
    start of the next, placed just above it: the first two lie a valid pitch apart, but
    one copy of both would cross two registrations (the driver refuses it), so the lone
    object stays alone; a run stops where the region changes."""
    seg0, seg1 = 1 << 40, (1 << 40) + (1 << 30) + 4096
    hosts = [seg0 + (1 << 30) - 32 * MB, seg1, seg1 + 32 * MB, seg1 + 64 * MB]
    assert even_runs(hosts, 32 * MB, [0, 1, 1, 1]) == [(0, 1, 0), (1, 3, 32 * MB)]
    assert runs(hosts, 32 * MB) == [(0, 2, seg1 - hosts[0]), (2, 2, 32 * MB)]  # one region
    evenly = [seg0 + i * 32 * MB for i in range(4)]
    assert even_runs(evenly, 32 * MB, [0, 0, 1, 1]) == [(0, 2, 32 * MB), (2, 2, 32 * MB)]


def test_a_layers_k_and_v_parts_share_one_pitch() -> None:
    assert even_pitch([(100, 50), (900, 50)]) == 800
    assert even_pitch([(0, 8), (16, 8), (32, 8)]) == 16


def test_parts_that_one_2d_copy_cannot_cover() -> None:
    assert even_pitch([(0, 64)]) == 0  # one part: nothing to span
    assert even_pitch([(0, 8), (16, 9)]) == 0  # sizes differ
    assert even_pitch([(0, 8), (16, 8), (40, 8)]) == 0  # uneven spacing
    assert even_pitch([(0, 8), (4, 8)]) == 0  # rows would overlap
    assert even_pitch([(16, 8), (0, 8)]) == 0  # descending
    assert even_pitch([(0, 8), (MAX_PITCH + 1, 8)]) == 0  # beyond the pitch limit
