"""Guards of l1.py's evictions, removals, resize and quota bookkeeping: exact eviction
counters, retiring segments given back, the pinning a resize starts (or does not)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvflow.core.tiers.base import ObjectKey
from kvflow.core.tiers.hostmem import HostPool
from kvflow.core.tiers.l1 import ALIGN, L1Cache
from kvflow.core.tiers.quota import TenantQuotas, salt_label
from tests.support.ops import wait_for

KIB = 1024
SEGMENT = 16 * KIB  # 16 objects of 1 KiB
SEG = 4 * KIB  # segments of the pinned-ahead caches


def _key(i: int, salt: str | None = None) -> ObjectKey:
    return ObjectKey(i.to_bytes(8, "little"), "m", 1, 0, salt)


def _l1(capacity: int, limits: dict[tuple[str, str], int] | None = None) -> L1Cache:
    return L1Cache(
        capacity, segment_bytes=SEGMENT, pool=HostPool(pinned=False), pin_ahead=False,
        tenants=TenantQuotas(limits),
    )  # fmt: skip


def _put(l1: L1Cache, key: ObjectKey, nbytes: int = KIB) -> None:
    outcome = l1.store([(key, torch.full((nbytes,), 7, dtype=torch.uint8))]).result()
    assert outcome.stored == 1


def _fill(l1: L1Cache, n: int, salt: str | None = None, nbytes: int = KIB) -> list[ObjectKey]:
    keys = [_key(i, salt) for i in range(n)]
    for key in keys:
        _put(l1, key, nbytes)
    return keys


def _drop(l1: L1Cache, key: ObjectKey) -> None:
    assert l1.drop_where(lambda k: k == key) == 1


def _tenant_row(l1: L1Cache, salt: str) -> dict[str, object]:
    (row,) = [r for r in l1.tenant_stats() if r["tenant"] == salt_label(salt)]
    return row


def _ahead_l1(capacity: int) -> L1Cache:
    """An L1 pinned ahead (on unpinned memory, so segments come at once), fully grown."""
    l1 = L1Cache(
        capacity, segment_bytes=SEG, pool=HostPool(pinned=False), pin_ahead=True, pin_threads=1
    )
    _wait_for(lambda: l1.stats()["reserved_bytes"] == capacity and _pinning_done(l1))
    return l1


def _pinning_done(l1: L1Cache) -> bool:
    state = l1.pin_state()
    assert state is not None
    return not state["pinning"]


def _wait_for(done: Callable[[], bool]) -> None:
    """Wait for `done` (the pinning threads run on their own) for at most 10 s."""
    wait_for(done, timeout_s=10, interval_s=0.01, what="the background pinning to settle")


# -- evictions and removals -------------------------------------------------------------


def test_set_quota_reports_only_its_own_evictions_and_counts_bytes_exactly() -> None:
    """After one LRU eviction, set_quota's four evictions: its outcome counts 4, and L1's
    and the tenant's totals count all 5 (bytes as stored, not as aligned)."""
    l1 = L1Cache(8 * KIB, segment_bytes=8 * KIB, pool=HostPool(pinned=False), pin_ahead=False)
    keys = _fill(l1, 9, salt="t", nbytes=1000)  # the 9th evicts keys[0]
    assert l1.stats()["evicted_chunks"] == 1 and l1.stats()["evicted_bytes"] == 1000
    outcome = l1.set_quota(("salt", "t"), 4 * KIB)
    assert outcome == {"usage_bytes": 4 * KIB, "evicted_chunks": 4}
    stats = l1.stats()
    assert (stats["evicted_chunks"], stats["evicted_bytes"]) == (5, 5000)
    assert stats["usage_bytes"] == 4 * KIB
    row = _tenant_row(l1, "t")
    assert (row["evicted_chunks"], row["usage_bytes"], row["objects"]) == (5, 4 * KIB, 4)
    assert l1.contains(keys).result() == [False] * 5 + [True] * 4


def test_a_quota_eviction_is_counted_in_the_write_plan_that_caused_it() -> None:
    """One plan of two keys, for a tenant at its limit, evicts the tenant's two objects:
    the plan names both and counts 2 chunks of their stored bytes."""
    l1 = _l1(64 * KIB, {("salt", "s"): 2 * KIB})
    old = _fill(l1, 2, salt="s", nbytes=1000)
    new = [_key(10, "s"), _key(11, "s")]
    plan = l1.prepare_write(new, 1000)
    assert plan.covered == 2
    assert (plan.evicted_chunks, plan.evicted_bytes) == (2, 2000)
    assert plan.evicted_keys == old
    l1.abort(plan)
    stats = l1.stats()
    assert (stats["evicted_chunks"], stats["evicted_bytes"]) == (2, 2000)


def test_drops_and_aborts_are_not_counted_as_a_tenants_evictions() -> None:
    """drop_where and abort free a tenant's objects without counting evictions, for the
    tenant or for L1."""
    l1 = _l1(64 * KIB)
    keys = _fill(l1, 3, salt="t")
    _drop(l1, keys[0])
    l1.abort(l1.prepare_write([_key(99, "t")], KIB))
    row = _tenant_row(l1, "t")
    assert (row["evicted_chunks"], row["usage_bytes"], row["objects"]) == (0, 2 * KIB, 2)
    assert l1.stats()["evicted_chunks"] == 0 and l1.stats()["usage_bytes"] == 2 * KIB


# -- shrinking: retiring segments ---------------------------------------------------------


def test_a_retiring_segment_counts_down_its_live_bytes_and_is_given_back_at_zero() -> None:
    """Two objects pinned in the retired segment keep it retiring; each one dropped takes
    its bytes off, the last one gives the memory back; repeated resizes change nothing."""
    l1 = _l1(2 * SEGMENT)
    keys = _fill(l1, 20)  # 16 in segment 0, 4 in segment 1
    reading = l1.pin_prefix(keys[16:18])
    assert len(reading) == 2
    assert l1.resize(SEGMENT) == {
        "capacity_bytes": SEGMENT, "reserved_bytes": SEGMENT, "usage_bytes": 18 * KIB,
        "evicted_chunks": 2, "retiring_bytes": 2 * KIB,
    }  # fmt: skip
    assert l1.resize(SEGMENT) == {  # the same budget again: nothing more retires
        "capacity_bytes": SEGMENT, "reserved_bytes": SEGMENT, "usage_bytes": 18 * KIB,
        "evicted_chunks": 0, "retiring_bytes": 2 * KIB,
    }  # fmt: skip
    l1.release(reading)
    _drop(l1, keys[16])
    assert l1.resize(SEGMENT)["retiring_bytes"] == KIB
    assert l1.pool.view(1, 0, KIB).numel() == KIB  # still held for keys[17]
    _drop(l1, keys[17])
    assert l1.pool.view(1, 0, KIB).numel() == 0  # given back
    assert l1.resize(SEGMENT) == {
        "capacity_bytes": SEGMENT, "reserved_bytes": SEGMENT, "usage_bytes": 16 * KIB,
        "evicted_chunks": 0, "retiring_bytes": 0,
    }  # fmt: skip
    assert l1.contains(keys[:16]).result() == [True] * 16


def test_a_shrink_gives_an_empty_segment_back_at_once() -> None:
    """A retired segment with no object left is released by the resize itself, and a
    later resize to the same budget neither counts nor releases it again."""
    l1 = _l1(2 * SEGMENT)
    keys = _fill(l1, 17)  # the 17th opens segment 1
    assert l1.stats()["reserved_bytes"] == 2 * SEGMENT
    _drop(l1, keys[16])
    expected = {
        "capacity_bytes": SEGMENT, "reserved_bytes": SEGMENT, "usage_bytes": 16 * KIB,
        "evicted_chunks": 0, "retiring_bytes": 0,
    }  # fmt: skip
    assert l1.resize(SEGMENT) == expected
    assert l1.pool.view(1, 0, KIB).numel() == 0
    assert l1.resize(SEGMENT) == expected
    assert l1.stats()["reserved_bytes"] == SEGMENT


# -- resize's arguments and the pinning it starts -----------------------------------------


def test_resize_takes_the_smallest_budget_and_refuses_non_integers() -> None:
    """ALIGN bytes is a valid budget; a bool or a float (even a whole one) is refused as
    not an integer, and the budget stays."""
    l1 = _l1(SEGMENT)
    for bad in (True, float(2 * SEGMENT)):
        with pytest.raises(ValueError, match="must be an integer of bytes"):
            l1.resize(bad)  # type: ignore[arg-type]
    assert l1.stats()["capacity_bytes"] == SEGMENT
    assert l1.resize(ALIGN)["capacity_bytes"] == ALIGN
    assert l1.stats()["capacity_bytes"] == ALIGN


def test_growing_an_on_demand_l1_starts_no_pinning() -> None:
    """An L1 that grows on demand stays so after a grow: no background pinning, no
    memory reserved ahead of a store."""
    l1 = _l1(SEGMENT)
    _fill(l1, 2)
    assert l1.resize(3 * SEGMENT)["reserved_bytes"] == SEGMENT
    assert l1.pin_state() is None
    assert l1.stats()["reserved_bytes"] == SEGMENT
    l1.close()


def test_growing_a_pinned_ahead_l1_pins_exactly_the_new_room() -> None:
    """Grown from 2 to 5 segments, an L1 pinned ahead pins the 3 new ones in the
    background: the new growth's target is the new room, and all of it ends up reserved."""
    l1 = _ahead_l1(2 * SEG)
    assert l1.resize(5 * SEG)["reserved_bytes"] == 2 * SEG
    state = l1.pin_state()
    assert state is not None and state["target_bytes"] == 3 * SEG
    _wait_for(lambda: _pinning_done(l1))
    state = l1.pin_state()
    assert state is not None
    assert (state["pinned_bytes"], state["failed"]) == (3 * SEG, None)
    assert l1.stats()["reserved_bytes"] == 5 * SEG
    l1.close()


def test_a_growth_of_exactly_align_bytes_is_pinned_ahead() -> None:
    """The smallest growth worth a segment (ALIGN bytes) is pinned ahead too."""
    l1 = _ahead_l1(2 * SEG)
    l1.resize(2 * SEG + ALIGN)
    state = l1.pin_state()
    assert state is not None and state["target_bytes"] == ALIGN
    _wait_for(lambda: _pinning_done(l1))
    assert l1.stats()["reserved_bytes"] == 2 * SEG + ALIGN
    l1.close()


def test_a_resize_to_the_same_budget_starts_no_pinning() -> None:
    """After a shrink leaves room unpinned, resizing to the same budget is no growth: the
    finished growth stays the last one and nothing more is reserved."""
    l1 = _ahead_l1(4 * SEG)
    budget = 2 * SEG + SEG // 2
    assert l1.resize(budget)["reserved_bytes"] == 2 * SEG
    assert l1.resize(budget)["reserved_bytes"] == 2 * SEG
    state = l1.pin_state()
    assert state is not None
    assert (state["target_bytes"], state["pinning"]) == (4 * SEG, False)
    assert l1.stats()["reserved_bytes"] == 2 * SEG
    l1.close()


@pytest.mark.parametrize("nbytes", [0, -1, 1.5, True])
def test_an_object_of_no_bytes_is_refused_and_nothing_is_planned(nbytes: object) -> None:
    """A write of zero (or a non-integer number of) bytes is refused before anything is
    allocated: no object, no segment, usage unchanged."""
    l1 = _l1(4 * SEGMENT)
    before = l1.stats()
    with pytest.raises(ValueError, match="at least one byte"):
        l1.prepare_write([_key(1)], nbytes)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one byte"):
        l1.store([(_key(2), torch.empty(0, dtype=torch.uint8))]).result()
    assert l1.stats() == before and not any(l1.contains([_key(1), _key(2)]).result())
